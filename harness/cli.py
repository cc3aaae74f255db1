"""The ``slotbench`` command: run, serve, suite, report, compare, calibrate, step-cost, trace-info.

Bad input prints one line and exits 2. A fault stops the run, writes what was measured and exits 1;
Ctrl-C does the same with exit 130, and a second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import pandas as pd

from harness.compare.run import add_compare_parser, cmd_compare
from harness.errors import UserError
from harness.flags import Parser, add_run_arguments, options_from_args
from harness.serve.command import add_serve_parser, cmd_serve

SUMMARY_COLUMNS = ["run", "strategy", "completed", "rejected", "failed", "duration_s", "request_throughput",
                   "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                   "mean_batch_size", "device_busy_fraction", "host_ms_per_iteration"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="slotbench", description="Benchmark and profile LLM executor batching strategies.")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    run = sub.add_parser("run", help="run strategies over a trace and write a run directory")
    add_run_arguments(run)
    run.add_argument("--out", default=None, help="run directory (default: a new runs/run-YYYYmmdd-HHMMSS)")
    run.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    run.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    run.add_argument("--repeats", type=int, default=1,
                     help="run N times (seeds SEED..SEED+N-1) and report each metric's mean, 95%% interval and CV")
    suite = sub.add_parser("suite", help="several runs from a TOML file, one combined output")
    suite.add_argument("file", help="suite TOML file")
    suite.add_argument("--out", default=None, help="output directory (default: runs/<suite name>)")
    suite.add_argument("--force", action="store_true")
    suite.add_argument("--no-progress", action="store_true")
    suite.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help="run each run as a Ray task: a local Ray, or join ADDRESS (auto, ray://host:port)")
    suite.add_argument("--resume", action="store_true", help="keep OUT and skip the runs already complete in it")
    suite.add_argument("--repeats", type=int, default=None, help="override the file's repeats")
    rep = sub.add_parser("report", help="one HTML report from run or suite directories")
    rep.add_argument("dirs", nargs="+", help="run or suite directories, or `vllm bench serve --save-result` files")
    rep.add_argument("--out", default="report.html")
    rep.add_argument("--baseline", default=None, help="strategy the ratios are taken against")
    cal = sub.add_parser("calibrate", help="fit a simulated-device profile to a real run's iterations, or to "
                                           "measured per-operator kernel tables (--op-profile)")
    cal.add_argument("run_dir", nargs="?", default=None)
    cal.add_argument("--op-profile", default=None, metavar="DIR",
                     help="a directory of Vidur kernel tables (*mlp.csv, *all_reduce.csv) instead of a run")
    cal.add_argument("--out", default=None, help="profile file (default: RUN_DIR/ or DIR/device-profile.json)")
    cal.add_argument("--gpu", default=None, help="datasheet whose efficiencies are fitted (default: cpu for a run; "
                                                 "required with --op-profile)")
    cal.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                     help="--op-profile: the tables' dtype (Vidur's: float16)")
    cost = sub.add_parser("step-cost", help="what one step costs on the simulated device, by phase (JSON)")
    cost.add_argument("--gpu", default="h200", help="GPU datasheet (a100, a40, h100, h200, l40s, cpu)")
    cost.add_argument("--model-spec", default="llama-3-8b", help="spec preset or a directory with config.json")
    cost.add_argument("--dtype", default=None, choices=("float32", "float64", "bfloat16", "float16"),
                      help="default: the spec's own")
    cost.add_argument("--tp", type=int, default=1)
    cost.add_argument("--ep", type=int, default=1, help="expert parallelism (a mixture of experts): 1 or --tp")
    cost.add_argument("--profile", default=None, help="a device profile (from `slotbench calibrate`)")
    cost.add_argument("--decode", action="append", default=[], metavar="B:KV",
                      help="B generation rows with KV cached tokens each (repeatable)")
    cost.add_argument("--prefill", action="append", default=[], metavar="N[:KV]",
                      help="one N-token prompt chunk after KV cached tokens (repeatable)")
    add_compare_parser(sub)
    add_serve_parser(sub)
    info = sub.add_parser("trace-info", help="rows, duration, rate, length percentiles, burstiness")
    info.add_argument("path")
    info.add_argument("--trace-format", default="auto")
    info.add_argument("--tokens-per-block", type=int, default=16, help="KV block size of the ideal prefix hit rate")
    info.add_argument("--length-scale", type=float, default=1.0, help="as in `run`: scales lengths and prefix blocks")
    info.add_argument("--limit", type=int, default=None, help="as in `run`: the first N requests")
    info.add_argument("--max-input-len", type=int, default=None, help="as in `run`: clip input lengths")
    return p


def print_summary(summary: pd.DataFrame) -> None:
    if summary.empty:
        print("no strategy produced results")
        return
    cols = [c for c in SUMMARY_COLUMNS if c in summary.columns]
    from reports.tables import readable

    with pd.option_context("display.width", 250, "display.max_columns", 40):
        print(readable(summary[cols]).to_string(index=False))


def _cmd_run(args: argparse.Namespace) -> int:
    from harness.app import execute

    opts = options_from_args(args)
    fault = None
    if os.environ.get("SLOTBENCH_INJECT_FAULT"):  # test hook: STRATEGY:ITERATION raises in the engine there
        name, _, it = os.environ["SLOTBENCH_INJECT_FAULT"].partition(":")
        fault = (name, int(it))
    out = Path(args.out) if args.out else Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")
    if args.repeats != 1:  # a one-configuration suite: OUT/run@rI/ per repeat, and the statistics
        from harness.suite.execute import execute_suite
        from harness.suite.spec import expand

        runs = expand([("run", {}, opts)], args.repeats)
        code, out, summary = execute_suite(out.name, "slotbench run", None, runs, out, force=args.force,
                                           progress=not args.no_progress)
        print_summary(summary)
        print(f"wrote {out}/ (statistics: {out / 'summary_repeats.csv'}, report: {out / 'report.html'})")
        return code
    outcome = execute(opts, out, force=args.force, progress=not args.no_progress, fault=fault)
    print_summary(outcome.summary)
    for note in outcome.notes:
        print(note)
    print(f"wrote {outcome.out}/ (report: {outcome.out / 'report.html'})")
    return outcome.exit_code


def _cmd_suite(args: argparse.Namespace) -> int:
    from harness.suite.run import run_suite

    code, out, summary = run_suite(Path(args.file), Path(args.out) if args.out else None, force=args.force,
                                   progress=not args.no_progress, ray_address=args.ray, resume=args.resume,
                                   repeats=args.repeats)
    print_summary(summary)
    if (out / "capacity.csv").is_file():
        from reports.tables import readable

        print(readable(pd.read_csv(out / "capacity.csv")).to_string(index=False))
    print(f"wrote {out}/ (report: {out / 'report.html'})")
    return code


def _cmd_report(args: argparse.Namespace) -> int:
    from reports.html import write_report

    paths = [Path(d) for d in args.dirs]
    for p in paths:
        if not (p / "summary.csv").is_file() and not (p / "suite.json").is_file() and not (
                p.is_file() and p.suffix == ".json"):
            raise UserError(f"{p}: not a run or suite directory (no summary.csv or suite.json), nor a "
                            "`vllm bench serve --save-result` file (.json)")
    try:
        out = write_report(paths, Path(args.out), baseline=args.baseline)
    except ValueError as exc:  # a file that is not what it claims to be
        raise UserError(str(exc)) from None
    print(f"wrote {out}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if (args.run_dir is None) == (args.op_profile is None):
        raise UserError("calibrate: give a run directory or --op-profile DIR (one of the two)")
    if args.op_profile is not None:
        from harness.calibrate.op_profile import fit_op_profile

        if args.gpu is None:
            raise UserError("calibrate --op-profile: --gpu names the GPU the tables were measured on")
        source = Path(args.op_profile)
        profile, stats = fit_op_profile(source, args.gpu, args.dtype)
    else:
        from harness.calibrate.from_run import calibrate

        source = Path(args.run_dir)
        profile, stats = calibrate(source, args.gpu or "cpu")
    out = Path(args.out) if args.out else source / "device-profile.json"
    profile.save(out)
    print(json.dumps(stats, indent=2))
    print(f"wrote {out}")
    return 0


def _cmd_step_cost(args: argparse.Namespace) -> int:
    from harness.step_cost import parse_pieces
    from strategies.runtime.sim.build import cost_model
    from strategies.runtime.sim.config import SimConfig

    try:
        sim = SimConfig(gpu=args.gpu, model_spec=args.model_spec, tp=args.tp, ep=args.ep, profile=args.profile,
                        dtype=args.dtype)
        model = cost_model(sim)
        work = parse_pieces(args.decode, args.prefill)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    phases = model.phases(work)
    print(json.dumps({"step_ms": sum(phases.values()) * 1e3, "phases": {k: v * 1e3 for k, v in phases.items()},
                      "gpu": model.profile.gpu.name, "model_spec": args.model_spec, "dtype": model.spec.dtype,
                      "tp": args.tp, "profile": model.profile.source, "work": dataclasses.asdict(work)}, indent=2))
    return 0


def _cmd_trace_info(args: argparse.Namespace) -> int:
    from harness.traces import Fit, fit_trace, load_trace, trace_info

    if args.tokens_per_block <= 0:
        raise UserError(f"--tokens-per-block must be positive, got {args.tokens_per_block}")
    trace = fit_trace(load_trace(args.path, args.trace_format), Fit(length_scale=args.length_scale, limit=args.limit,
                                                                          max_input_len=args.max_input_len))
    print(json.dumps(trace_info(trace, args.tokens_per_block), indent=2))
    return 0


def _install_sigint() -> None:
    state = {"hits": 0}

    def handler(signum: int, frame: object) -> None:
        state["hits"] += 1
        if state["hits"] > 1:
            os._exit(130)  # second Ctrl-C: leave now
        print("\nslotbench: interrupted; writing what was measured (Ctrl-C again to quit at once)", file=sys.stderr)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["run"]  # `slotbench` alone runs the default benchmark
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["run", *argv])
    commands = {"run": _cmd_run, "suite": _cmd_suite, "report": _cmd_report, "trace-info": _cmd_trace_info,
                "calibrate": _cmd_calibrate, "step-cost": _cmd_step_cost, "compare": cmd_compare,
                "serve": cmd_serve}
    _install_sigint()
    try:
        return commands[args.command](args)
    except UserError as exc:
        print(f"slotbench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> NoReturn:
    """The console script: ``main``, then leave without the interpreter's teardown. Finalising torch's,
    pandas' and plotly's modules takes a noticeable share of a short run (docs/host-path.md) and does nothing a
    user needs: files are closed where they are written, and exit handlers (Ray, multiprocessing's children,
    weakref finalizers) still run here. With a non-daemon thread still alive the normal exit joins it.
    ``python -m harness.cli`` keeps the normal exit, so that a profiler writing at exit (``python -m cProfile
    -m harness.cli``) still gets its file."""
    code = main()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # a reader that went away, or a closed stream: nothing to lose
        pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
