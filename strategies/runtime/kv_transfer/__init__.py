"""Disaggregated prefill/decode: what moves a request's KV cache from a context engine to a generation engine."""
