"""The end-to-end privacy harness: run neighbouring input streams through the whole flow.

Two drivers run the same raw Kafka-like messages:

* :func:`run_core` drives the real :class:`PartitionClock` and :class:`ShardState` objects the
  dataflow uses, without Bytewax, so that a scenario can be repeated over hundreds of noise keys,
  cut by a snapshot/restore (optionally under another configuration), batched and interleaved
  at will;
* :func:`run_dataflow` runs the real Bytewax dataflow (in-memory source, 1 or 2 workers).

Both return what the flow publishes, encoded exactly as it goes to Kafka, decoded from JSON:
``(role, record)`` pairs. :func:`structure` masks the noisy values; :func:`epsilon_lower_bound`
turns counts of an event over noise keys into a Clopper-Pearson lower bound on the privacy loss.
"""

from __future__ import annotations

import json
import pickle
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats

from dpstream.config import FlowConfig
from dpstream.core.noise.keys import NoiseKey
from dpstream.kinds.counters.events import (
    TICK,
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    PartitionClock,
    RawMessage,
)
from dpstream.kinds.counters.kind import event_rules, statistics_spec
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.kinds.counters.shard import ShardState
from dpstream.platform import build_flow, parse_config
from dpstream.stream.barrier import end_step_of

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
ORIGIN_ISO = "2026-09-21T14:13:20Z"
Record = tuple[str, dict[str, Any]]


def make_config(mode: str = "declared", accounting: str = "pure", **tables: dict) -> FlowConfig:
    """A small flow: 1 s steps, 3 shards; declared keys a..d, or an open universe."""
    raw: dict[str, dict] = {
        "flow": {"name": "nb", "origin": ORIGIN_ISO, "step": "1s", "shards": 3},
        "privacy": {"accounting": accounting, "budget": 1.0, "delta": 1e-6},
        "metrics": {"port": 0},
    }
    if mode == "declared":
        raw["admission"] = {"mode": "declared", "keys": ["a", "b", "c", "d"]}
        raw["counter"] = {"epsilon": 0.8} if accounting == "pure" else {"rho": 0.5, "horizon": 256}
        raw["counter"]["horizon"] = 256
    else:
        raw["admission"] = {"mode": "open",
                            "initial_epsilon" if accounting == "pure" else "initial_rho": 0.2}
        raw["monitor"] = {"epsilon": 0.3 if accounting == "pure" else 0.5, "horizon": 10}
        raw["counter"] = ({"epsilon": 0.5, "horizon": 256} if accounting == "pure"
                          else {"rho": 0.25, "horizon": 256})
    for table, values in tables.items():
        raw.setdefault(table, {}).update(values)
    return parse_config(raw)


def event(partition: int, key: str, ts: float, offset: int, broker: float | None = None
          ) -> RawMessage:
    """One event of ``key`` at event time ``ts`` (seconds); broker time ``broker`` (default ts)."""
    when = ts if broker is None else broker
    return (partition, json.dumps({"key": key, "ts": ts}).encode(), offset, "events",
            round(when * 1000), TIMESTAMP_LOG_APPEND_TIME)


def stream(spec: Sequence[tuple[int, str, float] | tuple[int, str, float, float]]
           ) -> list[RawMessage]:
    """Messages from ``(partition, key, seconds after ORIGIN[, broker seconds])``, offsets in order.

    The broker time defaults to the event time; within a partition the broker times are made
    non-decreasing (as Kafka's LogAppendTime is) unless given explicitly.
    """
    offsets: dict[int, int] = defaultdict(int)
    clock: dict[int, float] = defaultdict(lambda: float("-inf"))
    out = []
    for item in spec:
        partition, key, t = item[0], item[1], item[2]
        broker = item[3] if len(item) > 3 else max(t, clock[partition])  # type: ignore[misc]
        clock[partition] = max(clock[partition], broker)
        out.append(event(partition, key, ORIGIN + t, offsets[partition], ORIGIN + broker))
        offsets[partition] += 1
    return out


def producer_stream(spec: Sequence[tuple[int, str, float] | tuple[int, str, float, float]], *,
                    until: float = 30.0, tick_every: float = 0.5, partitions: int = 2
                    ) -> list[RawMessage]:
    """Messages as a ``flow.clock = "producer"`` flow reads them: events and heartbeat ticks.

    ``spec`` items are ``(partition, key, seconds after ORIGIN[, arrival seconds])``: an event
    carries its time in its ``ts`` field and as its producer timestamp (CreateTime); the
    arrival time (default: the event time) orders it among its partition's records. Every
    partition gets a tick (CreateTime) every ``tick_every`` seconds from ``tick_every`` through
    ``until``; an event arriving at a tick's time comes before the tick.
    """
    items: list[tuple[float, int, int, bytes, float, int]] = []
    for i, item in enumerate(spec):
        partition, key, t = item[0], item[1], item[2]
        arrival = item[3] if len(item) > 3 else t  # type: ignore[misc]
        items.append((arrival, 0, i, json.dumps({"key": key, "ts": ORIGIN + t}).encode(),
                      ORIGIN + t, partition))
    k = 1
    while k * tick_every <= until + 1e-9:
        for partition in range(partitions):
            items.append((k * tick_every, 1, partition, TICK, ORIGIN + k * tick_every,
                          partition))
        k += 1
    items.sort(key=lambda item: item[:3])
    offsets: dict[int, int] = defaultdict(int)
    out = []
    for _, _, _, value, stamp, partition in items:
        out.append((partition, value, offsets[partition], "events", round(stamp * 1000),
                    TIMESTAMP_CREATE_TIME))
        offsets[partition] += 1
    return out


def _decode(encoded: tuple[str, bytes | None, bytes]) -> Record:
    return encoded[0], json.loads(encoded[2])


class CoreFlow:
    """The flow's stream layer without Bytewax: partition clocks feeding shards."""

    def __init__(self, config: FlowConfig, noise: NoiseKey, instance: str, partitions: int,
                 states: dict[str, Any] | None = None) -> None:
        self.config, self.partitions = config, partitions
        spec = statistics_spec(config, instance)
        declared = config.declared_layout  # as the flow wires its shards
        rules = event_rules(config)
        states = states or {"clocks": {}, "shards": {}}
        self.clocks = {p: PartitionClock(rules, states["clocks"].get(p))
                       for p in range(partitions)}
        self.shards = {s: ShardState(spec, partitions, declared, noise, states["shards"].get(s))
                       for s in range(config.shards)}
        for shard in self.shards.values():  # as the flow builds them (keyed_statistics)
            shard.end_step = end_step_of(config)
        self.encoder = RecordEncoder(config.name, config.origin, config.step_seconds,
                                     config.privacy.delta, instance=instance)
        self.records: list[Record] = []
        self.dead_letters: list[Any] = []

    def feed(self, partition: int, batch: list[RawMessage]) -> None:
        """One source batch of one partition."""
        updates, dead = self.clocks[partition].process(partition, batch)
        self.dead_letters.extend(dead)
        for update in updates:
            self._publish(self.shards[update.shard].update(update))

    def end_of_input(self) -> None:
        """A bounded input ended: partitions close, then shards stop waiting for empty ones."""
        for clock in self.clocks.values():  # (a partition without records has no update)
            for update in clock.end_of_input():
                self._publish(self.shards[update.shard].update(update))
        for shard in self.shards.values():
            self._publish(shard.end_of_input())

    def snapshot(self) -> dict[str, Any]:
        """Every state, through pickle (as the recovery store keeps it)."""
        return pickle.loads(pickle.dumps({
            "clocks": {p: c.to_state() for p, c in self.clocks.items()},
            "shards": {s: sh.to_state() for s, sh in self.shards.items()}}))

    def _publish(self, outputs: list[Any]) -> None:
        self.records.extend(_decode(self.encoder.encode(o)) for o in outputs)


def run_core(config: FlowConfig, messages: Sequence[RawMessage], noise: NoiseKey, *,
             instance: str = "instance-1", partitions: int = 2, batch: int = 1_000,
             interleave_seed: int | None = None, restart_after: int | None = None,
             resume_config: FlowConfig | None = None, end: bool = True) -> list[Record]:
    """Run ``messages`` through clocks and shards and return the published records.

    Args:
        batch: records per source batch (per partition).
        interleave_seed: None feeds the partitions' batches round-robin; a seed shuffles the
            order in which partitions deliver (each partition stays in offset order).
        restart_after: snapshot after this many batches and resume from the snapshot, under
            ``resume_config`` if given.
        end: close everything at the end of the input (a bounded run).
    """
    per_partition: dict[int, list[RawMessage]] = defaultdict(list)
    for message in messages:
        per_partition[message[0]].append(message)
    queues = {p: [ms[i:i + batch] for i in range(0, len(ms), batch)]
              for p, ms in per_partition.items()}
    if interleave_seed is None:  # round-robin: the i-th batch of every partition in turn
        rounds = max(map(len, queues.values()), default=0)
        order = [p for i in range(rounds) for p in sorted(queues) if i < len(queues[p])]
    else:
        order = [p for p, q in sorted(queues.items()) for _ in q]
        random.Random(interleave_seed).shuffle(order)
    flow = CoreFlow(config, noise, instance, partitions)
    records: list[Record] = []
    cursor = {p: 0 for p in queues}
    for i, p in enumerate(order):
        if restart_after is not None and i == restart_after:
            records.extend(flow.records)
            flow = CoreFlow(resume_config or config, noise, instance, partitions,
                            flow.snapshot())
        flow.feed(p, queues[p][cursor[p]])
        cursor[p] += 1
    if end:
        flow.end_of_input()
    return records + flow.records


def run_dataflow(config: FlowConfig, messages: Sequence[RawMessage], noise: NoiseKey, *,
                 instance: str = "instance-1", partitions: int = 2, workers: int = 1,
                 batch: int = 1_000, metrics: Any = None) -> list[Record]:
    """Run ``messages`` through the real Bytewax dataflow (in-memory source and sink)."""
    from bytewax.testing import TestingSink, TestingSource, cluster_main, run_main

    sink: list[tuple[str, bytes | None, bytes]] = []
    flow = build_flow(config, noise, instance=instance, partitions=partitions,
                      source=TestingSource(list(messages), batch), sink=TestingSink(sink),
                      metrics=metrics)
    if workers == 1:
        run_main(flow)
    else:
        cluster_main(flow, [], 0, worker_count_per_proc=workers)
    return [_decode(item) for item in sink if item[0] != "dead_letters"]


NOISY_FIELDS = {"value"}


def structure(records: Sequence[Record]) -> list[str]:
    """Everything published but the noisy values, in a canonical order.

    A release's ``value`` is noisy; every other field (which records, keys and steps exist,
    std, privacy spend, windows, alerts, statuses) must not depend on the data beyond what the
    mechanisms decide.
    """
    masked = []
    for role, body in records:
        kept = {k: v for k, v in body.items() if k not in NOISY_FIELDS}
        masked.append(json.dumps([role, kept], sort_keys=True))
    return sorted(masked)


def about(records: Sequence[Record], key: str) -> list[Record]:
    """The records that name ``key``."""
    return [r for r in records if r[1].get("key") == key]


def not_about(records: Sequence[Record], key: str) -> list[str]:
    """The records that do not name ``key``, canonically encoded (noisy values included)."""
    return sorted(json.dumps(r, sort_keys=True) for r in records if r[1].get("key") != key)


def admitted(records: Sequence[Record], key: str) -> bool:
    """Whether ``key`` appears on any output."""
    return any(r[1].get("key") == key for r in records)


def clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    """The exact two-sided (1 - alpha) confidence interval of a binomial proportion."""
    low = 0.0 if k == 0 else float(stats.beta.ppf(alpha / 2, k, n - k + 1))
    high = 1.0 if k == n else float(stats.beta.ppf(1 - alpha / 2, k + 1, n - k))
    return low, high


def epsilon_lower_bound(k_a: int, n_a: int, k_b: int, n_b: int, alpha: float = 1e-3) -> float:
    """A lower confidence bound on the privacy loss an event's frequencies show.

    If a mechanism is epsilon-DP (with delta), ``p_a <= e^eps p_b + delta`` for every event
    and both orders of the neighbours. With Clopper-Pearson intervals at level ``alpha`` for
    each of the four proportions (the event and its complement in both worlds), the returned
    bound is below the true epsilon with probability at least ``1 - 2 alpha``. It is 0 when the
    data show no loss.
    """
    import math

    def one_way(ka: int, na: int, kb: int, nb: int) -> float:
        low_a, _ = clopper_pearson(ka, na, alpha)
        _, high_b = clopper_pearson(kb, nb, alpha)
        if low_a <= 0:
            return 0.0
        return max(0.0, math.log(low_a / high_b))

    return max(one_way(k_a, n_a, k_b, n_b), one_way(k_b, n_b, k_a, n_a),
               one_way(n_a - k_a, n_a, n_b - k_b, n_b), one_way(n_b - k_b, n_b, n_a - k_a, n_a))


# --- one person more or less (issue 24) -------------------------------------------------------
#
# The user-level sibling of the one-event drivers above: a stream is a list of :class:`Item`
# (a record of some person, or of nobody, before Kafka numbers it); :func:`kafka_view` numbers
# the offsets per partition in broker-time order, as Kafka would, so that removing a person's
# items renumbers everyone else's offsets but keeps their order (the bounding decides in that
# order: it must keep the same events of everyone else). :func:`reference_kept` is the
# bounding rule of the shared design written out plainly, per person, as the oracle of what
# the flow must keep; :func:`run_flow` runs the real Bytewax dataflow of any kind.

PERSON_FIELD = "user"


@dataclass(frozen=True)
class Item:
    """One input record: partition (numbered across the input topics), body, broker seconds."""

    partition: int
    body: dict[str, Any]
    broker: float  # seconds after ORIGIN (the step is its whole part with 1 s steps)
    topic: str = "events"


def kafka_view(items: Sequence[Item]) -> list[RawMessage]:
    """Kafka's view of ``items``: per partition in broker-time order, offsets from 0."""
    ordered = sorted(range(len(items)), key=lambda i: (items[i].broker, items[i].partition, i))
    offsets: dict[int, int] = defaultdict(int)
    out: list[RawMessage] = []
    for i in ordered:
        item = items[i]
        out.append((item.partition, json.dumps(item.body).encode(), offsets[item.partition],
                    item.topic, round((ORIGIN + item.broker) * 1000), TIMESTAMP_LOG_APPEND_TIME))
        offsets[item.partition] += 1
    return out


def without_person(items: Sequence[Item], person: str, field: str = PERSON_FIELD) -> list[Item]:
    """The remove-one-person neighbour: ``items`` without any record of ``person``."""
    return [item for item in items if item.body.get(field) != person]


@dataclass(frozen=True)
class Placed:
    """A person's event as the bounding sees it: where it sits and what it contributes to."""

    step: int
    partition: int
    offset: int
    group: Any


def placed_events(messages: Sequence[RawMessage], group_of: Any,
                  field: str = PERSON_FIELD) -> dict[str, list[Placed]]:
    """Every person's events of ``messages`` (1 s steps from ORIGIN, broker time), by person.

    ``group_of(body)`` names what the event contributes to (a counter's key, a histogram, ...);
    records of no person (questions, say) are left out.
    """
    people: dict[str, list[Placed]] = defaultdict(list)
    for partition, value, offset, _topic, millis, _kind in messages:
        body = json.loads(value)
        person = body.get(field) if isinstance(body, dict) else None
        if isinstance(person, str) and person:
            step = (millis - ORIGIN * 1000) // 1000
            people[person].append(Placed(step, partition, offset, group_of(body)))
    return people


def reference_kept(events: Sequence[Placed], grouping: str, max_groups: int,
                   max_per_group: int, period_steps: int | None) -> list[Placed]:
    """The events of ONE person the bounding must keep (the shared design's rule, plainly).

    In the order (step, partition, offset), per period (``step // period_steps``; one period
    with a lifetime): an event is kept iff its group is already one of the person's groups in
    this period with fewer than ``max_per_group`` kept events, or the person has fewer than
    ``max_groups`` groups (the group joins them). The group is the event's key ("key"), its
    step ("step", ERM's blocks) or one for all ("one", a PMWG histogram).
    """
    kept: list[Placed] = []
    period, counts = None, {}  # type: ignore[var-annotated]
    for e in sorted(events, key=lambda e: (e.step, e.partition, e.offset)):
        now = 0 if period_steps is None else e.step // period_steps
        if now != period:
            period, counts = now, {}
        group = e.group if grouping == "key" else e.step if grouping == "step" else 0
        if group in counts:
            if counts[group] >= max_per_group:
                continue
            counts[group] += 1
        elif len(counts) < max_groups:
            counts[group] = 1
        else:
            continue
        kept.append(e)
    return kept


def run_flow(config: FlowConfig, messages: Sequence[RawMessage], noise: NoiseKey, *,
             partitions: int | dict[str, int], instance: str = "instance-1", workers: int = 1,
             batch: int = 16, metrics: Any = None, **options: Any) -> list[Record]:
    """Run ``messages`` through the real dataflow of any kind; every published record.

    Dead letters are included (role ``dead_letters``), as every other output role is.
    """
    from bytewax.testing import TestingSink, TestingSource, cluster_main, run_main

    sink: list[tuple[str, bytes | None, bytes]] = []
    flow = build_flow(config, noise, instance=instance, partitions=partitions,
                      source=TestingSource(list(messages), batch), sink=TestingSink(sink),
                      metrics=metrics, **options)
    if workers == 1:
        run_main(flow)
    else:
        cluster_main(flow, [], 0, worker_count_per_proc=workers)
    return [_decode(item) for item in sink]
