"""The columnar key table against the per-key reference engine: the same outputs, bit for bit."""

import dataclasses
import pickle
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.key_statistics import KeyStatistics

from dpstream.core.accounting.ledger import PrivacyCharge
from dpstream.core.counting.blt_counter import BltCounterSpec
from dpstream.core.counting.key_table import KeyTable
from dpstream.core.counting.outputs import (
    Alert,
    AlertColumns,
    BudgetExhausted,
    Release,
    ReleaseColumns,
    StepOutputs,
)
from dpstream.core.counting.statistics_spec import StatisticsSpec
from dpstream.core.counting.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

KEY = NoiseKey.for_tests(9)


class Reference:
    """The per-key engine (KeyStatistics per key), driven exactly as ShardState.close drives it."""

    def __init__(self, spec, noise, declared=None, state=None):
        self.spec, self.noise, self.declared = spec, noise, declared
        self.keys, self.retired = {}, set()
        if state is not None:
            self.keys = {k: KeyStatistics(spec, k, 0, noise, s) for k, s in state["keys"].items()}
            self.retired = set(state["retired"])

    def idle(self):
        return not self.keys and self.declared is None

    def to_state(self):
        return {"keys": {k: s.to_state() for k, s in self.keys.items()},
                "retired": sorted(self.retired)}

    def close(self, step, bucket):
        if self.declared is not None and len(self.keys) + len(self.retired) < len(self.declared):
            for key in self.declared:
                if key not in self.keys and key not in self.retired:
                    self.keys[key] = KeyStatistics(self.spec, key, step, self.noise)
        for key in bucket:
            if key not in self.keys and key not in self.retired:
                self.keys[key] = KeyStatistics(self.spec, key, step, self.noise)
        out = []
        for key in sorted(self.keys):
            stats = self.keys[key]
            out.extend(stats.step(bucket.get(key, 0)))
            if stats.expired:
                del self.keys[key]
            elif stats.retired:
                del self.keys[key]
                self.retired.add(key)
        return out


def canonical(outputs):
    """Every field, floats by their bits (so -0.0 and 0.0 differ), sorted by (type, key, step)."""
    rows = []
    for o in outputs:
        fields = tuple(v.hex() if isinstance(v, float) else v for v in dataclasses.astuple(o))
        rows.append((type(o).__name__, o.key, o.step, fields))
    return sorted(rows)


def make_spec(mode="open", monitor=True, threshold=3, window=4, monitor_eps=1.0,
              declared_horizon=None, counter_eps=1.0, horizon=4, initial=0.5, budget=10.0,
              instance="inst"):
    if mode == "open":
        mon = ThresholdMonitorSpec(monitor_eps, threshold, window)
    else:
        mon = ThresholdMonitorSpec(monitor_eps, threshold, declared_horizon) if monitor else None
    init = None
    if mode == "open" and initial is not None:
        init = PrivacyCharge(epsilon=initial, label="initial count")
    return StatisticsSpec(flow="f", mode=mode, accounting="pure", budget=budget,
                          delta_budget=1e-6, counter=TreeCounterSpec(counter_eps, horizon),
                          monitor=mon, initial=init, admission_delta=1e-9, instance=instance)


def make_zcdp_spec(mode="open", monitor=True, threshold=3, window=4, monitor_eps=1.0,
                   declared_horizon=None, counter_rho=0.5, horizon=16, initial_rho=0.2,
                   initial_eps=None, budget=3.0, instance="inst"):
    """A zCDP spec with a BLT counter (the monitor's epsilon costs epsilon^2 / 2 rho)."""
    spec = make_spec(mode, monitor, threshold, window, monitor_eps, declared_horizon,
                     instance=instance)
    init = None
    if mode == "open" and initial_eps is not None:
        init = PrivacyCharge(epsilon=initial_eps, label="initial count")
    elif mode == "open" and initial_rho is not None:
        init = PrivacyCharge(rho=initial_rho, label="initial count")
    return dataclasses.replace(spec, accounting="zcdp", budget=budget, initial=init,
                               counter=BltCounterSpec(rho=counter_rho, horizon=horizon))


def roundtrip(state):
    return pickle.loads(pickle.dumps(state))


def declared_close(table, step, declared, bucket):
    """Close the table by declared position (``close_declared``), each count split in two
    entries of the same position when it can be (the repeats of several partitions)."""
    position = {k: i for i, k in enumerate(declared)}
    where, counts = [], []
    for key, n in bucket.items():
        halves = [n // 2, n - n // 2] if n > 1 else [n]
        where += [position[key]] * len(halves)
        counts += halves
    return table.close_declared(step, np.array(where, dtype=np.int64),
                                np.array(counts, dtype=np.int64))


def run_both(spec, stream, declared=None, restore_at=(), respec=None, check_steps=True,
             by_position=False):
    """Drive the reference and the table over ``stream`` (one dict of increments per step).

    At each step of ``restore_at`` both are snapshotted, pickled and restored, under
    ``respec`` (e.g. another budget) if given. Steps are skipped while both are idle and the
    step has no events, as the step barrier does. With ``by_position`` the table is closed by
    declared position (events of undeclared keys are dropped for both, as the clock drops
    them). Returns both output lists.
    """
    ref, table = Reference(spec, KEY, declared), KeyTable(spec, KEY, declared)
    ref_all, table_all = [], []
    for step, bucket in enumerate(stream):
        if step in restore_at:
            spec = respec or spec
            ref = Reference(spec, KEY, declared, roundtrip(ref.to_state()))
            table = KeyTable(spec, KEY, declared, roundtrip(table.to_state()))
        assert ref.idle() == table.idle()
        if by_position:
            bucket = {k: n for k, n in bucket.items() if k in declared}
        if table.idle() and not bucket:
            continue
        keys = list(bucket)
        increments = np.array([bucket[k] for k in keys], dtype=np.int64)
        expected = ref.close(step, bucket)
        if by_position:
            got = declared_close(table, step, declared, bucket)
        else:
            got = table.close(step, keys, increments)
        assert isinstance(got, StepOutputs) and got.step == step
        listed = list(got)
        assert len(got) == len(listed)
        releases, alerts, statuses = got.count()
        assert (releases, alerts, statuses) == (
            sum(isinstance(o, Release) for o in listed), sum(isinstance(o, Alert) for o in listed),
            sum(isinstance(o, BudgetExhausted) for o in listed))
        if check_steps:
            assert canonical(listed) == canonical(expected), f"step {step}"
        ref_all += expected
        table_all += listed
        assert table.live == len(ref.keys)
        assert table.retired == ref.retired
        check_invariants(table)
    return ref_all, table_all


def check_invariants(table):
    """The table's internal bookkeeping (white box): watched rows, groups, index."""
    flags = table._flags
    monitors = table._monitors
    watched = np.zeros(0, dtype=np.int64) if monitors is None else monitors.rows
    assert np.array_equal(watched, np.flatnonzero(flags & 32))
    if monitors is not None:
        assert len(monitors.lanes) == len(monitors.rho) == len(monitors.rows)
    names = table._index.names.tolist()
    assert list(table._index) == names
    assert np.array_equal(table._index.rows(names), np.arange(len(names)))
    assert len(table._prefix) == len(flags) == table.live
    grouped = np.concatenate([g.rows for g in table._groups] + [np.zeros(0, dtype=np.int64)])
    assert len(set(grouped.tolist())) == len(grouped)
    for group in table._groups:
        assert group.keys == tuple(names[i] for i in group.rows.tolist())
        assert ((flags[group.rows] & 12) == 4).all()  # counter paid, not exhausted


def random_stream(rng, steps, pool, density=0.5, high=4, undeclared=()):
    stream = []
    for _ in range(steps):
        bucket = {k: rng.randint(0, high) for k in pool if rng.random() < density}
        for k in undeclared:
            if rng.random() < 0.05:
                bucket[k] = rng.randint(1, high)
        if rng.random() < 0.15:
            bucket = {}
        stream.append(bucket)
    return stream


# --- seeded scenarios ---------------------------------------------------------------------------


@pytest.mark.parametrize("by_position", [False, True])
def test_declared_without_monitor_over_several_epochs_with_a_restore(by_position):
    rng = random.Random(1)
    pool = [f"k{i:02d}" for i in range(25)]
    spec = make_spec("declared", monitor=False, horizon=2)
    ref, got = run_both(spec, random_stream(rng, 40, pool), declared=pool, restore_at=(13, 29),
                        by_position=by_position)
    assert canonical(ref) == canonical(got)
    assert len(got) == 25 * 40  # every declared key releases at every step


@pytest.mark.parametrize("by_position", [False, True])
def test_declared_with_a_monitor_alerts_and_its_horizon(by_position):
    rng = random.Random(2)
    pool = [f"k{i}" for i in range(20)]
    for horizon in (None, 6):
        spec = make_spec("declared", monitor=True, threshold=4, declared_horizon=horizon,
                         horizon=8)
        ref, got = run_both(spec, random_stream(rng, 20, pool), declared=pool, restore_at=(5,),
                            by_position=by_position)
        assert canonical(ref) == canonical(got)
        assert any(isinstance(o, Alert) for o in got)


def test_open_universe_admission_expiry_and_epochs():
    rng = random.Random(3)
    pool = [f"key-{i}" for i in range(40)]
    spec = make_spec("open", threshold=4, window=3, horizon=2)
    ref, got = run_both(spec, random_stream(rng, 45, pool, density=0.3), restore_at=(7, 20))
    assert canonical(ref) == canonical(got)
    kinds = {type(o) for o in got}
    assert {Alert, Release} <= kinds
    # horizon 2: counter epochs end after 2, 6, 14, 30 steps; some counters pass several
    assert any(isinstance(o, Release) and o.step > 30 for o in got)


def test_open_universe_without_an_initial_count():
    rng = random.Random(4)
    pool = [f"k{i}" for i in range(15)]
    spec = make_spec("open", threshold=2, window=5, initial=None)
    ref, got = run_both(spec, random_stream(rng, 25, pool), restore_at=(11,))
    assert canonical(ref) == canonical(got)


def test_idle_open_shard_skips_empty_steps():
    spec = make_spec("open", threshold=1000, window=2)
    stream = [{}, {}, {"a": 1}, {}, {}, {}, {"b": 2}, {}]
    ref, got = run_both(spec, stream)
    assert ref == got == []  # never admitted: nothing published about a key


@pytest.mark.parametrize("budget", [1.0, 0.6, 0.4, 0.2])
def test_charges_refused_at_admission_or_start(budget):
    """Monitor 1.0 / initial 0.5 / counter 1.0 under small budgets: refusals and statuses."""
    assert_same_in_both_universes(
        random.Random(5), 12, 16, lambda mode: make_spec(
            mode, threshold=2, window=4, monitor_eps=0.2, initial=0.3, counter_eps=0.3,
            budget=budget))


def assert_same_in_both_universes(rng, keys, steps, spec_of):
    """The table and the reference engine agree on one random stream per key universe."""
    pool = [f"k{i}" for i in range(keys)]
    for mode in ("open", "declared"):
        ref, got = run_both(spec_of(mode), random_stream(rng, steps, pool),
                            declared=pool if mode == "declared" else None)
        assert canonical(ref) == canonical(got)


def test_budget_lowered_on_restore_exhausts_and_retires_admitted_keys():
    rng = random.Random(6)
    pool = [f"k{i}" for i in range(30)]
    spec = make_spec("open", threshold=3, window=4, monitor_eps=0.3, initial=0.2,
                     counter_eps=0.5, budget=2.0)
    for lowered in (0.9, 0.4, 0.25):  # below: admitted; initial + counter; the monitor
        respec = dataclasses.replace(spec, budget=lowered)
        stream = random_stream(rng, 30, pool)
        ref, got = run_both(spec, stream, restore_at=(12,), respec=respec)
        assert canonical(ref) == canonical(got)
        if lowered == 0.9:
            statuses = [o for o in got if isinstance(o, BudgetExhausted)]
            assert statuses and {s.label for s in statuses} == {"budget change"}
            assert all(s.step == 12 for s in statuses)


@pytest.mark.parametrize("by_position", [False, True])
def test_declared_budget_lowered_then_retired_keys_never_restart(by_position):
    pool = [f"d{i}" for i in range(6)]
    ones = dict.fromkeys(pool, 1)

    def close(t, step):
        if by_position:
            return declared_close(t, step, pool, ones)
        return t.close(step, pool, np.ones(6, dtype=np.int64))

    spec = make_spec("declared", monitor=False, counter_eps=1.0, budget=2.0)
    table = KeyTable(spec, KEY, pool)
    close(table, 0)
    state = roundtrip(table.to_state())
    lowered = dataclasses.replace(spec, budget=0.5)
    table = KeyTable(lowered, KEY, pool, state)
    again = KeyTable(lowered, KEY, pool, roundtrip(table.to_state()))  # pending kept
    for t in (table, again):
        out = close(t, 1)
        assert out.count() == (0, 0, 6)
        assert [s.key for s in out.statuses] == pool
        assert t.retired == set(pool) and t.live == 0 and not t.idle()
        assert len(close(t, 2)) == 0  # never restarted


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_same_outputs_as_the_reference(data):
    mode = data.draw(st.sampled_from(["open", "declared"]))
    monitor = data.draw(st.booleans())
    spec = make_spec(
        mode, monitor=monitor,
        threshold=data.draw(st.integers(1, 5)),
        window=data.draw(st.integers(1, 5)),
        monitor_eps=data.draw(st.sampled_from([0.25, 1.0, 3.0])),
        declared_horizon=data.draw(st.sampled_from([None, 3, 7])),
        counter_eps=data.draw(st.sampled_from([0.5, 1.0, 2.5])),
        horizon=data.draw(st.sampled_from([2, 4, 8])),
        initial=data.draw(st.sampled_from([None, 0.5, 1.0])),
        budget=data.draw(st.sampled_from([0.4, 1.0, 3.0, 10.0])),
    )
    assert_same_on_a_drawn_stream(data, spec, mode, keys=8, steps=22, counts=st.integers(0, 6))


def assert_same_on_a_drawn_stream(data, spec, mode, keys, steps, counts):
    """The table and the reference agree on a drawn stream, with drawn restores and budget.

    In the declared universe the table is closed by name or by position (drawn).
    """
    names = [f"k{i}" for i in range(data.draw(st.integers(1, keys)))]
    steps = data.draw(st.integers(1, steps))
    stream = data.draw(st.lists(
        st.dictionaries(st.sampled_from(names + ["x", "y"]), counts, max_size=6),
        min_size=steps, max_size=steps))
    declared = names if mode == "declared" else None
    by_position = mode == "declared" and data.draw(st.booleans())
    restore_at = data.draw(st.lists(st.integers(0, steps), max_size=2))
    respec = dataclasses.replace(spec, budget=data.draw(st.sampled_from([0.3, 1.0, 3.0, 10.0])))
    ref, got = run_both(spec, stream, declared=declared, restore_at=set(restore_at),
                        by_position=by_position, respec=respec)
    assert canonical(ref) == canonical(got)


def test_the_reference_driver_is_the_shard_engine():
    """The test's Reference drives KeyStatistics as the shard's per-key engine does."""
    from support.reference_shard import ReferenceShardState as Engine
    rng = random.Random(7)
    pool = [f"k{i}" for i in range(10)]
    for mode in ("open", "declared"):
        spec = make_spec(mode, threshold=2, window=3, horizon=4)
        declared = pool if mode == "declared" else None
        engine = Engine(spec, 1, None if declared is None else {0: declared}, KEY)
        engine.bind(0)
        ref = Reference(spec, KEY, declared)
        for step, bucket in enumerate(random_stream(rng, 15, pool)):
            if ref.idle() and not bucket:
                continue
            assert canonical(engine.close(step, dict(bucket))) == canonical(
                ref.close(step, bucket))


def test_many_keys_and_epochs_in_bulk():
    rng = random.Random(8)
    pool = [f"user-{i:04d}" for i in range(400)]
    spec = make_spec("open", threshold=3, window=5, horizon=2, monitor_eps=0.5)
    ref, got = run_both(spec, random_stream(rng, 36, pool, density=0.4), restore_at=(17,),
                        check_steps=False)
    assert canonical(ref) == canonical(got)
    assert sum(isinstance(o, Release) for o in got) > 1000


# --- the table's own contract -------------------------------------------------------------------


def test_rows_are_sorted_new_keys_appended_and_compacted_in_order():
    spec = make_spec("open", threshold=1000, window=2)
    table = KeyTable(spec, KEY)
    table.close(0, ["c", "a"], np.array([1, 1]))
    table.close(1, ["b"], np.array([1]))  # window end: all three forgotten
    assert table.live == 0 and table.idle()
    table.close(2, ["z", "b", "m"], np.array([1, 2, 3]))
    state = table.to_state()
    assert state["keys"] == ["b", "m", "z"]
    assert state["prefix"].tolist() == [2, 3, 1]
    assert "m" in table.keys and "a" not in table.keys and len(table.keys) == table.live == 3


def test_the_state_is_plain_data_without_lanes_or_noise():
    rng = random.Random(10)
    pool = [f"k{i}" for i in range(20)]
    spec = make_spec("open", threshold=2, window=6)
    table = KeyTable(spec, KEY)
    for step, bucket in enumerate(random_stream(rng, 4, pool, density=0.9)):
        table.close(step, list(bucket), np.array(list(bucket.values()), dtype=np.int64))
    state = table.to_state()
    assert state["groups"] and state["keys"]
    blob = pickle.dumps(state)
    for k in state["keys"]:
        for lane in (KEY.lane(spec.instance, k, "monitor", spec.monitor_digest, 0),
                     KEY.lane(spec.instance, k, "counter", spec.counter_digest, 0),
                     KEY.lane(spec.instance, k, "counter", spec.counter_digest, 1)):
            assert lane not in blob
            assert lane[:8] not in blob

    def plain(value):
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (int, float, str, np.ndarray))

    assert plain(state)


def test_step_outputs_is_a_sequence_statuses_alerts_then_releases():
    release = ReleaseColumns(3, ["a", "b"], np.array([1.5, -2.0]), 0.5, "tree-laplace",
                             1.0, 2.0, "epsilon", 1e-9)
    alert = Alert("c", 3, 5, 1.0)
    status = BudgetExhausted("d", 3, "x", "y", 1.0, 1.0, "epsilon")
    out = StepOutputs(3, [status], [alert], [release, ReleaseColumns(
        3, ["e"], np.array([7.0]), 1.0, "tree-laplace", 1.0, 2.0, "epsilon", 0.0, False)])
    assert len(out) == 5 and out.count() == (3, 1, 1)
    items = list(out)
    assert items[0] is status and items[1] is alert
    assert items[2] == Release("a", 3, 1.5, 0.5, "tree-laplace", 1.0, 2.0, "epsilon", 1e-9)
    assert [out[i] for i in range(5)] == items and out[-1] == items[-1] and out[1:3] == items[1:3]
    assert out[4].key == "e" and out[4].value == 7.0
    with pytest.raises(IndexError):
        out[5]
    assert StepOutputs(0).count() == (0, 0, 0) and list(StepOutputs(0)) == []


def test_alert_columns_make_their_alerts_when_read():
    columns = AlertColumns(4, ["a", "b", "c"], 9, 0.5)
    alerts = [Alert(k, 4, 9, 0.5) for k in "abc"]
    assert len(columns) == 3 and list(columns) == alerts
    assert columns[1] == alerts[1] and columns[-1] == alerts[-1] and columns[1:] == alerts[1:]
    out = StepOutputs(4, [], columns, [])
    assert out.count() == (0, 3, 0) and list(out) == alerts and out[2] == alerts[2]
    with pytest.raises(IndexError):
        columns[3]


def test_supports_pure_tree_and_zcdp_blt_specs_only():
    spec = make_spec("declared", monitor=False)
    assert KeyTable.supports(spec) and KeyTable.supports(make_spec("open"))
    zcdp = dataclasses.replace(spec, accounting="zcdp")
    blt = dataclasses.replace(spec, counter=BltCounterSpec(rho=0.5, horizon=2**10))
    assert not KeyTable.supports(zcdp) and not KeyTable.supports(blt)
    with pytest.raises(InvalidParameterError):
        KeyTable(blt, KEY)
    assert KeyTable.supports(make_zcdp_spec("declared", monitor=False))
    assert KeyTable.supports(make_zcdp_spec("open"))
    assert KeyTable.supports(make_zcdp_spec("open", initial_eps=0.5))
    assert KeyTable.supports(make_zcdp_spec("open", initial_rho=None))
    blt_tree_state = KeyTable(make_zcdp_spec("declared", monitor=False), KEY, ["a"])
    blt_tree_state.close(0, ["a"], np.array([3]))
    state = blt_tree_state.to_state()
    assert state["groups"][0]["kind"] == "blt"


# --- zCDP with BLT counters ---------------------------------------------------------------------


@pytest.mark.parametrize("by_position", [False, True])
def test_zcdp_declared_blt_over_several_epochs_with_restores(by_position):
    rng = random.Random(21)
    pool = [f"k{i:02d}" for i in range(12)]
    spec = make_zcdp_spec("declared", monitor=False, horizon=16)
    stream = random_stream(rng, 40, pool)
    stream[5] = {k: (1 << 62) + i for i, k in enumerate(pool)}  # huge increments: wide buffers
    ref, got = run_both(spec, stream, declared=pool, restore_at=(13, 17, 29),
                        by_position=by_position)
    assert canonical(ref) == canonical(got)
    assert len(got) == 12 * 40
    assert {o.mechanism for o in got} == {"blt-gaussian"} and {o.unit for o in got} == {"rho"}


def test_zcdp_declared_blt_with_a_monitor_and_its_horizon():
    rng = random.Random(22)
    pool = [f"k{i}" for i in range(10)]
    for horizon in (None, 6):
        spec = make_zcdp_spec("declared", monitor=True, threshold=4, declared_horizon=horizon)
        ref, got = run_both(spec, random_stream(rng, 20, pool), declared=pool, restore_at=(5,))
        assert canonical(ref) == canonical(got)
        assert any(isinstance(o, Alert) for o in got)


@pytest.mark.parametrize("initial", [("rho", 0.2), ("eps", 0.5), None])
def test_zcdp_open_universe_admission_initial_counts_and_epochs(initial):
    rng = random.Random(23)
    pool = [f"key-{i}" for i in range(25)]
    kwargs = {"initial_rho": None}
    if initial is not None:
        kwargs["initial_rho" if initial[0] == "rho" else "initial_eps"] = initial[1]
    spec = make_zcdp_spec("open", threshold=3, window=3, **kwargs)
    ref, got = run_both(spec, random_stream(rng, 40, pool, density=0.3), restore_at=(7, 20))
    assert canonical(ref) == canonical(got)
    assert {Alert, Release} <= {type(o) for o in got}
    assert any(isinstance(o, Release) and o.step > 20 for o in got)  # past a 16-step epoch


@pytest.mark.parametrize("budget", [0.3, 0.6, 0.75, 1.0])
def test_zcdp_charges_refused_at_admission_or_start(budget):
    """Monitor eps 0.8 (rho 0.32) / initial rho 0.3 / counter rho 0.4 under small budgets."""
    assert_same_in_both_universes(
        random.Random(24), 8, 12, lambda mode: make_zcdp_spec(
            mode, threshold=2, window=4, monitor_eps=0.8, initial_rho=0.3, counter_rho=0.4,
            budget=budget))


def test_zcdp_budget_lowered_on_restore_exhausts_and_retires_admitted_keys():
    rng = random.Random(25)
    pool = [f"k{i}" for i in range(15)]
    spec = make_zcdp_spec("open", threshold=3, window=4, monitor_eps=0.6, initial_rho=0.2,
                          counter_rho=0.5, budget=2.0)
    for lowered in (0.8, 0.5, 0.15):  # below: admitted; initial + counter; the monitor
        respec = dataclasses.replace(spec, budget=lowered)
        ref, got = run_both(spec, random_stream(rng, 24, pool), restore_at=(12,),
                            respec=respec)
        assert canonical(ref) == canonical(got)
        if lowered == 0.8:
            statuses = [o for o in got if isinstance(o, BudgetExhausted)]
            assert statuses and {s.label for s in statuses} == {"budget change"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_zcdp_blt_same_outputs_as_the_reference(data):
    mode = data.draw(st.sampled_from(["open", "declared"]))
    initial = data.draw(st.sampled_from([None, ("rho", 0.2), ("rho", 1.0), ("eps", 0.5)]))
    kwargs = {"initial_rho": None}
    if initial is not None:
        kwargs["initial_rho" if initial[0] == "rho" else "initial_eps"] = initial[1]
    spec = make_zcdp_spec(
        mode, monitor=data.draw(st.booleans()),
        threshold=data.draw(st.integers(1, 5)),
        window=data.draw(st.integers(1, 5)),
        monitor_eps=data.draw(st.sampled_from([0.25, 1.0, 2.0])),
        declared_horizon=data.draw(st.sampled_from([None, 3, 7])),
        counter_rho=data.draw(st.sampled_from([0.05, 0.5, 2.0])),
        horizon=data.draw(st.sampled_from([16, 32])),
        budget=data.draw(st.sampled_from([0.3, 1.0, 3.0, 10.0])),
        **kwargs,
    )
    # large increments widen the BLT buffers (x G up to 2^95); the prefix stays in int64
    counts = st.one_of(st.integers(0, 6), st.integers(0, 1 << 55))
    assert_same_on_a_drawn_stream(data, spec, mode, keys=6, steps=36, counts=counts)


def test_a_state_of_other_mechanisms_or_kind_is_refused():
    spec = make_spec("declared", monitor=False)
    table = KeyTable(spec, KEY, ["a"])
    table.close(0, [], np.zeros(0, dtype=np.int64))
    state = table.to_state()
    other = dataclasses.replace(spec, counter=TreeCounterSpec(0.7, 4))
    with pytest.raises(InvalidParameterError, match="other mechanism parameters"):
        KeyTable(other, KEY, ["a"], state)
    with pytest.raises(InvalidParameterError, match="not a key table state"):
        KeyTable(spec, KEY, ["a"], {**state, "version": 99})


def test_bad_increments_and_out_of_order_steps_are_refused():
    table = KeyTable(make_spec("declared", monitor=False), KEY, ["a", "b"])
    with pytest.raises(InvalidParameterError, match="negative"):
        table.close(0, ["a"], np.array([-1]))
    with pytest.raises(InvalidParameterError, match="integers"):
        table.close(0, ["a"], np.array([1.5]))
    with pytest.raises(InvalidParameterError, match="one count per key"):
        table.close(0, ["a", "b"], np.array([1]))
    table.close(0, ["a"], np.array([2]))
    with pytest.raises(InvalidParameterError, match="live keys are at step 1"):
        table.close(5, ["a"], np.array([1]))
