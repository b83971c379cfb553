"""An in-memory, batched, resumable source of raw messages (tests, benchmarks, notebooks).

It feeds the counters flow exactly what the Kafka source would, as
``(partition, value, offset, topic)`` tuples, one prepared batch at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition

from dpstream.messages import RawMessage

__all__ = ["MemorySource"]


class _BatchPartition(StatefulSourcePartition[RawMessage, int]):
    def __init__(self, batches: Sequence[list[RawMessage]], resume: int | None) -> None:
        self._batches, self._next = batches, resume or 0

    def next_batch(self) -> list[RawMessage]:
        if self._next >= len(self._batches):
            raise StopIteration
        batch = self._batches[self._next]
        self._next += 1
        return batch

    def snapshot(self) -> int:
        return self._next


class MemorySource(FixedPartitionedSource[RawMessage, int]):
    """Replays prepared batches of raw messages; resumes by batch index after recovery."""

    def __init__(self, batches: Sequence[list[RawMessage]]) -> None:
        self._batches = batches

    def list_parts(self) -> list[str]:
        """One partition: the batches are replayed in order."""
        return ["memory"]

    def build_part(self, step_id: str, for_part: str, resume_state: int | None
                   ) -> _BatchPartition:
        """Build the partition, resuming at the snapshotted batch index."""
        return _BatchPartition(self._batches, resume_state)
