"""What a flow's sink writes: encoded records, and dead letters.

Every kind's encoder turns its outputs into ``(topic_role, key_bytes, value_bytes)`` triples
(:data:`~dpstream.messages.Encoded`); a closed step's records may come as one
:class:`EncodedBatch`, whose :class:`EncodedColumn` blocks hold records built in bulk (the
counters' release columns). :func:`encode_dead_letter` writes the ``dpstream.dead_letter/1``
records of every kind (schema: :class:`dpstream.schemas.DeadLetter`). Dead letters hold raw
data: give the dead-letter topic to operators only, never to the audience of the releases.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from operator import eq
from typing import TYPE_CHECKING, Final

from dpstream import schemas
from dpstream.core.sequences import IndexedSequence
from dpstream.messages import DeadLetter, Encoded

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    IntArray = npt.NDArray[np.int64]

__all__ = [
    "EncodedBatch",
    "EncodedColumn",
    "MAX_ORIGINAL_BYTES",
    "Texts",
    "encode_dead_letter",
    "flatten",
]

MAX_ORIGINAL_BYTES: Final = 64 * 1024
"""The most of a bad record's bytes a dead letter carries (base64 makes it 4/3 larger)."""


class EncodedBatch(IndexedSequence[Encoded]):
    """The encoded records of one closed step of one shard: ``(role, key, value)`` triples.

    A sink that gets one writes every triple it holds, in order (see
    :class:`~dpstream.io.kafka.KafkaOutput`); :func:`flatten` turns a mixed stream of triples
    and batches back into triples. It holds parts: lists of triples, and
    :class:`EncodedColumn` blocks (the records of a release column, or of alerts that share
    their fields), built in bulk when the step was encoded, whose triples are sliced out of
    their buffers only when read. Built from triples (``EncodedBatch([...])``,
    :meth:`append`, :meth:`extend`), it compares equal to the list of the same triples, and
    it pickles with its parts.
    """

    __slots__ = ("_parts",)

    def __init__(self, records: Iterable[Encoded] = ()) -> None:
        self._parts: list[list[Encoded] | EncodedColumn] = []
        self.extend(records)

    def append(self, record: Encoded) -> None:
        """Add one triple at the end."""
        self._open_list().append(record)

    def extend(self, records: Iterable[Encoded]) -> None:
        """Add records at the end: triples, a column (kept whole) or another batch's."""
        if isinstance(records, EncodedBatch):
            for part in records._parts:
                self.extend(part)
        elif isinstance(records, EncodedColumn):
            self._parts.append(records)
        else:
            triples = list(records)
            if triples:
                self._open_list().extend(triples)

    def _open_list(self) -> list[Encoded]:
        """The list of triples at the end (a new one after a column)."""
        if not self._parts or not isinstance(self._parts[-1], list):
            self._parts.append([])
        return self._parts[-1]  # type: ignore[return-value]

    def __len__(self) -> int:
        return sum(map(len, self._parts))

    def __iter__(self) -> Iterator[Encoded]:
        return chain.from_iterable(self._parts)

    def _item(self, index: int) -> Encoded:
        position = index
        for part in self._parts:
            if 0 <= position < len(part):
                return part[position]
            position -= len(part)
        raise IndexError("EncodedBatch index out of range")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, EncodedBatch)):
            return NotImplemented
        return len(self) == len(other) and all(map(eq, self, other))

    __hash__ = None  # type: ignore[assignment]  # mutable, like a list

    def __repr__(self) -> str:
        return f"EncodedBatch({list(self)!r})"

    def __getstate__(self) -> list[list[Encoded] | EncodedColumn]:
        return self._parts

    def __setstate__(self, parts: list[list[Encoded] | EncodedColumn]) -> None:
        self._parts = parts


@dataclass(frozen=True, slots=True, eq=False)
class Texts:
    """Byte strings in one buffer: text ``i`` is ``data[starts[i]:ends[i]]``."""

    data: bytes
    starts: IntArray
    ends: IntArray

    def __len__(self) -> int:
        return len(self.starts)

    def text(self, i: int) -> bytes:
        """Text ``i``."""
        return self.data[self.starts[i]:self.ends[i]]

    def texts(self) -> list[bytes]:
        """Every text, in order (one slice each)."""
        data = self.data
        return [data[a:b] for a, b in zip(self.starts.tolist(), self.ends.tolist(),
                                           strict=True)]

    def lengths(self) -> IntArray:
        """The length of every text."""
        return self.ends - self.starts


@dataclass(frozen=True, slots=True, eq=False)
class EncodedColumn(IndexedSequence[Encoded]):
    """The records of one column encoded in bulk, as ``(role, key, value)`` triples.

    Triple ``i`` is ``(role, keys.text(i), records.text(i))``. The records' bytes are built
    when the step is encoded
    (:meth:`~dpstream.kinds.counters.records.RecordEncoder.encode_step`), all at once, into
    one buffer; reading the column only slices each key and record out of its buffer.
    ``len`` costs nothing.
    """

    role: str
    keys: Texts
    """The Kafka message keys (each key's UTF-8 bytes) in ``data``: the keys' JSON strings
    joined by commas, none of them escaped (so no key holds a quote)."""
    records: Texts
    """The Kafka message values (each record's JSON)."""

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Encoded]:
        keys = self.keys.data[1:-1].split(b'","')  # the keys' slices, as no key holds a quote
        role = self.role
        return ((role, key, record)
                for key, record in zip(keys, self.records.texts(), strict=True))

    def _item(self, index: int) -> Encoded:
        return self.role, self.keys.text(index), self.records.text(index)


def flatten(item: Encoded | EncodedBatch) -> list[Encoded]:
    """The triples of a stream item: a batch's, or the single triple itself."""
    return list(item) if isinstance(item, EncodedBatch) else [item]


def encode_dead_letter(flow: str, letter: DeadLetter, *, instance: str = ""
                       ) -> tuple[str, bytes | None, bytes]:
    """Encode a dead letter of flow ``flow`` (instance ``instance``) for the dead-letter topic.

    The record carries at most :data:`MAX_ORIGINAL_BYTES` of the original bytes (base64),
    with the full size and a SHA-256 digest, so a huge bad record never makes a dead letter
    the broker refuses.
    """
    return "dead_letters", None, schemas.encode(schemas.DeadLetter(
        flow=flow, instance=instance, reason=letter.reason,
        source=schemas.DeadLetterSource(topic=letter.topic, partition=letter.partition,
                                        offset=letter.offset),
        original_base64=base64.b64encode(letter.original[:MAX_ORIGINAL_BYTES]).decode(),
        original_size=len(letter.original),
        original_sha256=hashlib.sha256(letter.original).hexdigest(),
        original_truncated=len(letter.original) > MAX_ORIGINAL_BYTES))
