"""Issue 22, items 3, 4 and 9: only a trusted clock closes steps, and a bounded run ends at a
public step, through the real Bytewax dataflow (in-memory source and sink).

* **Item 3**: a bounded run's last released step was its latest record's step, so one event
  stamped far later changed 12 release records into 102. Now it is ``flow.end``'s step, or
  the step of the last trusted tick (producer clock) / broker time (broker clock).
* **Item 4**: under ``flow.clock = "producer"`` a record stamped 1 h ahead closed every step
  up to its own time and made every later event late. Now records' own times never move the
  watermark: only heartbeat ticks (and broker time) do, and a record's placement is clamped
  into ``[watermark - lateness, watermark + max_skew]``.
* **Item 9**: heartbeat ticks overtook producers' in-flight batches and made their events
  late. Now an overtaken event is clamped forward into the open step (and the heartbeat
  stamps its ticks ``flow.tick_delay`` behind its clock, see the last tests).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from support.messages import message, raw

from dpstream.core.noise.keys import NoiseKey
from dpstream.io.kafka import Heartbeat, KafkaClients
from dpstream.kinds.counters.events import PartitionClock
from dpstream.kinds.counters.kind import event_rules
from dpstream.messages import TICK, TIMESTAMP_CREATE_TIME
from dpstream.platform import build_flow, parse_config
from dpstream.runner import _lag_text

ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
KEYS = ["a", "b", "c"]
CREATE = TIMESTAMP_CREATE_TIME


def config(clock: str = "producer", **flow):
    return parse_config({
        "flow": {"name": "tc", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 2,
                 "clock": clock, **flow},
        "privacy": {"accounting": "pure", "budget": 1.0},
        "admission": {"mode": "declared", "keys": KEYS},
        "metrics": {"port": 0}})


def producer_stream(seconds: int = 6, extra: list | None = None, ticks: bool = True,
                    partitions: int = 2) -> list:
    """Events of every key in steps 0..seconds-1 (CreateTime = event time),
    heartbeat ticks every 0.5 s through ``seconds``; ``extra``: (partition, key, event time,
    after which tick time) events inserted into their partition's offset order."""
    items: list[tuple[float, int, bytes | None, float, int]] = []  # (order, p, value, stamp)
    for t in range(seconds):
        for i, key in enumerate(KEYS):
            p = i % partitions
            items.append((t + 0.1 + 0.2 * i, p, key, ORIGIN + t + 0.1 + 0.2 * i))
    if ticks:
        for half in range(1, 2 * seconds + 1):
            for p in range(partitions):
                items.append((half / 2 + 0.01, p, None, ORIGIN + half / 2))
    for p, key, when, after in extra or []:
        items.append((after + 0.02, p, key, when))
    items.sort(key=lambda item: item[0])
    offsets = Counter()
    out = []
    for _, p, key, stamp in items:
        if key is None:
            out.append(raw(p, TICK, offsets[p], stamp, kind=CREATE))
        else:
            out.append(message(p, key, stamp, offsets[p], kind=CREATE))
        offsets[p] += 1
    return out


def run(cfg, items, partitions: int = 2) -> tuple[list[dict], list[dict]]:
    """The released records and the dead letters of a bounded run."""
    sink: list = []
    flow = build_flow(cfg, NoiseKey.for_tests(5), instance="tc-1", partitions=partitions,
                      source=TestingSource(items, 7), sink=TestingSink(sink))
    run_main(flow)
    released = [json.loads(v) for role, _k, v in sink if role == "releases"]
    dead = [json.loads(v) for role, _k, v in sink if role == "dead_letters"]
    return released, dead


def coordinates(released: list[dict]) -> set[tuple[str, int]]:
    return {(r["key"], r["step"]) for r in released}


# --- item 3: one event more, stamped far later, changes no coordinate ----------------------

@pytest.mark.parametrize("partitions", [1, 2])
def test_producer_clock_bounded_run_ends_at_the_last_tick_not_the_latest_record(partitions):
    """Before the fix, with one partition: 21 release records (steps 0..6) became 153."""
    cfg = config()
    base, _ = run(cfg, producer_stream(partitions=partitions), partitions)
    extra, dead = run(cfg, producer_stream(extra=[(0, "a", ORIGIN + 50.5, 5.0)],
                                           partitions=partitions), partitions)
    expected = {(k, s) for k in KEYS for s in range(7)}  # the last tick (6.0) is in step 6
    assert coordinates(base) == expected
    assert coordinates(extra) == expected and len(extra) == len(base)  # was 102 vs 12-ish
    assert dead == []  # the late-stamped event waits in step 50, which never closed


def test_producer_clock_with_flow_end_ends_at_flow_end():
    cfg = config(end="2026-09-21T14:13:24Z")  # origin + 4 s: steps 0..3
    base, _ = run(cfg, producer_stream())
    extra, dead = run(cfg, producer_stream(extra=[(1, "b", ORIGIN + 50.5, 5.0)]))
    expected = {(k, s) for k in KEYS for s in range(4)}
    assert coordinates(base) == coordinates(extra) == expected
    assert all(d["reason"].startswith("after flow.end") for d in dead) and dead
    # without a single tick the run still ends at flow.end, with or without the extra event
    no_ticks, _ = run(cfg, producer_stream(ticks=False))
    no_ticks_extra, _ = run(cfg, producer_stream(ticks=False,
                                                 extra=[(0, "a", ORIGIN + 50.5, 5.0)]))
    assert coordinates(no_ticks) == coordinates(no_ticks_extra) == expected
    nothing, _ = run(cfg, [])  # and with no record at all: the end is the configuration's
    assert coordinates(nothing) == expected


def broker_stream(extra_broker: float | None = None) -> list:
    """Events in steps 0..5 with broker time = event time; one more arriving at extra_broker."""
    out = [message(i % 2, key, ORIGIN + t + 0.1 + 0.2 * i, t * 2 + (i // 2))
           for t in range(6) for i, key in enumerate(KEYS)]
    if extra_broker is not None:
        out.append(message(0, "a", ORIGIN + 2.5, 100, broker=ORIGIN + extra_broker))
    return out


def test_broker_clock_with_flow_end_ends_at_flow_end():
    cfg = config("broker", end="2026-09-21T14:13:26Z")  # origin + 6 s: steps 0..5
    base, _ = run(cfg, broker_stream())
    extra, dead = run(cfg, broker_stream(extra_broker=50.5))
    expected = {(k, s) for k in KEYS for s in range(6)}
    assert coordinates(base) == coordinates(extra) == expected
    assert [d["reason"].split(":")[0] for d in dead] == ["after flow.end"]


# --- item 4: a record stamped 1 h ahead closes no step and makes no event late -------------

def test_a_record_an_hour_ahead_moves_no_other_record():
    cfg = config(max_skew="5m")
    ahead = [(0, "c", ORIGIN + 3600 + 2.5, 2.0)]  # after the tick at 2.0, before the rest
    base, _ = run(cfg, producer_stream())
    extra, dead = run(cfg, producer_stream(extra=ahead))
    assert dead == []  # no later event became late
    assert coordinates(extra) == coordinates(base)  # no step beyond the ticks closed
    assert max(r["step"] for r in extra) == 6
    clock = PartitionClock(event_rules(cfg))
    updates, dead = clock.process(0, [raw(0, TICK, 0, ORIGIN + 2.0, kind=CREATE),
                                      message(0, "c", ORIGIN + 3602.5, 1, kind=CREATE),
                                      message(0, "a", ORIGIN + 2.2, 2, kind=CREATE)])
    assert dead == [] and clock.watermark == ORIGIN + 2.0 and updates[0].frontier == 2
    steps = {s for u in updates for s in u.increments}
    assert steps == {2, 302}  # the future record is clamped to watermark + max_skew (300 s)


# --- item 9: ticks that overtake in-flight events lose none of them ------------------------

def test_events_stamped_before_the_latest_tick_are_not_dead_letters():
    cfg = config()
    in_flight = [(p, key, ORIGIN + 2.7, 3.0) for p in (0, 1) for key in KEYS]  # after tick 3.0
    released, dead = run(cfg, producer_stream(extra=in_flight))
    assert dead == []
    clock = PartitionClock(event_rules(cfg))
    updates, dead = clock.process(0, [raw(0, TICK, 0, ORIGIN + 3.0, kind=CREATE),
                                      message(0, "a", ORIGIN + 2.7, 1, kind=CREATE)])
    assert dead == [] and {s for u in updates for s in u.increments} == {3}  # moved forward
    assert coordinates(released) == {(k, s) for k in KEYS for s in range(7)}


def test_a_data_record_never_moves_the_producer_clock():
    cfg = config()
    clock = PartitionClock(event_rules(cfg))
    updates, dead = clock.process(0, [message(0, "a", ORIGIN + 9.5, 0, kind=CREATE)])
    assert clock.watermark is None and updates[0].frontier is None and dead == []
    assert {s for u in updates for s in u.increments} == {9}  # placed by its own time
    clock.process(0, [raw(0, TICK, 1, ORIGIN + 4.0, kind=CREATE)])
    assert clock.watermark == ORIGIN + 4.0 and clock.frontier() == 4


def test_the_heartbeat_stamps_ticks_tick_delay_behind_its_clock():
    clients = KafkaClients(("127.0.0.1:1",), {})
    beat = Heartbeat(clients, "events", 2, 1.0, delay=2.0, now=lambda: 1000.25)
    assert beat.stamp() == 998_250
    assert Heartbeat(clients, "events", 2, 1.0, now=lambda: 1000.25).stamp() == 1_000_250


def test_the_progress_line_never_shows_a_negative_lag():
    """Item 4 showed "-3585 s behind the clock": closed steps ahead of this host's clock."""
    from dpstream.metrics import FlowMetrics
    from dpstream.runner import progress_line

    metrics = FlowMetrics("tc", clock=lambda: ORIGIN + 100.0)
    metrics.set_clock(ORIGIN, 1.0)
    metrics.observe_shard(0, 3684, 0)  # closed through a step ending 3585 s from "now"
    line = progress_line(metrics.registry)
    assert "-3585" not in line and "behind the clock" not in line, line
    assert "ends 3585 s after this host's clock" in line
    metrics.observe_shard(0, 87, 0)
    assert "12 s behind the clock" in progress_line(metrics.registry)
    assert _lag_text(12.4) == "12 s behind the clock"


def test_an_event_time_beyond_the_year_9999_is_clamped_not_overflowed():
    cfg = config(max_skew="5m")
    clock = PartitionClock(event_rules(cfg))
    huge = [message(0, "a", 1e300, 0, broker=ORIGIN + 1.0, kind=CREATE)]
    updates, dead = clock.process(0, huge)  # before the first tick: placed at the year 9999
    assert dead == [] and max(s for u in updates for s in u.increments) > 8 * 10**9
    clock.process(0, [raw(0, TICK, 1, ORIGIN + 2.0, kind=CREATE)])
    updates, dead = clock.process(0, [message(0, "a", 1e300, 2, broker=ORIGIN + 2.5,
                                              kind=CREATE)])
    assert dead == [] and {s for u in updates for s in u.increments} == {302}
    bounded = PartitionClock(event_rules(config(end="2026-09-21T14:13:30Z")))
    _, dead = bounded.process(0, huge)
    assert [d.reason.split(":")[0] for d in dead] == ["after flow.end"]


# --- the signals of a clamped record: a count, a metric (exact counts), a log line ----------

def test_the_clock_counts_records_clamped_ahead_and_behind():
    cfg = config(max_skew="5m", lateness="1s")
    clock = PartitionClock(event_rules(cfg))
    _, dead = clock.process(0, [raw(0, TICK, 0, ORIGIN + 10.0, kind=CREATE),
                                message(0, "c", ORIGIN + 3610.0, 1, kind=CREATE),  # ahead
                                message(0, "a", ORIGIN + 10.2, 2, kind=CREATE),  # in the window
                                message(0, "b", ORIGIN + 9.5, 3, kind=CREATE),  # in the window
                                message(0, "b", ORIGIN + 5.0, 4, kind=CREATE),  # behind
                                message(0, "a", ORIGIN + 3700.0, 5, kind=CREATE)])  # ahead
    assert dead == []
    assert clock.clamped == {("events", "ahead"): 2, ("events", "behind"): 1}
    assert clock.clamped_last == {"ahead": (2, 1), "behind": (1, 4)}
    clock.process(0, [message(0, "a", ORIGIN + 10.3, 6, kind=CREATE)])
    assert clock.clamped_last == {} and sum(clock.clamped.values()) == 3


def test_a_clock_without_ticks_yet_clamps_nothing():
    cfg = config(max_skew="5m")
    clock = PartitionClock(event_rules(cfg))
    clock.process(0, [message(0, "c", ORIGIN + 3610.0, 0, kind=CREATE)])
    assert clock.clamped == {}


@pytest.mark.parametrize("exact", [True, False])
def test_a_flow_shows_a_clamped_record_in_its_metrics_only_with_exact_counts(exact, caplog):
    from prometheus_client import CollectorRegistry

    from dpstream.metrics import FlowMetrics

    cfg = config(max_skew="5m")
    ahead = [(0, "c", ORIGIN + 3600 + 2.5, 2.0)]
    registry = CollectorRegistry()
    metrics = FlowMetrics("tc", registry, exact_counts=exact)
    sink: list = []
    flow = build_flow(cfg, NoiseKey.for_tests(5), instance="tc-1", partitions=2,
                      source=TestingSource(producer_stream(extra=ahead), 7),
                      sink=TestingSink(sink), metrics=metrics)
    with caplog.at_level("INFO", logger="dpstream"):
        run_main(flow)
    value = registry.get_sample_value("dpstream_clamped_records_total",
                                      {"flow": "tc", "topic": "events", "bound": "ahead"})
    behind = registry.get_sample_value("dpstream_clamped_records_total",
                                       {"flow": "tc", "topic": "events", "bound": "behind"})
    lines = [r.getMessage() for r in caplog.records if "max_skew" in r.getMessage()]
    assert len(lines) == 1, lines
    assert all(r.levelname == "WARNING" for r in caplog.records if "max_skew" in r.getMessage())
    assert str(ORIGIN + 3600) not in lines[0]  # never the record's time
    if exact:
        assert value == 1 and behind == 0
        assert lines[0].startswith("input events[0] offset ")
        assert "stamped more than flow.max_skew ahead of its partition's clock (heartbeat " \
               "ticks): counted at the limit" in lines[0]
    else:
        assert value is None and behind is None
        assert "dpstream_clamped_records" not in str(list(registry.collect()))
        assert "offset" not in lines[0] and "events[" not in lines[0]
        assert "metrics.exact_counts" in lines[0]
