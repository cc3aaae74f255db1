"""A server's ``/metrics`` (Prometheus text) read into one row of ``<label>/server_metrics.parquet``: the
gauges and counters a serving engine's over-time figure shows, by vLLM's names (summed over their label sets,
``engine`` and ``model_name``); a metric the server does not expose is left out of the row.

Only the lines of those families reach the parser. The whole text is mostly histograms' buckets: parsing all of
slotbench serve's 12.6 KB took 7.2 ms of the client's event loop a scrape, and with ``--scrape-interval 0.01``
that delay reached the client's own token times (its TTFT and E2E exceeded the server's by up to 27 ms, where
without scraping they did by at most 8 ms). A real vLLM's text, with more label sets, is larger still.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

COLUMNS = {  # row column → the metric family (prometheus_client drops a counter's _total)
    "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc", "preemptions": "vllm:num_preemptions",
    "prompt_tokens": "vllm:prompt_tokens", "generation_tokens": "vllm:generation_tokens",
}
_FAMILIES = frozenset(COLUMNS.values())


def read_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for column, name in COLUMNS.items():
            if family.name == name:
                values[column] = sum(s.value for s in family.samples)
    return values


def _wanted_lines(text: str) -> str:
    """The lines of ``COLUMNS``'s families: their samples, HELP and TYPE lines; not a counter's ``_created``
    (a family of its own, a timestamp) nor any other comment."""
    kept = [line for line in text.splitlines() if _family(line) in _FAMILIES]
    return "\n".join(kept) + "\n"


def _family(line: str) -> str | None:
    if line.startswith("#"):
        parts = line.split(None, 3)
        if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
            return None
        name = parts[2]
    else:
        name = line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""
    return name.removesuffix("_total")  # a counter's samples, HELP and TYPE lines carry its name + _total
