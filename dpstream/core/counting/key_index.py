"""A compact index from key strings to rows: an open-addressing hash table in one numpy array.

A Python ``dict`` from a million key strings to their rows costs about 70 bytes a key beyond
the strings: its hash table (about 40 bytes an entry) and one ``int`` object per row (28-32
bytes). :class:`KeyIndex` keeps a numpy array of references to the rows' key strings (8 bytes
a key, plus growth room) and one ``int64`` slot array of a power-of-two size at most half
full (16-32 bytes a key): about 30 bytes a key (measured in ``tests/test_key_index.py``).
A slot holds a row (low 32 bits) and a *tag*: 31 further bits of the key's hash.

**Lookup** is linear probing, vectorized over a batch of keys: a key's first slot is its
Python ``str`` hash masked to the table size (the hash is cached in the string object, so the
keys the step clock has already counted in a ``Counter`` cost nothing to hash again). The
probe moves on over slots whose tag differs (integer comparisons, in bulk) and stops at an
empty slot ("absent") or at a slot with the key's tag. That slot's row is then checked with
a real string comparison, never a hash alone, so two keys are never merged: if its string
differs (two keys share 31 tag bits as well as their slot, about one in 2^31), the probe
goes on. At most half of the slots are used, so a probe visits fewer than two slots on
average; the string comparisons are one numpy comparison of two object arrays.

**Rows are appended** in order (row ``i`` is the ``i``-th name). A tuple appended to an empty
index is kept as it is until a row is read by number or a key looked up (a declared table,
read by position, holds its shard's declared tuple and nothing more). Removing rows (the
key table compacts expired or retired keys, keeping the order of the rest) rebuilds the
slots from the names, in one vectorized pass. Appended rows get their slots lazily, at
the next lookup: a table read only by row (the declared universe, where the step clock
hands the shards row numbers) never builds them. The index holds no state of its own
worth saving: a snapshot keeps the names, and a restore rebuilds the slots (Python's
string hash is salted per process, so slots are never stored).

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
_TAG_SHIFT: Final = np.uint64(33)  # a slot's tag: the hash's top 31 bits, above the row's 32
_ROW_BITS: Final = np.int64(0xFFFF_FFFF)


def _hashes(keys: Sequence[str]) -> npt.NDArray[np.uint64]:
    return np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)).view(np.uint64)


class KeyIndex:
    """Rows of distinct key strings: row ``i`` is the ``i``-th key appended.

    Args:
        names: the first rows' keys (distinct).
    """

    __slots__ = ("_names_array", "_first_names", "_slots", "_mask", "_size", "_indexed")

    def __init__(self, names: Sequence[str] | npt.NDArray[np.object_] = ()) -> None:
        self._names_array: npt.NDArray[np.object_] = np.empty(0, dtype=object)
        # the first rows' names as appended (a tuple), until the references are needed
        self._first_names: tuple[str, ...] | None = None
        self._slots = np.full(_MIN_SLOTS, _EMPTY, dtype=np.int64)
        self._mask = np.uint64(_MIN_SLOTS - 1)
        self._size = 0
        self._indexed = 0
        self.rebuild(names)

    # -- a read-only set of the live keys --
    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return bool(self.rows([key])[0] >= 0)

    def __iter__(self) -> Iterator[str]:
        if self._first_names is not None:
            return iter(self._first_names)
        return iter(self._names[: self._size].tolist())

    @property
    def _names(self) -> npt.NDArray[np.object_]:
        """The references to the keys by row (made from the first tuple appended, if any)."""
        if self._first_names is not None:
            first, self._first_names = self._first_names, None
            self._names_array = np.empty(len(first), dtype=object)
            self._names_array[:] = first
        return self._names_array

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
        self._index_pending()
        mask, slots = self._mask, self._slots
        hashes = _hashes(keys)
        position = hashes & mask
        tags = (hashes >> _TAG_SHIFT).astype(np.int64)
        entries = slots[position]  # the first probe, over every key
        tagged = (entries >> 32) == tags  # an empty slot (-1) has no tag (-1)
        pending = np.flatnonzero(~tagged & (entries >= 0))
        while True:
            while pending.size:  # keys whose slot holds another tag: integers only
                position[pending] = (position[pending] + np.uint64(1)) & mask
                found = slots[position[pending]]
                entries[pending] = found
                match = (found >> 32) == tags[pending]
                tagged[pending[match]] = True
                pending = pending[~match & (found >= 0)]
            check = np.flatnonzero(tagged)
            if not check.size:
                return rows
            candidate = entries[check] & _ROW_BITS
            wanted = np.empty(check.size, dtype=object)
            wanted[:] = keys if check.size == n else list(map(keys.__getitem__, check.tolist()))
            same = self._names[candidate] == wanted
            rows[check[same]] = candidate[same]
            tagged[check] = False
            pending = check[~same]  # another key with the same tag (rare): probe on

    # -- changes --
    def append(self, names: Sequence[str]) -> None:
        """Index ``names`` (distinct, none indexed yet) as the next rows, in order."""
        first, last = self._size, self._size + len(names)
        if last == first:
            return
        if first == 0 and isinstance(names, tuple):  # kept as it is until a row is read: a
            self._first_names, self._size = names, last  # declared table may never read one
            return
        if last > self._names.size:  # grow the references by half again (amortised O(1))
            grown = np.empty(max(last, self._names.size * 3 // 2), dtype=object)
            grown[:first] = self._names[:first]
            self._names_array = grown
        self._names[first:last] = names
        self._size = last

    def rebuild(self, names: Sequence[str] | npt.NDArray[np.object_]) -> None:
        """Index ``names`` afresh as rows ``0..`` (after rows were removed, or on restore)."""
        self._first_names = None
        self._names_array = np.empty(len(names), dtype=object)
        self._names_array[:] = names
        self._size = len(names)
        self._indexed = 0
        self._index_pending()

    def _index_pending(self) -> None:
        """Put the rows appended since the last lookup in slots (growing the slots if needed).

        Slots are only needed by lookups: a table that is only ever read by row (the declared
        universe, routed by position) never pays for them.
        """
        first, size = self._indexed, self._size
        if first == size:
            return
        if 2 * size > self._slots.size or first == 0:
            slots = _MIN_SLOTS
            while slots < 2 * size:
                slots *= 2
            self._slots = np.full(slots, _EMPTY, dtype=np.int64)
            self._mask = np.uint64(slots - 1)
            first = 0
        self._insert(np.arange(first, size, dtype=np.int64))
        self._indexed = size

    def _insert(self, new_rows: IntArray) -> None:
        """Put ``new_rows`` (named, not in a slot yet) in free slots, probing linearly.

        Rows that want the same free slot are placed in row order (the first takes it, the
        others probe on).
        """
        if not new_rows.size:
            return
        slots, mask = self._slots, self._mask
        hashes = _hashes(self._names[new_rows].tolist())
        position = hashes & mask
        entries = ((hashes >> _TAG_SHIFT).astype(np.int64) << 32) | new_rows
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
                slots[wanted[winners]] = entries[pending[winners]]
                taken[winners] = True
            pending = pending[~taken]
            position[pending] = (position[pending] + np.uint64(1)) & mask
