"""The step barrier every flow kind's shard shares: close a step once all partitions passed it.

A shard learns every input partition's frontier (the first step that partition has not
closed) from the :class:`~dpstream.stream.clock.ShardUpdate` values it receives, collects
each step's buckets, and closes step ``s`` once all ``partitions`` input partitions have moved
past it. At the end of a bounded input (EOF) every partition closes its steps through ``flow.end``'s
step, or else through its trusted clock's, and says so (see
:meth:`~dpstream.stream.clock.StepClock.end_of_input`); a partition that never had a record is
then no longer waited for.

**What a step holds is a function of the input alone.** A step's buckets are merged from
every partition's updates and the step is closed only once every partition's frontier has
passed it; a partition sends a step's bucket no later than the update that moves its
frontier past that step, and Bytewax keeps one partition's updates in order. So the merged
bucket of a step does not depend on batching, on how the partitions' updates interleave, on
the number of workers or on restarts. No step is ever skipped while buckets for it may still
arrive.

A flow kind subclasses :class:`StepBarrier` with :meth:`~StepBarrier.merge` (add a bucket to
a step's pending one) and :meth:`~StepBarrier.close` (what closing a step publishes).

**Backlogs are closed in chunks.** A ``flow.origin`` in the past (or a restart after a long
outage) lets a shard close thousands of steps at once. With :attr:`StepBarrier.chunk_seconds`
set (the Bytewax operator sets it), :meth:`~StepBarrier.update` and
:meth:`~StepBarrier.close_backlog` close steps for at most that long (at least one step) and
leave the rest, :meth:`~StepBarrier.backlog` steps, for the next call: the operator passes
each chunk's outputs on at once, and calls :meth:`~StepBarrier.close_backlog` again at its
next activation. A chunk changes only *when* a step closes, never what it holds: every
partition has passed the steps of a backlog, so no bucket can still arrive for them. The
state between chunks (closed through ``next_step - 1``, the rest pending) is an ordinary
snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from dpstream.core.noise.keys import NOISE_SCHEME, NoiseKey
from dpstream.errors import InvalidParameterError, NoiseKeyError, RecoveryMismatchError
from dpstream.stream import stopping
from dpstream.stream.clock import ShardUpdate
from dpstream.stream.sharding import shard_of

__all__ = ["MechanismShard", "StepBarrier", "binding", "check_binding", "end_step_of"]


def end_step_of(config: Any) -> int | None:
    """The step of ``flow.end`` (it and every later step never close), or None.

    :attr:`dpstream.config.FlowConfig.end_step`; None for a configuration without an end.
    """
    return getattr(config, "end_step", None)


def binding(instance: str, mechanisms: str, noise: NoiseKey) -> dict[str, str]:
    """What every shard snapshot records about the flow instance it belongs to."""
    return {"instance": instance, "noise_fingerprint": noise.fingerprint(),
            "noise_scheme": NOISE_SCHEME, "mechanisms": mechanisms}


def check_binding(state: dict[str, Any], instance: str, mechanisms: str,
                  noise: NoiseKey, hint: Callable[[object], str] | None = None) -> None:
    """Refuse a snapshot of another flow instance, other mechanisms or another noise key.

    A resume under another noise key would publish replayed outputs with fresh noise
    (pitfall 13); under other mechanisms, outputs whose cost was never charged. ``hint`` (a
    binding's ``mechanisms_hint``) explains the recorded mechanisms when it can.
    """
    if state.get("instance") != instance:
        raise RecoveryMismatchError(
            "the recovery store belongs to another flow instance; refusing to resume")
    if state.get("mechanisms") != mechanisms:
        raise InvalidParameterError(
            "the recovery store was made with other mechanism parameters"
            + (hint(state.get("mechanisms")) if hint else "")
            + "; a flow instance's mechanisms cannot change (start a new flow instance)")
    if state.get("noise_scheme") != NOISE_SCHEME:
        raise RecoveryMismatchError(
            f"the recovery store was made with noise derivation {state.get('noise_scheme')!r} "
            f"(an older dpstream), this one derives noise as {NOISE_SCHEME!r}: resuming would "
            "publish replayed outputs with other noise. Finish the old flow instance with the "
            "dpstream that made it, or start a new flow instance")
    if state.get("noise_fingerprint") != noise.fingerprint():
        raise NoiseKeyError(
            "the recovery store was made with another noise key (fingerprint "
            f"{state.get('noise_fingerprint')}, now {noise.fingerprint()}); resuming would "
            "publish replayed outputs with fresh noise")


class StepBarrier:
    """Frontiers of the input partitions, pending buckets per step, and closing in order.

    Args:
        partitions: how many input partitions must close a step before it is closed here.
        first_step: the first step to close (None: the first step that has a bucket).

    Attributes:
        end_step: the step of ``flow.end`` (None: not set). At the end of a bounded input
            the barrier closes every step before it, whether or not any partition had a
            record: which steps a bounded run publishes is then a function of the
            configuration alone (pitfall 14). The flow kind's builder sets it.
    """

    end_step: int | None = None

    def __init__(self, partitions: int, first_step: int | None = None) -> None:
        self.partitions = partitions
        self.shard: int | None = None
        self.frontiers: dict[int, int] = {}
        self.ended_empty: set[int] = set()  # partitions that ended without any record
        self.pending: dict[int, Any] = {}
        self.next_step: int | None = first_step
        self.chunk_seconds: float | None = None
        """How long one call of :meth:`update` or :meth:`close_backlog` may close steps
        (if > 0, at least one step; if <= 0, none; None: every closable step at once)."""

    # -- what a flow kind provides --
    def merge(self, step: int, bucket: Any) -> None:
        """Add one partition's ``bucket`` for ``step`` to the pending one."""
        raise NotImplementedError

    def close(self, step: int, bucket: Any) -> Sequence[Any]:
        """Close ``step`` with its merged bucket (None if no partition sent one).

        Returns the step's outputs (a kind may return one sequence object per step: see
        ``whole`` in :meth:`update`).
        """
        raise NotImplementedError

    def idle(self) -> bool:
        """Whether steps without buckets may be skipped (nothing would be published)."""
        return False

    def bind(self, shard: int | None) -> None:
        """Learn which shard this is (from the first update, or a snapshot)."""
        self.shard = shard

    # -- the barrier --
    def barrier_state(self) -> dict[str, Any]:
        """The barrier's part of a snapshot (the pending buckets as the kind stores them)."""
        return {"shard": self.shard, "frontiers": dict(self.frontiers),
                "ended_empty": sorted(self.ended_empty), "next_step": self.next_step}

    def restore_barrier(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`barrier_state` (the kind restores ``pending``)."""
        self.bind(state["shard"])
        self.frontiers = dict(state["frontiers"])
        self.ended_empty = set(state.get("ended_empty", ()))
        self.next_step = state["next_step"]

    def update(self, update: ShardUpdate, *, whole: bool = False) -> list[Any]:
        """Take one partition's update and close every step that is now closed.

        Returns the closed steps' outputs, one by one; with ``whole``, what :meth:`close`
        returned for each step that published something, as it is.
        """
        if self.shard is None:
            self.bind(update.shard)
        if update.frontier is not None:
            self.frontiers[update.partition] = max(
                update.frontier, self.frontiers.get(update.partition, update.frontier))
            self.ended_empty.discard(update.partition)
        for step, bucket in update.increments.items():
            self.merge(step, bucket)
        return self.close_backlog(whole=whole)

    def closable_end(self) -> int | None:
        """The first step some partition has not passed (None: a partition never reported).

        Every step before it may be closed.
        """
        if not self.frontiers or len(self.frontiers) + len(self.ended_empty) < self.partitions:
            return None
        return min(self.frontiers.values())

    def backlog(self) -> int:
        """How many steps every partition has passed that are not closed yet.

        While :meth:`idle`, steps without buckets count too, though they close at no cost.
        """
        end, first = self.closable_end(), self.next_step
        # next_step only, never the pending buckets' first step: before a shard's first close
        # that would be the step of its earliest event (in an open universe, of a key no
        # mechanism has admitted yet), and this count is a metric and a log line
        return 0 if end is None or first is None else max(0, end - first)

    def close_backlog(self, *, whole: bool = False) -> list[Any]:
        """Close the closable steps, for at most :attr:`chunk_seconds` (``whole``: update's)."""
        end = self.closable_end()
        if end is None:
            return []
        return self._close_until(end, self.chunk_seconds, whole)

    def end_of_input(self, *, whole: bool = False) -> list[Any]:
        """The whole bounded input ended: stop waiting for partitions that had no record.

        Every partition that had records has sent its final frontier before this (see
        :meth:`~dpstream.stream.clock.StepClock.end_of_input`), so the steps closed now are
        exactly those every partition with data has closed; with ``flow.end``
        (:attr:`end_step`) that is every step before its step, which is also closed if no
        partition had a record.
        ``whole``: as in :meth:`update`.
        """
        self.ended_empty.update(p for p in range(self.partitions) if p not in self.frontiers)
        if self.end_step is not None:  # every partition ended: close through flow.end
            return self._close_until(self.end_step, whole=whole)
        if not self.frontiers:
            return []
        return self._close_until(min(self.frontiers.values()), whole=whole)

    def _close_until(self, end: int, seconds: float | None = None,
                     whole: bool = False) -> list[Any]:
        """Close the steps before ``end``, for at most ``seconds`` (None: all of them).

        With ``seconds > 0`` the first step is closed whatever it costs; with
        ``seconds <= 0`` none is (the caller's time is spent).

        While :meth:`idle`, steps without buckets are skipped, but never beyond ``end`` nor
        beyond the first step that has a bucket: those still to come for a step before
        ``end`` would otherwise be lost.
        """
        if self.next_step is None:
            if not self.pending:
                return []
            self.next_step = min(min(self.pending), end)
        out: list[Any] = []
        deadline = None if seconds is None else time.monotonic() + seconds
        first = seconds is None or seconds > 0  # the first step needs no time left
        while self.next_step < end:
            if stopping.stop_requested():  # a long run of steps must not delay a stop: the
                break  # state stays consistent (closed through next_step - 1), the rest later
            if deadline is not None and not first and time.monotonic() >= deadline:
                break  # a chunk of a backlog: the rest at the next call (close_backlog)
            first = False
            if self.idle():
                self.next_step = min([s for s in self.pending if s >= self.next_step] + [end])
                if self.next_step >= end:
                    break
            closed = self.close(self.next_step, self.pending.pop(self.next_step, None))
            if not whole:
                out.extend(closed)
            elif len(closed):
                out.append(closed)
            self.next_step += 1
        return out


class MechanismShard(StepBarrier):
    """A shard of named mechanisms (histograms, model streams) spread over shards by name.

    Each configured name lives on the shard ``shard_of(name, config.shards)`` and runs from
    step 0 (the origin): the names and their start are public, so neither reveals an event.
    A flow kind says which names it has (:meth:`names`) and how one is built or restored
    (:meth:`build`); the binding check, the snapshot and the restore are here.

    Attributes:
        members_key: the snapshot's key for the members' states.
        mechanism: the label of the members' noise coordinates
            ``(instance, flow name, mechanism, member name)``.
    """

    members_key = "members"
    mechanism = ""

    def __init__(self, config: Any, noise: NoiseKey, instance: str, partitions: int,
                 state: dict[str, Any] | None = None) -> None:
        super().__init__(partitions, first_step=0)
        self.end_step = end_step_of(config)
        self.config, self.noise, self.instance = config, noise, instance
        self.members: dict[str, Any] = {}
        self._states: dict[str, Any] = {}
        if state is not None:
            check_binding(state, instance, config.mechanisms_digest, noise,
                          config.mechanisms_hint)
            self._states = state[self.members_key]
            self.restore_barrier(state)
            self.pending = state["pending"]

    def names(self) -> list[str]:
        """The configured names (every shard sees all; each builds only its own)."""
        raise NotImplementedError

    def build(self, name: str, coordinates: tuple[Any, ...],
              state: dict[str, Any] | None) -> Any:
        """A member, new (``state`` None) or restored; it must offer ``to_state()``."""
        raise NotImplementedError

    def bind(self, shard: int | None) -> None:
        """Learn the shard and build (or restore) the members it owns."""
        self.shard = shard
        if shard is None:
            return
        for name in self.names():
            if shard_of(name, self.config.shards) == shard and name not in self.members:
                coordinates = (self.instance, self.config.name, self.mechanism, name)
                self.members[name] = self.build(name, coordinates, self._states.get(name))

    def to_state(self) -> dict[str, Any]:
        """Plain-data snapshot (the members' true data: the recovery store is secret)."""
        return {**binding(self.instance, self.config.mechanisms_digest, self.noise),
                **self.barrier_state(), "pending": self.pending,
                self.members_key: {n: m.to_state() for n, m in self.members.items()}}
