"""The bounding stage of user-level privacy: each person's events kept within the caps.

At the user level (``contribution.unit = "user"``) the flow protects a person, not an event
(pitfall 17), so before any mechanism sees an event, each person's contribution per period is
cut to the kind's caps (:class:`~dpstream.core.contribution.rules.BoundingRule`: counters L0
keys and Linf events a key; PMWG ``max_rows``; ERM ``max_rows_per_block`` in ``max_blocks``
blocks)::

    step clocks (one per input partition): the person's keyed hash, partition, offset, payload
      -> ShardUpdate per *person shard* ({step: PersonEvents})
      -> bound_contributions: BoundingShard per person shard, a StepBarrier over the input
         partitions; closing a step runs the ContributionBounder and routes the kept events
         with the kind's own route (or route_bounded)
      -> ShardUpdate per kind shard (partition = the person shard) -> the kind's shards,
         whose barriers wait for every one of the flow.shards person shards

**What is kept depends on each person's own events only.** Every event of a person lands on
that person's shard (the shard is a function of the keyed hash alone:
:func:`~dpstream.core.contribution.people.person_shards`). A person shard closes step ``s``
only once every input partition has passed it (the barrier), so the step's bucket holds
*all* of the step's accepted events of its people, whatever the batching, the interleaving
of partitions, the number of workers or a restart (:mod:`dpstream.stream.barrier`). The
bucket is sorted by (partition, offset), an order Kafka fixes, and the bounder decides per
person in that order, steps in increasing order: an event is kept iff its group (key, step or
the one histogram) is already one of the person's groups this period with fewer than
``max_per_group`` kept events, or the person has fewer than ``max_groups`` groups. The
decision for an event reads only the same person's earlier events, so adding or removing a
person changes no one else's kept events; two people share caps only if their 128-bit keyed
hashes collide (for the person added or removed, probability at most ``n 2^-128`` with ``n``
others: ``2^-64`` at the public bound of ``2^64`` people, counted into δ by the kinds'
accounting, :func:`~dpstream.core.contribution.people.collision_delta`).

**What a kind's shard receives is again a function of the input alone.** A person shard
sends its closed steps' kept buckets to every kind shard in the same update that moves its
frontier past them (:meth:`BoundingShard.close_backlog`), exactly the barrier's rule for an
input partition; so the kind's barrier, waiting for all ``flow.shards`` person shards, closes
a step with every person's kept events summed, and nothing else changes for the kind.

**Ids stay out.** The clock hashes the ids at once (a keyed 128-bit AES CBC-MAC under the
secret lane ``(instance, flow name, "people")``); this stage, its snapshots and its metric see the
16-byte hashes only. The snapshot is bound to the flow instance, the noise key and the
mechanisms' digest (which includes the contribution table): a store made under other caps is
refused (:func:`~dpstream.stream.barrier.check_binding`). How many events the caps dropped is
exact operator data: counted only with ``metrics.exact_counts`` (the ``observe`` callback).

**State.** The bounder keeps, per person of the current period, what the caps need (columns,
:class:`~dpstream.core.contribution.bounder.ContributionBounder`); a step of a later period
drops the old period's state first, so the state does not grow with the number of periods.
The pending buckets hold the events of steps not yet closed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from bytewax.dataflow import Stream

from dpstream.core.contribution.bounder import ContributionBounder
from dpstream.core.contribution.people import PersonHasher
from dpstream.core.contribution.rules import BoundingRule
from dpstream.core.noise.keys import NoiseKey
from dpstream.stream.barrier import StepBarrier, binding, check_binding, end_step_of
from dpstream.stream.clock import PassThrough, PersonEvents, ShardUpdate, StepClock
from dpstream.stream.operators import stepped_shards

__all__ = ["BoundingShard", "bound_contributions", "person_clocks"]


def person_clocks(make_clock: Callable[[dict[str, Any] | None], StepClock],
                  hasher: PersonHasher, shards: int
                  ) -> Callable[[dict[str, Any] | None], StepClock]:
    """A kind's clock factory whose clocks route people: hashed, to ``shards`` person shards.

    The kind's clock is unchanged otherwise; its decoder fills ``decoded_people`` when its
    configuration is at the user level (:mod:`dpstream.stream.clock`).
    """
    def make(state: dict[str, Any] | None) -> StepClock:
        clock = make_clock(state)
        clock.hasher, clock.person_shards = hasher, shards
        return clock
    return make


class BoundingShard(StepBarrier):
    """One person shard: its people's events per step, bounded when every partition passed it.

    Args:
        router: a clock of the kind (its ``route``, ``route_bounded`` and
            ``contribution_groups``; never its time state).
        config: the kind's configuration (``contribution``, ``shards``, ``end_step``).
        mechanisms: the digest of the flow's mechanisms (the kind's ``binding``; it includes
            the contribution table): the snapshot's binding.
        noise: the flow's noise key (the snapshot's binding).
        instance: the flow instance.
        partitions: the input partitions (every one must pass a step before it closes).
        state: a snapshot (:meth:`to_state`) to resume, or None.
        observe: ``observe(kept, dropped)`` after each closed step with events (exact
            operator data: the platform passes it only with ``metrics.exact_counts``).
    """

    def __init__(self, router: StepClock, config: Any, mechanisms: str, noise: NoiseKey,
                 instance: str, partitions: int, state: dict[str, Any] | None = None,
                 observe: Callable[[int, int], None] | None = None) -> None:
        super().__init__(partitions)
        self.end_step = end_step_of(config)
        self.router, self.config, self.noise, self.instance = router, config, noise, instance
        self.mechanisms = mechanisms
        self.kind_shards: int = config.shards
        self.observe = observe
        rule = BoundingRule.from_contribution(config.contribution)
        self.sent: int | None = None  # the frontier the kind's shards last heard from here
        self._out: dict[int, dict[int, Any]] = {}  # closed, unsent: {kind shard: {step: bucket}}
        self._groups = getattr(router, "contribution_groups", None)
        self._route_bounded = getattr(router, "route_bounded", None)
        if state is None:
            self.bounder = ContributionBounder(rule)
            return
        check_binding(state, instance, mechanisms, noise)
        self.restore_barrier(state)
        self.pending = state["pending"]
        self.sent = state["sent"]
        self.bounder = ContributionBounder(rule, state["bounder"])

    # -- the barrier's hooks --
    def merge(self, step: int, bucket: PersonEvents) -> None:
        """Keep one partition's events of ``step`` (joined when the step closes)."""
        self.pending.setdefault(step, []).append(bucket)

    def idle(self) -> bool:
        """Steps without events publish nothing here: skipped (the frontier still moves)."""
        return True

    def close(self, step: int, bucket: list[PersonEvents | PassThrough] | None
              ) -> Sequence[Any]:
        """Bound ``step``'s events and route the kept ones to the kind's shards (sent later).

        The events are sorted by (partition, offset) first: the bounder's decisions and the
        order of the kept payloads then depend on the input alone. Records that are no
        person's (:class:`~dpstream.stream.clock.PassThrough`: PMWG's questions) follow the
        kept events unbounded, in (partition, offset) order, through the kind's ``route``.
        """
        if not bucket:
            return []
        through = [b for b in bucket if isinstance(b, PassThrough)]
        people = [b for b in bucket if isinstance(b, PersonEvents)]
        payloads: list[Any] | np.ndarray = []
        first: Any = None
        if people:
            events = PersonEvents.merge(people).in_order()
            groups: Any = (events.payloads if self._groups is None
                           else self._groups(events.payloads))
            keep, first = self.bounder.keep(step, events.people, groups, events.partitions,
                                            events.offsets)
            kept = np.flatnonzero(keep)
            if self.observe is not None:
                self.observe(int(kept.size), len(events) - int(kept.size))
            if kept.size == len(events):  # nothing dropped: the payloads as they are
                payloads = events.payloads
            elif kept.size:
                payloads, first = events.take_payloads(kept), np.asarray(first)[kept]
        if through:  # a kind with such records routes with its route (no route_bounded)
            if self._route_bounded is not None:
                raise RuntimeError("records without people need the kind's route")
            payloads = [*payloads, *PassThrough.merge_in_order(through)]
        if not len(payloads):
            return []
        if self._route_bounded is not None:
            per_shard = self._route_bounded(payloads, first, step)
        else:
            per_shard = self.router.route(payloads, step)
        for shard, buckets in enumerate(per_shard):
            if buckets:
                self._out.setdefault(shard, {}).update(buckets)
        return []

    def _close_until(self, end: int, seconds: float | None = None,
                     whole: bool = False) -> list[Any]:
        """:meth:`StepBarrier._close_until`; before any event, the frontier moves to ``end``.

        Every partition has passed ``end``, so no event can still come for a step before
        it: those steps are closed (empty) at once, and the kind's shards hear so.
        """
        if self.next_step is None and not self.pending:
            self.next_step = end
            return []
        return super()._close_until(end, seconds, whole)

    # -- what the kind's shards hear --
    def close_backlog(self, *, whole: bool = False) -> list[Any]:
        """Close the closable steps and tell every kind shard (``(key, ShardUpdate)`` items).

        Each kind shard gets one update with this person shard as its ``partition``, the
        new frontier and the kept buckets of the steps just closed: a bucket is never sent
        after the frontier that passes its step.
        """
        super().close_backlog()
        return self._send()

    def end_of_input(self, *, whole: bool = False) -> list[Any]:
        """The bounded input ended: close as :meth:`StepBarrier.end_of_input`, pass it on."""
        super().end_of_input()
        return self._send()

    def _send(self) -> list[tuple[str, ShardUpdate]]:
        frontier = self.next_step
        if frontier is None or (frontier == self.sent and not self._out):
            return []
        self.sent = frontier
        out, self._out = self._out, {}
        return [(str(s), ShardUpdate(s, self.shard if self.shard is not None else -1, frontier,
                                     out.get(s, {})))
                for s in range(self.kind_shards)]

    def to_state(self) -> dict[str, Any]:
        """Plain-data snapshot: binding, barrier, pending events (hashes only), bounder."""
        return {**binding(self.instance, self.mechanisms, self.noise),
                **self.barrier_state(), "pending": self.pending, "sent": self.sent,
                "bounder": self.bounder.to_state()}


def bound_contributions(step_id: str, up: Stream[tuple[str, ShardUpdate]],
                        build: Callable[[dict[str, Any] | None], BoundingShard]
                        ) -> Stream[tuple[str, ShardUpdate]]:
    """Run the person shards (``build``: from a snapshot or None); kind shard updates out.

    The updates in are keyed by person shard (the clocks' ``ShardUpdate``); the updates out
    by kind shard, as :meth:`~dpstream.kind.FlowKind.wire` takes them. The step ids are
    ``<step_id>.shards`` and ``<step_id>.unkey`` (the recovery store's keys).
    """
    out: Stream[tuple[str, ShardUpdate]] = stepped_shards(step_id, up, build)
    return out
