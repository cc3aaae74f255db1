"""Sim to real: a run's figures per load stage against measured serving runs (``slotbench compare``)."""
