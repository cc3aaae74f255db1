"""``slotbench run --endpoint URL``: slotbench's traces and records against any OpenAI-compatible server."""
