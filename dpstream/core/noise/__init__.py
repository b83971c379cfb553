"""Noise: exact integer samplers fed by replay-safe, keyed cryptographic randomness."""
