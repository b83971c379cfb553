"""The counters flow kind: private per-key counts, released at every step (one room)."""
