"""The ERM kind at unit = "user" (issue 24): a block's sensitivity scales with the person's rows.

Privacy maps to exact fractions (each configured per-block charge is one person's
``max_rows_per_block`` rows; a person's total over ``max_blocks`` blocks), the rounded
integers' distances the maps rest on, the scaled noise (statistical, with a power check),
the decoder's dead letters and payloads, the records' user-level fields, and a user-level flow
in memory whose models do not see a person's rows beyond the caps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fakes import FakeTrain
from support.flows import run_in_memory
from support.messages import raw
from support.stage import HandStage, interleave
from support.stage import drive as drive_stage

from dpstream.core.accounting.ledger import exact
from dpstream.core.contribution.people import PEOPLE_BOUND, collision_delta
from dpstream.core.erm.contribution import (
    noise_std,
    person_cost,
    stream_factor,
    widest_computation,
)
from dpstream.core.erm.ermg import ErmgSpec
from dpstream.core.erm.grid import round_to_grid, rows_l1_factor
from dpstream.core.erm.output_noise import NoiseLevel, private_erm
from dpstream.core.erm.sampling import amplified_epsilon
from dpstream.core.erm.schedules.schedule import ReleaseSchedule
from dpstream.core.erm.schedules.spec import ScheduleSpec
from dpstream.core.erm.solver import solve
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.coordinates import parameter_digest
from dpstream.core.noise.keys import NoiseKey
from dpstream.kinds.erm.config import parse_config
from dpstream.kinds.erm.events import ErmClock
from dpstream.kinds.erm.records import ModelEncoder
from dpstream.kinds.erm.shard import ModelRecord
from dpstream.messages import RawBatch
from dpstream.stream.clock import bad_person

KEY = NoiseKey.for_tests(24)
COLLISION = collision_delta(PEOPLE_BOUND)  # just above 2^-64
COORDS = ("i", "f", "erm", "a")
ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z
D = 3


def _erm(accounting: str = "pure", r: int = 1, **more: Any) -> ErmSpec:
    return ErmSpec(classes=(0, 1), dimension=2, clip_norm=1.0, regularization=0.5,
                   accounting=accounting, unit_rows=r, **more)


def _block(rows: int, seed: int, spec: ErmSpec) -> Block:
    x = np.random.default_rng(seed).normal(size=(rows, spec.dimension))
    return Block(spec.features(x), (x[:, 0] > 0).astype(np.int64))


def _tables(*, contribution: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
            privacy: dict[str, Any] | None = None, **release: Any) -> dict[str, Any]:
    tables: dict[str, Any] = {
        "flow": {"kind": "erm", "name": "u", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 2},
        "privacy": {"accounting": "pure", "epsilon": 1.0},
        "metrics": {"port": 0},
        "model": {"classes": ["no", "yes"], "dimension": D, "clip_norm": 3.0,
                  "regularization": 0.05, "streams": ["a", "b"], "stream_field": "s"},
        "release": {"algorithm": "continual", "block_size": 100, "base_blocks": 2, **release},
    }
    if contribution is not None:
        tables["contribution"] = contribution
    tables["model"].update(model or {})
    tables["privacy"].update(privacy or {})
    tables["release"] = {k: v for k, v in tables["release"].items() if v is not None}
    return tables


USER = {"unit": "user", "user_field": "user", "max_rows_per_block": 3, "max_blocks": 2}


# --- privacy maps, exact ------------------------------------------------------------------


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
@pytest.mark.parametrize("r", [1, 2, 7])
def test_a_blocks_sensitivity_and_grid_scale_with_the_rows_and_the_charge_stays(
        accounting: str, r: int) -> None:
    event, user = _erm(accounting), _erm(accounting, r)
    for n in (100.0, 800.0):
        assert user.sensitivity(n) == r * event.sensitivity(n)
        assert user.grid(user.sensitivity(n)) == r * event.grid(event.sensitivity(n))
    cost = Fraction(1, 3)
    for spec in (event, user):  # the configured cost at the spec's own reference
        level = NoiseLevel(reference_sensitivity=spec.sensitivity(100.0), reference_cost=cost)
        assert level.cost_at(spec, spec.sensitivity(100.0)) == cost
        assert level.cost_at(spec, spec.sensitivity(400.0)) == (
            cost / 4 if accounting == "pure" else cost / 16)
    # the real noise is r times the event level's (the integer noise is the same on a grid r
    # times coarser)
    ev = NoiseLevel(reference_sensitivity=event.sensitivity(100.0), reference_cost=cost)
    us = NoiseLevel(reference_sensitivity=user.sensitivity(100.0), reference_cost=cost)
    if accounting == "pure":
        assert us.real_scale(user) == r * ev.real_scale(event)
    else:
        assert us.real_variance(user) == r * r * ev.real_variance(event)


def test_unit_rows_is_bound_only_when_it_is_not_one() -> None:
    assert "unit_rows" not in _erm().to_dict()
    assert _erm(r=3).to_dict()["unit_rows"] == 3
    with pytest.raises(Exception, match="unit_rows"):
        _erm(r=0)


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
def test_the_per_block_ledger_charges_one_persons_rows_what_it_charged_one_event(
        accounting: str) -> None:
    spec = ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=10, base_blocks=1,
                        accounting=accounting)
    spends = []
    for r in (1, 4):
        s = ReleaseSchedule(spec, _erm(accounting, r), KEY, COORDS, train=FakeTrain())
        for step in range(6):
            s.add_block(step, _block(3, step, s.erm))
        spends.append([s.block_spend(b) for b in range(6)])
    assert spends[0] == spends[1]
    assert all(0 < x <= spec.budget() for x in spends[1])


def test_a_person_costs_kappa_b_budget_pure_and_kappa_m_b_budget_zcdp() -> None:
    pure = ScheduleSpec(algorithm="continual", epsilon=0.5, block_size=10, base_blocks=2)
    cost = person_cost(pure, _erm("pure", 4), 10, 1)
    assert cost.stream_factor == 1 and cost.overlap == 1
    assert cost.total == 10 * 2 * Fraction(1, 2) == 10  # B x 2 eps (continual)
    indep = ScheduleSpec(algorithm="independent", epsilon=0.25, block_size=10,
                         accounting="zcdp")
    assert person_cost(indep, _erm("zcdp", 4), 6, 1).total == 6 * Fraction(1, 4)  # m = 1
    window = ScheduleSpec(algorithm="sliding-window", epsilon=0.25, block_size=10,
                          window_blocks=7, accounting="zcdp")
    assert widest_computation(window) == 7
    assert person_cost(window, _erm("zcdp", 4), 10, 1).total == 7 * 10 * Fraction(1, 4)
    assert person_cost(window, _erm("zcdp", 4), 3, 1).total == 3 * 3 * Fraction(1, 4)
    mr = ScheduleSpec(algorithm="multi-resolution", epsilon=0.25, block_size=10,
                      accounting="zcdp")
    assert widest_computation(mr) is None
    assert person_cost(mr, _erm("zcdp", 2), 5, 1).total == 5 * 5 * Fraction(1, 4)  # m = B
    ermg = ErmgSpec(epsilon=1.0, delta=1e-6, block_size=10)
    rho = ermg._improver_spec(p=1.0, p_prime=1.0, p_double_prime=0.0, g=1.0).budget
    got = person_cost(ermg, _erm("pure", 2), 3, 1)
    assert got.total == 9 * exact(rho) and got.accounting == "ermg"
    assert got.epsilon(1e-6) == pytest.approx(rho * 9 + 2 * math.sqrt(rho * 9 * math.log(1e6)))


def test_the_stream_factor_is_one_for_one_stream_and_exact_for_several() -> None:
    spec = _erm("pure", 4)  # p = 3 (binary, d = 2, intercept)
    assert stream_factor(spec, 1, "pure") == stream_factor(_erm("pure", 1), 5, "pure") == 1
    p, s = 3, 2
    c1, d1 = spec.grid_l1_sensitivity, None
    d1 = c1
    x = 4096 * s * (1 + Fraction(2, 1 << 19))
    root_up = Fraction(math.isqrt(p * x.numerator ** 2) + 1, x.denominator)
    assert root_up >= math.sqrt(p) * float(x)  # an upper bound on sqrt(p) x
    assert stream_factor(spec, 2, "pure") == (root_up + 2 * p) / d1
    assert 1 < stream_factor(spec, 2, "pure") < 1 + Fraction(2, 4096)
    # at most min(streams, r) streams hold a person's rows of one block
    assert stream_factor(spec, 9, "pure") == stream_factor(spec, 4, "pure")
    z = stream_factor(_erm("zcdp", 4), 2, "zcdp")
    lam = s * (4096 * (1 + Fraction(2, 1 << 19)) + 2) / _erm("zcdp", 4).grid_l2_sensitivity
    assert z == lam * lam and 1 < z < 1 + Fraction(4, 4096)


@pytest.mark.parametrize("k", [1, 3])
def test_a_persons_rows_in_k_blocks_move_the_rounded_integers_by_at_most_k_d1(k: int) -> None:
    """What the maps rest on: r rows in each of k blocks, normaliser fixed, on the user grid."""
    r, n = 5, 60.0
    spec = _erm("pure", r)
    delta = spec.sensitivity(n)
    g = spec.grid(delta)
    tau = float(spec.precision(n))
    worst = 0
    for seed in range(6):
        base = _block(40, seed, spec)
        rng = np.random.default_rng(100 + seed)
        person = rng.normal(size=(k * r, spec.dimension)) * 5  # far out: clipped rows
        extra = Block(spec.features(person), rng.integers(0, 2, k * r))
        both = Block.concat([base, extra], spec.columns)
        a = round_to_grid(solve(spec, base, n, None, precision=tau).params, g)
        b = round_to_grid(solve(spec, both, n, None, precision=tau).params, g)
        l1 = sum(abs(u - v) for u, v in zip(a, b, strict=True))
        l2 = math.sqrt(sum((u - v) ** 2 for u, v in zip(a, b, strict=True)))
        worst = max(worst, l1)
        assert l1 <= k * spec.grid_l1_sensitivity
        assert l2 <= k * spec.grid_l2_sensitivity
    assert worst > (k - 1) * spec.grid_l1_sensitivity / 4  # the bound is not vacuous here


def test_a_persons_block_split_over_streams_stays_within_the_stream_factor() -> None:
    """r rows of one block spread over two streams: the two streams' integer moves, summed,
    stay within kappa D1 (L1) and sqrt(kappa_zcdp) D2 (L2)."""
    r, n = 4, 40.0
    spec = _erm("pure", r)
    delta = spec.sensitivity(n)
    g, tau = spec.grid(delta), float(spec.precision(n))
    kappa = stream_factor(spec, 2, "pure")
    kappa_z = stream_factor(_erm("zcdp", r), 2, "zcdp")
    for seed in range(4):
        rng = np.random.default_rng(200 + seed)
        person = Block(spec.features(rng.normal(size=(r, spec.dimension)) * 5),
                       rng.integers(0, 2, r))
        l1 = l2 = 0.0
        for stream, rows in enumerate((slice(0, 1), slice(1, r))):  # 1 row and r - 1 rows
            base = _block(30, 10 * seed + stream, spec)
            extra = Block(person.z[rows], person.y[rows])
            a = round_to_grid(solve(spec, base, n, None, precision=tau).params, g)
            b = round_to_grid(solve(spec, Block.concat([base, extra], spec.columns), n, None,
                                    precision=tau).params, g)
            l1 += sum(abs(u - v) for u, v in zip(a, b, strict=True))
            l2 += math.sqrt(sum((u - v) ** 2 for u, v in zip(a, b, strict=True)))
        assert l1 <= kappa * spec.grid_l1_sensitivity
        assert l2 ** 2 <= kappa_z * spec.grid_l2_sensitivity ** 2


@pytest.mark.parametrize("algorithm", ["multi-resolution", "continual", "sliding-window"])
def test_sampling_amplifies_kappa_r_times_the_cost_and_keeps_the_papers_charges(
        algorithm: str) -> None:
    """A person's r rows are sampled independently: the plan amplifies ``kappa_r cost`` (the
    rows' linear bound) and lowers the rate until that is at most the paper's ``cost/2^j``."""
    spec = ScheduleSpec(algorithm=algorithm, epsilon=1.0, block_size=10, base_blocks=1,
                        window_blocks=7, sampling=True)
    r = 6
    kappa = rows_l1_factor(3, r)
    assert kappa == stream_factor(_erm("pure", r), r, "pure") and 1 < kappa < 1 + Fraction(1, 500)
    assert rows_l1_factor(3, 1) == 1
    charged: dict[int, list[Any]] = {}
    for rows in (1, r):
        s = ReleaseSchedule(spec, _erm("pure", rows), KEY, COORDS, train=FakeTrain())
        for step in range(12):
            s.add_block(step, _block(20, step, s.erm))
            for c in s.trained:
                charged.setdefault(rows, []).append(c)
        assert s.max_block_spend() <= spec.budget()
    event, user = charged[1], charged[r]
    sampled = [(a, b) for a, b in zip(event, user, strict=True) if b.rate is not None]
    assert sampled
    for a, b in sampled:
        assert a.rate is not None and b.rate <= a.rate  # a lower rate for r rows
        full = spec.reference_costs()["update" if b.role == "update" else (
            "multi-resolution" if algorithm != "sliding-window" else "update")]
        target = full / (1 << int(b.level or 0))
        assert b.cost == amplified_epsilon(kappa * full, b.rate) <= target
        assert a.cost == amplified_epsilon(full, a.rate) <= target
    for a, b in zip(event, user, strict=True):  # unsampled computations charge the same
        if b.rate is None:
            assert a.cost == b.cost


# --- configuration and records ------------------------------------------------------------


def test_config_reports_the_person_and_binds_the_contribution() -> None:
    event = parse_config(_tables())
    user = parse_config(_tables(contribution=USER))
    assert event.model.unit_rows == 1 and user.model.unit_rows == 3
    assert event.person_cost() is None
    # the event level's digest keeps its bytes (the pre-issue-24 expression)
    assert event.mechanisms_digest == parameter_digest(
        repr(sorted(event.model.to_dict().items())),
        repr(sorted(event.schedule.to_dict().items())), event.algorithm, *event.streams)
    other = parse_config(_tables(contribution={**USER, "max_blocks": 3}))
    assert len({event.mechanisms_digest, user.mechanisms_digest, other.mechanisms_digest}) == 3
    text = user.describe()
    assert "privacy unit: one person (field 'user')" in text
    cost = user.person_cost()
    assert cost is not None and cost.total == cost.stream_factor * 2 * 2  # B x 2 eps
    assert f"= {float(cost.total):.6g}" in text
    assert "one event" not in event.describe().splitlines()[0]
    assert "privacy unit: one event" in event.describe()
    # the noise std per output: r = 3 times the event level's (output perturbation); the
    # objective learner (the default under pure epsilon) spends C/r a row, so at least 3 times:
    # its b noise is ~1/eps_b, eps_b = 0.99 e - min(jac, e/2) with jac at most 3 times smaller
    # at e = C/3 (Lambda is raised only when jac would exceed e/2)
    assert event.model.learner == "objective"
    for role, std in event.noise_std().items():
        assert user.noise_std()[role] >= 3 * std * (1 - 1e-9)
    output = [parse_config(_tables(**extra, model={"learner": "output"}))
              for extra in ({}, {"contribution": USER})]
    for role, std in output[0].noise_std().items():
        assert output[1].noise_std()[role] == pytest.approx(3 * std, rel=1e-9)
    assert set(event.noise_std()) == {"multi-resolution", "base", "update"}


def _record(stream: str = "a") -> ModelRecord:
    spec = _erm("pure", 3)
    model = FakeTrain()(spec, _block(5, 0, spec), normalizer=100.0, center=None,
                        level=NoiseLevel(spec.sensitivity(100.0), Fraction(1, 2)),
                        rng=KEY.stream("x"))
    return ModelRecord(stream, "continual", 1, "base", 1, 0, 1, ((0, 1),), model, 0.5, 0.5,
                       2.0, None)


def test_model_records_carry_the_user_level_only_at_the_user_level() -> None:
    user = parse_config(_tables(model={"classes": ["no", "yes"], "dimension": 2,
                                       "streams": ["a"], "stream_field": None},
                                contribution={**USER, "period": "1h"}))
    _, _, body = ModelEncoder(user, "u-1").encode(_record())
    privacy = json.loads(body)["privacy"]
    cost = user.person_cost()
    assert cost is not None
    assert privacy["unit"] == "user"
    assert privacy["person"] == {"period": "3600 steps",
                                 "caps": [["max_rows_per_block", 3], ["max_blocks", 2]],
                                 "epsilon": float(cost.total), "delta": COLLISION}
    event = parse_config(_tables(model={"classes": ["no", "yes"], "dimension": 2,
                                        "streams": ["a"], "stream_field": None}))
    _, _, body = ModelEncoder(event, "u-1").encode(_record())
    privacy = json.loads(body)["privacy"]
    assert privacy["unit"] == "event" and "person" not in privacy
    zcdp = parse_config(_tables(privacy={"accounting": "zcdp", "rho": 0.5}, contribution=USER,
                                model={"dimension": 2}))
    _, _, body = ModelEncoder(zcdp, "u-1").encode(_record())
    user_part = json.loads(body)["privacy"]["person"]
    assert user_part["rho"] == float(zcdp.person_cost().total)  # type: ignore[union-attr]
    assert user_part["delta"] == 1e-6 + COLLISION and user_part["epsilon"] > user_part["rho"]


# --- the decoder --------------------------------------------------------------------------


def _batch(bodies: list[Any]) -> RawBatch:
    return RawBatch.of([raw(1, json.dumps(b).encode(), 10 + i, ORIGIN + 0.5)
                        for i, b in enumerate(bodies)])


def test_the_decoder_dead_letters_a_record_without_a_person_and_aligns_the_people() -> None:
    config = parse_config(_tables(contribution=USER))
    clock = ErmClock(config)
    good = {"features": [1.0, 2.0, 3.0], "label": "yes", "s": "a", "ts": ORIGIN + 0.5}
    bodies = [dict(good, user="ann"), dict(good), dict(good, user=""), dict(good, user=7),
              dict(good, user="bob", s="b", label="no"), dict(good, user="cy", features=[1]),
              dict(good, user=["ann"])]
    dead: list[Any] = []
    payloads, times, refs = clock.decode(1, _batch(bodies), dead)
    assert clock.decoded_people == ["ann", "bob"]
    assert list(refs) == [0, 4] and len(times) == 2
    reasons = {letter.offset: letter.reason for letter in dead}
    assert reasons == {11: bad_person("user"), 12: bad_person("user"), 13: bad_person("user"),
                       15: "field 'features' must be a list of 3 numbers",
                       16: bad_person("user")}
    assert all("ann" not in r for r in reasons.values())
    # the payloads carry their rows: routed from another operator (the bounding stage)
    assert payloads["stream"].tolist() == [0, 1] and payloads["y"].tolist() == [1, 0]
    assert payloads["order"].tolist() == [[1, 10], [1, 14]]
    np.testing.assert_array_equal(payloads["z"], clock._z)
    routed = ErmClock(config).route(payloads[::-1], 0)  # another clock: no shared arrays
    direct = clock.route(payloads, 0)
    for a, b in zip(routed, direct, strict=True):
        assert a.keys() == b.keys()
        for step in a:
            for name in a[step]:
                for x, y in zip(a[step][name][0], b[step][name][0], strict=True):
                    np.testing.assert_array_equal(x, y)


def test_the_event_level_decoder_is_unchanged() -> None:
    config = parse_config(_tables())
    clock = ErmClock(config)
    good = {"features": [1.0, 2.0, 3.0], "label": "yes", "s": "a", "ts": ORIGIN + 0.5}
    dead: list[Any] = []
    payloads, _times, refs = clock.decode(1, _batch([good, dict(good, user=None)]), dead)
    assert payloads == [0, 1] and list(refs) == [0, 1] and not dead
    assert clock.decoded_people == []


# --- the scaled noise, statistically -------------------------------------------------------


@pytest.mark.statistical
@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
def test_the_released_noise_is_r_times_the_event_levels(accounting: str) -> None:
    """Empty blocks: the release is the rounded zero plus noise, r = 4 times the event level's.

    ``N = 1500`` releases of ``p = 3`` coordinates (4500 draws, independent streams). The
    sample variance ``s^2`` of ``N'`` iid draws has relative std ``sqrt((kurt - 1)/N')``:
    Laplace kurtosis 6 -> ``sqrt(5/4500) = 0.033``; Gaussian 3 -> ``0.021``. We accept
    ``|s^2 / V - 1| <= 0.17`` (over 5 sigma for Laplace, 8 for Gaussian; the discrete
    samplers' variances are the exact ones ``noise_std`` uses). Power: the event level's
    variance is ``V / 16``; had the noise not been scaled, ``s^2 / V`` would be near ``1/16``.
    """
    r, n_bar = 4, 200.0
    spec = _erm(accounting, r)
    schedule = ScheduleSpec(algorithm="independent", epsilon=0.5, block_size=200,
                            accounting=accounting)
    expected_std = noise_std(schedule, spec)["independent"]
    event_std = noise_std(schedule, dataclasses.replace(spec, unit_rows=1))["independent"]
    assert expected_std == pytest.approx(r * event_std, rel=1e-9)
    level = NoiseLevel(reference_sensitivity=spec.sensitivity(n_bar),
                       reference_cost=Fraction(1, 2))
    empty = Block.empty(spec.columns)
    draws = []
    for i in range(1500):
        model = private_erm(spec, empty, normalizer=n_bar, center=None, level=level,
                            rng=KEY.stream("user-noise", accounting, i))
        assert model.noise_std == pytest.approx(expected_std, rel=1e-12)
        draws.extend(model.params.reshape(-1).tolist())
    variance = float(np.mean(np.square(draws)))  # the mean is 0 (rounded zero + noise)
    ratio = variance / expected_std**2
    assert abs(ratio - 1) <= 0.17
    # power: unscaled (event-level) noise would give s^2 / V near 1/16, far outside the band
    # (by more than 20 of its sigmas)
    assert abs(event_std**2 / expected_std**2 - 1) > 0.17 + 20 * 0.033


# --- a user-level flow in memory -----------------------------------------------------------


def _stream(keep_heavy: Any = None, seed: int = 0) -> list[Any]:
    """Light people (one row each) on partitions 0 and 1, and one heavy person: 10 rows on
    partition 0 in each of steps 0-5. Offsets follow time in each partition.

    ``keep_heavy(step, i)``: which of the heavy person's rows (the ``i``-th of its step) stay in
    the stream (None: all); the others are left out, every offset staying as it was.
    """
    rng = random.Random(seed)
    rows: list[tuple[float, int, dict[str, Any], bool]] = []
    for step in range(8):
        for i in range(60):
            x = [rng.gauss(0, 1) for _ in range(D)]
            body = {"features": x, "label": "yes" if x[0] > 0 else "no",
                    "s": rng.choice("ab"), "ts": 0.0, "user": f"light-{step}-{i}"}
            rows.append((ORIGIN + step + rng.random() * 0.9, rng.randrange(2), body, True))
        if step < 6:
            for i in range(10):
                body = {"features": [9.0 - i, step - 9.0, 3.0 * i], "label": "no", "s": "a",
                        "ts": 0.0,
                        "user": "heavy"}
                kept = keep_heavy is None or keep_heavy(step, i)
                rows.append((ORIGIN + step + 0.05 + i / 100, 0, body, kept))
    rows.sort(key=lambda row: row[0])
    offsets = [0, 0]
    items = []
    for ts, p, body, kept in rows:
        if kept:
            items.append(raw(p, json.dumps(dict(body, ts=ts)).encode(), offsets[p], ts))
        offsets[p] += 1
    return items


@pytest.mark.flow
def test_a_user_level_flow_keeps_a_persons_rows_within_the_caps_and_says_so() -> None:
    """The heavy person has 10 rows in each of steps 0-5; with r = 3, B = 2 the flow trains on
    their first 3 rows (in offset order) of steps 0 and 1 only: the models are byte-identical
    to those of the stream that holds only those rows (the same noise, keyed identically)."""
    config = parse_config(_tables(contribution=USER))
    everything = run_in_memory(config, _stream(), KEY, instance="u-1", partitions=2)
    bounded = run_in_memory(config, _stream(lambda step, i: step < 2 and i < 3), KEY,
                            instance="u-1", partitions=2)
    models = [json.loads(v) for role, _k, v in everything if role == "models"]
    assert models and not [v for role, _k, v in everything if role != "models"]
    assert everything == bounded
    more = run_in_memory(config, _stream(lambda step, i: step < 2 and i < 4), KEY,
                         instance="u-1", partitions=2)
    assert more == everything  # a fourth row of a block is dropped too
    # power: the kept rows count, and which rows are kept matters
    none = run_in_memory(config, _stream(lambda step, i: False), KEY, instance="u-1",
                         partitions=2)
    other = run_in_memory(config, _stream(lambda step, i: step < 2 and 3 <= i < 6), KEY,
                          instance="u-1", partitions=2)
    assert none != everything and other != everything
    cost = config.person_cost()
    assert cost is not None
    for m in models:
        assert m["privacy"]["unit"] == "user"
        assert m["privacy"]["person"] == {
            "period": "lifetime", "caps": [["max_rows_per_block", 3], ["max_blocks", 2]],
            "epsilon": float(cost.total), "delta": COLLISION}
        assert m["privacy"]["budget"] == 2.0


@pytest.mark.flow
@pytest.mark.parametrize("privacy, release", [
    ({"accounting": "zcdp", "rho": 0.5}, {}),
    ({}, {"algorithm": "multi-resolution", "sampling": True}),
    ({}, {"algorithm": "sliding-window", "window_blocks": 3, "base_blocks": None}),
    ({}, {"algorithm": "independent", "base_blocks": None}),
    ({"delta": 1e-6}, {"algorithm": "ermg", "first_blocks": 2, "base_blocks": None}),
])
def test_every_schedule_runs_at_the_user_level_and_reports_the_person(
        privacy: dict[str, Any], release: dict[str, Any]) -> None:
    config = parse_config(_tables(contribution=USER, privacy=privacy, **release))
    out = run_in_memory(config, _stream(), KEY, instance="u-1", partitions=2)
    models = [json.loads(v) for role, _k, v in out if role == "models"]
    assert models and len(models) == len(out)  # no dead letter: every record names a person
    cost = config.person_cost()
    assert cost is not None
    expected = {"period": "lifetime", "caps": [["max_rows_per_block", 3], ["max_blocks", 2]],
                "epsilon": cost.epsilon(1e-6), "delta": cost.delta(1e-6)}
    if cost.accounting != "pure":
        expected["rho"] = float(cost.total)
    for m in models:
        assert m["privacy"]["unit"] == "user" and m["privacy"]["person"] == expected
        assert m["noise"]["std"] > 0
    assert {m["role"] for m in models} <= set(config.noise_std()) | {"window", "ermg"}


# --- properties: batching, interleaving, workers and restarts keep the same rows ----------

def _people_by_order(items: list[Any]) -> dict[tuple[int, int], str]:
    """Each record's person, by its (partition, offset): what identifies a kept row."""
    return {(m[0], m[2]): json.loads(m[1])["user"] for m in items}


class _ErmStage(HandStage):
    """The clocks and person shards of the user-level ERM flow, driven by hand (no Bytewax).

    ``rows`` collects every row the person shards hand the model shards, as
    ``(model shard, step, stream, (partition, offset), label, feature bytes)``.
    """

    carried = HandStage.carried + ("rows",)

    def __init__(self, config: Any, partitions: int = 2,
                 states: dict[str, Any] | None = None) -> None:
        super().__init__(config, KEY, partitions=partitions, states=states)
        self.rows: list[tuple[Any, ...]] = []

    def take(self, out: list[Any]) -> None:
        for _key, update in out:
            for step, bucket in update.increments.items():
                for stream, parts in bucket.items():
                    for z, y, order in parts:
                        self.rows += [(update.shard, step, stream, tuple(order[i].tolist()),
                                       int(y[i]), z[i].tobytes()) for i in range(len(y))]

    def feed(self, batch: list[Any]) -> None:
        super().feed(batch)
        assert not self.dead


def _drive(config: Any, items: list[Any], batch: int = 1000, seed: int | None = None,
           restart_after: int | None = None) -> _ErmStage:
    """Feed ``items`` per partition in batches: round robin, or in an order shuffled with
    ``seed`` (each partition's batches stay in order); restarted from a snapshot after
    ``restart_after`` batches if given."""
    return drive_stage(lambda states: _ErmStage(config, states=states), items, batch, seed,
                       restart_after)


def test_the_stage_keeps_a_persons_rows_within_the_caps_in_offset_order() -> None:
    """The heavy person (10 rows in each of steps 0-5): their first 3 rows by offset in steps
    0 and 1 only (r = 3, B = 2); every light person (one row) is kept."""
    config = parse_config(_tables(contribution=USER))
    items = _stream()
    stage = _drive(config, items)
    people = _people_by_order(items)
    kept = [(row[1], row[3]) for row in stage.rows]
    heavy = sorted((step, order) for step, order in kept if people[order] == "heavy")
    first = sorted((m[4] // 1000 - ORIGIN, (m[0], m[2])) for m in items
                   if people[(m[0], m[2])] == "heavy" and m[4] // 1000 - ORIGIN < 2)
    expected = [row for step in (0, 1) for row in [r for r in first if r[0] == step][:3]]
    assert heavy == expected and len(heavy) == 6
    light = sum(1 for order in people.values() if order != "heavy")
    assert len(kept) == light + 6 and len(set(kept)) == len(kept)
    assert (stage.kept, stage.dropped) == (light + 6, 60 - 6)  # 60 heavy rows in all


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.sampled_from([1, 3, 17, 1000]), st.integers(0, 10**6),
       st.integers(0, 60))
def test_batching_interleaving_and_restarts_keep_the_same_rows(
        seed: int, batch: int, order: int, cut: int) -> None:
    config = parse_config(_tables(contribution=USER))
    items = _stream(seed=seed)
    reference = _drive(config, items)
    assert reference.dropped == 54  # the heavy person's rows beyond the caps: the caps bind
    for other in (_drive(config, items, batch=batch, seed=order),
                  _drive(config, items, batch=batch, restart_after=cut)):
        assert sorted(other.rows) == sorted(reference.rows)
        assert (other.kept, other.dropped) == (reference.kept, reference.dropped)


def _models(out: list[Any]) -> list[bytes]:
    models = sorted(v for role, _k, v in out if role == "models")
    assert models and len(models) == len(out)
    return models


@pytest.mark.flow
def test_one_and_two_workers_batching_and_interleaving_publish_the_same_models() -> None:
    config = parse_config(_tables(contribution=USER))
    items = _stream(seed=4)
    reference = _models(run_in_memory(config, items, KEY, instance="u-1", partitions=2))
    assert _models(run_in_memory(config, items, KEY, instance="u-1", partitions=2,
                                 batch=7)) == reference
    assert _models(run_in_memory(config, interleave(items, 9), KEY, instance="u-1",
                                 partitions=2, batch=5)) == reference
    assert _models(run_in_memory(config, items, KEY, instance="u-1", partitions=2,
                                 workers=2, batch=13)) == reference
    # power: the bounding matters here (the same stream at the event level differs)
    event = parse_config(_tables())
    assert _models(run_in_memory(event, items, KEY, instance="u-1", partitions=2)) != reference


@pytest.mark.flow
def test_a_user_level_erm_restart_mid_run_publishes_the_same_models(tmp_path: Any) -> None:
    from datetime import timedelta

    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.testing import TestingSink, TestingSource, run_main

    from dpstream.platform import build_flow

    config = parse_config(_tables(contribution=USER))
    items = _stream(seed=6)
    whole = _models(run_in_memory(config, items, KEY, instance="u-1", partitions=2, batch=10))
    init_db_dir(tmp_path, 1)
    recovery = RecoveryConfig(tmp_path)
    crashing = items[:len(items) // 2] + [TestingSource.ABORT()] + items[len(items) // 2:]
    runs: list[list[Any]] = []
    for _ in range(2):
        sink: list[Any] = []
        run_main(build_flow(config, KEY, instance="u-1", partitions=2,
                            source=TestingSource(crashing, 10), sink=TestingSink(sink)),
                 epoch_interval=timedelta(0), recovery_config=recovery)
        runs.append(sink)
    assert runs[0] and len(runs[0]) < len(whole)  # the crash lands mid-run
    copies: dict[tuple[Any, ...], set[bytes]] = {}
    for _role, _k, v in runs[0] + runs[1]:
        body = json.loads(v)
        copies.setdefault((body["stream"], body["step"], body["role"], str(body["level"])),
                          set()).add(v)
    assert all(len(c) == 1 for c in copies.values())  # replays are byte-identical
    assert sorted(v for c in copies.values() for v in c) == whole
    store = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert b"heavy" not in store and b"light-" not in store  # keyed hashes only
