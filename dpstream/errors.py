"""The exceptions dpstream raises: one root, a few precise subclasses."""

from __future__ import annotations

__all__ = [
    "BudgetExhaustedError",
    "ConfigError",
    "DpstreamError",
    "InvalidParameterError",
    "NoiseKeyError",
    "RecoveryMismatchError",
    "RecoveryStoreInUseError",
]


class DpstreamError(Exception):
    """Root of every error dpstream raises on purpose."""


class InvalidParameterError(DpstreamError, ValueError):
    """A mechanism or ledger was given a parameter outside its valid range."""


class ConfigError(DpstreamError):
    """The configuration file or environment is invalid; raised at start-up."""


class NoiseKeyError(DpstreamError):
    """The secret noise key is missing or malformed."""


class BudgetExhaustedError(DpstreamError):
    """A privacy charge was refused because it would exceed the ledger's budget."""


class RecoveryMismatchError(DpstreamError):
    """The recovery store belongs to another flow instance or another configuration."""


class RecoveryStoreInUseError(DpstreamError):
    """Another process holds the recovery store (a partition of it) this process would use."""
