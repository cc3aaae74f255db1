"""Peer engines run through the same harness: Hugging Face transformers' ``generate`` over static
batches (``hf-static``) and its continuous batching manager (``hf-cb``). Optional: ``slotbench[peers]``."""

import transformers  # noqa: F401  (ImportError here means the extra is not installed)

from strategies.peers import hf_cb, hf_static  # noqa: F401  (register)
