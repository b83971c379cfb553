"""Per-key statistics: admission, charging, status records, snapshots."""

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpstream.core.key_statistics import (
    Alert,
    BudgetExhausted,
    KeyStatistics,
    Release,
    StatisticsSpec,
)
from dpstream.core.ledger import PrivacyCharge
from dpstream.core.noise import NoiseKey
from dpstream.core.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.tree_counter import TreeCounterSpec

KEY = NoiseKey.for_tests(11)


def spec(mode="open", budget=1.0, counter_eps=0.5, threshold=20):
    return StatisticsSpec(
        flow="t", mode=mode, accounting="pure", budget=budget, delta_budget=1e-6,
        counter=TreeCounterSpec(counter_eps, 64),
        monitor=ThresholdMonitorSpec(0.3, threshold, 1000),
        initial=PrivacyCharge(epsilon=0.2, label="initial count") if mode == "open" else None,
        admission_delta=1e-7)


def run(stats, increments):
    return [out for inc in increments for out in stats.step(inc)]


def test_open_key_publishes_nothing_before_its_monitor_fires():
    stats = KeyStatistics(spec(threshold=10_000), "k", 5, KEY)
    assert run(stats, [1] * 50) == []
    assert stats.ledger.spent == pytest.approx(0.3)  # only the monitor was paid for


def test_admission_alert_initial_count_then_counter():
    stats = KeyStatistics(spec(), "k", 0, KEY)
    outs = run(stats, [100] * 10)
    alert = outs[0]
    assert isinstance(alert, Alert) and alert.step == 0 and alert.threshold == 20
    releases = [o for o in outs if isinstance(o, Release)]
    assert [r.step for r in releases] == list(range(10))
    assert releases[0].std == pytest.approx(2**0.5 / 0.2, rel=0.01)  # the initial count alone
    assert all(r.std > releases[0].std for r in releases[1:])  # + the counter's noise
    for r in releases:
        assert abs(r.value - 100 * (r.step + 1)) < 8 * r.std
        assert r.spent == pytest.approx(1.0) and r.budget == 1.0 and r.delta == pytest.approx(1e-7)
    assert stats.ledger.spent <= stats.ledger.budget


def test_declared_key_releases_from_its_first_step_without_a_monitor_gate():
    stats = KeyStatistics(spec(mode="declared"), "k", 0, KEY)
    outs = run(stats, [0, 0, 3])
    assert [o.step for o in outs if isinstance(o, Release)] == [0, 1, 2]


def test_a_budget_too_small_for_the_counter_is_announced():
    stats = KeyStatistics(spec(budget=0.6), "k", 0, KEY)  # 0.3 + 0.2 fit, the counter does not
    outs = run(stats, [100] * 3)
    assert isinstance(outs[0], Alert)
    status = [o for o in outs if isinstance(o, BudgetExhausted)]
    assert len(status) == 1 and status[0].label == "tree counter"
    assert not [o for o in outs if isinstance(o, Release)]
    assert stats.ledger.spent == pytest.approx(0.5) and stats.dormant


def test_snapshot_holds_no_noise_key_and_pickles():
    stats = KeyStatistics(spec(), "k", 0, KEY)
    run(stats, [50] * 3)
    state = pickle.dumps(stats.to_state())
    assert KEY._key not in state


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=2, max_size=40), st.data(),
       st.sampled_from(["open", "declared"]))
def test_restore_continues_identically(increments, data, mode):
    cut = data.draw(st.integers(1, len(increments) - 1))
    whole = KeyStatistics(spec(mode), "k", 3, KEY)
    expected = run(whole, increments)
    first = KeyStatistics(spec(mode), "k", 3, KEY)
    head = run(first, increments[:cut])
    state = pickle.loads(pickle.dumps(first.to_state()))
    resumed = KeyStatistics(spec(mode), "k", 0, KEY, state)
    assert head + run(resumed, increments[cut:]) == expected


def test_expired_monitor_key_is_retired_and_never_restarts():
    import json as _json

    from dpstream.config import parse_config
    from dpstream.pipeline import event_rules, statistics_spec
    from dpstream.stream.events import PartitionClock
    from dpstream.stream.shard import ShardState

    cfg = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1},
                        "monitor": {"horizon": 3, "threshold": 10_000}, "privacy": {"delta": 0.5},
                        "metrics": {"port": 0}})
    clock = PartitionClock(event_rules(cfg))
    shard = ShardState(statistics_spec(cfg), 1, None, KEY)
    origin = 1_790_000_000
    for t in range(8):
        msg = (0, _json.dumps({"key": "rare", "ts": origin + t}).encode(), t, "e")
        updates, _ = clock.process(0, [msg])
        assert shard.update(updates[0]) == []
    assert "rare" in shard.retired and "rare" not in shard.keys
    restored = ShardState(statistics_spec(cfg), 1, None, KEY, shard.to_state())
    assert restored.retired == {"rare"}


def test_restart_after_a_config_change_draws_noise_at_new_coordinates():
    """A counter restarted at its own admission step must not reuse the first one's noise."""
    from support.recording import RecordingKey

    recorder = RecordingKey(3)
    stats = KeyStatistics(spec(), "k", 0, recorder)
    run(stats, [100])  # admitted at step 0: initial count and counter at step 0
    state = pickle.loads(pickle.dumps(stats.to_state()))
    first = set(recorder.calls)
    recorder.calls.clear()
    changed = spec(budget=5.0, counter_eps=0.9)
    resumed = KeyStatistics(changed, "k", 0, recorder, state)
    run(resumed, [100])
    assert resumed.generation == 1
    assert not first & set(recorder.calls)  # no coordinate is drawn from twice
    unchanged = KeyStatistics(spec(), "k", 0, NoiseKey.for_tests(3), state)
    assert unchanged.generation == 0


def test_exhausted_declared_keys_are_not_recreated():
    """Declared keys retired by a lowered budget never come back with a fresh ledger."""
    from dpstream.config import parse_config
    from dpstream.pipeline import statistics_spec
    from dpstream.stream.events import ShardUpdate
    from dpstream.stream.shard import ShardState

    def cfg(budget, eps):
        return parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s",
                                      "shards": 1},
                             "privacy": {"budget": budget}, "counter": {"epsilon": eps},
                             "admission": {"mode": "declared", "keys": ["a"]},
                             "metrics": {"port": 0}})

    shard = ShardState(statistics_spec(cfg(1.0, 0.7)), 1, {0: ["a"]}, KEY)
    assert len(shard.update(ShardUpdate(0, 0, 2, 2, {0: {"a": 1}}))) == 2
    lowered = ShardState(statistics_spec(cfg(0.5, 0.5)), 1, {0: ["a"]}, KEY, shard.to_state())
    out = lowered.update(ShardUpdate(0, 0, 6, 6, {}))
    assert [type(o).__name__ for o in out] == ["BudgetExhausted"]
    assert lowered.retired == {"a"} and not lowered.keys
