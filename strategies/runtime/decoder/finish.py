"""The finish codes a device writes for each output row, and the reasons the host reads from them (torch-free:
the simulated device writes them too, ``sim/decoder.py``)."""

# DISCARDED marks a row computed for a request the device already knew to be finished (overlap's one extra
# step; static's padding rows).
CONTINUE, STOP, LENGTH, DISCARDED = 0, 1, 2, -1
FINISH_REASONS = {STOP: "stop", LENGTH: "length"}
