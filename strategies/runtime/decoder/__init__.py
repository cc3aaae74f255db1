"""Decoder state on the device: per-slot sampler state, the sampler, and beam search."""
