"""Parameter checks shared by the mechanisms (one message format everywhere)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

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


def fraction_text(value: Fraction) -> str:
    """An exact rational as ``"num/den"`` (what snapshots and records store)."""
    return f"{value.numerator}/{value.denominator}"


def check_state(state: dict[str, Any], kind: str, version: int,
                made_with: dict[str, tuple[str, dict[str, Any]]]) -> None:
    """Refuse a snapshot of another kind or version, or made with other specs.

    ``made_with`` maps each spec's key in the state to a label for messages and the
    ``to_dict()`` of the spec the state must have been made with.
    """
    if state["version"] != version or state["kind"] != kind:
        raise InvalidParameterError(
            f"not an {kind} state of version {version}: kind {state['kind']!r}, version "
            f"{state['version']!r}")
    for key, (label, spec) in made_with.items():
        if state[key] != spec:
            raise InvalidParameterError(
                f"the state was made with {label} {state[key]!r}, but this one is {spec!r}")
