"""A compact index from key strings to rows: an open-addressing hash table in one numpy array.

A Python ``dict`` from a million key strings to their rows costs about 70 bytes a key beyond
the strings: its hash table (about 40 bytes an entry) and one ``int`` object per row (28-32
bytes). :class:`KeyIndex` keeps a numpy array of references to the rows' key strings (8 bytes
a key, plus growth room) and one ``int32`` slot array of a power-of-two size at most half
full (8-16 bytes a key): about 20 bytes a key (measured in ``tests/test_key_index.py``).

**Lookup** is linear probing, vectorized over a batch of keys: a key's first slot is its
Python ``str`` hash masked to the table size (the hash is cached in the string object, so the
keys the step clock has already counted in a ``Counter`` cost nothing to hash again); a slot
holding a row whose string *equals* the key (a real string comparison, never a hash alone,
so two keys are never merged) ends the probe, an empty slot means "absent", anything else
moves to the next slot. At most half of the slots are used, so a probe visits fewer than two
slots on average. The string comparisons are one numpy comparison of two object arrays.

**Rows are appended** in order (row ``i`` is the ``i``-th name); removing rows (the key table
compacts expired or retired keys, keeping the order of the rest) rebuilds the slots from the
names, in one vectorized pass. The index holds no state of its own worth saving: a snapshot
keeps the names, and a restore rebuilds the slots (Python's string hash is salted per
process, so slots are never stored).

The index is exact whatever the hash function does: collisions cost probes, never
correctness. An adversary who could predict the salted hash could only slow lookups down.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["KeyIndex"]

IntArray = npt.NDArray[np.int64]

_EMPTY: Final = -1
_MIN_SLOTS: Final = 16


def _hashes(keys: Sequence[str]) -> npt.NDArray[np.uint64]:
    return np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)).view(np.uint64)


class KeyIndex:
    """Rows of distinct key strings: row ``i`` is the ``i``-th key appended.

    Args:
        names: the first rows' keys (distinct).
    """

    __slots__ = ("_names", "_slots", "_mask", "_size")

    def __init__(self, names: Sequence[str] = ()) -> None:
        self._names: npt.NDArray[np.object_] = np.empty(0, dtype=object)
        self._slots = np.full(_MIN_SLOTS, _EMPTY, dtype=np.int32)
        self._mask = np.uint64(_MIN_SLOTS - 1)
        self._size = 0
        self.rebuild(names)

    # -- a read-only set of the live keys --
    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return bool(self.rows([key])[0] >= 0)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names[: self._size].tolist())

    @property
    def names(self) -> npt.NDArray[np.object_]:
        """The keys by row, a read-only object array view (do not keep it across changes)."""
        view = self._names[: self._size]
        view.flags.writeable = False
        return view

    @property
    def nbytes(self) -> int:
        """The bytes of the index's arrays (the key strings themselves not included)."""
        return int(self._slots.nbytes + self._names.nbytes)

    # -- lookups --
    def rows(self, keys: Sequence[str]) -> IntArray:
        """The row of every key, -1 for a key that is not indexed (vectorized linear probing)."""
        n = len(keys)
        rows = np.full(n, _EMPTY, dtype=np.int64)
        if n == 0 or self._size == 0:
            return rows
        mask = self._mask
        position = _hashes(keys) & mask
        wanted = np.empty(n, dtype=object)
        wanted[:] = keys
        names, slots = self._names, self._slots
        candidate = slots[position]  # the first probe, over every key
        same = names[candidate] == wanted  # an empty slot (-1) is masked out below
        same &= candidate >= 0
        rows[same] = candidate[same]
        pending = np.flatnonzero(~same & (candidate >= 0))
        while pending.size:  # the rare keys whose first slot holds another key
            position[pending] = (position[pending] + np.uint64(1)) & mask
            candidate = slots[position[pending]]
            occupied = candidate >= 0
            if not occupied.all():
                pending, candidate = pending[occupied], candidate[occupied]
            same = names[candidate] == wanted[pending]
            rows[pending[same]] = candidate[same]
            pending = pending[~same]
        return rows

    # -- changes --
    def append(self, names: Sequence[str]) -> None:
        """Index ``names`` (distinct, none indexed yet) as the next rows, in order."""
        first, last = self._size, self._size + len(names)
        if last == first:
            return
        if 2 * last > self._slots.size:
            self.rebuild([*self._names[:first].tolist(), *names])
            return
        if last > self._names.size:  # grow the references by half again (amortised O(1))
            grown = np.empty(max(last, self._names.size * 3 // 2), dtype=object)
            grown[:first] = self._names[:first]
            self._names = grown
        self._names[first:last] = names
        self._size = last
        self._insert(np.arange(first, last, dtype=np.int64))

    def rebuild(self, names: Sequence[str] | npt.NDArray[np.object_]) -> None:
        """Index ``names`` afresh as rows ``0..`` (after rows were removed, or on restore)."""
        size = len(names)
        slots = _MIN_SLOTS
        while slots < 2 * size:
            slots *= 2
        self._names = np.empty(size, dtype=object)
        self._names[:] = names
        self._slots = np.full(slots, _EMPTY, dtype=np.int32)
        self._mask = np.uint64(slots - 1)
        self._size = size
        self._insert(np.arange(size, dtype=np.int64))

    def _insert(self, new_rows: IntArray) -> None:
        """Put ``new_rows`` (named, not in a slot yet) in free slots, probing linearly.

        Rows that want the same free slot are placed in row order (the first takes it, the
        others probe on).
        """
        if not new_rows.size:
            return
        slots, mask = self._slots, self._mask
        position = _hashes(self._names[new_rows].tolist()) & mask
        pending = np.arange(new_rows.size, dtype=np.int64)
        while pending.size:
            wanted = position[pending]
            free = slots[wanted] < 0
            taken = np.zeros(pending.size, dtype=bool)
            if free.any():
                candidates = np.flatnonzero(free)
                # the first pending row of each free slot takes it
                _, first = np.unique(wanted[candidates], return_index=True)
                winners = candidates[first]
                slots[wanted[winners]] = new_rows[pending[winners]]
                taken[winners] = True
            pending = pending[~taken]
            position[pending] = (position[pending] + np.uint64(1)) & mask
