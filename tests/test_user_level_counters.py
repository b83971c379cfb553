"""The counters' user-level accounting: scaled mechanisms, people counts, per-person totals.

At ``unit = "user"`` (caps ``L0 = max_keys``, ``Linf = max_per_key``) every configured charge
covers one person's bounded contribution to one key: the counters and the initial count are
calibrated to sensitivity ``Linf``, the monitors count distinct people, and a person's total is
``L0`` keys' worth plus the hash-collision delta. Exact-fraction checks of those maps, the
scaled noise sampled (statistical), the people count reaching the monitors, the records'
fields and the configuration's refusals. The event level's bytes are pinned by
tests/test_golden.py.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from datetime import UTC, datetime
from fractions import Fraction

import numpy as np
import orjson
import pytest

from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, exact
from dpstream.core.contribution.people import PEOPLE_BOUND, collision_delta
from dpstream.core.counting.blt_counter import _RHO_RESERVE, BltCounter, BltCounterSpec
from dpstream.core.counting.blt_counter import analytic_std as blt_std
from dpstream.core.counting.blt_parameters import _parameters
from dpstream.core.counting.key_table import KeyTable
from dpstream.core.counting.outputs import ReleaseColumns
from dpstream.core.counting.statistics_spec import StatisticsSpec, person_privacy
from dpstream.core.counting.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.counting.tree_counter import TreeCounter, TreeCounterSpec
from dpstream.core.counting.tree_counter import analytic_std as tree_std
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_gaussian_variance, discrete_laplace_variance
from dpstream.errors import ConfigError, InvalidParameterError
from dpstream.kinds.counters.events import EventRules, PartitionClock
from dpstream.kinds.counters.kind import parse_config, statistics_spec
from dpstream.kinds.counters.layout import DeclaredLayout, PeopleCounts, RowCounts
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.kinds.counters.shard import ShardState

KEY = NoiseKey.for_tests(24)
ORIGIN = datetime(2026, 11, 20, tzinfo=UTC)


def user_raw(accounting: str = "pure", max_keys: int = 4, max_per_key: int = 3,
             period: str = "lifetime", **tables: dict) -> dict:
    """An open-universe counters configuration at the user level."""
    raw: dict = {"flow": {"origin": "2026-11-20T00:00:00Z", "step": "1s"},
                 "privacy": {"accounting": accounting, "budget": 1.0, "delta": 1e-6},
                 "contribution": {"unit": "user", "user_field": "user", "period": period,
                                  "max_keys": max_keys, "max_per_key": max_per_key}}
    for name, values in tables.items():
        raw.setdefault(name, {}).update(values)
    return raw


def spent_of(charges: list[PrivacyCharge], accounting: str) -> Fraction:
    ledger = PrivacyLedger(accounting, 10**6)
    for charge in charges:
        ledger.charge(charge)
    return Fraction(ledger.to_state()["spent"])


# --- the scaled mechanisms: exact maps ------------------------------------------------------


@pytest.mark.parametrize("linf", [1, 2, 7])
@pytest.mark.parametrize("epsilon", [0.1, 0.9])
def test_tree_counter_with_sensitivity_linf_costs_epsilon_for_linf_events(linf: int,
                                                                          epsilon: float) -> None:
    spec = TreeCounterSpec(epsilon=epsilon, horizon=16, sensitivity=linf)
    eps = exact(epsilon)
    assert spec.charge.epsilon == epsilon  # the charge is the configured one
    for epoch in range(4):
        # Linf events move at most Linf (m_j + 1) of epoch j's node vector in L1
        l1 = Fraction(linf * spec.levels(epoch))
        assert l1 / spec.noise_scale(epoch) == eps
        # and the unscaled counter's scale is exactly Linf times smaller
        plain = TreeCounterSpec(epsilon=epsilon, horizon=16)
        assert spec.noise_scale(epoch) == linf * plain.noise_scale(epoch)


@pytest.mark.parametrize("linf", [2, 5])
@pytest.mark.parametrize(("rho", "horizon"), [(0.05, 2**10), (0.5, 2**16)])
def test_blt_counter_with_sensitivity_linf_costs_rho_for_linf_events(linf: int, rho: float,
                                                                     horizon: int) -> None:
    spec = BltCounterSpec(rho=rho, horizon=horizon, sensitivity=linf)
    assert spec.charge.rho == rho
    delta2 = _parameters(horizon).delta2 * linf * linf  # (Linf Delta_G)^2, triangle inequality
    sigma2 = spec.sigma2_grid
    assert sigma2.denominator == 1
    assert delta2 / (2 * sigma2) <= exact(rho) * (1 - _RHO_RESERVE)
    assert delta2 / (2 * (sigma2 - 1)) > exact(rho) * (1 - _RHO_RESERVE)  # the smallest sigma
    plain = BltCounterSpec(rho=rho, horizon=horizon)
    assert spec.noise_std == pytest.approx(linf * plain.noise_std, rel=1e-9)
    assert spec.l2_sensitivity == pytest.approx(linf * plain.l2_sensitivity, rel=1e-12)


def test_sensitivity_one_is_the_event_level_bit_for_bit() -> None:
    tree, tree1 = TreeCounterSpec(0.7, 64), TreeCounterSpec(0.7, 64, sensitivity=1)
    assert tree == tree1 and tree.noise_scale(3) == tree1.noise_scale(3)
    blt, blt1 = BltCounterSpec(0.3, 2**10), BltCounterSpec(0.3, 2**10, sensitivity=1)
    assert blt == blt1 and blt.sigma2_grid == blt1.sigma2_grid
    # the snapshots of the event level do not change shape
    assert "sensitivity" not in TreeCounter(tree, KEY, ("c",)).to_state()
    assert "sensitivity" not in BltCounter(blt, KEY, ("c",)).to_state()


def test_a_counter_snapshot_of_another_sensitivity_is_refused() -> None:
    tree = TreeCounter(TreeCounterSpec(0.7, 64, sensitivity=3), KEY, ("c",))
    tree.step(2)
    with pytest.raises(InvalidParameterError, match="sensitivity"):
        TreeCounter(TreeCounterSpec(0.7, 64), KEY, ("c",), tree.to_state())
    TreeCounter(TreeCounterSpec(0.7, 64, sensitivity=3), KEY, ("c",), tree.to_state())
    blt = BltCounter(BltCounterSpec(0.3, 2**10, sensitivity=3), KEY, ("c",))
    blt.step(1)
    with pytest.raises(InvalidParameterError, match="sensitivity"):
        BltCounter(BltCounterSpec(0.3, 2**10), KEY, ("c",), blt.to_state())
    with pytest.raises(InvalidParameterError, match="sensitivity"):
        TreeCounterSpec(0.7, 64, sensitivity=0)
    with pytest.raises(InvalidParameterError, match="sensitivity"):
        BltCounterSpec(0.3, 2**10, sensitivity=True)  # type: ignore[arg-type]


# --- the scaled noise, sampled --------------------------------------------------------------


def _declared_spec(counter: TreeCounterSpec | BltCounterSpec, accounting: str, linf: int
                   ) -> StatisticsSpec:
    return StatisticsSpec(flow="f", mode="declared", accounting=accounting,  # type: ignore[arg-type]
                          budget=10.0, delta_budget=1e-6, counter=counter, monitor=None,
                          instance="inst",
                          contribution=(("period_steps", 0), ("max_keys", 2),
                                        ("max_per_key", linf)))


@pytest.mark.statistical
@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
def test_the_columnar_engine_draws_noise_of_the_scaled_std(accounting: str) -> None:
    """The production engine's releases have the derived std at Linf = 4, not the event level's.

    4000 declared keys with no events: at step 5 each release is pure noise, the keys' noise
    independent (one lane each). The sample std ``s`` of n = 4000 draws has relative standard
    error ``sqrt((kappa - 1) / (4 n))`` (kappa the kurtosis): at most ``sqrt(5 / 16000) =
    0.018`` (a Laplace node, kappa = 6; a sum of nodes or a Gaussian has less). The tolerance
    is 6 of those, 0.11: a false failure has probability below 1e-8. Power: the unscaled
    counter's std is 4 times smaller, so |s / std_unscaled - 1| is about 3, far outside it.
    """
    linf, n, step = 4, 4000, 5
    counter: TreeCounterSpec | BltCounterSpec
    if accounting == "pure":
        counter = TreeCounterSpec(epsilon=0.8, horizon=64, sensitivity=linf)
        derived = tree_std(counter, step)
        unscaled = tree_std(TreeCounterSpec(epsilon=0.8, horizon=64), step)
    else:
        counter = BltCounterSpec(rho=0.4, horizon=2**10, sensitivity=linf)
        derived = blt_std(counter, step)
        unscaled = blt_std(BltCounterSpec(rho=0.4, horizon=2**10), step)
    keys = [f"k{i:05d}" for i in range(n)]
    table = KeyTable(_declared_spec(counter, accounting, linf), KEY, keys)
    for s in range(step + 1):
        out = table.close(s, [], np.zeros(0, dtype=np.int64))
    (column,) = out.releases
    assert column.std == pytest.approx(derived, rel=1e-12)  # what releases report
    sample = float(np.std(np.asarray(column.values), ddof=1))
    tolerance = 6 * math.sqrt(5 / (4 * n))
    assert abs(sample / derived - 1) < tolerance
    assert abs(sample / unscaled - 1) > tolerance  # the power check: unscaled noise fails


@pytest.mark.statistical
def test_the_initial_count_noise_is_scaled_by_linf() -> None:
    """The initial count (events since the monitor started) has ``DLap(Linf / epsilon)`` noise.

    3000 open keys, each with 5 events from 5 people, admitted at step 0 (threshold 1, monitor
    epsilon 40: its noise is below one count with probability 1 - 1e-6 per key; a key not
    admitted only shrinks n). Relative standard error of the sample std of a discrete
    Laplace: ``sqrt(5 / (4 n)) <= 0.021``; tolerance 6 of those (0.125). Power: the event level's
    ``DLap(1 / epsilon)`` std is 3 times smaller.
    """
    linf, n = 3, 3000
    eps = 0.5
    spec = StatisticsSpec(flow="f", mode="open", accounting="pure", budget=100.0,
                          delta_budget=1e-6, counter=TreeCounterSpec(1.0, 16, sensitivity=linf),
                          monitor=ThresholdMonitorSpec(40.0, 1, 8),
                          initial=PrivacyCharge(epsilon=eps, label="initial count"),
                          admission_delta=1e-9, instance="inst",
                          contribution=(("period_steps", 0), ("max_keys", 1),
                                        ("max_per_key", linf)))
    table = KeyTable(spec, KEY)
    keys = [f"k{i:05d}" for i in range(n)]
    out = table.close(0, keys, np.full(n, 5, dtype=np.int64), np.full(n, 5, dtype=np.int64))
    (column,) = out.releases
    assert len(column.keys) > 0.99 * n
    derived = math.sqrt(discrete_laplace_variance(linf / exact(eps)))
    assert column.std == pytest.approx(derived, rel=1e-12)
    sample = float(np.std(np.asarray(column.values) - 5, ddof=1))
    tolerance = 6 * math.sqrt(5 / (4 * len(column.keys)))
    assert abs(sample / derived - 1) < tolerance
    assert abs(sample / math.sqrt(discrete_laplace_variance(1 / exact(eps))) - 1) > tolerance


# --- people counts reach the monitors -------------------------------------------------------


def _open_user_spec(initial: float | None = 0.5, linf: int = 2) -> StatisticsSpec:
    return StatisticsSpec(
        flow="f", mode="open", accounting="pure", budget=1000.0, delta_budget=1e-6,
        counter=TreeCounterSpec(1.0, 16, sensitivity=linf),
        monitor=ThresholdMonitorSpec(60.0, 10, 8),  # query noise DLap(1/15): below 1 count
        initial=None if initial is None else PrivacyCharge(epsilon=initial, label="initial"),
        admission_delta=1e-9, instance="inst",
        contribution=(("period_steps", 0), ("max_keys", 3), ("max_per_key", linf)))


def test_the_monitor_counts_people_and_the_initial_count_counts_events() -> None:
    """``many-events`` has 400 events of one person; ``many-people`` 24 events of 12 people.

    With threshold 10 and monitor noise below one count (DLap(1/15) and DLap(1/30): a
    deviation of 1 has probability below 1e-6), only the key with 12 people is admitted, and
    its initial count is its 24 events (plus noise), not its 12 people.
    """
    table = KeyTable(_open_user_spec(initial=100.0), KEY)
    out = table.close(0, ["many-events", "many-people"], np.array([400, 24]), np.array([1, 12]))
    assert list(out.alerts[i].key for i in range(len(out.alerts))) == ["many-people"]
    (column,) = out.releases
    assert list(column.keys) == ["many-people"]
    assert abs(float(column.values[0]) - 24) < 1  # DLap(2/100): events, not people
    # the same events counted as events (the event level) admit both
    event = dataclasses.replace(_open_user_spec(initial=100.0, linf=1), contribution=(),
                                counter=TreeCounterSpec(1.0, 16))
    both = KeyTable(event, KEY).close(0, ["many-events", "many-people"], np.array([400, 24]))
    assert sorted(both.alerts[i].key for i in range(len(both.alerts))) == [
        "many-events", "many-people"]


def test_people_accumulate_over_steps_and_survive_a_snapshot() -> None:
    spec = _open_user_spec()
    table = KeyTable(spec, KEY)
    fired = []
    for step in range(6):
        if step == 3:
            table = KeyTable(spec, KEY, state=pickle.loads(pickle.dumps(table.to_state())))
        out = table.close(step, ["k"], np.array([9]), np.array([3]))
        fired += [(step, out.alerts[i].key) for i in range(len(out.alerts))]
    assert fired == [(3, "k")]  # 3 people a step: 12 >= 10 at step 3 (not 9 at step 2)
    assert "people" in table.to_state()
    assert "people" not in KeyTable(dataclasses.replace(spec, contribution=(),
                                                        counter=TreeCounterSpec(1.0, 16)),
                                    KEY).to_state()


def test_route_bounded_counts_events_and_first_people_per_shard() -> None:
    rules = EventRules(key_field="key", time_field="ts", origin=ORIGIN, step_seconds=1.0,
                       lateness_seconds=0.0, shards=3)
    clock = PartitionClock(rules)
    keys = ["a", "b", "a", "c", "a", "b"]
    first = np.array([True, True, False, True, True, False])
    per_shard = clock.route_bounded(keys, first, 7)
    merged = PeopleCounts({}, {})
    for buckets in per_shard:
        assert set(buckets) <= {7}
        for bucket in buckets.values():
            merged.add(bucket)
    assert merged.events == {"a": 3, "b": 2, "c": 1}
    assert merged.people == {"a": 2, "b": 1, "c": 1}
    assert clock.route_bounded([], np.zeros(0, dtype=bool), 7) == [{}, {}, {}]
    # the declared universe: positions, with the people column
    layout = DeclaredLayout(["a", "b", "c"], 2)
    declared = PartitionClock(dataclasses.replace(rules, shards=2, declared=layout))
    positions = layout.positions(keys)
    rows = [b[3] for b in declared.route_bounded(positions, first, 3) if b]
    named = PeopleCounts({}, {})
    for shard, bucket in zip([s for s, b in enumerate(declared.route_bounded(
            positions, first, 3)) if b], rows, strict=True):
        assert isinstance(bucket, RowCounts) and bucket.people is not None
        named.add(bucket.named_people(layout.keys_of(shard)))
    assert named.events == {"a": 3, "b": 2, "c": 1}
    assert named.people == {"a": 2, "b": 1, "c": 1}


@pytest.mark.parametrize("declared", [False, True])
def test_a_shard_merges_people_buckets_across_partitions_and_snapshots(declared: bool) -> None:
    spec = _open_user_spec()
    keys = ["x", "y"]
    layout = DeclaredLayout(keys, 1) if declared else None
    if declared:
        spec = dataclasses.replace(spec, mode="declared", monitor=ThresholdMonitorSpec(60.0, 10),
                                   initial=None)
    rules = EventRules(key_field="key", time_field="ts", origin=ORIGIN, step_seconds=1.0,
                       lateness_seconds=0.0, shards=1, declared=layout)
    clock = PartitionClock(rules)

    def bucket(events: list[str], first: list[bool]) -> object:
        payloads = layout.positions(events) if layout is not None else events
        return clock.route_bounded(payloads, np.array(first), 0)[0][0]

    shard = ShardState(spec, 2, layout, KEY)
    shard.bind(0)
    shard.merge(0, bucket(["x"] * 6 + ["y"], [True] * 6 + [True]))
    restored = ShardState(spec, 2, layout, KEY, state=pickle.loads(pickle.dumps(
        shard.to_state())))
    restored.bind(0)
    for s in (shard, restored):
        s.merge(0, bucket(["x"] * 5 + ["y"] * 2, [True] * 5 + [False, True]))
        out = s.close(0, s.pending.pop(0))
        assert [out.alerts[i].key for i in range(len(out.alerts))] == ["x"]  # 11 people, y 2


# --- per-person totals ----------------------------------------------------------------------


@pytest.mark.parametrize("max_keys", [1, 4])
def test_person_privacy_is_l0_keys_worth_plus_the_collision_delta(max_keys: int) -> None:
    config = parse_config(user_raw("pure", max_keys=max_keys, max_per_key=3))
    charges = config.per_key_charges()
    key_eps = spent_of(charges, "pure")
    person = config.person_privacy()
    assert person is not None and person.rho is None
    assert person.epsilon == float(max_keys * key_eps)
    assert person.epsilon == pytest.approx(max_keys * (0.1 + 0.2 + 0.7))  # the defaults
    collision = collision_delta(PEOPLE_BOUND)
    assert collision == pytest.approx(2.0**-64)
    assert person.delta == float(max_keys * exact(config.admission.delta)) + collision
    assert max_keys * config.admission.delta <= 1e-6  # the threshold keeps L0 deltas in budget


def test_person_privacy_under_zcdp_is_l0_rho_converted() -> None:
    config = parse_config(user_raw("zcdp", max_keys=5, max_per_key=2))
    key_rho = spent_of(config.per_key_charges(), "zcdp")
    person = config.person_privacy()
    assert person is not None and person.rho == float(5 * key_rho)
    rho = float(5 * key_rho)
    # BS16 Prop. 1.3 at privacy.delta, the L0 admission deltas and the collision added
    assert person.epsilon == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1 / 1e-6)),
                                           rel=1e-12)
    assert person.delta == pytest.approx(1e-6 + 5 * config.admission.delta
                                         + collision_delta(PEOPLE_BOUND), rel=1e-12)
    assert person_privacy("zcdp", 0.5, 0.0, 2, 0.0).epsilon == math.inf


def test_the_configuration_scales_the_mechanisms_and_describes_the_person() -> None:
    pure = parse_config(user_raw("pure", max_keys=4, max_per_key=3, period="1h"))
    assert isinstance(pure.privacy.counter, TreeCounterSpec)
    assert pure.privacy.counter.sensitivity == 3
    zcdp = parse_config(user_raw("zcdp", max_per_key=5))
    assert isinstance(zcdp.privacy.counter, BltCounterSpec)
    assert zcdp.privacy.counter.sensitivity == 5
    text = pure.describe()
    assert "privacy unit: one person" in text and "per period of 3600 steps" in text
    person = pure.person_privacy()
    assert person is not None and f"({person.epsilon:.4g}," in text
    assert "noise std: counter" in text
    stds = pure.noise_std()
    event = parse_config({k: v for k, v in user_raw("pure").items() if k != "contribution"})
    assert stds["counter"] == pytest.approx(3 * event.noise_std()["counter"], rel=0.02)
    assert stds["initial"] == pytest.approx(math.sqrt(discrete_laplace_variance(
        Fraction(3) / exact(0.2))))
    assert stds["monitor"] == event.noise_std()["monitor"]  # people: sensitivity 1
    assert event.person_privacy() is None and "one person" not in event.describe()
    # the per-key figure every release reports is unchanged in meaning (against one person)
    assert pure.release_epsilon_delta()[0] == pytest.approx(1.0)
    zstd = zcdp.noise_std()["initial"]
    assert zstd == pytest.approx(math.sqrt(discrete_gaussian_variance(
        Fraction(25) / (2 * exact(zcdp.admission.initial.rho)))))  # type: ignore[union-attr]


def test_the_mechanisms_digest_binds_the_contribution() -> None:
    base = statistics_spec(parse_config(user_raw(max_keys=4, max_per_key=3)), "i")
    other_keys = statistics_spec(parse_config(user_raw(max_keys=5, max_per_key=3)), "i")
    other_period = statistics_spec(parse_config(user_raw(period="10s")), "i")
    event = statistics_spec(parse_config(
        {k: v for k, v in user_raw().items() if k != "contribution"}), "i")
    digests = {base.mechanisms_digest, other_keys.mechanisms_digest,
               other_period.mechanisms_digest, event.mechanisms_digest}
    assert len(digests) == 4
    assert base.counter_digest != event.counter_digest  # Linf changes the counter's noise
    assert event.contribution == () and not event.user_level
    table = KeyTable(base, KEY)
    table.close(0, ["k"], np.array([1]), np.array([1]))
    with pytest.raises(InvalidParameterError, match="other mechanism parameters"):
        KeyTable(other_keys, KEY, state=table.to_state())


def test_the_configuration_refuses_what_the_budget_or_delta_cannot_pay() -> None:
    with pytest.raises(ConfigError, match="cannot pay"):
        parse_config(user_raw(counter={"epsilon": 0.95}))
    # an explicit threshold whose L0 admission deltas exceed privacy.delta is refused
    ok = parse_config(user_raw(max_keys=1))
    threshold = ok.privacy.monitor.threshold  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="for the contribution.max_keys = 1000 keys"):
        parse_config(user_raw(max_keys=1000, monitor={"threshold": threshold}))
    # left to its default, the threshold grows with L0 so that they fit
    wide = parse_config(user_raw(max_keys=1000))
    assert wide.privacy.monitor.threshold > threshold  # type: ignore[union-attr]
    assert 1000 * wide.admission.delta <= 1e-6
    with pytest.raises(ConfigError, match="max_per_key is required"):
        raw = user_raw()
        del raw["contribution"]["max_per_key"]
        parse_config(raw)


# --- the records ----------------------------------------------------------------------------


def _columns(unit: str, spent: float) -> ReleaseColumns:
    return ReleaseColumns(step=3, keys=("a", "b\"q", "c"), values=np.array([1.5, -2.0, 7.25]),
                          std=2.5, mechanism="tree-laplace", spent=spent, budget=1.0,
                          unit=unit, delta=1e-9)


@pytest.mark.parametrize("unit", ["epsilon", "rho"])
def test_releases_carry_the_unit_the_caps_the_period_and_the_person_totals(unit: str) -> None:
    config = parse_config(user_raw("pure" if unit == "epsilon" else "zcdp", max_keys=4,
                                   max_per_key=3, period="1h"))
    encoder = RecordEncoder("f", ORIGIN, 1.0, 1e-6, instance="i",
                            contribution=config.contribution)
    columns = _columns(unit, 0.5)
    bulk = [value for _, _, value in encoder.encode_columns(columns)]
    one = [encoder.encode(release)[2] for release in columns]
    assert bulk == one  # the bulk template carries the person's block byte for byte
    privacy = orjson.loads(bulk[0])["privacy"]
    assert privacy["unit"] == "user"
    person = privacy["person"]
    assert person["period"] == "3600 steps"
    assert person["caps"] == [["max_keys", 4], ["max_per_key", 3]]
    expected = person_privacy("pure" if unit == "epsilon" else "zcdp", 0.5, 1e-9, 4, 1e-6)
    assert person["epsilon"] == expected.epsilon and person["delta"] == expected.delta
    if unit == "rho":
        assert person["rho"] == 2.0
    else:
        assert "rho" not in person and person["epsilon"] == 2.0
    # the event level writes neither
    plain = RecordEncoder("f", ORIGIN, 1.0, 1e-6, instance="i")
    record = orjson.loads(plain.encode_columns(columns)[0][2])
    assert record["privacy"]["unit"] == "event" and "person" not in record["privacy"]


# --- through a real flow --------------------------------------------------------------------


@pytest.mark.flow
def test_a_user_level_flow_admits_keys_by_people_and_reports_the_person() -> None:
    """A real in-memory flow (the bounding stage, the counters shards, the encoder).

    ``few`` gets 12 kept events from 4 people (3 each, ``max_per_key = 3``), ``many`` 12 events
    from 12 people. With threshold 8 and monitor epsilon 20 (query noise DLap(1/5), threshold
    noise DLap(1/10): a deviation of 2 counts has probability below 1e-4), the people count
    admits ``many`` and not ``few``, though both have 12 events: the event count would admit
    both. Every release reports the unit, the caps and the person's totals.
    """
    from support.flows import run_in_memory
    from support.messages import raw

    from dpstream.platform import parse_config as platform_config

    origin = 1_790_000_000
    cfg = platform_config({
        "flow": {"name": "u", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 2,
                 "end": "2026-09-21T14:13:26Z"},
        "privacy": {"budget": 30.0, "delta": 1e-6},
        "counter": {"epsilon": 5.0, "horizon": 64},
        "monitor": {"epsilon": 20.0, "threshold": 8, "horizon": 100},
        "admission": {"mode": "open", "initial_epsilon": 2.0},
        "contribution": {"unit": "user", "user_field": "user", "max_keys": 2,
                         "max_per_key": 3},
        "metrics": {"port": 0}})
    events = [("few", f"f{p}") for p in range(4) for _ in range(5)]  # 5 each, 3 kept
    events += [("many", f"m{p}") for p in range(12)]
    items = []
    for offset, (key, user) in enumerate(events):
        ts = origin + 1.25 + offset / 100
        items.append(raw(offset % 2, orjson.dumps({"key": key, "ts": ts, "user": user}),
                         offset // 2, ts))
    out = run_in_memory(cfg, items, KEY, instance="u-1", partitions=2)
    alerts = [orjson.loads(v)["key"] for role, _, v in out if role == "alerts"]
    assert alerts == ["many"]
    releases = [orjson.loads(v) for role, _, v in out if role == "releases"]
    assert releases and {r["key"] for r in releases} == {"many"}
    person = cfg.person_privacy()
    assert person is not None
    for record in releases:
        privacy = record["privacy"]
        assert privacy["unit"] == "user"
        assert privacy["person"] == {"period": "lifetime",
                                     "caps": [["max_keys", 2], ["max_per_key", 3]],
                                     "epsilon": person.epsilon, "delta": person.delta}
    assert person.epsilon == pytest.approx(2 * (20.0 + 2.0 + 5.0))


def test_a_user_level_shard_takes_buckets_that_name_no_person_as_events_only() -> None:
    """A bucket by name without people (an input no person is named in) adds events only."""
    spec = _open_user_spec()
    shard = ShardState(spec, 2, None, KEY)
    shard.merge(0, PeopleCounts({"k": 3}, {"k": 3}))
    shard.merge(0, {"k": 50})
    pending = shard.pending[0]
    assert isinstance(pending, PeopleCounts)
    assert pending.events == {"k": 53} and pending.people == {"k": 3}
