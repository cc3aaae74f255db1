"""The device: streams (a CUDA stream, the CPU worker), the run clock, the CPU budget, and NVTX."""
