"""From options to a resolved plan: the trace, the model (or the simulated device's stand-in), the executor's
limits (KV capacity from GPU memory on the simulated device), and the checks that refuse a plan that cannot
run, before anything is measured or written (``execute``'s first stage, ``harness/app.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.context_length import resolve_max_seq_len
from harness.errors import UserError
from harness.options import RunOptions
from harness.runner import request_ids
from harness.serve.tokenizer import CheckpointTokenizer
from harness.traces import Fit, Trace, fit_trace, load_trace, synthetic_trace
from harness.traces.trace import TraceRequest
from harness.traces.workload import load_workload
from harness.traces.workload_trace import workload_trace
from strategies.config import ExecutorConfig
from strategies.runtime.models.checkpoint import load_checkpoint, resolve_model_config
from strategies.runtime.models.config import PRESETS, ModelConfig
from strategies.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class Plan:
    """Everything a run needs, resolved and checked: what the strategies are then run with."""

    opts: RunOptions  # the options, with what they left open resolved (--max-seq-len)
    trace: Trace  # the fitted trace: every strategy replays the same requests
    model_cfg: ModelConfig  # the model's config (on the simulated device: the spec's stand-in)
    model: Any  # the host's model (a torch module), or None on the simulated device
    executor: ExecutorConfig  # the executor's limits (KV capacity; beam rows as wide as the widest request)
    sim_info: dict | None  # the simulated device's memory and profile (run.json), or None
    defaults: SamplingParams  # sampling a trace line does not override
    warm: list[TraceRequest]  # the warm-up requests (--warmup), capped in length
    client: type | None = None  # --endpoint: the client executor, bound to the server (harness/endpoint/)


def resolve_plan(opts: RunOptions, log: Callable[[str], None]) -> Plan:
    """Options → a plan; a plan that cannot run is refused here (UserError), before anything is measured."""
    trace = make_trace(opts)
    request_ids(trace.requests)  # refused here, before anything is written, if a generated id is a given one
    for note in trace.notes:
        log(f"note: {trace.source}: {note}")
    if trace.skipped:
        log(f"note: {trace.source}: skipped {trace.skipped} failed rows (zero response tokens)")
    model_cfg, model = load_model(opts)
    settings = None
    if opts.endpoint is not None:  # the server's context, where it states one, is the run's --max-seq-len
        from harness.endpoint.connect import connect

        settings = connect(opts)
        if opts.max_seq_len is None and settings.max_model_len is not None:
            opts = dataclasses.replace(opts, max_seq_len=settings.max_model_len)
    opts = resolve_max_seq_len(opts, model_cfg)
    check_encoder_inputs(opts, model_cfg, trace)
    check_draft_model(opts, model_cfg)
    executor, sim_info = resolve_executor(opts, model_cfg)
    defaults = opts.sampling_defaults()
    if executor.speculative is not None and model_cfg.is_encoder_decoder:
        raise UserError("--speculative-config: an encoder–decoder model does not speculate here")
    # The decoder state and block tables hold as many beam rows per slot as the widest request needs.
    widest = max([defaults.beam_width] + [int((t.sampling or {}).get("beam_width", 1)) for t in trace.requests])
    if widest != executor.max_beam_width:
        try:
            executor = dataclasses.replace(executor, max_beam_width=widest)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    warm = [warm_request(t, opts.max_seq_len) for t in trace.requests[: opts.warmup]]
    client = None
    if settings is not None:
        from harness.endpoint.client import client_for

        client = client_for(dataclasses.replace(settings, max_seq_len=opts.max_seq_len))
    return Plan(opts, trace, model_cfg, model, executor, sim_info, defaults, warm, client)


def warm_request(t: TraceRequest, max_seq_len: int) -> TraceRequest:
    """A warm-up request of ``t``'s shape, capped (half the context, 16 output tokens): it compiles and profiles
    the shapes, and nothing of it is measured."""
    return TraceRequest(0.0, min(t.input_tokens, max_seq_len // 2), min(t.output_tokens, 16),
                        encoder_tokens=min(t.encoder_tokens, max_seq_len // 2))


def make_trace(opts: RunOptions) -> Trace:
    if opts.workload_config is not None:
        tokenizer = CheckpointTokenizer(opts.tokenizer) if opts.tokenizer else None  # the server's: its prompts
        trace = workload_trace(load_workload(opts.workload_config), opts.workload_config, opts.seed, _vocab_size(opts),
                               tokenizer)
    elif opts.trace == "synthetic":
        trace = synthetic_trace(opts.num_prompts, opts.input_len, opts.output_len, request_rate=opts.request_rate,
                                burstiness=opts.burstiness, length_dist=opts.length_dist,
                                range_ratio=opts.range_ratio, output_range_ratio=opts.output_range_ratio,
                                prefix_len=opts.prefix_len, num_prefixes=opts.num_prefixes, seed=opts.seed,
                                encoder_input_len=opts.encoder_input_len, ramp=opts.ramp(), sessions=opts.sessions())
    else:
        trace = load_trace(opts.trace, opts.trace_format)
    fit = Fit(start_offset_s=opts.start_offset, limit=opts.limit, time_scale=opts.time_scale,
              length_scale=opts.length_scale, max_input_len=opts.max_input_len, max_output_len=opts.max_output_len)
    return fit_trace(trace, fit)


def _vocab_size(opts: RunOptions) -> int:
    """The vocabulary a workload's prompt ids are drawn from: the model's (the spec's on the simulated device)."""
    try:
        if opts.device == "sim":
            from strategies.runtime.sim.specs import resolve_model_spec

            return resolve_model_spec(opts.model_spec).vocab_size
        return resolve_model_config(opts.model).vocab_size
    except ValueError as exc:
        raise UserError(str(exc)) from None


def load_model(opts: RunOptions) -> tuple:
    if opts.device == "sim":  # nothing is computed: buffers are sized for a stand-in model of the spec's vocabulary
        from strategies.runtime.sim.engine import proxy_config
        from strategies.runtime.sim.specs import resolve_model_spec

        try:
            return proxy_config(resolve_model_spec(opts.model_spec)), None
        except ValueError as exc:
            raise UserError(str(exc)) from None
    try:
        cfg = resolve_model_config(opts.model).with_dtype(opts.dtype or "float32")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if opts.endpoint is not None:  # the server has the weights: the config sizes the prompts (vocabulary)
        return cfg, None
    from strategies.runtime.models.llama import build_model, script_model  # torch: never on the simulated device

    try:  # the host's model; each engine places a copy of its own on the device (DeviceMemory.place)
        model = build_model(cfg) if opts.model in PRESETS else load_checkpoint(opts.model, cfg)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return cfg, (script_model(model) if opts.compile else model)


def resolve_executor(opts: RunOptions, model_cfg: ModelConfig) -> tuple[ExecutorConfig, dict | None]:
    """The executor config; on the simulated device, KV capacity comes from GPU memory minus weights."""
    executor = opts.executor_config()
    if executor.sim is None:
        return _host_tier(opts, executor, model_cfg.kv_bytes_per_token), None
    from strategies.runtime.sim.build import cost_model

    try:
        cost = cost_model(executor.sim)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    spec = executor.speculative
    try:
        draft = cost_model(dataclasses.replace(executor.sim, model_spec=spec.model)) if spec and spec.model else None
    except ValueError as exc:  # its message names --model-spec: the draft's spec is the config's model key
        raise UserError(f"--speculative-config model: {exc}".replace("--model-spec ", "")) from None
    capacity = cost.kv_capacity_tokens(draft=draft)
    if cost.spec.is_encoder_decoder:  # cross-attention KV takes the same bytes per token: split the memory
        capacity //= 2
        if executor.cross_kv_blocks is None:
            executor = dataclasses.replace(executor, cross_kv_blocks=max(1, capacity // executor.tokens_per_block))
    if executor.kv_blocks is None:
        blocks = capacity // executor.tokens_per_block
        if blocks <= 0:
            raise UserError(f"{executor.sim.model_spec} does not fit on {executor.sim.tp} x {cost.profile.gpu.name}: "
                            f"weights {cost.weight_bytes / 1e9:.0f} GB leave no room for KV (try a larger --tp)")
        executor = dataclasses.replace(executor, kv_blocks=blocks)
    executor = _host_tier(opts, executor, cost.kv_bytes_per_token)
    info = {"kv_capacity_tokens": capacity, "weight_bytes": cost.weight_bytes,
            "kv_bytes": (executor.total_kv_blocks + (executor.total_cross_kv_blocks if cost.spec.is_encoder_decoder
                                                     else 0)) * executor.tokens_per_block * cost.kv_bytes_per_token,
            "kv_bytes_per_token": cost.kv_bytes_per_token, "profile": dataclasses.asdict(cost.profile)}
    return executor, info


def _host_tier(opts: RunOptions, executor: ExecutorConfig, kv_bytes_per_token: float) -> ExecutorConfig:
    """``--kv-offloading-size`` GiB as host-tier blocks of the model's (every rank's) KV bytes, as vLLM sizes it."""
    if opts.kv_offloading_size is None:
        return executor
    if opts.kv_offload_blocks:
        raise UserError("--kv-offloading-size and --kv-offload-blocks size the same tier: give one")
    if not opts.kv_offloading_size > 0:
        raise UserError(f"--kv-offloading-size must be positive, got {opts.kv_offloading_size:g}")
    blocks = int(opts.kv_offloading_size * 2**30 // (kv_bytes_per_token * executor.tokens_per_block))
    try:
        return dataclasses.replace(executor, kv_offload_blocks=max(1, blocks))
    except ValueError as exc:
        raise UserError(str(exc).replace("--kv-offload-blocks", "--kv-offloading-size")) from None


def check_encoder_inputs(opts: RunOptions, model_cfg: ModelConfig, trace: Trace) -> None:
    """An encoder–decoder model needs an encoder input on every request; a decoder-only one takes none."""
    with_encoder = sum(1 for t in trace.requests if t.encoder_tokens)
    if model_cfg.is_encoder_decoder and "pipeline" in opts.strategies and opts.device != "sim":
        raise UserError(f"--model {opts.model}: the pipeline strategy's stages run decoder-only models")
    if model_cfg.is_encoder_decoder and ("disagg" in opts.strategies or opts.num_replicas > 1):
        raise UserError(f"--model {opts.model}: disagg's and --num-replicas' engines run decoder-only models")
    if model_cfg.is_encoder_decoder:
        if with_encoder < len(trace.requests):
            raise UserError(f"--model {opts.model} is an encoder–decoder model: {len(trace.requests) - with_encoder} "
                            "requests have no encoder input (--encoder-input-len, or encoder_prompt_token_ids / "
                            "encoder_input_tokens on each trace line)")
        if opts.prefix_caching:
            raise UserError("--prefix-caching: an encoder–decoder model's decoder KV depends on the encoder input, "
                            "which the block hashes do not cover")
    elif with_encoder:
        raise UserError(f"--model {opts.model} is decoder-only, but {with_encoder} requests have an encoder input")


def check_draft_model(opts: RunOptions, model_cfg: ModelConfig) -> None:
    """A draft model on a real device: it must exist and share the target's vocabulary."""
    spec = opts.speculative()
    if spec is None or spec.model is None or opts.device == "sim":
        return
    from strategies.runtime.spec.draft_model import draft_config

    try:
        cfg = draft_config(spec.model, model_cfg)
    except ValueError as exc:
        raise UserError(str(exc).replace("--model ", "--speculative-config model: ", 1)) from None
    if opts.max_seq_len is not None and cfg.max_position_embeddings < opts.max_seq_len:
        raise UserError(f"--speculative-config model {spec.model!r}: its context ({cfg.max_position_embeddings}) is "
                        f"shorter than --max-seq-len ({opts.max_seq_len})")
