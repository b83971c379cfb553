"""The data universe of PMWG: a finite product of categorical and bucketed attributes.

Private multiplicative weights for growing databases (PMWG; Cummings, Krehbiel,
Lai, Tantipongpipat 2018, "Differential Privacy for Growing Databases",
Algorithm 1 and appendix B) keeps a public histogram ``y`` over a finite data
universe ``X`` of ``N`` elements, and a database is its normalised histogram
``x_t`` over ``X``. This module defines ``X`` and maps records to its
elements.

**Attributes.** A :class:`Categorical` attribute has a declared tuple of string
values (domain size ``len(values)``). A :class:`Bucketed` attribute has ``k + 1``
strictly increasing finite edges and ``k`` buckets ``[e_0, e_1), ...,
[e_{k-1}, e_k]``: every bucket is left-closed and right-open except the last,
which is closed on both sides. A number outside ``[e_0, e_k]``, a non-finite
number or a non-number does not fit.

**Cells.** The universe is the product of its attributes' domains, in their
declared order; a cell's index is the C-order (row-major) index of its codes,
first attribute most significant, exactly ``np.ravel_multi_index(codes,
shape)``. PMWG holds dense ``float64`` histograms over the cells, so a universe
has at most :data:`MAX_CELLS` ``= 2**24`` cells (128 MiB per histogram).

**Bad records are data, not crashes.** :meth:`Universe.cells` returns the cell
of every record that fits and, for every other record, its index and a reason
(``attribute 'age': value 130 outside [0, 120]``) for the dead-letter topic.
The common case, every record fitting, runs vectorised per attribute (a dict
lookup through ``map`` for categoricals, ``np.searchsorted`` for buckets); a
per-value pass only runs for the attributes where something did not fit.

**Binding.** :meth:`Universe.digest` is a SHA-256 of a canonical encoding of
the schema (built here, independent of any JSON library), so a mechanism's
state and parameters can be bound to the universe they were made for.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from dpstream.errors import InvalidParameterError

__all__ = [
    "MAX_CELLS",
    "Attribute",
    "Bucketed",
    "Categorical",
    "Universe",
    "UniverseError",
]

MAX_CELLS: Final = 2**24
"""The largest universe: dense float64 histograms of up to 2^24 cells (128 MiB)."""

_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_DIGEST_TAG: Final = "dpstream.universe/1"
_SHOW_LIMIT: Final = 40

IntArray: TypeAlias = npt.NDArray[np.int64]
BoolArray: TypeAlias = npt.NDArray[np.bool_]


class UniverseError(InvalidParameterError):
    """A universe specification is invalid (raised at construction, never per record)."""


class _Sentinel:
    """A marker for values that a record does not have."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return self.label


_MISSING: Final = _Sentinel("<missing>")
_NOT_MAPPING: Final = _Sentinel("<not a mapping>")


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


def _canonical_string(text: str) -> str:
    # json.dumps of a lone str with ensure_ascii is a fixed, ASCII-only escaping
    return json.dumps(text, ensure_ascii=True)


def _canonical_attribute(attr: Attribute) -> str:
    if isinstance(attr, Categorical):
        body = ",".join(_canonical_string(v) for v in attr.values)
        return f'{{"kind":"categorical","name":{_canonical_string(attr.name)},"values":[{body}]}}'
    body = ",".join(repr(e) for e in attr.edges)
    return f'{{"kind":"bucketed","name":{_canonical_string(attr.name)},"edges":[{body}]}}'


# -- per-attribute coding of a column (list or array) of values -------------------------------


def _missing_reason(attr: Attribute, value: object) -> str | None:
    if value is _MISSING:
        return f"attribute {attr.name!r} missing"
    if value is _NOT_MAPPING:
        return "record is not an object (a mapping of attribute names to values)"
    return None


def _categorical_slow(
    attr: Categorical, column: Sequence[object]
) -> tuple[IntArray, BoolArray, dict[int, str]]:
    index = attr._index
    codes = np.zeros(len(column), dtype=np.int64)
    bad = np.zeros(len(column), dtype=np.bool_)
    reasons: dict[int, str] = {}
    for i, value in enumerate(column):
        try:
            codes[i] = index[value]
            continue
        except (KeyError, TypeError):
            pass
        bad[i] = True
        reason = _missing_reason(attr, value)
        if reason is None:
            kind = "" if isinstance(value, str) else f" (a {type(value).__name__})"
            reason = (
                f"attribute {attr.name!r}: {_show(value)}{kind} is not one of the declared values"
            )
        reasons[i] = reason
    return codes, bad, reasons


def _categorical_codes(
    attr: Categorical, column: Sequence[object] | npt.NDArray[np.generic]
) -> tuple[IntArray, BoolArray | None, dict[int, str]]:
    n = len(column)
    items: Sequence[object]
    if isinstance(column, np.ndarray):
        if column.dtype.kind == "U" and column.ndim == 1:
            return _categorical_codes_unicode(attr, column.astype(np.str_, copy=False))
        items = column.tolist()
    else:
        items = column
    try:
        codes = np.fromiter(map(attr._index.__getitem__, items), dtype=np.int64, count=n)
        return codes, None, {}
    except (KeyError, TypeError):
        return _categorical_slow(attr, items)


def _categorical_codes_unicode(
    attr: Categorical, column: npt.NDArray[np.str_]
) -> tuple[IntArray, BoolArray | None, dict[int, str]]:
    order = np.argsort(np.array(attr.values))
    ordered = np.array(attr.values)[order]
    pos = np.searchsorted(ordered, column)
    np.minimum(pos, len(ordered) - 1, out=pos)
    found = ordered[pos] == column
    codes = order[pos].astype(np.int64)
    if bool(found.all()):
        return codes, None, {}
    bad = ~found
    name = attr.name
    reasons = {
        int(i): f"attribute {name!r}: {_show(str(column[i]))} is not one of the declared values"
        for i in np.flatnonzero(bad)
    }
    return codes, bad, reasons


def _bucketed_slow(
    attr: Bucketed, column: Sequence[object]
) -> tuple[npt.NDArray[np.float64], BoolArray, dict[int, str]]:
    lo, hi = attr.edges[0], attr.edges[-1]
    values = np.full(len(column), lo, dtype=np.float64)
    bad = np.zeros(len(column), dtype=np.bool_)
    reasons: dict[int, str] = {}
    for i, value in enumerate(column):
        reason = _missing_reason(attr, value)
        if reason is None:
            if not _is_real(value):
                reason = f"attribute {attr.name!r}: {_show(value)} is not a number"
            else:
                try:
                    x = float(value)  # type: ignore[arg-type]
                except OverflowError:
                    x = math.inf if value > 0 else -math.inf  # type: ignore[operator]
                if math.isnan(x):
                    reason = f"attribute {attr.name!r}: value {_show(value)} is not a number"
                elif not lo <= x <= hi:
                    reason = (
                        f"attribute {attr.name!r}: value {_show(value)} outside {attr.range_text}"
                    )
                else:
                    values[i] = x
                    continue
        bad[i] = True
        reasons[i] = reason
    return values, bad, reasons


def _bucketed_codes(
    attr: Bucketed, column: Sequence[object] | npt.NDArray[np.generic]
) -> tuple[IntArray, BoolArray | None, dict[int, str]]:
    lo, hi = attr.edges[0], attr.edges[-1]
    values: npt.NDArray[np.float64] | None = None
    bad: BoolArray | None = None
    reasons: dict[int, str] = {}
    items: Sequence[object] | None = None
    if isinstance(column, np.ndarray) and column.dtype.kind in "iuf" and column.ndim == 1:
        values = column.astype(np.float64, copy=False)
    else:
        items = column.tolist() if isinstance(column, np.ndarray) else column
        if set(map(type, items)) <= {int, float}:
            try:
                values = np.array(items, dtype=np.float64)
            except OverflowError:
                values = None
    if values is not None and len(values):
        # NaN propagates through min/max and fails both comparisons
        if not (float(values.min()) >= lo and float(values.max()) <= hi):
            outside = ~((values >= lo) & (values <= hi))
            bad = outside
            for i in np.flatnonzero(outside):
                x = float(values[i])
                shown = _fmt_value(x) if items is None else _show(items[int(i)])
                if math.isnan(x):
                    reasons[int(i)] = f"attribute {attr.name!r}: value {shown} is not a number"
                else:
                    reasons[int(i)] = (
                        f"attribute {attr.name!r}: value {shown} outside {attr.range_text}"
                    )
            values = np.where(outside, lo, values)
    elif values is None:
        values, bad, reasons = _bucketed_slow(attr, items if items is not None else [])
    codes = np.searchsorted(attr._array, values, side="right").astype(np.int64)
    codes -= 1
    np.minimum(codes, attr.size - 1, out=codes)  # e_k itself falls in the last bucket
    return codes, bad, reasons


def _fmt_value(x: float) -> str:
    return _fmt_number(x) if math.isfinite(x) else repr(x)


def _column_codes(
    attr: Attribute, column: Sequence[object] | npt.NDArray[np.generic]
) -> tuple[IntArray, BoolArray | None, dict[int, str]]:
    if isinstance(attr, Categorical):
        return _categorical_codes(attr, column)
    return _bucketed_codes(attr, column)


def _extract(records: Sequence[Mapping[str, object]], name: str) -> list[object]:
    """Return ``[r[name] for r in records]``, with sentinels for missing values."""
    try:
        return list(map(operator.itemgetter(name), records))
    except (KeyError, TypeError, IndexError):
        pass
    out: list[object] = []
    for record in records:
        if isinstance(record, Mapping):
            out.append(record.get(name, _MISSING))
        else:
            out.append(_NOT_MAPPING)
    return out


@dataclass(frozen=True)
class Universe:
    """The finite data universe: the product of its attributes' domains.

    Attributes:
        attributes: the attributes, in cell-index order (first most significant).
        shape: the domain sizes, in order.
        size: the number of cells ``N``, the product of ``shape``.

    Raises:
        UniverseError: no attributes, an attribute of another type, a repeated
            name, or more than :data:`MAX_CELLS` cells.

    """

    attributes: tuple[Attribute, ...]
    shape: tuple[int, ...] = field(init=False, compare=False)
    size: int = field(init=False, compare=False)
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False, hash=False)
    _positions: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    MAX_CELLS: ClassVar[int] = MAX_CELLS

    def __post_init__(self) -> None:
        attributes = self.attributes
        if not isinstance(attributes, (list, tuple)) or not attributes:
            raise UniverseError(
                "a universe needs a non-empty tuple of attributes (Categorical or Bucketed), "
                f"got {_show(attributes)}"
            )
        positions: dict[str, int] = {}
        for i, attr in enumerate(attributes):
            if not isinstance(attr, (Categorical, Bucketed)):
                raise UniverseError(
                    f"attributes[{i}] must be a Categorical or a Bucketed, "
                    f"got a {type(attr).__name__}"
                )
            if attr.name in positions:
                raise UniverseError(
                    f"attributes[{i}] name {attr.name!r} is already used by "
                    f"attributes[{positions[attr.name]}]; names must be unique"
                )
            positions[attr.name] = i
        shape = tuple(attr.size for attr in attributes)
        size = math.prod(shape)
        if size > MAX_CELLS:
            dims = " x ".join(str(s) for s in shape)
            raise UniverseError(
                f"the universe has {size} cells ({dims}), more than the limit of "
                f"{MAX_CELLS} = 2^24: dense histograms are supported up to 2^24 cells "
                "(128 MiB of float64); use fewer values or coarser buckets"
            )
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        object.__setattr__(self, "attributes", tuple(attributes))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "_strides", strides)
        object.__setattr__(self, "_positions", positions)

    # -- construction from configuration data --
    @classmethod
    def from_spec(cls, spec: object, path: str = "universe") -> Universe:
        """Build a universe from config-like data.

        Example: ``[{"name": "country", "values": ["de", "fr"]},
        {"name": "age", "edges": [0, 18, 30, 65, 120]}]``: each entry has a
        ``name`` and exactly one of ``values`` (categorical) or ``edges`` (bucketed).

        Args:
            spec: the decoded list of attribute objects.
            path: the spec's location, used as the prefix of error paths.

        Raises:
            UniverseError: the spec is malformed; the message gives the path
                (``universe[1].edges``), what was wrong and what was expected.

        """
        if not isinstance(spec, (list, tuple)):
            raise UniverseError(
                f"{path} must be a non-empty list of attribute objects, got a {type(spec).__name__}"
            )
        if not spec:
            raise UniverseError(f"{path} must be a non-empty list of attribute objects, got []")
        attributes: list[Attribute] = []
        names: dict[str, int] = {}
        for i, entry in enumerate(spec):
            here = f"{path}[{i}]"
            if not isinstance(entry, Mapping):
                raise UniverseError(
                    f'{here} must be an object with "name" and "values" or "edges", '
                    f"got a {type(entry).__name__}"
                )
            unknown = sorted(str(k) for k in entry if k not in ("name", "values", "edges"))
            if unknown:
                raise UniverseError(
                    f"{here} has unknown key {unknown[0]!r}; allowed keys: name, values, edges"
                )
            if "name" not in entry:
                raise UniverseError(f'{here}.name is missing; every attribute needs a "name"')
            name = _check_name(entry["name"], f"{here}.name")
            if name in names:
                raise UniverseError(
                    f"{here}.name {name!r} is already used by {path}[{names[name]}]; "
                    "names must be unique"
                )
            names[name] = i
            has_values, has_edges = "values" in entry, "edges" in entry
            if has_values == has_edges:
                raise UniverseError(
                    f'{here} must have exactly one of "values" (categorical) or "edges" '
                    f"(bucketed), got {'both' if has_values else 'neither'}"
                )
            if has_values:
                values = _check_values(entry["values"], f"{here}.values")
                attributes.append(Categorical(name, values))
            else:
                attributes.append(Bucketed(name, _check_edges(entry["edges"], f"{here}.edges")))
        return cls(tuple(attributes))

    def to_spec(self) -> list[dict[str, object]]:
        """Return the universe as config-like data, the inverse of :meth:`from_spec`."""
        out: list[dict[str, object]] = []
        for attr in self.attributes:
            if isinstance(attr, Categorical):
                out.append({"name": attr.name, "values": list(attr.values)})
            else:
                out.append({"name": attr.name, "edges": list(attr.edges)})
        return out

    # -- schema --
    @property
    def names(self) -> tuple[str, ...]:
        """The attribute names, in order."""
        return tuple(attr.name for attr in self.attributes)

    def position(self, name: str) -> int:
        """Return the position of attribute ``name``.

        Raises:
            KeyError: there is no such attribute.

        """
        return self._positions[name]

    def attribute(self, name: str) -> Attribute:
        """Return attribute ``name``.

        Raises:
            KeyError: there is no such attribute.

        """
        return self.attributes[self._positions[name]]

    def digest(self) -> str:
        """Return a stable hex SHA-256 of the schema (names, kinds, values, edges, order)."""
        body = ",".join(_canonical_attribute(attr) for attr in self.attributes)
        text = f"{_DIGEST_TAG}[{body}]"
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    def describe_cell(self, index: int) -> dict[str, str]:
        """Return cell ``index`` as ``{attribute: value or bucket text}``.

        Raises:
            UniverseError: ``index`` is not an integer in ``[0, size)``.

        """
        if (
            not isinstance(index, (int, np.integer))
            or isinstance(index, (bool, np.bool_))
            or not 0 <= index < self.size
        ):
            raise UniverseError(f"cell index must be an integer in [0, {self.size}), got {index!r}")
        codes = np.unravel_index(int(index), self.shape)
        pairs = zip(self.attributes, codes, strict=True)
        return {attr.name: attr.label(int(code)) for attr, code in pairs}

    # -- records to cells --
    def cell_of_columns(
        self, columns: Mapping[str, Sequence[object] | npt.NDArray[np.generic]]
    ) -> tuple[IntArray, BoolArray, list[tuple[int, str]]]:
        """Map a batch given as columns (attribute name -> values) to cells.

        Args:
            columns: one column per attribute, all of the same length. Numpy
                columns are fastest (numeric for bucketed, unicode for
                categorical); lists work too. A missing column marks every row bad.

        Returns:
            ``(cells, bad, reasons)``: the int64 cell of every row (``-1`` for
            rows that do not fit), the boolean mask of rows that do not fit, and
            ``(row, reason)`` for each of those, sorted by row.

        Raises:
            UniverseError: the columns do not all have the same length.

        """
        lengths = {len(col) for col in columns.values()}
        if len(lengths) > 1:
            raise UniverseError(
                "columns must all have the same length, got "
                + ", ".join(f"{name}: {len(col)}" for name, col in columns.items())
            )
        n = lengths.pop() if lengths else 0
        return self._cells([columns.get(attr.name, None) for attr in self.attributes], n)

    def cells(
        self, records: Sequence[Mapping[str, object]]
    ) -> tuple[IntArray, list[tuple[int, str]]]:
        """Map decoded records (dicts) to their cells.

        Args:
            records: the records; each should map every attribute name to a value.

        Returns:
            ``(cells, bad)``: the int64 cells of the records that fit, in order,
            and ``(index in records, reason)`` for those that do not, sorted by
            index. The reason names the first attribute (in declared order) that
            did not fit, e.g. ``attribute 'age': value 130 outside [0, 120]``.

        """
        n = len(records)
        columns = [_extract(records, attr.name) for attr in self.attributes]
        cells, bad, reasons = self._cells(columns, n)
        if not reasons:
            return cells, []
        return cells[~bad], reasons

    def _cells(
        self,
        columns: Sequence[Sequence[object] | npt.NDArray[np.generic] | None],
        n: int,
    ) -> tuple[IntArray, BoolArray, list[tuple[int, str]]]:
        cells = np.zeros(n, dtype=np.int64)
        bad: BoolArray | None = None
        reasons: dict[int, str] = {}
        for attr, stride, column in zip(self.attributes, self._strides, columns, strict=True):
            if column is None:
                column = [_MISSING] * n
            codes, attr_bad, attr_reasons = _column_codes(attr, column)
            if stride != 1:
                codes *= stride
            cells += codes
            if attr_bad is not None:
                bad = attr_bad if bad is None else bad | attr_bad
                for i, reason in attr_reasons.items():
                    reasons.setdefault(i, reason)
        if bad is None:
            return cells, np.zeros(n, dtype=np.bool_), []
        cells[bad] = -1
        return cells, bad, sorted(reasons.items())
