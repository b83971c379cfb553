"""Parameter checks shared by the mechanisms (one message format everywhere)."""

from __future__ import annotations

import math

import numpy as np

from dpstream.errors import InvalidParameterError


def is_integer(value: object) -> bool:
    """Whether ``value`` is a Python or numpy integer (and not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_finite(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite number > 0; raise otherwise."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0):
        raise InvalidParameterError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def integer_at_least(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``; raise otherwise."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) \
            or value < minimum:
        raise InvalidParameterError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def increment(value: object) -> int:
    """Return a step's increment as an int; the error never shows the value (it is data)."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise InvalidParameterError(
            f"increment must be an integer >= 0, got a {type(value).__name__}")
    if value < 0:
        raise InvalidParameterError("increment must be an integer >= 0, got a negative one")
    return int(value)
