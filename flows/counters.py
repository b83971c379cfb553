"""Kept for older commands: the flow module is now :mod:`dpstream.flows.counters`."""

from dpstream.flows.counters import flow

__all__ = ["flow"]
