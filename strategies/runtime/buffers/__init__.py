"""Buffers between host and device: memory placement, the engine's runtime buffers, decoder step I/O,
encoder buffers, request slots, and the buffer set one in-flight step owns."""
