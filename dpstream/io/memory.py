"""An in-memory, batched, resumable source of raw records (tests, benchmarks, notebooks).

It feeds a flow what the Kafka source would: each prepared batch is a
:class:`~dpstream.messages.RawBatch` (one input partition's records as columns, handed over
as one item, as the Kafka source does) or a list of
:data:`~dpstream.messages.RawMessage` tuples (handed over one item per record).
"""

from __future__ import annotations

from collections.abc import Sequence

from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition

from dpstream.messages import RawBatch, RawMessage

__all__ = ["MemorySource"]

Prepared = RawBatch | list[RawMessage]


class _BatchPartition(StatefulSourcePartition[RawBatch | RawMessage, int]):
    def __init__(self, batches: Sequence[Prepared], resume: int | None) -> None:
        self._batches, self._next = batches, resume or 0

    def next_batch(self) -> list[RawBatch | RawMessage]:
        if self._next >= len(self._batches):
            raise StopIteration
        batch = self._batches[self._next]
        self._next += 1
        return [batch] if isinstance(batch, RawBatch) else list(batch)

    def snapshot(self) -> int:
        return self._next


class MemorySource(FixedPartitionedSource[RawBatch | RawMessage, int]):
    """Replays prepared batches of raw records; resumes by batch index after recovery."""

    def __init__(self, batches: Sequence[Prepared]) -> None:
        self._batches = batches

    def list_parts(self) -> list[str]:
        """One partition: the batches are replayed in order."""
        return ["memory"]

    def build_part(self, step_id: str, for_part: str, resume_state: int | None
                   ) -> _BatchPartition:
        """Build the partition, resuming at the snapshotted batch index."""
        return _BatchPartition(self._batches, resume_state)
