"""The engine core every strategy runs (``engine_core.py``): one loop over a queue of steps in flight."""
