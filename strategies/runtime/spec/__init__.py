"""Speculative decoding: its configuration and the n-gram proposer (the accept step is decoder/accept.py)."""
