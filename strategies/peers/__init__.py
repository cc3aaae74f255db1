"""Peer engines run through the same harness: Hugging Face transformers' ``generate`` over static
batches (``hf-static``) and its continuous batching manager (``hf-cb``). Optional: ``slotbench[peers]``;
``strategies.registry`` imports them only when one is asked for."""
