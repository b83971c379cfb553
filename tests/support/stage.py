"""The bounding stage of a user-level flow driven by hand, without Bytewax (issue 24).

* :class:`HandStage` builds a kind's person clocks (one per input partition, hashing people with
  the flow's ``people`` lane) and its person shards (``BoundingShard``), feeds batches of raw
  records through them, and hands what the person shards send to the kind shards to
  :meth:`HandStage.take`, which a test's subclass defines to collect what it checks;
* :func:`drive` feeds records per partition in batches (:func:`batch_order`: round robin or in a
  shuffled order), and can restart the stage from a snapshot part-way;
* :func:`interleave` is another order of delivery of raw records across partitions.
"""

from __future__ import annotations

import pickle
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from dpstream.core.contribution.people import PersonHasher
from dpstream.platform import KINDS
from dpstream.stream.bounding import BoundingShard, person_clocks


class HandStage:
    """The clocks and the person shards of a user-level flow, driven by hand (no Bytewax).

    ``kept`` and ``dropped`` sum what the person shards observe; ``dead`` holds the clocks'
    dead letters. A subclass defines :meth:`take` (what a person shard's output is to the test)
    and names in ``carried`` what it collects, so that :func:`drive` carries it over a restart.
    """

    carried: tuple[str, ...] = ("kept", "dropped")

    def __init__(self, cfg: Any, noise: Any, *, instance: str = "u-1", partitions: int = 3,
                 states: dict[str, Any] | None = None) -> None:
        kind = KINDS[cfg.kind]
        self.cfg, self.partitions = cfg, partitions
        hasher = PersonHasher(noise.lane(instance, cfg.name, "people"))
        make = person_clocks(kind.clock(cfg, {"events": 0}), hasher, cfg.shards)
        digest = kind.binding(cfg).mechanisms_digest
        states = states or {"clocks": {}, "shards": {}}
        self.clocks = {p: make(states["clocks"].get(p)) for p in range(partitions)}
        self.shards = {s: BoundingShard(kind.clock(cfg, {"events": 0})(None), cfg, digest,
                                        noise, instance, partitions, states["shards"].get(s),
                                        observe=self._observe)
                       for s in range(cfg.shards)}
        self.kept = self.dropped = 0
        self.dead: list[Any] = []

    def _observe(self, kept: int, dropped: int) -> None:
        self.kept += kept
        self.dropped += dropped

    def take(self, out: list[Any]) -> None:
        """What a person shard sent on: ``(key, ShardUpdate)`` pairs."""
        raise NotImplementedError

    def feed(self, batch: list[Any]) -> None:
        """One batch of raw records of one partition."""
        updates, dead = self.clocks[batch[0][0]].process(batch[0][0], batch)
        self.dead += dead
        for update in updates:
            self.take(self.shards[update.shard].update(update))

    def end(self) -> None:
        for clock in self.clocks.values():
            for update in clock.end_of_input():
                self.take(self.shards[update.shard].update(update))
        for shard in self.shards.values():
            self.take(shard.end_of_input())

    def snapshot(self) -> dict[str, Any]:
        return pickle.loads(pickle.dumps({
            "clocks": {p: c.to_state() for p, c in self.clocks.items()},
            "shards": {s: sh.to_state() for s, sh in self.shards.items()}}))


Stage = TypeVar("Stage", bound=HandStage)


def drive(make: Callable[[dict[str, Any] | None], Stage], items: list[Any],
          batch: int = 1000, seed: int | None = None,
          restart_after: int | None = None) -> Stage:
    """Feed ``items`` to ``make(None)`` per partition in batches: round robin, or in an order
    shuffled with ``seed`` (each partition's batches stay in order); after ``restart_after``
    batches, if given, go on with ``make(snapshot)``, which carries what was collected."""
    queues, order = batch_order(items, batch, seed)
    stage = make(None)
    cursor = dict.fromkeys(queues, 0)
    for i, p in enumerate(order):
        if i == restart_after:
            resumed = make(stage.snapshot())
            for name in stage.carried:
                setattr(resumed, name, getattr(stage, name))
            stage = resumed
        stage.feed(queues[p][cursor[p]])
        cursor[p] += 1
    stage.end()
    return stage


def batch_order(items: Sequence[Any], batch: int, seed: int | None = None
                ) -> tuple[dict[int, list[list[Any]]], list[int]]:
    """Raw records (``item[0]`` the partition) in batches of ``batch`` per partition, and the
    order to deliver them in, as the partition of each next batch: round robin, or shuffled
    with ``seed`` (each partition's batches stay in order either way)."""
    per_partition: dict[int, list[Any]] = defaultdict(list)
    for item in items:
        per_partition[item[0]].append(item)
    queues = {p: [records[i:i + batch] for i in range(0, len(records), batch)]
              for p, records in per_partition.items()}
    if seed is None:
        rounds = max(map(len, queues.values()), default=0)
        order = [p for i in range(rounds) for p in sorted(queues) if i < len(queues[p])]
    else:
        order = [p for p, q in sorted(queues.items()) for _ in q]
        random.Random(seed).shuffle(order)
    return queues, order


def interleave(items: list[Any], seed: int) -> list[Any]:
    """Another order of delivery across partitions: each partition's records keep theirs,
    taken 1 to 9 at a time from a partition chosen at random (with ``seed``)."""
    rng = random.Random(seed)
    queues: dict[int, list[Any]] = defaultdict(list)
    for item in items:
        queues[item[0]].append(item)
    out: list[Any] = []
    cursors = dict.fromkeys(queues, 0)
    while len(out) < len(items):
        p = rng.choice([q for q in queues if cursors[q] < len(queues[q])])
        take = rng.randint(1, 9)
        out += queues[p][cursors[p]:cursors[p] + take]
        cursors[p] += take
    return out
