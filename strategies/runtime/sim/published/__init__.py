"""Kernels the simulated device prices from published H100 measurements, as vLLM runs them: tensor parallelism's
all-reduce (``allreduce.py``) and the fused mixture-of-experts kernels (``fused_moe.py``). Each module holds its
published points, where they come from, and the fit made from them at first use."""
