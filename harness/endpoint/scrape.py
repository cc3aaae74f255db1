"""A server's ``/metrics`` (Prometheus text) read into one row of ``<label>/server_metrics.parquet``: the
gauges and counters a serving engine's over-time figure shows, by vLLM's names (summed over their label sets,
``engine`` and ``model_name``); a metric the server does not expose is left out of the row."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

COLUMNS = {  # row column → the metric family (prometheus_client drops a counter's _total)
    "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc", "preemptions": "vllm:num_preemptions",
    "prompt_tokens": "vllm:prompt_tokens", "generation_tokens": "vllm:generation_tokens",
}


def read_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for column, name in COLUMNS.items():
            if family.name == name:
                values[column] = sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return values
