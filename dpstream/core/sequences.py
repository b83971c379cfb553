"""A read-only sequence given by its length and its items, for columns read item by item.

Released columns (:class:`~dpstream.core.counting.outputs.StepOutputs`, the encoded records of
:mod:`dpstream.kinds.counters.records`) hold their items as arrays and make an item object only
when it is read; they share this one typed ``__getitem__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, overload

__all__ = ["IndexedSequence"]

T = TypeVar("T")


class IndexedSequence(Sequence[T]):
    """A :class:`Sequence` whose subclasses give ``__len__`` and ``_item`` only.

    An index may be negative, as for a list; a slice gives a list.
    """

    __slots__ = ()

    def __len__(self) -> int:
        raise NotImplementedError

    def _item(self, index: int) -> T:
        """Item ``index``, with ``0 <= index < len(self)``."""
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(len(self)))]
        size = len(self)
        position = index + size if index < 0 else index
        if not 0 <= position < size:
            raise IndexError(f"{type(self).__name__} index out of range")
        return self._item(position)
