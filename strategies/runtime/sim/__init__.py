"""The simulated device: slotbench's own strategies, buffers and sampler, with only the device modelled.

A forward is not computed; it returns cheap deterministic logits and takes the time a roofline cost
model predicts for the batch actually scheduled, on a virtual clock.
"""
