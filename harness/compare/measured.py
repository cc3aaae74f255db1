"""Measured serving runs as figures per load stage, for ``slotbench compare``.

Each reader returns rows of ``FIGURE_COLUMNS``: source (the file), stage (an int, or -1 for the whole
run), metric, stat, value. Metrics and their units:
- ``ttft_ms``, ``e2el_ms``: request sent -> first streamed event / last event (mean, median, p90, p99);
- ``tpot_ms`` (mean): time per output token, (mean E2E - mean TTFT) / (output tokens - 1), as
  ../shared/validation/README.md defines it (the files' own TPOT is per streamed event, not per token);
- ``request_throughput`` (req/s) and ``output_throughput`` (tok/s): succeeded requests (their output
  tokens) over the stage's duration;
- ``failed_pct``: requests that failed, in percent of those sent.

Formats: a measured run's JSON as ../shared/validation keeps it (``stages`` with ``ttft_ms`` …);
inference-perf's lifecycle reports (``stage_<k>_lifecycle_metrics.json``, ``summary_lifecycle_metrics.json``,
seconds; or a directory holding them; TPOT and throughputs from the run's ``config.yaml`` beside them:
``read_lifecycle``); a ``vllm bench serve --save-result`` file (one stage: the run).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.errors import UserError
from harness.traces.workload import Workload, load_workload

FIGURE_COLUMNS = ["source", "stage", "metric", "stat", "value"]
STATS = ("mean", "median", "p90", "p99")
WHOLE_RUN = -1


def _rows(source: str, stage: int, metric: str, stats: dict, scale: float = 1.0) -> list[dict]:
    return [{"source": source, "stage": stage, "metric": metric, "stat": s, "value": float(stats[s]) * scale}
            for s in STATS if isinstance(stats.get(s), int | float)]


def _one(source: str, stage: int, metric: str, value: float, stat: str = "value") -> dict:
    return {"source": source, "stage": stage, "metric": metric, "stat": stat, "value": float(value)}


def _tpot(source: str, stage: int, e2e_ms: float, ttft_ms: float, tokens: float) -> list[dict]:
    return [_one(source, stage, "tpot_ms", (e2e_ms - ttft_ms) / (tokens - 1), "mean")] if tokens > 1 else []


def read_validation(path: Path, doc: dict) -> list[dict]:
    """A measured run of ../shared/validation: each stage's figures; TPOT from max_tokens (ignore_eos)."""
    src, out = path.name, []
    max_tokens = float(doc.get("workload", {}).get("max_tokens", 0))
    for k, st in enumerate(doc["stages"]):
        out += _rows(src, k, "ttft_ms", st.get("ttft_ms") or {})
        out += _rows(src, k, "e2el_ms", st.get("e2e_latency_ms") or {})
        if st.get("ttft_ms") and st.get("e2e_latency_ms"):
            out += _tpot(src, k, st["e2e_latency_ms"]["mean"], st["ttft_ms"]["mean"], max_tokens)
        dur, ok, sent = float(st["duration_s"]), float(st.get("succeeded", 0)), float(st.get("sent", 0))
        out += [_one(src, k, "request_throughput", ok / dur), _one(src, k, "output_throughput", ok * max_tokens / dur)]
        if sent:
            out.append(_one(src, k, "failed_pct", 100 * float(st.get("failed", 0)) / sent))
    return out


def read_lifecycle(path: Path, doc: dict, stage: int) -> list[dict]:
    """An inference-perf lifecycle report (seconds). Its own output counts and throughputs are not the engine's:
    ``output_len`` is the streamed text tokenised again on the client (Llama 2's 7B runs: ~200 of the 248 tokens
    generated, an EOS decodes to nothing) and ``requests_per_sec`` spans the stage's drain. So TPOT and the throughputs
    are taken, as for ../shared/validation's files, from the run's ``config.yaml`` beside the report (its
    ``output_len`` where ``ignore_eos`` holds every request to it, its stages' durations), and left out without one
    that ``--workload-config`` reads."""
    src, lat = path.name, doc["successes"]["latency"]
    ttft, e2e = lat.get("time_to_first_token") or {}, lat.get("request_latency") or {}
    out = _rows(src, stage, "ttft_ms", ttft, 1e3) + _rows(src, stage, "e2el_ms", e2e, 1e3)
    w = _beside_config(path)
    if w is not None and stage != WHOLE_RUN and stage < len(w.stages):
        tokens = w.output.mean if w.ignore_eos and not w.output.std_dev else None
        dur, ok = w.stages[stage].duration_s, float(doc["successes"].get("count") or 0)
        if tokens and "mean" in ttft and "mean" in e2e:
            out += _tpot(src, stage, e2e["mean"] * 1e3, ttft["mean"] * 1e3, tokens)
        out.append(_one(src, stage, "request_throughput", ok / dur))
        if tokens:
            out.append(_one(src, stage, "output_throughput", ok * tokens / dur))
    sent = float(doc.get("load_summary", {}).get("count") or 0)
    if sent:
        out.append(_one(src, stage, "failed_pct", 100 * float(doc.get("failures", {}).get("count", 0)) / sent))
    return out


def _beside_config(report: Path) -> Workload | None:
    """The workload of the inference-perf run whose report this is: its ``config.yaml``, if it is beside it and a
    replay could read it (else None: the report's latencies are still compared)."""
    config = report.parent / "config.yaml"
    if not config.is_file():
        return None
    try:
        return load_workload(str(config))
    except UserError:  # a workload the replay does not take (another data type, a sweep, newer keys)
        return None


def read_vllm_bench(path: Path, doc: dict) -> list[dict]:
    """A ``vllm bench serve --save-result`` file: the whole run as one stage."""
    src, w, out = path.name, WHOLE_RUN, []
    for metric, key in (("ttft_ms", "ttft"), ("e2el_ms", "e2el")):
        out += _rows(src, w, metric, {s: doc.get(f"{s}_{key}_ms") for s in STATS})
    if "mean_tpot_ms" in doc:
        out.append(_one(src, w, "tpot_ms", doc["mean_tpot_ms"], "mean"))
    out += [_one(src, w, k, doc[k]) for k in ("request_throughput", "output_throughput") if k in doc]
    done, failed = float(doc.get("completed", 0)), float(doc.get("failed", 0) or 0)
    if done + failed:
        out.append(_one(src, w, "failed_pct", 100 * failed / (done + failed)))
    return out


def read_measured(path: Path) -> list[dict]:
    """Figures of one measured file, or of every lifecycle report in a directory."""
    if path.is_dir():
        files = sorted(p for p in path.glob("*lifecycle_metrics.json"))
        if not files:
            raise UserError(f"{path}: no inference-perf *lifecycle_metrics.json in it")
        return [row for f in files for row in read_measured(f)]
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UserError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: not a measured run (expected a JSON object)")
    try:
        if "stages" in doc and "workload" in doc:
            return read_validation(path, doc)
        if "successes" in doc:
            m = re.match(r"stage_(\d+)_", path.name)
            return read_lifecycle(path, doc, int(m.group(1)) if m else WHOLE_RUN)
        if "request_throughput" in doc and "duration" in doc:
            return read_vllm_bench(path, doc)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: a measured run with a missing or malformed field ({exc})") from None
    raise UserError(f"{path}: not a measured run (a ../shared/validation JSON, an inference-perf lifecycle report "
                    "or a `vllm bench serve --save-result` file)")
