"""Helpers to drive Megatron-Bridge's real training step on a CPU machine (tests, the demo).

Not used by the patch itself.
"""
