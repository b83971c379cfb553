"""The data universe of PMWG: a finite product of categorical and bucketed attributes.

Private multiplicative weights for growing databases (PMWG; Cummings, Krehbiel,
Lai, Tantipongpipat 2018, "Differential Privacy for Growing Databases",
Algorithm 1 and appendix B) keeps a public histogram ``y`` over a finite data
universe ``X`` of ``N`` elements, and a database is its normalised histogram
``x_t`` over ``X``. This module defines ``X`` and maps records to its
elements.

The attributes themselves (:class:`~dpstream.core.pmwg.attributes.Categorical`,
:class:`~dpstream.core.pmwg.attributes.Bucketed`) are in
:mod:`dpstream.core.pmwg.attributes`.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from dpstream.core.pmwg.attributes import (
    Attribute,
    Bucketed,
    Categorical,
    UniverseError,
    _check_edges,
    _check_name,
    _check_values,
    _fmt_number,
    _is_real,
    _show,
)

__all__ = [
    "MAX_CELLS",
    "Universe",
]

MAX_CELLS: Final = 2**24
"""The largest universe: dense float64 histograms of up to 2^24 cells (128 MiB)."""

_DIGEST_TAG: Final = "dpstream.universe/1"

IntArray: TypeAlias = npt.NDArray[np.int64]
BoolArray: TypeAlias = npt.NDArray[np.bool_]


class _Sentinel:
    """A marker for values that a record does not have."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return self.label


_MISSING: Final = _Sentinel("<missing>")
_NOT_MAPPING: Final = _Sentinel("<not a mapping>")


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
