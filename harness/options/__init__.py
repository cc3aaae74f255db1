"""The options of one benchmark run, shared by ``slotbench run`` flags and suite TOML keys.

Each option is declared once (name, type, default, help); argparse flags and the keys a suite file may
use are both derived from this table, so they cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from harness.devices import check_device, check_devices
from harness.errors import UserError
from harness.metrics import parse_goodput, parse_percentiles
from harness.options.disagg import DisaggOptions
from harness.options.endpoint import ENDPOINT, EndpointOptions
from harness.options.field import opt as _opt
from harness.traces import FORMATS, LENGTH_DISTS
from harness.traces.sessions import SessionShape
from harness.traces.synthetic import RAMP_STRATEGIES, ramp_rates
from strategies.config import CAPACITY_POLICIES, ExecutorConfig, SimConfig
from strategies.runtime.buffers.mirrored import MEMORY_MODES
from strategies.runtime.sampling_params import SamplingParams
from strategies.runtime.sim.config import SERVING_CHOICES
from strategies.runtime.spec.config import SpecConfig, parse_speculative_config


@dataclass(frozen=True)
class RunOptions(EndpointOptions, DisaggOptions):
    strategies: tuple[str, ...] = _opt(("static", "inflight", "overlap"), "comma-separated strategies")
    model: str = _opt("small", "preset (tiny, small) or a Hugging Face checkpoint directory")
    dtype: str | None = _opt(None, "model dtype (default: float32 on cpu and cuda; on sim the spec's own, "
                                   "e.g. a config.json's torch_dtype)",
                             choices=("float32", "float64", "bfloat16", "float16"))
    device: str = _opt("cpu", "cpu, cuda[:N], or sim (the simulated device: see --gpu, --model-spec)")
    device_memory: str | None = _opt(None, "shared: on CPU the device reads the host's buffers; split: the device "
                                           "owns its tensors and every transfer is a copy on the stream, as on "
                                           "CUDA (default: shared on cpu and sim, split on cuda)",
                                     choices=MEMORY_MODES)
    gpu: str = _opt("h200", "sim: GPU datasheet (a100, a40, h100, h200, l40s, cpu)")
    model_spec: str = _opt("llama-3-8b", "sim: model shapes (llama-3-8b, llama-3-70b, qwen2.5-7b, tiny, small, "
                                         "or a config.json directory)")
    tp: int = _opt(1, "sim: tensor-parallel degree")
    ep: int = _opt(1, "sim, a mixture-of-experts spec: expert-parallel degree (= --tp: whole experts split over "
                      "the engine's GPUs, combined by the layer's all-reduce; 1: every expert sharded --tp ways)")
    moe_skew: float = _opt(0.0, "sim, a mixture-of-experts spec: routing skew (0: uniform; s: expert e takes "
                                "tokens in proportion to (e + 1) ** -s)")
    profile: str | None = _opt(None, "sim: calibrated device profile (from `slotbench calibrate`)")
    host_time: str = _opt("measured", "sim: host time measured (real host code) or modelled",
                          choices=("measured", "modelled"))
    host_ms_per_iteration: float = _opt(0.0, "sim, modelled host time: per iteration")
    host_us_per_request: float = _opt(0.0, "sim, modelled host time: per request in the batch")
    serving_path: str = _opt("auto", "sim: what a client's times include beyond the engine: vllm (vLLM's API "
                                     "server, docs/simulator.md), none, auto (vllm on a GPU)", choices=SERVING_CHOICES)
    trace: str = _opt("synthetic", "'synthetic' or a trace file path")
    trace_format: str = _opt("auto", "replay format", choices=("auto", *FORMATS))
    workload_config: str | None = _opt(None, "a load generator's workload instead of --trace: an inference-perf "
                                             "config (YAML: shared_prefix, random or synthetic data; constant or "
                                             "poisson load in stages), or a measured run's JSON (../shared/validation)")
    num_prompts: int = _opt(200, "synthetic: number of requests")
    request_rate: float = _opt(math.inf, "synthetic: requests/s (inf: all at t=0)")
    burstiness: float = _opt(1.0, "synthetic: gamma shape of inter-arrivals (1.0 = Poisson)")
    ramp_up_strategy: str | None = _opt(None, "synthetic: request rate ramps from --ramp-up-start-rps to "
                                              "--ramp-up-end-rps over the run (vllm bench serve's; instead of "
                                              "--request-rate)", choices=RAMP_STRATEGIES)
    ramp_up_start_rps: float | None = _opt(None, "synthetic: the ramp's first rate (req/s)")
    ramp_up_end_rps: float | None = _opt(None, "synthetic: the ramp's last rate (req/s)")
    max_concurrency: int | None = _opt(None, "at most this many requests (multi-turn: sessions) in flight (closed "
                                             "loop with rate inf)")
    session_turns_mean: float = _opt(1.0, "synthetic: turns per multi-turn session, normal around this (AIPerf's); "
                                          "--num-prompts counts turns, --request-rate starts sessions")
    session_turns_stddev: float = _opt(0.0, "synthetic: spread of turns per session")
    session_turn_delay_mean: float = _opt(0.0, "synthetic: think time in ms between a turn's last token and the "
                                               "next turn (AIPerf's)")
    session_turn_delay_stddev: float = _opt(0.0, "synthetic: spread of think times (ms)")
    input_len: int = _opt(128, "synthetic: mean input length (an encoder–decoder model's decoder prompt)")
    encoder_input_len: int = _opt(0, "synthetic: mean encoder input length, with --input-len's range options "
                                     "(encoder–decoder models; 0: none)")
    output_len: int = _opt(64, "synthetic: mean output length")
    prefix_len: int = _opt(0, "synthetic: a shared prefix of this many tokens before each prompt "
                              "(vllm bench serve --random-prefix-len)")
    num_prefixes: int = _opt(1, "synthetic: distinct shared prefixes, one drawn per request (SGLang's "
                                "generated-shared-prefix groups)")
    range_ratio: float = _opt(0.5, "synthetic: spread of lengths (uniform: [L(1-r), L(1+r)])")
    output_range_ratio: float | None = _opt(None, "synthetic: spread of output lengths (default: --range-ratio)")
    length_dist: str = _opt("uniform", "synthetic: length distribution", choices=LENGTH_DISTS)
    time_scale: float = _opt(1.0, "replay: multiply inter-arrival times")
    length_scale: float = _opt(1.0, "replay: multiply lengths")
    max_input_len: int | None = _opt(None, "clip input lengths")
    max_output_len: int | None = _opt(None, "clip output lengths")
    limit: int | None = _opt(None, "replay: first N requests")
    start_offset: float = _opt(0.0, "replay: skip requests before this many seconds")
    max_batch_size: int = _opt(32, "requests per iteration (and slots)")
    max_num_tokens: int = _opt(1024, "tokens per iteration (in-flight strategies)")
    max_seq_len: int | None = _opt(None, "prompt + output per request (default: the model's context length, "
                                         "capped by what the KV pool holds: --kv-blocks x --tokens-per-block, or "
                                         "on sim what the GPU's memory leaves for KV)")
    capacity_policy: str = _opt("guaranteed-no-evict", "KV admission policy", choices=CAPACITY_POLICIES)
    chunked_prefill: bool = _opt(True, "split long prompts across iterations, within --max-num-tokens (on by "
                                       "default, as in vLLM's engine; static batching prefills a row whole)")
    kv_blocks: int | None = _opt(None, "KV cache blocks (default: every slot at max-seq-len)")
    tokens_per_block: int = _opt(16, "tokens per KV block")
    prefix_caching: bool = _opt(False, "reuse cached KV blocks of equal prefixes across requests")
    kv_offload_blocks: int = _opt(0, "host KV tier: blocks of host memory that cached blocks the KV pool evicts go "
                                     "to, onloaded again on a prefix hit (needs --prefix-caching; 0: none)")
    kv_offloading_size: float | None = _opt(None, "the host KV tier in GiB instead, as vLLM sizes it (all TP ranks')")
    kv_watermark: float = _opt(0.0, "max-utilization: fraction of KV blocks kept free while requests run "
                                    "(vLLM V1 keeps none; V0 kept 0.01)")
    temperature: float = _opt(0.0, "sampling temperature (0: greedy)")
    top_k: int = _opt(0, "top-k (0: off)")
    top_p: float = _opt(1.0, "top-p (1: off)")
    min_p: float = _opt(0.0, "min-p (0: off)")
    seed: int = _opt(0, "seed for the trace, prompts and sampling")
    ignore_eos: bool = _opt(False, "generate exactly the trace's output lengths")
    pp: int = _opt(2, "pipeline: stages, each a process with a contiguous range of the model's layers")
    num_micro_batches: int | None = _opt(None, "pipeline: micro-batches in flight (default: --pp)")
    stage_timeout: float = _opt(60.0, "pipeline: seconds a silent stage may take before the run ends")
    num_replicas: int = _opt(1, "inflight: engines behind a least-outstanding-tokens router (each with the limits "
                                "above; on sim --tp GPUs each): the equal-GPU baseline for disagg (see --router)")
    router: str = _opt("least-tokens", "--num-replicas and disagg's prefill workers: an arrival goes to the engine "
                                       "with the fewest tokens left to compute, or to each in turn",
                       choices=("least-tokens", "round-robin"))
    devices: str | None = _opt(None, "a fleet's engines, one device each (comma-separated: cpu, or cuda:N "
                                                 "with --device cuda): each replica, or disagg's prefill workers "
                                                 "then its decode workers (default: every engine on --device)")
    beam_width: int = _opt(1, "beams per request: deterministic beam search, HF's semantics (1: off; a trace "
                              "line's beam_width overrides)")
    length_penalty: float = _opt(1.0, "beam search: a finished beam scores log-prob / generated length ** this")
    early_stopping: str = _opt("false", "beam search: stop a request once K beams finished (true; the flag alone "
                                        "means true, as HF's early_stopping=True), when HF's heuristic says none "
                                        "can improve (false), or by the exact criterion (never)",
                               choices=("false", "true", "never"), nargs="?", const="true")
    num_return_sequences: int = _opt(1, "beam search: best finished beams returned per request (<= beam width)")
    metric_percentiles: str = _opt("90,99", "percentiles reported for each latency metric")
    goodput: tuple[str, ...] | None = _opt(None, "SLOs as METRIC:MS (ttft, tpot, e2el)", nargs="+")
    slice_duration: float | None = _opt(None, "seconds per time slice: <strategy>/slices.csv holds each window's "
                                              "throughput, latency percentiles and requests in flight (AIPerf's)")
    warmup: int = _opt(8, "warm-up requests per strategy (not measured)")
    device_threads: int = _opt(1, "CPU: torch threads of the device worker, and of a peer engine; 0: every CPU")
    cpu_device: str = _opt("process", "CPU: the device as a process of its own (it shares no interpreter lock with "
                                      "the host, so host work does not slow a step) or a thread of this process "
                                      "(its tensors within reach of a debugger)", choices=("process", "thread"))
    speculative_config: str | None = _opt(None, "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
                                                "\"num_speculative_tokens\": K, \"prompt_lookup_min\": 1, "
                                                "\"prompt_lookup_max\": 3} (static, inflight, overlap); on --device "
                                                "sim also \"acceptance_rate\": a, each draft kept with probability a")
    compile: bool = _opt(True, "run the forward as one TorchScript call")
    instrument: bool = _opt(True, "emit NVTX ranges")
    profile_iters: str | None = _opt(None, "CUDA: iterations A-B bracketed by cudaProfilerStart/Stop")

    def __post_init__(self) -> None:
        self.check_endpoint()
        if self.endpoint is not None:  # the server's engine is what runs: one row, named by its label
            object.__setattr__(self, "strategies", (ENDPOINT,))
        if not self.strategies:
            raise UserError("--strategies: give at least one strategy")
        from strategies.registry import strategy_names

        unknown = [s for s in self.strategies if s not in (*strategy_names(), ENDPOINT)]
        if unknown:
            raise UserError(f"unknown strategy {unknown[0]!r}; valid: {', '.join(strategy_names())}")
        check_device(self.device, self.strategies)
        if self.num_replicas > 1 and set(self.strategies) - {"inflight", "disagg"}:  # disagg: its P and D workers
            raise UserError("--num-replicas: inflight runs several engines (disagg its --num-prefill-workers and "
                            "--num-decode-workers), other strategies one")
        if self.devices:
            engines = {"inflight": self.num_replicas} if "inflight" in self.strategies and self.num_replicas > 1 else {}
            if "disagg" in self.strategies:
                engines["disagg"] = self.num_prefill_workers + self.num_decode_workers
            check_devices(self.device_list(), self.device, engines)
        for name in ("num_prompts", "input_len", "output_len", "num_prefixes"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        self.ramp()
        self.sessions()
        if self.workload_config is not None and (self.trace != "synthetic" or self.limit or self.start_offset
                                                 or self.time_scale != 1.0):
            raise UserError("--workload-config sets the requests and their stages: leave --trace, --limit, "
                            "--start-offset and --time-scale out (shorten a stage in the file instead)")
        if self.encoder_input_len < 0:
            raise UserError(f"--encoder-input-len must be >= 0, got {self.encoder_input_len}")
        if self.prefix_len < 0:
            raise UserError(f"--prefix-len must be >= 0, got {self.prefix_len}")
        if self.slice_duration is not None and not self.slice_duration > 0:
            raise UserError(f"--slice-duration must be positive, got {self.slice_duration}")
        if self.warmup < 0:
            raise UserError("--warmup must be >= 0")
        if self.seed < 0:
            raise UserError(f"--seed must be >= 0, got {self.seed}")
        self.sampling_defaults()
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise UserError(f"--max-concurrency must be positive, got {self.max_concurrency}")
        parse_percentiles(self.metric_percentiles)
        parse_goodput(list(self.goodput) if self.goodput else None)
        if self.profile_iters is not None:
            self.profile_range()
        self._check_speculation()
        # validates the executor limits (an unresolved --max-seq-len by a stand-in: resolve_max_seq_len
        # validates again with the value the run uses)
        self.executor_config(self.max_seq_len or self.max_num_tokens)

    def speculative(self) -> SpecConfig | None:
        if not self.speculative_config:  # "" is off too: a suite's sweep cannot write None
            return None
        try:
            return parse_speculative_config(self.speculative_config)
        except ValueError as exc:
            raise UserError(str(exc)) from None

    def _check_speculation(self) -> None:
        if self.speculative() is None or self.endpoint is not None:
            return
        from strategies.registry import get_strategy

        for name in self.strategies:
            if not get_strategy(name).speculates:
                raise UserError(f"--speculative-config: {name} does not speculate (static, inflight and "
                                "overlap do)")

    def sampling_defaults(self) -> SamplingParams:
        """Every request's sampling unless its trace line says otherwise."""
        early = {"true": True, "false": False}.get(str(self.early_stopping).lower(), self.early_stopping)
        try:
            return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                                  ignore_eos=self.ignore_eos, beam_width=self.beam_width,
                                  length_penalty=self.length_penalty, early_stopping=early,
                                  num_return_sequences=self.num_return_sequences)
        except ValueError as exc:
            raise UserError(f"sampling options: {exc}") from None

    def ramp(self) -> tuple[str, float, float] | None:
        """(strategy, start rps, end rps) of a request-rate ramp, validated; None without one."""
        given = [x is not None for x in (self.ramp_up_strategy, self.ramp_up_start_rps, self.ramp_up_end_rps)]
        if not any(given):
            return None
        if not all(given):
            raise UserError("a ramp needs --ramp-up-strategy, --ramp-up-start-rps and --ramp-up-end-rps together")
        if not math.isinf(self.request_rate):
            raise UserError("--ramp-up-strategy: the ramp sets the request rate; leave --request-rate out")
        ramp = (str(self.ramp_up_strategy), float(self.ramp_up_start_rps), float(self.ramp_up_end_rps))
        ramp_rates(2, *ramp)  # validates
        return ramp

    def sessions(self) -> SessionShape:
        return SessionShape(self.session_turns_mean, self.session_turns_stddev, self.session_turn_delay_mean,
                            self.session_turn_delay_stddev)

    @property
    def percentiles(self) -> tuple[float, ...]:
        return parse_percentiles(self.metric_percentiles)

    @property
    def goodput_slo(self) -> dict[str, float] | None:
        return parse_goodput(list(self.goodput) if self.goodput else None)

    def profile_range(self) -> tuple[int, int] | None:
        if self.profile_iters is None:
            return None
        try:
            a, b = (int(x) for x in self.profile_iters.split("-"))
        except ValueError:
            raise UserError(f"--profile-iters {self.profile_iters!r}: expected A-B, e.g. 10-20") from None
        if not 0 <= a <= b:
            raise UserError(f"--profile-iters {self.profile_iters!r}: need 0 <= A <= B")
        return a, b

    def device_list(self) -> tuple[str, ...] | None:
        return tuple(d.strip() for d in self.devices.split(",") if d.strip()) if self.devices else None

    def sim_config(self) -> SimConfig | None:
        if self.device != "sim":
            return None
        return SimConfig(gpu=self.gpu, model_spec=self.model_spec, tp=self.tp, ep=self.ep, moe_skew=self.moe_skew,
                         profile=self.profile, dtype=self.dtype, host_time=self.host_time,
                         host_ms_per_iteration=self.host_ms_per_iteration, host_us_per_request=self.host_us_per_request,
                         serving_path=self.serving_path)

    def executor_config(self, max_seq_len: int | None = None) -> ExecutorConfig:
        max_seq_len = max_seq_len or self.max_seq_len
        if max_seq_len is None:
            raise ValueError("--max-seq-len is not resolved yet (harness.context_length.resolve_max_seq_len)")
        try:
            return ExecutorConfig(
                max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens, max_seq_len=max_seq_len,
                capacity_policy=self.capacity_policy, chunked_prefill=self.chunked_prefill,
                tokens_per_block=self.tokens_per_block, kv_blocks=self.kv_blocks, prefix_caching=self.prefix_caching,
                kv_offload_blocks=self.kv_offload_blocks, kv_watermark=self.kv_watermark, device=self.device,
                device_memory=self.device_memory, device_threads=self.device_threads, cpu_device=self.cpu_device,
                compile=self.compile, instrument=self.instrument,
                max_beam_width=self.beam_width, pipeline_stages=self.pp, num_micro_batches=self.num_micro_batches,
                stage_timeout_s=self.stage_timeout, sim=self.sim_config(), speculative=self.speculative(),
                num_replicas=self.num_replicas, router=self.router, devices=self.device_list(),
                disagg=self.disagg_config())
        except ValueError as exc:
            raise UserError(str(exc)) from None

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
