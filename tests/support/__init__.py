"""Helpers shared by the test suite (real Prometheus server, ...)."""
