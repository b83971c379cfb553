"""Thin Bytewax operators around every kind's step clock and step barrier.

Each operator is ``op(step_id, up, ...) -> Stream``; the logic lives in the
bytewax-free classes (a flow kind's :class:`~dpstream.stream.clock.StepClock` and
:class:`~dpstream.stream.barrier.StepBarrier`), and the ``StatefulBatchLogic`` adapters only
pass batches in, outputs out and snapshots to the recovery store. Every flow kind uses the
same two operators: :func:`assign_steps` (input partitions -> steps, dead letters) and
:func:`stepped_shards` (steps -> what each shard publishes). Bytewax builders receive
only the resume state, not the key, so partition and shard ids travel with the
items and are kept in the snapshots. A kind's own operators live in its package (the
counters' :func:`~dpstream.kinds.counters.operator.keyed_statistics`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol

import bytewax.operators as op
from bytewax.dataflow import Stream, operator
from bytewax.operators import StatefulBatchLogic

from dpstream.messages import DeadLetter, RawBatch, RawMessage
from dpstream.stream import stopping
from dpstream.stream.barrier import StepBarrier
from dpstream.stream.clock import UNDECODABLE, ShardUpdate, StepClock
from dpstream.stream.quarantine import QUARANTINED, Quarantine

__all__ = ["FlowObserver", "StepAssignment", "assign_steps", "stepped_shards"]

log = logging.getLogger("dpstream")
STALL_REPORT_SECONDS = float(os.environ.get("DPSTREAM_STALL_REPORT_SECONDS", "60"))
"""How often a shard waiting for a lagging input partition says so in the log."""
STALL_STEPS = 3
"""Steps a shard must hold open before it reports (partitions normally differ by a step)."""
BACKLOG_CHUNK_SECONDS = float(os.environ.get("DPSTREAM_BACKLOG_CHUNK_SECONDS", "0.25"))
"""How long a shard closes steps of a backlog before it passes their outputs on (at least
one step each activation; ``inf``: a whole backlog at once). A chunk changes when a step's
outputs leave, never what they are."""
BACKLOG_REPORT_STEPS = 100
"""A backlog this long is logged when a shard starts on it."""
_PAST: Final = datetime(1970, 1, 1, tzinfo=UTC)
"""A notification time already due: Bytewax calls ``on_notify`` at the operator's next
activation, which it schedules at once (``activate_after(0)``, bytewax 0.21.1
``src/operators.rs``), after the operators downstream have taken the chunk's outputs."""
_last_stall_report = [0.0]  # process-wide: one stall line per interval, not one per shard
_last_backlog_report = [0.0]


class FlowObserver(Protocol):
    """Where the operators report what they do (:class:`dpstream.metrics.FlowMetrics`)."""

    def observe_input(self, name: str, amount: int) -> None:
        """Events accepted (``events``) or dead letters (``dead_letter:<reason>``)."""

    def observe_partition(self, partition: int, frontier_step: int | None,
                          broker_seconds: float | None) -> None:
        """An input partition's frontier and latest trusted broker time."""

    def observe_shard(self, shard: int, closed_step: int | None, pending_steps: int,
                      backlog_steps: int = 0) -> None:
        """A shard's last closed step, steps waiting for partitions, and its backlog.

        The backlog: closable steps (every partition passed them) not closed yet.
        """

    def observe_undecodable(self, partition: int, offset: int | None, reason: str) -> None:
        """A record of ``partition`` at ``offset`` could not be decoded (a dead letter)."""

    def observe_clamped(self, partition: int, topic: str, bound: str, count: int,
                        offset: int | None) -> None:
        """``count`` records of a batch were placed at a clamp's limit (``ahead``/``behind``).

        ``offset``: the first of them. Only under ``flow.clock = "producer"``.
        """



class _Nobody:
    """Observes nothing."""

    def observe_input(self, name: str, amount: int) -> None:
        return None

    def observe_partition(self, partition: int, frontier_step: int | None,
                          broker_seconds: float | None) -> None:
        return None

    def observe_shard(self, shard: int, closed_step: int | None, pending_steps: int,
                      backlog_steps: int = 0) -> None:
        return None

    def observe_undecodable(self, partition: int, offset: int | None, reason: str) -> None:
        return None

    def observe_clamped(self, partition: int, topic: str, bound: str, count: int,
                        offset: int | None) -> None:
        return None


class _PartitionLogic(StatefulBatchLogic[RawBatch, Any, dict[str, Any]]):
    def __init__(self, clock: StepClock, observer: FlowObserver,
                 quarantine: Quarantine | None = None) -> None:
        self.clock, self.observer, self.quarantine = clock, observer, quarantine

    def on_batch(self, values: list[RawBatch]) -> tuple[list[Any], bool]:
        out: list[Any] = []
        clock, observer, quarantine = self.clock, self.observer, self.quarantine
        for batch in values:
            if quarantine is not None:  # before anything reads the records
                batch, skipped = quarantine.split(batch)
                out.extend(skipped)
                if skipped:
                    observer.observe_input("dead_letter:" + QUARANTINED, len(skipped))
            before = clock.events
            try:
                updates, dead = clock.process(batch.partition, batch)
            except Exception:
                _name_the_records(batch, quarantine)
                raise
            out.extend((str(update.shard), update) for update in updates)
            out.extend(dead)
            observer.observe_input("events", clock.events - before)
            for letter in dead:
                observer.observe_input("dead_letter:" + letter.reason.split(":")[0], 1)
                if letter.reason.startswith(UNDECODABLE):
                    observer.observe_undecodable(batch.partition, letter.offset, letter.reason)
            if clock.clamped_last:
                topic = next((t for t in batch.topics if t is not None), "")
                for bound, (count, offset) in clock.clamped_last.items():
                    observer.observe_clamped(batch.partition, topic, bound, count, offset)
        if clock.partition is not None:
            observer.observe_partition(clock.partition, clock.frontier(), clock.watermark)
        return out, StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list[Any], bool]:
        if stopping.stop_requested():  # a stop, not the end of a bounded input: close nothing
            return [], StatefulBatchLogic.RETAIN
        # closes through flow.end's step, or the trusted clock's; nothing if neither is known
        return ([(str(u.shard), u) for u in self.clock.end_of_input()],
                StatefulBatchLogic.RETAIN)

    def snapshot(self) -> dict[str, Any]:
        return self.clock.to_state()


def _name_the_records(batch: RawBatch, quarantine: Quarantine | None) -> None:
    """Log which records a crash of the clock came from (for ``--skip-record``)."""
    offsets = [o for o in batch.offsets if o is not None]
    topic = next((t for t in batch.topics if t is not None), None)
    if not offsets or topic is None:
        return
    base = quarantine.bases.get(topic, 0) if quarantine is not None else 0
    log.error("the flow failed on a batch of %s[%d], offsets %d to %d. If it fails there again "
              "after a restart, one of these records crashes it (a bug: please report it): "
              "quarantine it with dpstream run --skip-record %s:%d:OFFSET",
              topic, batch.partition - base, min(offsets), max(offsets), topic,
              batch.partition - base)


@dataclass(frozen=True)
class StepAssignment:
    """The two outputs of :func:`assign_steps`."""

    updates: Stream[tuple[str, ShardUpdate]]
    dead_letters: Stream[DeadLetter]


def _group_by_partition(items: list[RawBatch | RawMessage]) -> list[tuple[str, RawBatch]]:
    """Key the source's items by input partition, as :class:`RawBatch` columns.

    The sources hand over whole batches (one :class:`RawBatch` per consumed batch); loose
    :data:`RawMessage` tuples (e.g. a test's ``TestingSource``) are grouped into batches, in
    their order within each partition.
    """
    batches = [item for item in items if type(item) is RawBatch]
    if len(batches) == len(items):  # the sources' case
        return [(str(item.partition), item) for item in batches]
    out: list[tuple[str, RawBatch]] = []
    loose: dict[int, list[RawMessage]] = defaultdict(list)
    for item in items:
        if isinstance(item, RawBatch):
            out.append((str(item.partition), item))
        else:
            loose[item[0]].append(item)
    out.extend((str(p), RawBatch.of(msgs)) for p, msgs in loose.items())
    return out


@operator
def assign_steps(step_id: str, up: Stream[RawBatch | RawMessage],
                 make_clock: Callable[[dict[str, Any] | None], StepClock],
                 observer: FlowObserver | None = None,
                 quarantine: Quarantine | None = None) -> StepAssignment:
    """Parse raw messages per input partition and route each step's buckets to shards.

    ``make_clock`` is the flow kind's clock factory (a snapshot or None -> a
    :class:`~dpstream.stream.clock.StepClock`). ``quarantine``: records the operator
    quarantined (:mod:`dpstream.stream.quarantine`), turned into dead letters before the
    clock reads anything of them.
    """
    grouped = op.flat_map_batch("group_by_partition", up, _group_by_partition)
    seen = observer or _Nobody()
    parsed = op.stateful_batch(
        "parse", grouped, lambda state: _PartitionLogic(make_clock(state), seen, quarantine))
    flat = op.key_rm("unkey", parsed)
    branches = op.branch("split", flat, lambda item: isinstance(item, DeadLetter))
    return StepAssignment(branches.falses, branches.trues)


def waiting_for(shard: StepBarrier) -> tuple[list[int], int | None]:
    """The input partitions that hold a shard's next step open, and the step they hold."""
    step = shard.next_step  # never the first pending bucket's step: see StepBarrier.backlog
    if step is None:
        return [], None
    if not shard.frontiers:
        return list(range(shard.partitions)), step
    ahead = max(shard.frontiers.values())
    if ahead <= step:
        return [], step
    lagging = [p for p in range(shard.partitions) if p not in shard.ended_empty
               and shard.frontiers.get(p, step) <= step]
    return lagging, step


class _ShardLogic(StatefulBatchLogic[ShardUpdate, Any, dict[str, Any]]):
    """Pass a shard's outputs on, and its snapshots to the recovery store.

    A shard that keeps closed steps whole (the counters' ``ShardState``, with
    ``update_batches``) passes one item per closed step, not one per output.

    **Backlogs in chunks.** One activation closes steps for at most
    :data:`BACKLOG_CHUNK_SECONDS` (the shard's ``chunk_seconds``, shared by every update of
    a batch); what is left (:meth:`StepBarrier.backlog`) is closed at the next activations
    (:meth:`notify_at` returns a time already due), each chunk's outputs leaving as it
    closes. A stop request ends the chunks: the state stays a consistent snapshot.
    """

    def __init__(self, shard: StepBarrier, observer: FlowObserver,
                 observe_outputs: Callable[[list[Any]], None]) -> None:
        self.shard, self.observer, self.observe_outputs = shard, observer, observe_outputs
        self._next_report = time.monotonic() + STALL_REPORT_SECONDS
        self._pending = 0
        self._update = getattr(shard, "update_batches", shard.update)
        self._close_backlog = getattr(shard, "close_backlog_batches", shard.close_backlog)
        self._end_of_input = getattr(shard, "end_of_input_batches", shard.end_of_input)
        chunk = BACKLOG_CHUNK_SECONDS
        self._chunk = None if math.isinf(chunk) else max(1e-9, chunk)  # 0: a step a time
        self._backlog_reported = False

    def on_batch(self, values: list[ShardUpdate]) -> tuple[list[Any], bool]:
        out: list[Any] = []
        shard, chunk = self.shard, self._chunk
        start = time.monotonic()
        for update in values:  # one chunk's time for the whole batch (a step at least)
            if chunk is not None:
                shard.chunk_seconds = chunk - (time.monotonic() - start)
            out.extend(self._update(update))
        self._observe(out)
        return out, StatefulBatchLogic.RETAIN

    def _observe(self, out: list[Any]) -> None:
        shard = self.shard
        self.observe_outputs(out)
        if shard.shard is None:
            return
        closed = None if shard.next_step is None else shard.next_step - 1
        ahead = max(shard.frontiers.values(), default=None)
        first_open = shard.next_step  # None before the first close: never the first pending
        backlog = shard.backlog()  # step (in an open universe, a key not admitted yet)
        waiting = 0 if ahead is None or first_open is None else \
            max(0, ahead - first_open - backlog)
        self.observer.observe_shard(shard.shard, closed, waiting, backlog)
        self._pending = waiting
        now = time.monotonic()
        if backlog >= BACKLOG_REPORT_STEPS and not self._backlog_reported:
            self._backlog_reported = True
            if now - _last_backlog_report[0] >= STALL_REPORT_SECONDS * 0.9:
                _last_backlog_report[0] = now
                log.info("shard %d (and maybe others): closing a backlog of %d step(s) from "
                         "step %s, every input partition has passed them (a flow.origin in "
                         "the past, or a restart after an outage); their outputs are written "
                         "chunk by chunk (dpstream_backlog_steps)", shard.shard, backlog,
                         first_open)
        elif not backlog:
            self._backlog_reported = False
        if waiting >= STALL_STEPS and now >= self._next_report:
            self._next_report = now + STALL_REPORT_SECONDS
            lagging, step = waiting_for(shard)
            if lagging and now - _last_stall_report[0] >= STALL_REPORT_SECONDS * 0.9:
                _last_stall_report[0] = now
                name = getattr(self.observer, "partition_name", str)
                behind = ", ".join(f"{name(p)} (at step {shard.frontiers.get(p, 'none')})"
                                   for p in lagging[:10])
                log.warning("shard %d (and maybe others): %d step(s) from step %s wait for "
                            "input partition(s) %s; "
                            "the others are at step %s. A partition without records holds "
                            "every step open: check its producers, or the heartbeat "
                            "(flow.heartbeat)", shard.shard, waiting, step, behind, ahead)

    def _closing(self) -> bool:
        """Whether a backlog is left to close at the next activation."""
        return self._chunk is not None and not stopping.stop_requested() \
            and self.shard.backlog() > 0

    def notify_at(self) -> datetime | None:
        """At once while a backlog is left; else to report a stall even without input."""
        if self._closing():
            return _PAST
        if self._pending:
            return datetime.now(UTC) + timedelta(
                seconds=max(0.0, self._next_report - time.monotonic()))
        return None

    def on_notify(self) -> tuple[list[Any], bool]:
        out: list[Any] = []
        if self._closing():
            self.shard.chunk_seconds = self._chunk
            out = self._close_backlog()
        self._observe(out)
        return out, StatefulBatchLogic.RETAIN

    def on_eof(self) -> tuple[list[Any], bool]:
        if stopping.stop_requested():  # a stop, not the end of a bounded input
            return [], StatefulBatchLogic.RETAIN
        self.shard.chunk_seconds = None  # the last activation: every closable step now
        out = self._end_of_input()
        self._observe(out)
        return out, StatefulBatchLogic.RETAIN

    def snapshot(self) -> dict[str, Any]:
        return self.shard.to_state()  # type: ignore[attr-defined, no-any-return]


@operator
def stepped_shards(step_id: str, up: Stream[tuple[str, ShardUpdate]],
                   build: Callable[[dict[str, Any] | None], StepBarrier],
                   observer: FlowObserver | None = None,
                   observe_outputs: Callable[[list[Any]], None] | None = None) -> Stream[Any]:
    """Run a flow kind's shards: each closes its steps and publishes what they yield.

    ``build`` makes a shard from its snapshot (or None); a shard must offer ``to_state()``.
    """
    return _run_shards(up, build, observer or _Nobody(), observe_outputs or (lambda _out: None))


def _run_shards(up: Stream[tuple[str, ShardUpdate]],
                build: Callable[[dict[str, Any] | None], StepBarrier], seen: FlowObserver,
                published: Callable[[list[Any]], None]) -> Stream[Any]:
    keyed = op.stateful_batch("shards", up,
                              lambda state: _ShardLogic(build(state), seen, published))
    return op.key_rm("unkey", keyed)
