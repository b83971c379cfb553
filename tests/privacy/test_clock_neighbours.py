"""Neighbouring streams under every clock mode, and the end of bounded runs (issue 22, items
3, 4 and 9; pitfalls 10, 14 and 15).

The extra event is placed adversarially in time: before a partition's first heartbeat tick,
far in the future, far in the past, older than the lateness, or as the last record of a
bounded input stamped long after every other. Under ``flow.clock = "producer"`` data records
never move the watermark (only the ticks do), so whatever the extra event says, the two
neighbours publish records of identical structure: the same keys and steps, every field but
the noisy values equal, and, with the same noise key, every record that does not name the
affected key byte-identical. A bounded run ends at ``flow.end``'s step, or at the step of the
last tick (producer clock) / the broker's time (broker clock): never at a step a data
record's own time chooses.
"""

from __future__ import annotations

import pytest
from harness import (
    about,
    admitted,
    make_config,
    not_about,
    producer_stream,
    run_core,
    run_dataflow,
    stream,
    structure,
)
from test_neighbours import base_events

from dpstream.core.noise.keys import NoiseKey

pytestmark = [pytest.mark.privacy]

MODES = [("declared", "pure"), ("declared", "zcdp"), ("open", "pure"), ("open", "zcdp")]
SEEDS = 6

# (partition, key, event seconds after the origin, arrival seconds: its place among the ticks)
PRODUCER_PLACEMENTS = {
    "before the first tick": (0, "a", 0.2, 0.0),
    "far future, before the first tick": (1, "a", 10.0**7, 0.0),
    "far future (an hour ahead)": (0, "a", 3600.0 + 4.4, 4.45),
    "far future (beyond the year 9999)": (0, "a", 10.0**12, 4.45),
    "far past (before the origin)": (1, "a", -10.0**6, 7.05),
    "old (older than the lateness), arriving late": (1, "a", 0.5, 21.7),
    "in flight: stamped before the latest tick": (0, "a", 9.9, 10.2),
    "last record of the input, stamped far later": (1, "a", 500.0, 40.0),
}


def producer_config(mode: str, accounting: str, **flow):
    return make_config(mode, accounting, flow={"clock": "producer", **flow})


def producer_neighbours(mode: str, extra: tuple, **kwargs) -> tuple[list, list]:
    base = base_events(mode)
    return producer_stream(base, **kwargs), producer_stream(base + [extra], **kwargs)


def assert_neighbours(mode: str, config, without: list, with_extra: list, label: str,
                      seeds: int = SEEDS) -> list:
    """The coupled check of test_neighbours: only the extra event's own key may change, by 1."""
    same_decision = 0
    r0: list = []
    for seed in range(seeds):
        noise = NoiseKey.for_tests(seed)
        r0 = run_core(config, without, noise, batch=7)
        r1 = run_core(config, with_extra, noise, batch=7)
        assert r0, label
        assert not_about(r0, "a") == not_about(r1, "a"), label
        a0, a1 = about(r0, "a"), about(r1, "a")
        alerts0 = [b["step"] for role, b in a0 if role == "alerts"]
        alerts1 = [b["step"] for role, b in a1 if role == "alerts"]
        if mode == "declared" or alerts0 == alerts1:
            same_decision += 1
            assert structure(a0) == structure(a1), label
            values0 = {b["step"]: b["value"] for role, b in a0 if "value" in b}
            values1 = {b["step"]: b["value"] for role, b in a1 if "value" in b}
            assert values0.keys() == values1.keys(), label
            for step, value in values0.items():
                assert abs(values1[step] - value) <= 1 + 1e-6, (label, step)
    assert same_decision >= seeds // 2, label
    if mode == "open":
        assert admitted(r0, "b") and admitted(r0, "a")
    return r0


@pytest.mark.parametrize("placement", list(PRODUCER_PLACEMENTS))
@pytest.mark.parametrize(("mode", "accounting"), MODES)
def test_producer_clock_one_event_changes_only_its_own_keys_values(mode, accounting, placement):
    config = producer_config(mode, accounting)
    without, with_extra = producer_neighbours(mode, PRODUCER_PLACEMENTS[placement])
    records = assert_neighbours(mode, config, without, with_extra, placement)
    steps = {b["step"] for _, b in records if "step" in b}
    assert max(steps) == 30  # the last tick (30.0) is in step 30: the end is the ticks'


@pytest.mark.parametrize("placement", ["far future (an hour ahead)",
                                       "in flight: stamped before the latest tick"])
@pytest.mark.parametrize(("mode", "accounting"), [("declared", "pure"), ("open", "zcdp")])
def test_producer_clock_a_short_max_skew_counts_the_future_event_in_an_open_step(
        mode, accounting, placement):
    """With max_skew 2 s the future event is counted (2 s ahead of the ticks), not dropped."""
    config = producer_config(mode, accounting, max_skew="2s", lateness="1s")
    without, with_extra = producer_neighbours(mode, PRODUCER_PLACEMENTS[placement])
    assert_neighbours(mode, config, without, with_extra, placement)
    if mode == "declared":
        noise = NoiseKey.for_tests(0)
        v0 = {b["step"]: b["value"] for _, b in about(run_core(config, without, noise), "a")}
        v1 = {b["step"]: b["value"] for _, b in about(run_core(config, with_extra, noise), "a")}
        moved = [s for s in v0 if v0[s] != v1[s]]
        assert moved and min(moved) <= 7 if "ahead" in placement else moved  # counted


@pytest.mark.parametrize(("mode", "accounting"), MODES)
def test_producer_clock_one_partition_ends_at_its_last_tick(mode, accounting):
    """Item 3 on one partition (no other partition's clock to hide it): before the fix the
    extra event stamped far later closed 470 more steps of every key."""
    config = producer_config(mode, accounting)
    base = [(0, key, t) for _, key, t in base_events(mode)]
    without = producer_stream(base, partitions=1)
    with_extra = producer_stream(base + [(0, "a", 500.0, 40.0)], partitions=1)
    same = 0
    for seed in range(3):
        noise = NoiseKey.for_tests(seed)
        r0 = run_core(config, without, noise, partitions=1, batch=7)
        r1 = run_core(config, with_extra, noise, partitions=1, batch=7)
        assert not_about(r0, "a") == not_about(r1, "a")
        if mode == "declared" or [b for r, b in about(r0, "a") if r == "alerts"] == [
                b for r, b in about(r1, "a") if r == "alerts"]:
            same += 1
            assert structure(about(r0, "a")) == structure(about(r1, "a"))
        assert max(b["step"] for _, b in r1 if "step" in b) == 30
    assert same >= 1


def test_producer_clock_ticks_alone_close_steps():
    """Without ticks and without flow.end, a bounded producer-clock run closes nothing."""
    config = producer_config("declared", "pure")
    messages = [m for m in producer_stream(base_events("declared")) if b"dpstream.tick" not in
                m[1]]
    assert run_core(config, messages, NoiseKey.for_tests(0)) == []


# --- bounded runs end at a public step ------------------------------------------------------

END_PLACEMENTS = {
    "last record, stamped after flow.end": (1, "a", 27.5, 29.95),
    "last record, stamped far later": (0, "a", 5000.0, 40.0),
    "first record, stamped far later": (0, "a", 5000.0, 0.0),
    "inside the run": (1, "a", 12.2, 12.2),
}


@pytest.mark.parametrize("placement", list(END_PLACEMENTS))
@pytest.mark.parametrize(("mode", "accounting"), MODES)
def test_producer_clock_with_flow_end_ends_at_flow_end(mode, accounting, placement):
    config = producer_config(mode, accounting, end="2026-09-21T14:13:45Z")  # origin + 25 s
    extra = END_PLACEMENTS[placement]
    base = base_events(mode)
    for ticks in (True, False):  # with the heartbeat's ticks, and with none at all
        until = 40.0 if ticks else 0.0
        without = producer_stream(base, until=until)
        with_extra = producer_stream(base + [extra], until=until)
        records = assert_neighbours(mode, config, without, with_extra, placement, seeds=3)
        assert max(b["step"] for _, b in records if "step" in b) == 24, placement


@pytest.mark.parametrize("placement", ["last record, stamped far later",
                                       "first record, stamped far later"])
@pytest.mark.parametrize(("mode", "accounting"), MODES)
def test_broker_clock_with_flow_end_ends_at_flow_end(mode, accounting, placement):
    """Under the broker clock the extra event arrives (broker time) long after the others."""
    config = make_config(mode, accounting, flow={"end": "2026-09-21T14:13:45Z"})
    base = base_events(mode)
    _, key, t, _ = END_PLACEMENTS[placement]
    extra = (0, key, t, 5000.0 if "last" in placement else 0.3)
    with_extra = sorted(base + [extra], key=lambda e: e[3] if len(e) > 3 else e[2])
    records = assert_neighbours(mode, config, stream(base), stream(with_extra), placement,
                                seeds=3)
    assert max(b["step"] for _, b in records if "step" in b) == 24


@pytest.mark.flow
@pytest.mark.parametrize(("mode", "accounting"), [("declared", "pure"), ("open", "zcdp")])
@pytest.mark.parametrize("placement", ["far future (an hour ahead)",
                                       "last record of the input, stamped far later",
                                       "far future, before the first tick"])
def test_the_real_dataflow_under_the_producer_clock(mode, accounting, placement):
    """Through Bytewax (1 and 2 workers): what the harness drives, and identical structure."""
    config = producer_config(mode, accounting)
    without, with_extra = producer_neighbours(mode, PRODUCER_PLACEMENTS[placement])
    noise = NoiseKey.for_tests(7)
    expected = sorted(map(repr, run_core(config, with_extra, noise, batch=5)))
    assert sorted(map(repr, run_dataflow(config, with_extra, noise, batch=5))) == expected
    assert sorted(map(repr, run_dataflow(config, with_extra, noise, workers=2,
                                         batch=3))) == expected
    r0 = run_dataflow(config, without, noise, batch=5)
    r1 = run_dataflow(config, with_extra, noise, batch=5)
    assert not_about(r0, "a") == not_about(r1, "a")
    if mode == "declared":
        assert structure(r0) == structure(r1)


@pytest.mark.flow
def test_the_real_dataflow_with_flow_end_and_an_empty_neighbour():
    """Declared keys, flow.end: an input of one event and an empty input publish the same
    steps (every shard closes through flow.end, whether or not a record reached it)."""
    config = producer_config("declared", "pure", end="2026-09-21T14:13:30Z")
    noise = NoiseKey.for_tests(8)
    empty = run_dataflow(config, [], noise)
    one = run_dataflow(config, producer_stream([(0, "a", 3.3)], until=0.0), noise)
    assert structure(empty) == structure(one) and len(empty) == 4 * 10
