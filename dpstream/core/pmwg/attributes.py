"""The attributes of PMWG's data universe: categorical values and numeric buckets.

Private multiplicative weights for growing databases (PMWG; Cummings, Krehbiel,
Lai, Tantipongpipat 2018, "Differential Privacy for Growing Databases",
Algorithm 1 and appendix B) keeps a public histogram ``y`` over a finite data
universe ``X`` of ``N`` elements, and a database is its normalised histogram
``x_t`` over ``X``. ``X`` is a product of attributes (:mod:`dpstream.core.pmwg.universe`);
this module defines one attribute's domain and its codes.

**Attributes.** A :class:`Categorical` attribute has a declared tuple of string
values (domain size ``len(values)``). A :class:`Bucketed` attribute has ``k + 1``
strictly increasing finite edges and ``k`` buckets ``[e_0, e_1), ...,
[e_{k-1}, e_k]``: every bucket is left-closed and right-open except the last,
which is closed on both sides. A number outside ``[e_0, e_k]``, a non-finite
number or a non-number does not fit.

Validation errors are :class:`UniverseError` (raised at construction, never per record); their
messages show values through a bounded ``repr`` (:func:`_show`), as record reasons do. No
noise and no state: an attribute is public, immutable schema.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass, field
from typing import ClassVar, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from dpstream.errors import InvalidParameterError

__all__ = [
    "Attribute",
    "Bucketed",
    "Categorical",
    "UniverseError",
]

_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_SHOW_LIMIT: Final = 40


class UniverseError(InvalidParameterError):
    """A universe specification is invalid (raised at construction, never per record)."""


def _make_repr() -> reprlib.Repr:
    shower = reprlib.Repr()
    shower.maxstring = shower.maxother = shower.maxlong = _SHOW_LIMIT
    shower.maxlist = shower.maxtuple = shower.maxset = 6
    shower.maxdict = 4
    shower.maxlevel = 3
    return shower


_REPR: Final = _make_repr()


def _show(value: object) -> str:
    """Return a bounded ``repr`` of ``value`` (it goes into reasons and error messages).

    Never raises and never walks more than a few elements, whatever the value
    (huge lists, deep nesting, a failing ``__repr__``).
    """
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a message must never fail
        return f"<a {type(value).__name__}>"
    if len(text) > 2 * _SHOW_LIMIT:
        text = text[: 2 * _SHOW_LIMIT - 3] + "..."
    return text


def _fmt_number(x: float) -> str:
    """Return a short exact text for an edge: ``18`` for 18.0, ``repr`` otherwise."""
    if x.is_integer() and abs(x) < 2**53:
        return str(int(x))
    return repr(x)


def _is_real(value: object) -> bool:
    """Whether ``value`` is an int or float (numpy ones included), and not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _check_name(name: object, path: str) -> str:
    if not isinstance(name, str):
        raise UniverseError(
            f"{path} must be a string matching [A-Za-z_][A-Za-z0-9_]{{0,63}}, "
            f"got a {type(name).__name__}"
        )
    if _NAME_RE.fullmatch(name) is None:
        raise UniverseError(
            f"{path} must match [A-Za-z_][A-Za-z0-9_]{{0,63}} (a letter or _ then up to 63 "
            f"letters, digits or _), got {_show(name)}"
        )
    return name


def _check_values(values: object, path: str) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise UniverseError(
            f"{path} must be a non-empty list of distinct strings, got a {type(values).__name__}"
        )
    if not values:
        raise UniverseError(f"{path} must be a non-empty list of distinct strings, got []")
    seen: dict[str, int] = {}
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise UniverseError(f"{path}[{i}] must be a string, got {_show(value)}")
        if value in seen:
            raise UniverseError(
                f"{path}[{i}] {_show(value)} repeats {path}[{seen[value]}]; values must be distinct"
            )
        seen[value] = i
    return tuple(values)


def _check_edges(edges: object, path: str) -> tuple[float, ...]:
    if isinstance(edges, (str, bytes)) or not isinstance(edges, (list, tuple)):
        raise UniverseError(
            f"{path} must be a list of at least 2 strictly increasing finite numbers, "
            f"got a {type(edges).__name__}"
        )
    if len(edges) < 2:
        raise UniverseError(
            f"{path} must have at least 2 edges (1 bucket), got {len(edges)}: {_show(list(edges))}"
        )
    out: list[float] = []
    for i, edge in enumerate(edges):
        if not _is_real(edge):
            raise UniverseError(f"{path}[{i}] must be a finite number, got {_show(edge)}")
        try:
            x = float(edge)
        except OverflowError:
            x = math.inf
        if not math.isfinite(x):
            raise UniverseError(f"{path}[{i}] must be a finite number, got {_show(edge)}")
        x += 0.0  # -0.0 -> 0.0, so equal schemas have equal digests
        if out and not x > out[-1]:
            raise UniverseError(
                f"{path} must be strictly increasing, got {_show(list(edges))} "
                f"({path}[{i}] = {_fmt_number(x)} <= {path}[{i - 1}] = {_fmt_number(out[-1])})"
            )
        out.append(x)
    return tuple(out)



@dataclass(frozen=True)
class Categorical:
    """An attribute with a declared, ordered list of string values.

    Attributes:
        name: the attribute's name (``[A-Za-z_][A-Za-z0-9_]{0,63}``).
        values: the distinct values; value ``values[i]`` has code ``i``.

    Raises:
        UniverseError: a bad name, or values that are empty, not strings or repeated.

    """

    name: str
    values: tuple[str, ...]
    _index: dict[object, int] = field(init=False, repr=False, compare=False, hash=False)

    kind: ClassVar[str] = "categorical"

    def __post_init__(self) -> None:
        _check_name(self.name, "attribute name")
        values = _check_values(self.values, f"attribute {self.name!r} values")
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "_index", {v: i for i, v in enumerate(values)})

    @property
    def size(self) -> int:
        """The domain size ``len(values)``."""
        return len(self.values)

    def code(self, value: str) -> int:
        """Return the code of ``value``.

        Raises:
            KeyError: ``value`` is not one of the declared values.

        """
        return self._index[value]

    def label(self, code: int) -> str:
        """Return the value with code ``code``."""
        return self.values[code]


@dataclass(frozen=True)
class Bucketed:
    """A numeric attribute cut into buckets by strictly increasing edges.

    ``k + 1`` edges make ``k`` buckets ``[e_0, e_1), ..., [e_{k-1}, e_k]``; the
    last bucket is closed on both sides. Edges are stored as floats.

    Attributes:
        name: the attribute's name (``[A-Za-z_][A-Za-z0-9_]{0,63}``).
        edges: the ``k + 1 >= 2`` finite, strictly increasing bucket edges.

    Raises:
        UniverseError: a bad name, or fewer than 2 edges, a non-finite or
            non-numeric edge, or edges that do not strictly increase.

    """

    name: str
    edges: tuple[float, ...]
    _array: npt.NDArray[np.float64] = field(init=False, repr=False, compare=False, hash=False)

    kind: ClassVar[str] = "bucketed"

    def __post_init__(self) -> None:
        _check_name(self.name, "attribute name")
        edges = _check_edges(self.edges, f"attribute {self.name!r} edges")
        object.__setattr__(self, "edges", edges)
        array = np.array(edges, dtype=np.float64)
        array.flags.writeable = False
        object.__setattr__(self, "_array", array)

    @property
    def size(self) -> int:
        """The number of buckets ``len(edges) - 1``."""
        return len(self.edges) - 1

    def code(self, value: float) -> int:
        """Return the bucket of ``value``.

        Raises:
            KeyError: ``value`` is non-finite or outside ``[e_0, e_k]``.

        """
        x = float(value)
        if not self.edges[0] <= x <= self.edges[-1]:
            raise KeyError(value)
        return min(int(np.searchsorted(self._array, x, side="right")) - 1, self.size - 1)

    def label(self, code: int) -> str:
        """Return bucket ``code`` as text: ``[18, 30)``, or ``[65, 120]`` for the last one."""
        lo, hi = self.edges[code], self.edges[code + 1]
        close = "]" if code == self.size - 1 else ")"
        return f"[{_fmt_number(lo)}, {_fmt_number(hi)}{close}"

    @property
    def range_text(self) -> str:
        """The closed range ``[e_0, e_k]`` of values that fit, as text."""
        return f"[{_fmt_number(self.edges[0])}, {_fmt_number(self.edges[-1])}]"


Attribute: TypeAlias = Categorical | Bucketed
