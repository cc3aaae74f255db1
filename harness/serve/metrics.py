"""``/metrics``: Prometheus text with vLLM's metric names and meanings (vllm/v1/metrics/loggers.py), kept by the
front end's engine client as the engine process publishes each step, read by its event loop.

Gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0-1) are the
engine's state at its last step. Counters: ``vllm:prompt_tokens`` (prompts computed: counted at a request's first
token), ``vllm:generation_tokens``, ``vllm:prefix_cache_queries`` / ``_hits`` (prompt tokens looked up / found
cached in GPU memory, at admission), with a host KV tier ``vllm:external_prefix_cache_queries`` / ``_hits`` (as
vLLM counts its offloading connector's: queried = the prompt tokens the GPU's cache did not hold),
``vllm:num_preemptions`` (counted when the request ends), ``vllm:request_success`` by
``finished_reason`` (stop, length; a failed or aborted request is not a success). Histograms with vLLM's buckets:
``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds`` (one observation per streamed gap),
``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds`` (arrival → first admission).
Labels ``model_name`` and ``engine="0"``, as vLLM's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from strategies.runtime.request import Request, Status

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
LABELS = ("model_name", "engine")


class ServerMetrics:
    def __init__(self, model_name: str, host_tier: bool = False) -> None:
        self.registry = CollectorRegistry()  # the server's own (prometheus_client's metrics are thread-safe)
        lab = {"model_name": model_name, "engine": "0"}

        def make(kind: type, name: str, doc: str, **kw: object):  # one metric, vLLM's labels set
            return kind(name, doc, LABELS, registry=self.registry, **kw).labels(**lab)

        self.running = make(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self.cache_queries = make(Counter, "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.")
        self.cache_hits = make(Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.")
        # the host KV tier's (--kv-offload-blocks): vLLM exports a KV connector's hits only where it has one
        self.external_queries = self.external_hits = None
        if host_tier:
            self.external_queries = make(Counter, "vllm:external_prefix_cache_queries", "External prefix cache "
                                         "queries from KV connector cross-instance cache sharing, in terms of number "
                                         "of queried tokens.")
            self.external_hits = make(Counter, "vllm:external_prefix_cache_hits", "External prefix cache hits from "
                                      "KV connector cross-instance cache sharing, in terms of number of cached tokens.")
        self.preemptions = make(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=self.registry)
        self.success = {reason: success.labels(**lab, finished_reason=reason) for reason in ("stop", "length")}
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                         "seconds.", buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                        "seconds.", buckets=TPOT_BUCKETS)
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                        "seconds.", buckets=LATENCY_BUCKETS)
        self.queue = make(Histogram, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase "
                          "for request.", buckets=LATENCY_BUCKETS)

    # --- the engine client's thread (each step the engine publishes) -----------------------------
    def engine_state(self, running: int, waiting: int, kv_usage: float) -> None:
        """The engine's state at its last step (``engine_process.py`` reads it there)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def tokens(self, r: Request, first: bool, times: list[float], previous_s: float | None) -> None:
        """``r`` streamed ``len(times)`` new tokens (one chunk per distinct time); ``first``: its first ones."""
        self.generation_tokens.inc(len(times))
        if first:
            self.prompt_tokens.inc(r.prompt_len)
            self.cache_queries.inc(r.prompt_len)
            local = r.cached_tokens - r.host_cached_tokens
            self.cache_hits.inc(local)
            if self.external_queries is not None and self.external_hits is not None:
                self.external_queries.inc(r.prompt_len - local)
                self.external_hits.inc(r.host_cached_tokens)
            self.ttft.observe(times[0] - r.arrival_s)
        last = previous_s if previous_s is not None else times[0]
        for t in times:
            if t > last:  # tokens handed out together are one chunk: one gap
                self.itl.observe(t - last)
                last = t

    def ended(self, r: Request) -> None:
        self.preemptions.inc(r.preemptions)
        if r.status is not Status.FINISHED:
            return
        self.success[r.finish_reason if r.finish_reason in self.success else "stop"].inc()
        self.e2e.observe(r.finish_s - r.arrival_s)
        if r.admitted_s is not None:
            self.queue.observe(r.admitted_s - r.arrival_s)

    # --- the front end's thread -----------------------------------------------------------------
    def text(self) -> str:
        return generate_latest(self.registry).decode()
