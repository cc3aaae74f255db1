"""``slotbench run``: a trace, a model and a list of strategies → one run directory.

Layout (all times are seconds since the run start on one monotonic clock)::

    OUT/run.json                       resolved options, versions, seed, device, trace source and sha256
    OUT/summary.csv, summary.json      one row per strategy
    OUT/report.html                    the HTML report
    OUT/<strategy>/requests.parquet    one row per request
    OUT/<strategy>/tokens.jsonl        tokens and their times per request
    OUT/<strategy>/iterations.parquet  one row per iteration
    OUT/<strategy>/slots.parquet       one row per slot tenure (who held which request slot when)
    OUT/<strategy>/timeline.json       Chrome trace: host and device lanes
    OUT/<strategy>/slices.csv          with --slice-duration: each time window's metrics
    OUT/<strategy>/vllm_bench.json     the strategy's run as `vllm bench serve --save-result --save-detailed`

The directory is assembled beside OUT and renamed into place at the end, so an existing OUT is never
half-overwritten; every file inside is written atomically too.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from harness.context_length import resolve_max_seq_len
from harness.errors import UserError
from harness.options import RunOptions
from harness.output.rejections import rejection_note
from harness.output.run_files import write_run_files
from harness.output.strategy_dir import write_strategy
from harness.runner import StrategyRun, build_requests, request_ids, run_strategy
from harness.traces import Fit, Trace, fit_trace, load_trace, synthetic_trace
from harness.traces.trace import TraceRequest
from reports.run_data import StrategyFrames
from strategies.config import ExecutorConfig
from strategies.runtime.models.checkpoint import load_checkpoint, resolve_model_config
from strategies.runtime.models.config import PRESETS, ModelConfig

EXIT_FAULT, EXIT_INTERRUPTED = 1, 130


@dataclass
class RunOutcome:
    out: Path
    summary: pd.DataFrame
    exit_code: int
    notes: list[str] = dataclasses.field(default_factory=list)  # printed under the summary (rejections)


def make_trace(opts: RunOptions) -> Trace:
    if opts.trace == "synthetic":
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


def load_model(opts: RunOptions) -> tuple:
    if opts.device == "sim":  # nothing is computed: buffers are sized for a stand-in vocabulary
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
    from strategies.runtime.models.llama import build_model, script_model  # torch: never on the simulated device

    try:  # the host's model; each engine places a copy of its own on the device (DeviceMemory.place)
        model = build_model(cfg) if opts.model in PRESETS else load_checkpoint(opts.model, cfg)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return cfg, (script_model(model) if opts.compile else model)


def resolve_executor(opts: RunOptions) -> tuple[ExecutorConfig, dict | None]:
    """The executor config; on the simulated device, KV capacity comes from GPU memory minus weights."""
    executor = opts.executor_config()
    if executor.sim is None:
        return executor, None
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
    info = {"kv_capacity_tokens": capacity, "weight_bytes": cost.weight_bytes,
            "kv_bytes": (executor.total_kv_blocks + (executor.total_cross_kv_blocks if cost.spec.is_encoder_decoder
                                                     else 0)) * executor.tokens_per_block * cost.kv_bytes_per_token,
            "kv_bytes_per_token": cost.kv_bytes_per_token, "profile": dataclasses.asdict(cost.profile)}
    return executor, info


def prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise UserError(f"{out} exists; pass --force to overwrite it")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")


def _swap_into_place(staging: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{time.time_ns()}")
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_encoder_inputs(opts: RunOptions, model_cfg: ModelConfig, trace: Trace) -> None:
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


def _check_draft_model(opts: RunOptions, model_cfg: ModelConfig) -> None:
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


def execute(opts: RunOptions, out: Path, *, force: bool = False, progress: bool = True, report: bool = True,
            fault: tuple[str, int] | None = None, log: Callable[[str], None] | None = None) -> RunOutcome:
    """Run every strategy of ``opts`` and write the run directory. ``fault`` = (strategy, iteration)
    injects an engine exception there (a test hook)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    prepare_out(out, force)
    trace = make_trace(opts)
    request_ids(trace.requests)  # refused here, before anything is written, if a generated id is a given one
    for note in trace.notes:
        log(f"note: {trace.source}: {note}")
    if trace.skipped:
        log(f"note: {trace.source}: skipped {trace.skipped} failed rows (zero response tokens)")
    model_cfg, model = load_model(opts)
    opts = resolve_max_seq_len(opts, model_cfg)
    _check_encoder_inputs(opts, model_cfg, trace)
    _check_draft_model(opts, model_cfg)
    executor, sim_info = resolve_executor(opts)
    defaults = opts.sampling_defaults()
    # The decoder state and block tables hold as many beam rows per slot as the widest request needs.
    if executor.speculative is not None and model_cfg.is_encoder_decoder:
        raise UserError("--speculative-config: an encoder–decoder model does not speculate here")
    widest = max([defaults.beam_width] + [int((t.sampling or {}).get("beam_width", 1)) for t in trace.requests])
    if widest != executor.max_beam_width:
        try:
            executor = dataclasses.replace(executor, max_beam_width=widest)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    warm = [TraceRequest(0.0, min(t.input_tokens, opts.max_seq_len // 2), min(t.output_tokens, 16),
                         encoder_tokens=min(t.encoder_tokens, opts.max_seq_len // 2))
            for t in trace.requests[: opts.warmup]]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    staging.chmod(0o755)
    runs: list[StrategyRun] = []
    rows: list[dict] = []
    frames: dict[str, StrategyFrames] = {}  # what was written, for the report
    notes: list[str] = []
    with _frozen_heap():
        try:
            for name in opts.strategies:
                requests = build_requests(list(trace.requests), defaults, model_cfg.vocab_size, opts.seed,
                                          max_seq_len=opts.max_seq_len)
                bar = tqdm(total=len(requests), desc=f"{name:>8}", unit="req", file=sys.stderr, disable=not progress,
                           mininterval=0.5, leave=True)
                warmup = build_requests(warm, defaults, model_cfg.vocab_size, opts.seed + 1, "warmup-")
                run = run_strategy(name, model_cfg, model, executor, requests, max_concurrency=opts.max_concurrency,
                                   warmup=warmup, on_end=lambda _r, bar=bar: bar.update(1),
                                   fault_at_iteration=fault[1] if fault and fault[0] == name else None,
                                   profile_iters=opts.profile_range())
                bar.close()
                runs.append(run)
                with _collector_paused():
                    row, frames[name] = write_strategy(staging, run, opts)
                rows.append(row)
                note = rejection_note(name, run.requests)
                if note:
                    notes.append(note)
                if run.error:
                    log(f"error: {name} stopped early: {run.error}")
                if run.interrupted:
                    break
        finally:
            # Whatever was measured is written, even when the loop above was cut short.
            summary = pd.DataFrame(rows)
            write_run_files(staging, opts, executor, sim_info, trace, model_cfg, summary, runs)
            if report and rows:
                from reports.html import write_report

                try:  # the measurements matter more than the page: never lose them to a report failure
                    with _collector_paused():
                        write_report([staging], staging / "report.html", names=[out.name], frames=frames)
                except Exception as exc:
                    log(f"error: report not written: {type(exc).__name__}: {exc}")
            _swap_into_place(staging, out)
    code = EXIT_INTERRUPTED if any(r.interrupted for r in runs) else EXIT_FAULT if any(r.error for r in runs) else 0
    return RunOutcome(out, summary, code, notes)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No automatic collection while a strategy's files or the run's report are written: the writing makes
    ~10^5 dicts and lists (the timeline's events, the vLLM file's lists, the figures' data) that reference
    counting frees, and the full collections they set off walk every record the run kept (on the 70B run,
    two of 0.09 s in 1.5 s of writing its files, one of 0.1 s in its report)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def _frozen_heap() -> Iterator[None]:
    """What is alive on entry (imported modules, the model, the trace) leaves the cyclic collector's
    generations until the run is written, as vLLM freezes its heap after start-up (``freeze_gc_heap``): a full
    collection otherwise walks all of it, 0.1-0.2 s each here, in a measured step as readily as in the
    writing (the 70B run's three took 0.39 s of its 9 s; frozen, two took 0.14 s). On exit everything goes
    back to the collector, so that a later run in this process (a suite's) frees what this one left."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
