"""Pipeline parallelism: stage processes, each with a contiguous range of layers and their KV cache."""
