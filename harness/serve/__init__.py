"""``slotbench serve``: one strategy's own loop behind an OpenAI-compatible HTTP front end."""
