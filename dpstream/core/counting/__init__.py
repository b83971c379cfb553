"""Continual counting: the binary tree and BLT counters, the threshold monitor, per-key state."""
