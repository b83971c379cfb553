"""Tests of the black-box schedulers (dpstream.core.pmwg.bb_scheduler, bb_improver, runner)."""

from __future__ import annotations

import copy
import json
import math
from fractions import Fraction

import numpy as np
import pytest
from support.query_class_boxes import SmallDB
from support.recording import RecordingKey

from dpstream.core.accounting.ledger import exact, zcdp_to_approx_dp
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.pmwg.bb_improver import BBImprover, BBImproverSpec
from dpstream.core.pmwg.bb_scheduler import BBScheduler, BBSchedulerSpec
from dpstream.core.pmwg.blackboxes import HistogramSynopsis, NoisyHistogram
from dpstream.errors import BudgetExhaustedError, InvalidParameterError

COORDS = ("flow", "bb", "key-1")


class FakeBox:
    """A black box that records its calls and releases the true normalised histogram."""

    def __init__(self, p: float = 1.0, g: float = 1.0, size: int = 4) -> None:
        self.name = "fake"
        self.p = p
        self.p_prime = p
        self.p_double_prime = 0.0
        self.g = g
        self.size = size
        self.calls: list[tuple[int, float, float, float, int]] = []

    def run(self, counts, n, epsilon, alpha, beta, rng_for):
        draw = rng_for("x").randbelow(2**32)
        self.calls.append((n, epsilon, alpha, beta, draw))
        return HistogramSynopsis(np.asarray(counts, dtype=np.float64) / n)


def counts_for(t: int, size: int = 4) -> np.ndarray:
    c = np.full(size, t // size, dtype=np.int64)
    c[0] += t - int(c.sum())
    return c


def pure_spec(**kw) -> BBSchedulerSpec:
    args = {"epsilon": 1.0, "beta": 0.05, "n": 1000, "p": 1.0, "g": 1.0}
    args.update(kw)
    return BBSchedulerSpec(**args)


# --- BBSchedulerSpec: validation --------------------------------------------------------


def test_spec_validation_messages() -> None:
    with pytest.raises(InvalidParameterError, match=r"epsilon must be finite and > 0, got -1"):
        pure_spec(epsilon=-1)
    for bad in (0, 1, 1.5, -0.1, math.nan):
        with pytest.raises(InvalidParameterError, match=r"beta must be in \(0, 1\)"):
            pure_spec(beta=bad)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InvalidParameterError, match="n must be an integer >= 1"):
            pure_spec(n=bad)
    with pytest.raises(InvalidParameterError, match=r"delta must be in \[0, 1\)"):
        pure_spec(delta=1.0)
    with pytest.raises(InvalidParameterError, match="g must be finite and > 0"):
        pure_spec(g=0.0)


def test_gamma_not_below_one_is_refused_with_the_reason() -> None:
    # gamma = (g log(1/beta) / (eps n))^(1/3) for p = 1; g = 1, eps = 1, beta = 0.05:
    # gamma < 1 iff n > log(20) = 2.996
    with pytest.raises(
        InvalidParameterError,
        match=r"gamma = .* is not < 1 .* n = 2 is too small .* needs n > 2\.99",
    ):
        pure_spec(n=2)
    pure_spec(n=3)
    # delta > 0: Z carries 3 sqrt(log(1/delta)) (reading 3): needs n > 3 sqrt(log(1e6)) log(20)
    need = 3 * math.sqrt(math.log(1e6)) * math.log(20)
    with pytest.raises(InvalidParameterError, match=r"delta = 1e-06 .* needs n > 33\.40"):
        pure_spec(n=int(need), delta=1e-6)
    pure_spec(n=int(need) + 1, delta=1e-6)


def test_delta_spec_refused_when_the_conversion_exceeds_epsilon() -> None:
    # at the full budget rho = eps^2/(9 L), eps' = eps^2/(9L) + 2 eps/3 <= eps iff eps <= 3 L
    with pytest.raises(InvalidParameterError, match="converts to epsilon"):
        BBSchedulerSpec(epsilon=5.0, beta=0.05, n=10**9, p=1.0, g=1.0, delta=0.5)
    BBSchedulerSpec(epsilon=2.0, beta=0.05, n=10**9, p=1.0, g=1.0, delta=0.5)  # 2 <= 3 ln 2


# --- BBSchedulerSpec: the schedule, against hand values ----------------------------------


def test_pure_schedule_hand_values() -> None:
    spec = pure_spec()
    gamma = (math.log(20) / 1000) ** (1 / 3)  # g^(1/3) (log(1/beta)/(eps n))^(1/3), p = 1
    assert spec.gamma == pytest.approx(0.14415653427904535, rel=1e-15)
    assert spec.gamma == pytest.approx(gamma, rel=1e-15)
    assert spec.gamma_exact == Fraction("0.14415653427904535")
    # t_i = ceil((1 + gamma)^i n): 1000, 1144.16, 1309.09, 1497.81, 1713.73, 1960.77
    assert [spec.epoch_start(i) for i in range(6)] == [1000, 1145, 1310, 1498, 1714, 1961]
    # epsilon_i = gamma^2 (i+1) / (1+gamma)^(i+2) epsilon
    for i in range(6):
        hand = gamma**2 * (i + 1) / (1 + gamma) ** (i + 2)
        assert spec.epoch_epsilon(i) == pytest.approx(hand, rel=1e-13)
    assert spec.epoch_epsilon(0) == pytest.approx(0.01587441665638932, rel=1e-14)
    assert spec.epoch_epsilon(1) == pytest.approx(0.027748679801740745, rel=1e-14)
    # beta_i = (beta / (1 + beta))^(i+1)
    assert spec.epoch_beta(0) == pytest.approx(1 / 21, rel=1e-15)
    assert spec.epoch_beta(2) == pytest.approx((1 / 21) ** 3, rel=1e-14)
    assert spec.epoch_log_inv_beta(4) == pytest.approx(5 * math.log(21), rel=1e-15)
    # alpha_i = g log(1/beta_i) / (eps_i (1+gamma)^i n) is constant (the proof's algebra):
    # g (1+gamma)^2 log(21) / (gamma^2 eps n) = 0.19179
    constant = (1 + gamma) ** 2 * math.log(21) / (gamma**2 * 1000)
    for i in range(6):
        assert spec.epoch_alpha(i) == pytest.approx(constant, rel=1e-12)
    assert constant == pytest.approx(0.191787988410776, rel=1e-12)
    # accuracy at t: alpha_i + gamma / (1 + gamma) (D.1)
    assert spec.accuracy(1200) == pytest.approx(constant + gamma / (1 + gamma), rel=1e-12)
    with pytest.raises(InvalidParameterError, match="no accuracy guarantee before"):
        spec.accuracy(999)


def test_epoch_of_agrees_with_epoch_start() -> None:
    spec = pure_spec()
    assert spec.epoch_of(0) == spec.epoch_of(999) == -1
    for i in range(40):
        start = spec.epoch_start(i)
        assert spec.epoch_of(start) == i
        assert spec.epoch_of(start - 1) == i - 1
        # "the first t >= (1+gamma)^i n": the start is the ceiling of the exact value
        exact_start = 1000 * (1 + spec.gamma_exact) ** i
        assert start - 1 < exact_start <= start
    assert spec.epoch_of(10**30) == pytest.approx(math.log(10**27) / math.log1p(spec.gamma), abs=1)


def test_pure_epsilons_sum_to_epsilon_and_never_exceed_it() -> None:
    spec = pure_spec()
    total = Fraction(0)
    for i in range(400):
        eps_i = spec.epoch_epsilon(i)
        total += exact(eps_i)  # what the ledger charges
        assert total <= exact(spec.epsilon)  # rounded down: no partial sum exceeds epsilon
    assert float(exact(spec.epsilon) - total) < 1e-9
    # the closed form behind it: gamma^2/(1+gamma) sum (i+1)/(1+gamma)^(i+1) = 1
    g = spec.gamma
    assert g * g / (1 + g) * sum((i + 1) / (1 + g) ** (i + 1) for i in range(2000)) == (
        pytest.approx(1.0, rel=1e-12)
    )


@pytest.mark.parametrize("gamma", [0.01, 0.1, 0.5, 0.9, 0.999])
def test_delta_epsilon_reading_matches_the_proof(gamma: float) -> None:
    # The proof's reading eps_i = (i+1) gamma^1.5 / (1+gamma)^(i+1.5) (times eps/(3 sqrt L))
    # has sum eps_i^2 = eps^2/(9L) (1+gamma)(gamma^2+2gamma+2)/(gamma+2)^3 <= 10/27 < 2.
    def proof_term(i: int) -> float:  # in log space: (1 + gamma)^i overflows
        return math.exp(math.log(i + 1) + 1.5 * math.log(gamma) - (i + 1.5) * math.log1p(gamma))

    proof = sum(proof_term(i) ** 2 for i in range(20000))
    closed = (1 + gamma) * (gamma**2 + 2 * gamma + 2) / (gamma + 2) ** 3
    assert proof == pytest.approx(closed, rel=1e-9)
    assert closed <= 10 / 27 + 1e-12 < 2
    # Algorithm 4's printed gamma^(1.5(i+1)) also sums below 2, but not to the proof's closed
    # form, and its alpha_i (proportional to (i+1)/eps_i) blows up with i.
    printed = [gamma ** (1.5 * (i + 1)) / (1 + gamma) ** (i + 1.5) for i in range(40)]
    assert sum(e * e for e in printed) < 2
    assert sum(e * e for e in printed) != pytest.approx(closed, rel=1e-3)
    assert (40 / printed[39]) / (1 / printed[0]) > 10


def test_delta_schedule_hand_values_and_squared_sum() -> None:
    eps, delta = 0.5, 1e-6
    spec = BBSchedulerSpec(epsilon=eps, beta=0.05, n=10**5, p=1.0, g=1.0, delta=delta)
    L = math.log(1 / delta)
    z = 3 * math.sqrt(L) * math.log(20) / (eps * 10**5)
    gamma = z ** (1 / 2.5)  # g^(1/(1.5p+1)) Z^(p/(1.5p+1)), p = 1
    assert spec.gamma == pytest.approx(gamma, rel=1e-14)
    assert spec.gamma == pytest.approx(0.05369515337549063, rel=1e-14)
    for i in range(5):
        hand = (i + 1) * gamma**1.5 / (1 + gamma) ** (i + 1.5) * eps / (3 * math.sqrt(L))
        assert spec.epoch_epsilon(i) == pytest.approx(hand, rel=1e-12)
    assert spec.epoch_epsilon(0) == pytest.approx(0.0005158167458143966, rel=1e-12)
    # alpha_i constant: g ((1+gamma)/gamma)^1.5 Z' with Z' = 3 sqrt(L) log(21)/(eps n)
    const = ((1 + gamma) / gamma) ** 1.5 * 3 * math.sqrt(L) * math.log(21) / (eps * 10**5)
    assert [spec.epoch_alpha(i) for i in range(5)] == pytest.approx([const] * 5, rel=1e-12)
    squares = sum(spec.epoch_epsilon(i) ** 2 for i in range(3000))
    closed = (1 + gamma) * (gamma**2 + 2 * gamma + 2) / (gamma + 2) ** 3
    assert squares == pytest.approx(eps**2 / (9 * L) * closed, rel=1e-9)
    assert squares <= 2 * eps**2 / (9 * L)
    assert squares / 2 <= spec.budget == pytest.approx(eps**2 / (9 * L))


@pytest.mark.parametrize("eps", [0.01, 0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("delta", [1e-12, 1e-6, 1e-3, 0.1])
def test_delta_reported_epsilon_at_most_configured(eps: float, delta: float) -> None:
    spec = BBSchedulerSpec(epsilon=eps, beta=0.05, n=10**12, p=1.0, g=1.0, delta=delta)
    assert spec.guaranteed_epsilon <= eps
    # Theorem 4 at the budget: rho + 2 sqrt(rho L) with rho = eps^2 / (9 L)
    L = math.log(1 / delta)
    assert spec.guaranteed_epsilon == pytest.approx(eps**2 / (9 * L) + 2 * eps / 3, rel=1e-12)


# --- BBScheduler: running ----------------------------------------------------------------


def test_synopsis_is_reused_within_an_epoch() -> None:
    box = FakeBox()
    sched = BBScheduler(pure_spec(), box, NoiseKey.for_tests(1), COORDS)
    assert sched.epoch == -1 and sched.synopsis is None
    assert sched.observe(counts_for(500), 500) is None  # before n: nothing runs
    with pytest.raises(InvalidParameterError, match="no synopsis yet"):
        sched.answer(np.ones(4), 500)
    first = sched.observe(counts_for(1000), 1000)
    assert first is not None and sched.epoch == 0 and len(box.calls) == 1
    for t in range(1001, 1145):
        assert sched.observe(counts_for(t), t) is None
    assert len(box.calls) == 1 and sched.synopsis is first
    assert sched.answer(np.array([1.0, 0, 0, 0]), 1144) == first.answer(np.array([1.0, 0, 0, 0]))
    with pytest.raises(InvalidParameterError, match="lies in epoch 1, .* observe"):
        sched.answer(np.ones(4), 1145)
    second = sched.observe(counts_for(1145), 1145)
    assert second is not None and sched.epoch == 1 and len(box.calls) == 2
    # the run gets (t, eps_i, alpha_i, beta_i) of its epoch
    n, eps, alpha, beta, _ = box.calls[1]
    assert (n, eps, alpha, beta) == (
        1145,
        sched.spec.epoch_epsilon(1),
        sched.spec.epoch_alpha(1),
        sched.spec.epoch_beta(1),
    )
    assert sched.run_epsilon == eps and sched.run_t == 1145
    with pytest.raises(InvalidParameterError, match="t must not decrease"):
        sched.observe(counts_for(1100), 1100)


def test_epochs_jumped_over_are_skipped_and_not_charged() -> None:
    box = FakeBox()
    spec = pure_spec()
    sched = BBScheduler(spec, box, NoiseKey.for_tests(1), COORDS)
    sched.observe(counts_for(1000), 1000)
    sched.observe(counts_for(1600), 1600)  # epoch 3 (1498 <= 1600 < 1714)
    assert sched.epoch == 3 and len(box.calls) == 2
    assert box.calls[1][1] == spec.epoch_epsilon(3)
    expected = exact(spec.epoch_epsilon(0)) + exact(spec.epoch_epsilon(3))
    assert sched.ledger.spent == float(expected)
    assert sched.ledger.releases == 2


def test_ledger_never_overspends_over_many_epochs() -> None:
    box = FakeBox()
    spec = pure_spec()
    sched = BBScheduler(spec, box, NoiseKey.for_tests(1), COORDS)
    counts = counts_for(1000)  # the schedulers never look at the counts themselves
    for i in range(300):
        t = spec.epoch_start(i)  # up to 10^20: beyond int64, fine as a public Python int
        assert sched.observe(counts, t) is not None
        assert sched.ledger.remaining >= 0
    assert sched.epoch == 299
    assert 0 < spec.epsilon - sched.ledger.spent < 1e-9
    assert sched.privacy_spent() == (sched.ledger.spent, 0.0)


def test_delta_ledger_and_reported_epsilon() -> None:
    box = FakeBox()
    spec = BBSchedulerSpec(epsilon=0.9, beta=0.05, n=10**5, p=1.0, g=1.0, delta=1e-6)
    sched = BBScheduler(spec, box, NoiseKey.for_tests(1), COORDS)
    assert sched.ledger.accounting == "zcdp"
    assert sched.ledger.budget == pytest.approx(0.81 / (9 * math.log(1e6)))
    for i in range(400):
        t = spec.epoch_start(i)
        sched.observe(counts_for(1000), t)
    # charged rho_i = eps_i^2 / 2, exactly
    rho = sum(exact(spec.epoch_epsilon(i)) ** 2 / 2 for i in range(400))
    assert sched.ledger.spent == float(rho)
    eps_spent, delta = sched.privacy_spent()
    assert delta == 1e-6
    assert eps_spent == pytest.approx(zcdp_to_approx_dp(float(rho), 1e-6))
    assert eps_spent <= spec.guaranteed_epsilon <= 0.9


def test_a_run_past_the_budget_is_refused_and_changes_nothing() -> None:
    box = FakeBox()
    spec = pure_spec()
    sched = BBScheduler(spec, box, NoiseKey.for_tests(1), COORDS)
    sched.observe(counts_for(1000), 1000)
    state = sched.to_state()
    # a ledger that has (somehow) spent almost everything: epoch 1 no longer fits
    state["ledger"]["spent"] = "999/1000"
    resumed = BBScheduler.from_state(state, spec, box, NoiseKey.for_tests(1), COORDS)
    before = resumed.to_state()
    calls = len(box.calls)
    with pytest.raises(BudgetExhaustedError, match="refused bbscheduler epoch 1"):
        resumed.observe(counts_for(1145), 1145)
    assert len(box.calls) == calls  # the black box never ran
    assert resumed.to_state() == before
    assert resumed.epoch == 0
    # still refused on retry, never silent
    with pytest.raises(BudgetExhaustedError):
        resumed.observe(counts_for(1200), 1200)


def test_black_box_must_match_the_spec() -> None:
    with pytest.raises(InvalidParameterError, match=r"the spec was made for g = 1\.0"):
        BBScheduler(pure_spec(), FakeBox(g=2.0), NoiseKey.for_tests(1), COORDS)
    box = FakeBox(g=3.0)
    spec = BBSchedulerSpec.for_black_box(box, epsilon=1.0, beta=0.05, n=1000)
    assert (spec.p, spec.g) == (1.0, 3.0)
    BBScheduler(spec, box, NoiseKey.for_tests(1), COORDS)
    with pytest.raises(InvalidParameterError, match="coordinates"):
        BBScheduler(spec, box, NoiseKey.for_tests(1), ("flow", 1.5))  # type: ignore[arg-type]


def test_smalldb_refused_at_construction_for_a_big_universe() -> None:
    box = SmallDB(np.eye(64))
    spec = BBSchedulerSpec.for_black_box(box, epsilon=1.0, beta=0.05, n=10**6)
    with pytest.raises(InvalidParameterError, match="SmallDB would score .* only for tiny"):
        BBScheduler(spec, box, NoiseKey.for_tests(1), COORDS)


def test_replay_gives_the_same_synopses() -> None:
    box = NoisyHistogram(8)
    spec = BBSchedulerSpec.for_black_box(box, epsilon=1.0, beta=0.05, n=10**4)

    def run(key: object, coords: tuple[str | int, ...]) -> list[np.ndarray]:
        sched = BBScheduler(spec, box, key, coords)  # type: ignore[arg-type]
        out = []
        for i in range(3):
            t = spec.epoch_start(i)
            syn = sched.observe(counts_for(t, 8), t)
            assert isinstance(syn, HistogramSynopsis)
            out.append(syn.values)
        return out

    a = run(NoiseKey.for_tests(5), COORDS)
    b = run(NoiseKey.for_tests(5), COORDS)
    c = run(NoiseKey.for_tests(5), ("flow", "bb", "key-2"))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    key = RecordingKey(5)
    run(key, COORDS)
    assert key.calls == [(*COORDS, "bbscheduler", "noisy-histogram", i, "cells") for i in range(3)]


def test_state_round_trip_continues_identically() -> None:
    box = NoisyHistogram(8)
    spec = BBSchedulerSpec.for_black_box(box, epsilon=1.0, beta=0.05, n=10**4)
    times = [
        spec.epoch_start(0),
        spec.epoch_start(0) + 7,
        spec.epoch_start(1),
        spec.epoch_start(2) + 3,
        spec.epoch_start(3),
        spec.epoch_start(5),
    ]
    straight = BBScheduler(spec, box, NoiseKey.for_tests(2), COORDS)
    outs = [straight.observe(counts_for(t, 8), t) for t in times]
    for cut in range(len(times) + 1):
        sched = BBScheduler(spec, box, NoiseKey.for_tests(2), COORDS)
        got = [sched.observe(counts_for(t, 8), t) for t in times[:cut]]
        state = json.loads(json.dumps(sched.to_state()))
        resumed = BBScheduler.from_state(state, spec, box, NoiseKey.for_tests(2), COORDS)
        assert resumed.to_state() == sched.to_state()
        got += [resumed.observe(counts_for(t, 8), t) for t in times[cut:]]
        assert got == outs
        assert resumed.ledger == straight.ledger
        assert resumed.answer(np.full(8, 0.5), times[-1]) == straight.answer(
            np.full(8, 0.5), times[-1]
        )


def test_state_is_bound_to_spec_and_black_box() -> None:
    box = NoisyHistogram(8)
    spec = BBSchedulerSpec.for_black_box(box, epsilon=1.0, beta=0.05, n=10**4)
    sched = BBScheduler(spec, box, NoiseKey.for_tests(2), COORDS)
    sched.observe(counts_for(10**4, 8), 10**4)
    state = sched.to_state()
    other = BBSchedulerSpec.for_black_box(box, epsilon=0.5, beta=0.05, n=10**4)
    with pytest.raises(InvalidParameterError, match="made with spec"):
        BBScheduler.from_state(state, other, box, NoiseKey.for_tests(2), COORDS)
    renamed = NoisyHistogram(8)
    renamed.name = "other"
    with pytest.raises(InvalidParameterError, match="made with black box 'noisy-histogram'"):
        BBScheduler.from_state(state, spec, renamed, NoiseKey.for_tests(2), COORDS)
    broken = copy.deepcopy(state)
    del broken["ledger"]
    with pytest.raises(InvalidParameterError, match="malformed bbscheduler state"):
        BBScheduler.from_state(broken, spec, box, NoiseKey.for_tests(2), COORDS)
    broken = copy.deepcopy(state)
    broken["synopsis"] = None
    with pytest.raises(InvalidParameterError, match="inconsistent"):
        BBScheduler.from_state(broken, spec, box, NoiseKey.for_tests(2), COORDS)


def test_numbers_for_the_report() -> None:
    # eps = 1, beta = 0.05, n = 10^6, NoisyHistogram with N = 2^10: g = 2 (1 + N ln 2)
    box = NoisyHistogram(2**10)
    spec = BBSchedulerSpec.for_black_box(box, epsilon=1.0, beta=0.05, n=10**6)
    assert box.g == pytest.approx(2 * (1 + 1024 * math.log(2)))
    gamma = (box.g * math.log(20) / 10**6) ** (1 / 3)
    assert spec.gamma == pytest.approx(gamma, rel=1e-14)
    assert spec.gamma == pytest.approx(0.16209, abs=1e-5)
    assert [round(spec.epoch_epsilon(i), 5) for i in range(5)] == [
        0.01946,
        0.03348,
        0.04322,
        0.04959,
        0.05334,
    ]
    assert [round(spec.epoch_alpha(i), 4) for i in range(5)] == [0.2225] * 5
    assert [spec.epoch_start(i) for i in range(5)] == [1000000, 1162091, 1350454, 1569349, 1823725]


# --- BBImprover ----------------------------------------------------------------------------


def improver_spec(**kw) -> BBImproverSpec:
    args = {
        "epsilon": 0.5,
        "delta": 1e-6,
        "beta": 0.05,
        "n": 100,
        "c": 0.1,
        "p": 1.0,
        "p_prime": 1.0,
        "p_double_prime": 0.0,
        "g": 1.0,
    }
    args.update(kw)
    return BBImproverSpec(**args)


def test_improver_refuses_delta_zero_and_bad_parameters() -> None:
    with pytest.raises(InvalidParameterError, match=r"needs delta > 0: .*Theorem 29 .*only"):
        improver_spec(delta=0)
    with pytest.raises(InvalidParameterError, match=r"needs delta > 0"):
        improver_spec(delta=0.0)
    with pytest.raises(InvalidParameterError, match=r"delta must be in \(0, 1\)"):
        improver_spec(delta=1.0)
    with pytest.raises(InvalidParameterError, match="c must be finite and > 0"):
        improver_spec(c=0)
    with pytest.raises(InvalidParameterError, match=r"n = 1 must be >= 2c = 3\.0"):
        improver_spec(n=1, c=1.5)
    with pytest.raises(InvalidParameterError, match="p_prime must be finite and >= 0"):
        improver_spec(p_prime=-1)
    with pytest.raises(InvalidParameterError, match="converts to epsilon"):
        improver_spec(epsilon=8.0, delta=0.5)


def test_improver_schedule_hand_values() -> None:
    spec = improver_spec()
    L = math.log(1e6)
    for t in (100, 101, 1000, 10**9):
        hand = math.sqrt(0.1) / (3 * math.sqrt(L)) * 0.5 / t**0.6
        assert spec.run_epsilon(t) == pytest.approx(hand, rel=1e-13)
        assert spec.run_beta(t) == pytest.approx(0.05 / (2 * t * t), rel=1e-15)
        # alpha_t = g (1/(eps_t t))^p log^p''(t) log^p'(1/beta_t), p = p' = 1, p'' = 0
        alpha = 1 / (hand * t) * math.log(2 * t * t / 0.05)
        assert spec.accuracy(t) == pytest.approx(alpha, rel=1e-12)
    assert spec.run_epsilon(100) == pytest.approx(0.0008946749548835241, rel=1e-13)
    with pytest.raises(InvalidParameterError, match="runs from t = n = 100 on"):
        spec.run_epsilon(99)


@pytest.mark.parametrize(("n", "c"), [(1, 0.01), (1, 0.5), (100, 0.1), (10**4, 0.2)])
def test_improver_cdp_sum_bound(n: int, c: float) -> None:
    spec = improver_spec(n=n, c=c)
    L = math.log(1e6)
    # sum_{t >= n} eps_t^2 = c eps^2 / (9 L) sum t^-(1+2c); bound the tail past T by the integral
    T = n + 200_000
    t = np.arange(n, T, dtype=np.float64)
    head = float(np.sum((math.sqrt(c) / (3 * math.sqrt(L)) * 0.5 / t ** (0.5 + c)) ** 2))
    tail = c * 0.25 / (9 * L) * (T - 1) ** (-2 * c) / (2 * c)
    assert head + tail <= spec.squared_sum_bound() <= 0.25 / (9 * L)  # (D.2)
    assert spec.budget == pytest.approx(0.25 / (18 * L))
    assert spec.guaranteed_epsilon <= 0.5


def test_improver_runs_at_every_new_t_and_skipping_only_lowers_the_cost() -> None:
    spec = improver_spec()
    full = BBImprover(spec, FakeBox(), NoiseKey.for_tests(1), COORDS)
    sparse = BBImprover(spec, FakeBox(), NoiseKey.for_tests(1), COORDS)
    assert full.observe(counts_for(50), 50) is None
    for t in range(100, 600):
        assert full.observe(counts_for(t), t) is not None
        if t % 7 == 0:
            sparse.observe(counts_for(t), t)
    assert full.observe(counts_for(599), 599) is None  # the same t again: no rerun
    assert len(full.black_box.calls) == 500  # type: ignore[attr-defined]
    assert sparse.ledger.spent < full.ledger.spent <= full.ledger.budget
    rho = sum(exact(spec.run_epsilon(t)) ** 2 / 2 for t in range(100, 600))
    assert full.ledger.spent == float(rho)
    eps_spent, delta = full.privacy_spent()
    assert delta == 1e-6 and eps_spent <= spec.guaranteed_epsilon <= 0.5
    n, eps, alpha, beta, _ = full.black_box.calls[-1]  # type: ignore[attr-defined]
    assert (n, eps, alpha, beta) == (
        599,
        spec.run_epsilon(599),
        spec.accuracy(599),
        spec.run_beta(599),
    )
    assert full.answer(np.ones(4), 599) == pytest.approx(1.0)
    with pytest.raises(InvalidParameterError, match="no synopsis for t = 600"):
        full.answer(np.ones(4), 600)


def test_improver_budget_exhaustion_is_explicit() -> None:
    spec = improver_spec()
    imp = BBImprover(spec, FakeBox(), NoiseKey.for_tests(1), COORDS)
    imp.observe(counts_for(100), 100)
    state = imp.to_state()
    state["ledger"]["spent"] = state["ledger"]["budget"]
    resumed = BBImprover.from_state(state, spec, imp.black_box, NoiseKey.for_tests(1), COORDS)
    with pytest.raises(BudgetExhaustedError, match="refused bbimprover t=101"):
        resumed.observe(counts_for(101), 101)
    assert resumed.run_t == 100


def test_improver_replay_and_state_round_trip() -> None:
    box = NoisyHistogram(8)
    spec = BBImproverSpec.for_black_box(box, epsilon=0.5, delta=1e-6, beta=0.05, n=1000, c=0.1)
    times = [1000, 1001, 1005, 1100]
    a = BBImprover(spec, box, NoiseKey.for_tests(3), COORDS)
    outs = [a.observe(counts_for(t, 8), t) for t in times]
    key = RecordingKey(3)
    b = BBImprover(spec, box, key, COORDS)  # type: ignore[arg-type]
    assert [b.observe(counts_for(t, 8), t) for t in times] == outs
    assert key.calls == [(*COORDS, "bbimprover", "noisy-histogram", t, "cells") for t in times]
    c = BBImprover(spec, box, NoiseKey.for_tests(3), COORDS)
    c.observe(counts_for(1000, 8), 1000)
    state = json.loads(json.dumps(c.to_state()))
    d = BBImprover.from_state(state, spec, box, NoiseKey.for_tests(3), COORDS)
    assert [d.observe(counts_for(t, 8), t) for t in times[1:]] == outs[1:]
    assert d.ledger == a.ledger
    with pytest.raises(InvalidParameterError, match="not a bbscheduler state .* kind .bbimprover."):
        BBScheduler.from_state(
            state,
            BBSchedulerSpec.for_black_box(box, epsilon=1.0, beta=0.05, n=10**4),
            box,
            NoiseKey.for_tests(3),
            COORDS,
        )
