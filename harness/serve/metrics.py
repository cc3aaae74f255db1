"""``/metrics``: Prometheus text with vLLM's metric names and meanings (vllm/v1/metrics/loggers.py), kept by the
engine's thread as requests stream and end, read by the front end's.

Gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0-1) are the
engine's state at its last step. Counters: ``vllm:prompt_tokens`` (prompts computed: counted at a request's first
token), ``vllm:generation_tokens``, ``vllm:prefix_cache_queries`` / ``_hits`` (prompt tokens looked up / found
cached, at admission), ``vllm:num_preemptions`` (counted when the request ends), ``vllm:request_success`` by
``finished_reason`` (stop, length; a failed or aborted request is not a success). Histograms with vLLM's buckets:
``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds`` (one observation per streamed gap),
``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds`` (arrival → first admission).
Labels ``model_name`` and ``engine="0"``, as vLLM's.
"""

from __future__ import annotations

import threading
from bisect import bisect_left

from strategies.interface import Executor
from strategies.runtime.request import Request, Status

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.counts[bisect_left(self.buckets, x)] += 1
        self.sum += x

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [f"# TYPE {name} histogram"], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {total}')
        return [*out, f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {total}"]


def _workers(executor: Executor) -> list:
    return list(getattr(executor, "workers", [executor]))


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{model_name}",engine="0"'
        self._lock = threading.Lock()
        self.gauges = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
                       "vllm:kv_cache_usage_perc": 0.0}
        self.counters = {"vllm:prompt_tokens": 0, "vllm:generation_tokens": 0, "vllm:prefix_cache_queries": 0,
                         "vllm:prefix_cache_hits": 0, "vllm:num_preemptions": 0}
        self.success: dict[str, int] = {"stop": 0, "length": 0}
        self.histograms = {"vllm:time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
                           "vllm:time_per_output_token_seconds": Histogram(TPOT_BUCKETS),
                           "vllm:e2e_request_latency_seconds": Histogram(LATENCY_BUCKETS),
                           "vllm:request_queue_time_seconds": Histogram(LATENCY_BUCKETS)}

    # --- the engine's thread ----------------------------------------------------------------------
    def engine_state(self, executor: Executor) -> None:
        workers = _workers(executor)
        used = sum(w.kv.blocks_in_use for w in workers)
        total = sum(w.kv.total_blocks for w in workers) or 1
        with self._lock:
            self.gauges["vllm:num_requests_running"] = float(sum(len(w.running) for w in workers))
            self.gauges["vllm:num_requests_waiting"] = float(sum(len(w.waiting) for w in workers))
            self.gauges["vllm:kv_cache_usage_perc"] = used / total

    def tokens(self, r: Request, first: bool, times: list[float], previous_s: float | None) -> None:
        """``r`` streamed ``len(times)`` new tokens (one chunk per distinct time); ``first``: its first ones."""
        with self._lock:
            self.counters["vllm:generation_tokens"] += len(times)
            if first:
                self.counters["vllm:prompt_tokens"] += r.prompt_len
                self.counters["vllm:prefix_cache_queries"] += r.prompt_len
                self.counters["vllm:prefix_cache_hits"] += r.cached_tokens
                self.histograms["vllm:time_to_first_token_seconds"].observe(times[0] - r.arrival_s)
            last = previous_s if previous_s is not None else times[0]
            for t in times:
                if t > last:  # tokens handed out together are one chunk: one gap
                    self.histograms["vllm:time_per_output_token_seconds"].observe(t - last)
                    last = t

    def ended(self, r: Request) -> None:
        with self._lock:
            self.counters["vllm:num_preemptions"] += r.preemptions
            if r.status is not Status.FINISHED:
                return
            self.success[r.finish_reason or "stop"] = self.success.get(r.finish_reason or "stop", 0) + 1
            self.histograms["vllm:e2e_request_latency_seconds"].observe(r.finish_s - r.arrival_s)
            if r.admitted_s is not None:
                self.histograms["vllm:request_queue_time_seconds"].observe(r.admitted_s - r.arrival_s)

    # --- the front end's thread -----------------------------------------------------------------
    def text(self) -> str:
        lab = self.labels
        with self._lock:
            lines = []
            for name, value in self.gauges.items():
                lines += [f"# TYPE {name} gauge", f"{name}{{{lab}}} {value!r}"]
            for name, value in self.counters.items():  # (the TYPE line names the sample: ``_total`` included)
                lines += [f"# TYPE {name}_total counter", f"{name}_total{{{lab}}} {value}"]
            lines.append("# TYPE vllm:request_success_total counter")
            lines += [f'vllm:request_success_total{{{lab},finished_reason="{k}"}} {v}' for k, v in self.success.items()]
            for name, h in self.histograms.items():
                lines += h.lines(name, lab)
        return "\n".join(lines) + "\n"
