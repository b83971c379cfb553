"""The mechanisms: numpy-only, randomness injected, state serialisable."""
