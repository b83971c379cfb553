"""Per-key statistics: admission, charging, status records, snapshots."""

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.key_statistics import KeyStatistics

from dpstream.core.accounting.ledger import PrivacyCharge
from dpstream.core.counting.outputs import Alert, BudgetExhausted, Release
from dpstream.core.counting.statistics_spec import StatisticsSpec
from dpstream.core.counting.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.noise.keys import NoiseKey

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
    assert stats.ledger.spent == pytest.approx(0.5) and stats.retired


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


def test_an_unadmitted_key_is_forgotten_at_its_window_end_and_watched_again_later():
    """Monitor windows are global and fixed: [0, 3), [3, 6), ...; nothing is retired."""
    from support.messages import message
    from support.recording import RecordingKey

    from dpstream.kinds.counters.events import PartitionClock
    from dpstream.kinds.counters.kind import event_rules, statistics_spec
    from dpstream.kinds.counters.shard import ShardState
    from dpstream.platform import parse_config

    cfg = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 1},
                        "monitor": {"horizon": 3, "threshold": 10_000}, "privacy": {"delta": 0.5},
                        "metrics": {"port": 0}})
    clock = PartitionClock(event_rules(cfg))
    recorder = RecordingKey(3)
    shard = ShardState(statistics_spec(cfg, "i"), 1, None, recorder)
    origin = 1_790_000_000
    present = []
    for t in range(8):
        updates, _ = clock.process(0, [message(0, "rare", origin + t + 0.5, t)])
        assert shard.update(updates[0]) == []
        present.append("rare" in shard.keys)
    # after record t, steps < t are closed; the key lives from its first event to its
    # window's end (closing step 2 forgets it, closing step 3 watches it again, ...)
    assert present == [False, True, True, False, True, True, False, True]
    assert not shard.retired
    thresholds = [c for c in recorder.calls if c[-1] == "threshold"]
    assert [c[4] for c in thresholds] == [0, 1, 2]  # one monitor per window, window-keyed
    queries = sorted({c[-1] for c in recorder.calls if "query" in c})
    assert queries == [0, 1, 2]  # query noise at the step's index in its window


def test_resuming_with_other_mechanisms_is_refused():
    """Issue 5, item 8: a changed mechanism under a running instance could reuse a generation
    after a crash; dpstream refuses the change instead of restarting mechanisms."""
    from dpstream.errors import InvalidParameterError

    stats = KeyStatistics(spec(), "k", 0, KEY)
    run(stats, [100])
    state = pickle.loads(pickle.dumps(stats.to_state()))
    with pytest.raises(InvalidParameterError, match="other mechanism parameters"):
        KeyStatistics(spec(budget=5.0, counter_eps=0.9), "k", 0, KEY, state)
    resumed = KeyStatistics(spec(budget=5.0), "k", 0, KEY, state)  # a budget change is fine
    assert [type(o).__name__ for o in run(resumed, [1])] == ["Release"]


def test_budget_exhaustion_on_resume_is_announced_only_for_admitted_keys():
    from dpstream.core.accounting.ledger import PrivacyLedger

    admitted = KeyStatistics(spec(), "a", 0, KEY)
    run(admitted, [100])
    waiting = KeyStatistics(spec(threshold=10_000), "w", 0, KEY)
    run(waiting, [1])
    for stats in (admitted, waiting):  # as if a budget far below the spend were in force
        state = stats.to_state()
        state["ledger"] = PrivacyLedger("pure", 10.0, 1e-6).to_state() | {
            "spent": "50", "budget": "10"}
        resumed = KeyStatistics(spec(threshold=stats.spec.monitor.threshold), stats.key, 0,
                                KEY, state)
        outs = run(resumed, [5])
        if stats is admitted:
            assert [type(o).__name__ for o in outs] == ["BudgetExhausted"]
        else:
            assert outs == []  # never name a key before its admission
        assert resumed.exhausted
