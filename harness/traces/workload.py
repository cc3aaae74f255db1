"""A load generator's workload as requests: inference-perf configs, and the measured runs' restatements.

``--workload-config FILE`` reads either
- an inference-perf config (YAML): ``data.type`` shared_prefix, random or synthetic; ``load.type`` constant
  or poisson with ``stages`` of ``rate`` and ``duration``; ``api.type`` completion or chat (streaming); or
- a measured run's JSON as ``../shared/validation`` keeps it: ``workload`` (the shared-prefix parameters,
  ``max_tokens``, ``ignore_eos``) and ``stages`` (``rate_rps``, ``duration_s``, and the ``prompt_tokens`` the
  server counted).

Requests are built as inference-perf builds them (its generator from the measured runs' build, of November 2025
by their config's keys, to February 2026: the parts read here did not change):
- shared_prefix: each of ``num_groups`` groups has one random system prompt; each of its
  ``num_prompts_per_group`` prompts is that prefix followed by a random question. The prompts are shuffled
  once (seeded), and request i sends prompt i mod N, so every prompt recurs every N requests.
- random / synthetic: each request's lengths drawn from ``input_distribution`` / ``output_distribution``
  (a normal clipped to [min, max], rounded), random ids, nothing shared.
- load constant: a stage's rate x duration requests, gaps drawn exponential and scaled so that they sum to
  the duration (inference-perf's ConstantLoadTimer); poisson: a Poisson count of requests in each second, spread
  over it as the constant timer spreads a stage (its PoissonLoadTimer), rate x duration requests in all. (Its
  single-process loop, ``num_workers: 0``, sends only those due before the stage's end.)
- request i of a stage (counted from 0 in each stage, as the generator counts) sends prompt i mod N; a random
  workload's ``total_count`` lengths are drawn once and request i of a stage takes the i-th.
- a stage starts once every request of the one before has ended, ``load.interval`` after the check that saw it
  (``harness/traces/stage_drain.py``).
- the client as inference-perf's: a request not complete ``load.request_timeout`` seconds after it was sent fails
  (where that is null, aiohttp's default session time-out, 300 s, which aiohttp ends on a whole second: the
  measured reasoning run's 4,068 failures took 300.0-301.0 s), and at most num_workers x worker_max_concurrency
  requests are in flight.

The server tokenises the generator's text again: a measured run's ``prompt_tokens`` (BOS included) are
~5% longer than system prompt + question. Where the file states them (the JSON), the replayed prompts are
sized so that their mean is the measured one: one BOS token shared by all, system prompt and question each
scaled by the same factor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import UserError

LOADS = ("constant", "poisson")
DATA_TYPES = ("shared_prefix", "random", "synthetic")
APIS = ("completion", "chat")
BOS_ID = 1  # the token every replayed prompt opens with (Llama's BOS); shared, so it is never a cache miss


@dataclass(frozen=True)
class Dist:
    """A length: fixed (std_dev 0) or inference-perf's clipped normal."""

    mean: float
    min: int
    max: int
    std_dev: float = 0.0
    total_count: int | None = None  # random data: this many lengths drawn once, request i of a stage takes the i-th

    def __post_init__(self) -> None:
        if not (0 < self.min <= self.mean <= self.max) or self.std_dev < 0:
            raise UserError(f"workload length {self}: need 0 < min <= mean <= max and std_dev >= 0")
        if self.total_count is not None and self.total_count <= 0:
            raise UserError(f"workload length {self}: total_count must be positive")

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        x = np.clip(rng.normal(self.mean, self.std_dev, size=n), self.min, self.max) if self.std_dev else \
            np.full(n, self.mean)
        return np.clip(np.round(x), self.min, self.max).astype(np.int64)


@dataclass(frozen=True)
class Stage:
    rate: float  # requests/s
    duration_s: float
    prompt_tokens_mean: float | None = None  # the server's count (measured runs): prompts are sized to it


@dataclass(frozen=True)
class Workload:
    data: str  # one of DATA_TYPES
    load: str  # one of LOADS
    stages: tuple[Stage, ...]
    output: Dist
    input: Dist | None = None  # random / synthetic
    num_groups: int = 0  # shared_prefix
    prompts_per_group: int = 0
    system_prompt: Dist | None = None
    question: Dist | None = None
    ignore_eos: bool = True  # (inference-perf's default: server.ignore_eos)
    seed: int | None = None  # the file's own; else the run's --seed
    # the client's: its time-out of a whole request (inference-perf's load.request_timeout; where that is null, the
    # aiohttp session's default total time-out, 300 s) and its cap on requests in flight (num_workers x
    # worker_max_concurrency; None where the file does not say both)
    request_timeout_s: float = 300.0
    max_concurrency: int | None = None
    interval_s: float = 1.0  # load.interval: between a stage's close and the next stage (stage_drain.py)
    multi_process: bool = True  # load.num_workers > 0 (its default): the multi-process loop's stages and counts

    def stage_bounds(self) -> list[tuple[float, float]]:
        ends = np.cumsum([s.duration_s for s in self.stages])
        return [(float(e - s.duration_s), float(e)) for s, e in zip(self.stages, ends, strict=True)]


def _dist(value: Any, where: str) -> Dist:
    if isinstance(value, bool) or value is None:
        raise UserError(f"workload config: {where} must be a number or {{min, max, mean, std_dev}}")
    if isinstance(value, int | float):
        return Dist(float(value), int(value), int(value))
    if isinstance(value, dict):
        _only(value, ("min", "max", "mean", "std_dev", "total_count"), where)
        try:
            count = value.get("total_count")
            if count is not None and (isinstance(count, bool) or int(count) != count):
                raise ValueError
            return Dist(float(value["mean"]), int(value["min"]), int(value["max"]), float(value.get("std_dev", 0)),
                        int(count) if count is not None else None)
        except (KeyError, TypeError, ValueError):
            raise UserError(f"workload config: {where} needs min, max and mean numbers (total_count: an "
                            "integer)") from None
    raise UserError(f"workload config: {where} must be a number or {{min, max, mean, std_dev}}")


def _only(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(set(obj) - set(allowed))
    if extra:
        key = f"{where}.{extra[0]}" if where else extra[0]
        raise UserError(f"workload config: {key} is not supported here (supported: {', '.join(allowed)})")


def _section(obj: dict, key: str, where: str = "") -> dict:
    value = obj.get(key) or {}
    if not isinstance(value, dict):
        raise UserError(f"workload config: {where}{key} must be a mapping")
    return value


def _stages(load: dict, kind: str) -> tuple[Stage, ...]:
    rows = load.get("stages")
    if not isinstance(rows, list) or not rows:
        raise UserError("workload config: load.stages must list at least one {rate, duration}")
    out = []
    for i, st in enumerate(rows):
        if not isinstance(st, dict):
            raise UserError(f"workload config: load.stages[{i}] must be a mapping")
        _only(st, ("rate", "duration", "num_requests", "concurrency_level"), f"load.stages[{i}]")
        for key in ("num_requests", "concurrency_level"):  # (a concurrent stage's; null in a rate stage)
            _refuse_set(st, key, f"load.stages[{i}].", "a concurrent load stage is not supported")
        try:
            rate, duration = float(st["rate"]), float(st["duration"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"workload config: load.stages[{i}] needs numeric rate and duration") from None
        if not (rate > 0 and duration > 0 and np.isfinite(rate * duration)):
            raise UserError(f"workload config: load.stages[{i}]: rate and duration must be positive and finite")
        out.append(Stage(rate, duration))
    return tuple(out)


CIRCUIT_BREAKERS = "circuit breakers end a stage on its failures, which a replay does not"  # (top level or load.)


def _refuse_set(obj: dict, key: str, where: str, why: str) -> None:
    """A key that would change the replay in a way it cannot honour: refused when set (null, empty or false: absent)."""
    if obj.get(key) not in (None, [], {}, False):
        raise UserError(f"workload config: {where}{key} is set: {why}")


def _client(load: dict) -> dict:
    """The client's time-out and concurrency cap, as inference-perf applies them (Workload's fields)."""
    out: dict = {}
    timeout = load.get("request_timeout")
    if timeout is not None:  # null (or 0): no time-out of inference-perf's, so aiohttp's default applies
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
            raise UserError(f"workload config: load.request_timeout must be seconds >= 0, got {timeout!r}")
        if timeout:
            out["request_timeout_s"] = float(timeout)
    try:
        workers, per = load.get("num_workers"), load.get("worker_max_concurrency")
        # num_workers 0: inference-perf's single-process loop, a task per request and no cap
        out["multi_process"] = workers is None or int(workers) != 0
        if workers is not None and per is not None and out["multi_process"]:  # a permit per request in flight
            conns = load.get("worker_max_tcp_connections")
            out["max_concurrency"] = int(workers) * min(int(per), int(conns) if conns is not None else int(per))
    except (TypeError, ValueError):
        raise UserError("workload config: load.num_workers and worker_max_* must be integers") from None
    if out.get("max_concurrency", 1) <= 0 or (workers is not None and int(workers) < 0):
        raise UserError("workload config: load.num_workers and worker_max_* must be positive")
    interval = load.get("interval", 1.0)
    if isinstance(interval, bool) or not isinstance(interval, int | float) or not 0 <= interval < float("inf"):
        raise UserError(f"workload config: load.interval must be seconds >= 0, got {interval!r}")
    out["interval_s"] = float(interval)
    return out


def parse_inference_perf(cfg: dict) -> Workload:
    """An inference-perf config, as inference-perf dumps it (null and empty keys included): what changes the replay is
    honoured, what does not (headers, reports, storage, the model server's address; the tokenizer's name, as the
    tokenizer itself is ``--tokenizer``'s) is accepted, and a key that is set and cannot be honoured is refused by
    name."""
    _only(cfg, ("load", "api", "server", "tokenizer", "data", "metrics", "report", "storage", "circuit_breakers"), "")
    _refuse_set(cfg, "circuit_breakers", "", CIRCUIT_BREAKERS)
    load, data, api = _section(cfg, "load"), _section(cfg, "data"), _section(cfg, "api")
    _only(load, ("type", "stages", "interval", "num_workers", "worker_max_concurrency", "worker_max_tcp_connections",
                 "sweep", "circuit_breakers", "request_timeout", "trace", "lora_traffic_split"), "load")
    _refuse_set(load, "sweep", "load.", "a sweep measures its own stages first; give the stages it chose")
    _refuse_set(load, "trace", "load.", "a trace's own times are replayed with --trace")
    _refuse_set(load, "lora_traffic_split", "load.", "LoRA adapters are not modelled")
    _refuse_set(load, "circuit_breakers", "load.", CIRCUIT_BREAKERS)
    kind = load.get("type", "constant")
    if kind not in LOADS:
        raise UserError(f"workload config: load.type {kind!r} is not supported (supported: {', '.join(LOADS)})")
    _only(api, ("type", "streaming", "headers", "slo_unit", "slo_tpot_header", "slo_ttft_header"), "api")
    if api.get("type", "completion") not in APIS:
        raise UserError(f"workload config: api.type {api.get('type')!r} is not supported ({', '.join(APIS)})")
    dtype = data.get("type", "shared_prefix")
    _refuse_set(data, "trace", "data.", "a trace's own times are replayed with --trace")
    if dtype not in DATA_TYPES:
        raise UserError(f"workload config: data.type {dtype!r} is not supported (supported: {', '.join(DATA_TYPES)})")
    server = _section(cfg, "server")
    common = {"load": kind, "stages": _stages(load, kind), "ignore_eos": bool(server.get("ignore_eos", True)),
              **_client(load)}
    for i, st in enumerate(common["stages"]):
        if common["multi_process"] and int(st.rate * st.duration_s) == 0:  # (its progress divides by the count)
            raise UserError(f"workload config: load.stages[{i}] sends no request (rate x duration < 1), which "
                            "inference-perf's multi-process load generator cannot run")
    if dtype == "shared_prefix":  # its generator reads none of data's other keys
        _only(data, ("type", "shared_prefix", "path", "input_distribution", "output_distribution", "trace"), "data")
        sp = _section(data, "shared_prefix", "data.")
        _only(sp, ("num_groups", "num_unique_system_prompts", "num_prompts_per_group", "num_users_per_system_prompt",
                   "system_prompt_len", "question_len", "output_len", "question_distribution", "output_distribution",
                   "seed", "enable_multi_turn_chat"), "data.shared_prefix")
        _refuse_set(sp, "enable_multi_turn_chat", "data.shared_prefix.", "its multi-turn sessions are not replayed")
        groups = int(sp.get("num_groups", sp.get("num_unique_system_prompts", 10)))
        per = int(sp.get("num_prompts_per_group", sp.get("num_users_per_system_prompt", 10)))
        if groups <= 0 or per <= 0:
            raise UserError("workload config: shared_prefix groups and prompts per group must be positive")
        return Workload(data=dtype, num_groups=groups, prompts_per_group=per,
                        system_prompt=_dist(sp.get("system_prompt_len", 100), "system_prompt_len"),
                        question=_dist(sp.get("question_distribution") or sp.get("question_len", 50), "question_len"),
                        output=_dist(sp.get("output_distribution") or sp.get("output_len", 50), "output_len"),
                        seed=sp.get("seed"), **common)
    _only(data, ("type", "input_distribution", "output_distribution", "path", "shared_prefix", "trace"), "data")
    for key in ("input_distribution", "output_distribution"):
        if key not in data:
            raise UserError(f"workload config: data.type {dtype} needs data.{key}")
    return Workload(data=dtype, input=_dist(data["input_distribution"], "input_distribution"),
                    output=_dist(data["output_distribution"], "output_distribution"), **common)


def parse_measured(doc: dict) -> Workload:
    """A measured run's JSON (``../shared/validation``): its workload, at the measured stages."""
    w = doc["workload"]
    stages = []
    for i, st in enumerate(doc.get("stages") or []):
        try:
            stages.append(Stage(float(st["rate_rps"]), float(st["duration_s"]),
                                (st.get("prompt_tokens") or {}).get("mean")))
        except (KeyError, TypeError, ValueError):
            raise UserError(f"workload file: stages[{i}] needs rate_rps and duration_s") from None
    if not stages:
        raise UserError("workload file: no stages")
    try:
        return Workload(data="shared_prefix", load="constant", stages=tuple(stages),
                        num_groups=int(w["num_groups"]), prompts_per_group=int(w["prompts_per_group"]),
                        system_prompt=_dist(w["system_prompt_len"], "system_prompt_len"),
                        question=_dist(w["question_len"], "question_len"), output=_dist(w["max_tokens"], "max_tokens"),
                        ignore_eos=bool(w.get("ignore_eos", True)))
    except KeyError as exc:
        raise UserError(f"workload file: workload.{exc.args[0]} is missing") from None


def load_workload(path: str) -> Workload:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UserError(f"--workload-config {path}: {exc.strerror or exc}") from None
    try:
        if p.suffix == ".json":
            doc = json.loads(text)
        else:
            import yaml

            doc = yaml.safe_load(text)
    except Exception as exc:  # json's and yaml's errors alike: the file is not what it claims to be
        raise UserError(f"--workload-config {path}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                        f"{str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise UserError(f"--workload-config {path}: expected a mapping at the top")
    return parse_measured(doc) if "workload" in doc and "stages" in doc else parse_inference_perf(doc)
