"""Unit and accounting tests of PMWG (dpstream.core.pmwg.mechanism)."""

from __future__ import annotations

import math
import pickle
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fakes import DenseQuery
from support.recording import RecordingKey

from dpstream.core.accounting.ledger import exact, zcdp_to_approx_dp
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.pmwg.guarantee import accuracy_guarantee
from dpstream.core.pmwg.hard_query_sums import hard_query_increment
from dpstream.core.pmwg.mechanism import (
    HARD_BUDGET_EXCEEDED,
    PRIVACY_BUDGET_EXHAUSTED,
    LinearQueryLike,
    Pmwg,
)
from dpstream.core.pmwg.sparse_vector import NumericSparse, _floor_log2, _round_half_up
from dpstream.core.pmwg.spec import PmwgSpec
from dpstream.errors import InvalidParameterError

COORDS = ("flow-instance", "pmwg", "key-1")


def _protocol_check(q: LinearQueryLike) -> LinearQueryLike:  # mypy-style structural check
    return q


def spec_of(**kw) -> PmwgSpec:
    base = dict(epsilon=1.0, delta=0.0, alpha=0.05, beta=0.05, n=10**6, universe_size=2**16)
    base.update(kw)
    return PmwgSpec(**base)


def precise(
    n=100, cells=4, alpha=0.3, threshold=None, cap=10, epsilon=1000.0, delta=0.0, **kw
) -> PmwgSpec:
    """A practical spec (beta = 0.05); by default its noise is negligible (xi_n ~ 10^4 per
    fraction unit). ``kw`` goes to PmwgSpec (e.g. ``accounting``)."""
    return PmwgSpec(
        epsilon=epsilon,
        delta=delta,
        alpha=alpha,
        beta=0.05,
        n=n,
        universe_size=cells,
        mode="practical",
        hard_query_cap=cap,
        threshold=threshold,
        **kw,
    )


# --- spec validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(alpha=1.5), r"alpha must be in \(0, 1\), got 1.5"),
        (dict(alpha=0), r"alpha must be in \(0, 1\), got 0"),
        (dict(beta=1.0), r"beta must be in \(0, 1\), got 1.0"),
        (dict(epsilon=-1), r"epsilon must be finite and > 0, got -1"),
        (dict(epsilon=math.inf), r"epsilon must be a finite number, got inf"),
        (dict(delta=1e-6), r"delta must be 0 with accounting 'pure', got 1e-06"),
        (dict(accounting="zcdp"), r"delta must be in \(0, 1\) with accounting 'zcdp', got 0.0"),
        (dict(accounting="rdp"), r"accounting must be one of \('pure', 'zcdp'\), got 'rdp'"),
        (dict(n=1), r"n must be an integer >= 2, got 1"),
        (dict(n=2.5), r"n must be an integer >= 2, got 2.5"),
        (dict(universe_size=1), r"universe_size must be an integer >= 2, got 1"),
        (dict(p=1.0), r"p must be in \[0, 1\), got 1.0"),
        (dict(mode="fast"), r"mode must be one of \('paper', 'solved', 'practical'\)"),
        (
            dict(mode="practical"),
            r"hard_query_cap must be an integer >= 1 in mode 'practical', got None",
        ),
        (
            dict(hard_query_cap=5),
            r"hard_query_cap is only used in mode 'practical', got 5 with mode 'paper'",
        ),
        (dict(threshold=0.0), r"threshold must be in \(0, 1\], got 0.0"),
    ],
)
def test_spec_validation_messages(kw, message) -> None:
    base = dict(epsilon=1.0, delta=0.0, alpha=0.05, beta=0.05, n=1000, universe_size=64)
    base.update(kw)
    with pytest.raises(InvalidParameterError, match=message):
        PmwgSpec(**base)


def test_paper_spec_refused_when_its_computed_cost_exceeds_epsilon() -> None:
    # the paper's constants need n >= 21 (Theorem 5): at n = 2, N = 2 the sum is ~1.59 eps
    with pytest.raises(InvalidParameterError, match="exceeds the budget 1 with the paper's"):
        spec_of(n=2, universe_size=2)
    # the same parameters work when c is solved
    spec = spec_of(n=2, universe_size=2, mode="solved")
    assert spec.worst_case_cost() <= 1.0


# --- the noise function ---------------------------------------------------------------------


def test_xi_formulas_against_hand_values() -> None:
    # Algorithm 1, delta = 0: alpha^2 n^(1/2) eps t^(1/2) / (162 log(N n))
    spec = spec_of()
    log_nn = 16 * math.log(2) + 6 * math.log(10)  # log(2^16 * 10^6) = 24.90587...
    assert math.isclose(log_nn, 24.9058654, rel_tol=1e-8)
    c = 0.05**2 * 1000 / (162 * log_nn)
    assert math.isclose(spec.xi(10**6), c * 1000, rel_tol=1e-14)
    assert math.isclose(spec.xi(10**6), 0.6196170, rel_tol=1e-6)  # the brief's "~0.62"
    assert math.isclose(spec.xi(4 * 10**6), 2 * spec.xi(10**6), rel_tol=1e-15)
    # (B.5), delta = 0, p = 3/4: alpha^2 (1-p)^2 n^(1-p) eps t^p / (126 log(N n))
    spec = spec_of(p=0.75, n=10**4, universe_size=3, alpha=0.2, epsilon=2.0)
    c = 0.04 * 0.0625 * 10.0 * 2.0 / (126 * math.log(3 * 10**4))
    assert math.isclose(spec.xi(10**4), c * 1000.0, rel_tol=1e-13)
    assert math.isclose(spec.xi(10**4), 0.0384933, rel_tol=1e-6)
    # delta > 0, p = 1/2: alpha n^(1/2) eps t^(1/2) / (48 log^(1/2)(N n) log^(1/2)(1/delta))
    spec = spec_of(accounting="zcdp", delta=1e-6)
    c = 0.05 * 1000 / (48 * math.sqrt(log_nn) * math.sqrt(6 * math.log(10)))
    assert math.isclose(spec.xi(10**6), c * 1000, rel_tol=1e-13)
    assert math.isclose(spec.xi(10**6), 56.15578, rel_tol=1e-6)
    # (B.5), delta > 0, p = 0.3
    spec = spec_of(accounting="zcdp", delta=1e-5, p=0.3, n=500, universe_size=10)
    c = 0.05 * 0.7 * 500**0.7 / (24 * math.sqrt(math.log(5000)) * math.sqrt(math.log(1e5)))
    assert math.isclose(spec.xi(800), c * 800**0.3, rel_tol=1e-13)


def test_p_half_uses_algorithm_1_constant_not_b5() -> None:
    # at p = 1/2, delta = 0, (B.5) would give 126 / (1/2)^2 = 504 in place of 162
    spec = spec_of()
    b5 = 0.05**2 * 0.25 * 1000 / (126 * math.log(2**16 * 10**6))
    assert math.isclose(spec.paper_coefficient / b5, 504 / 162, rel_tol=1e-12)
    # with delta > 0 both give 48 at p = 1/2
    zspec = spec_of(accounting="zcdp", delta=1e-6)
    b5z = 0.05 * 0.5 * 1000 / (24 * math.sqrt(math.log(2**16 * 10**6) * math.log(1e6)))
    assert math.isclose(zspec.paper_coefficient, b5z, rel_tol=1e-14)


def test_xi_rejects_times_before_n() -> None:
    spec = precise()
    with pytest.raises(InvalidParameterError, match="t must be an integer >= n = 100, got 99"):
        spec.xi(99)
    with pytest.raises(InvalidParameterError, match="t must be <= 2\\^48"):
        spec.xi(2**48 + 1)


def test_grid_is_a_power_of_two_tied_to_xi_delta() -> None:
    for spec in (spec_of(), precise(), spec_of(accounting="zcdp", delta=1e-6, p=0.3)):
        for t in (spec.n, spec.n + 1, 3 * spec.n, 10**9):
            g = Fraction(2) ** spec.grid_exponent(t)
            ratio = Fraction(spec.xi(t)) / t
            assert ratio / 2**33 < g <= ratio / 2**32
            s = spec.sensitivity_bound(t)
            assert s == ratio * (1 + Fraction(1, 10**12)) + g


def test_exact_helpers() -> None:
    assert [_round_half_up(Fraction(k, 2)) for k in range(-5, 6)] == [
        -2,
        -2,
        -1,
        -1,
        0,
        0,
        1,
        1,
        2,
        2,
        3,
    ]
    assert _round_half_up(Fraction(-7, 3)) == -2 and _round_half_up(Fraction(7, 3)) == 2
    for x in (
        Fraction(1),
        Fraction(3, 4),
        Fraction(1, 3),
        Fraction(1024),
        Fraction(1023),
        Fraction(5, 1 << 70),
        Fraction(0.6196170455637957),
    ):
        k = _floor_log2(x)
        assert Fraction(2) ** k <= x < Fraction(2) ** (k + 1)


# --- the histogram updates ------------------------------------------------------------------


def _hand_mw(y, weights, rate, towards_one):
    y = np.asarray(y, dtype=float)
    w = np.asarray(weights, dtype=float)
    r = (1 - w) if towards_one else w
    out = np.exp(-rate * r) * y
    return out / out.sum()


def test_mw_update_r_equals_one_minus_f() -> None:
    spec = precise()
    pm = Pmwg(spec, NoiseKey.for_tests(1), COORDS)
    q = DenseQuery([1.0, 0.5, 0.0, 0.0])
    counts = np.array([100, 0, 0, 0], dtype=np.int64)  # f(D) = 1 > f(y) = 0.375: hard, a > f(y)
    ans = pm.answer(q, counts, 100)
    assert ans.kind == "hard" and abs(ans.value - 1.0) < 0.01
    expected = _hand_mw([0.25] * 4, [1, 0.5, 0, 0], 0.05, towards_one=True)
    # by hand: proportional to [1, e^(-alpha/12), e^(-alpha/6), e^(-alpha/6)], alpha = 0.3
    by_hand = np.array([1, math.exp(-0.025), math.exp(-0.05), math.exp(-0.05)])
    np.testing.assert_allclose(expected, by_hand / by_hand.sum(), rtol=1e-15)
    np.testing.assert_allclose(pm.histogram(), expected, rtol=1e-14)


def test_mw_update_r_equals_f() -> None:
    spec = precise()
    pm = Pmwg(spec, NoiseKey.for_tests(2), COORDS)
    q = DenseQuery([1.0, 0.5, 0.0, 0.0])
    counts = np.array([0, 0, 50, 50], dtype=np.int64)  # f(D) = 0 < f(y) = 0.375: a < f(y)
    ans = pm.answer(q, counts, 100)
    assert ans.kind == "hard" and abs(ans.value) < 0.01
    by_hand = np.array([math.exp(-0.05), math.exp(-0.025), 1, 1])
    np.testing.assert_allclose(pm.histogram(), by_hand / by_hand.sum(), rtol=1e-14)


def test_uniform_update_then_mw_by_hand() -> None:
    spec = precise()
    pm = Pmwg(spec, NoiseKey.for_tests(3), COORDS)
    q = DenseQuery([1.0, 0.5, 0.0, 0.0])
    pm.answer(q, np.array([100, 0, 0, 0], dtype=np.int64), 100)
    y1 = _hand_mw([0.25] * 4, [1, 0.5, 0, 0], 0.05, towards_one=True)
    zero = DenseQuery([0.0] * 4)  # f = 0 on every database: easy (no MW step)
    ans = pm.answer(zero, np.array([150, 0, 0, 0], dtype=np.int64), 150)
    assert ans.kind == "easy" and ans.value == 0.0
    y2 = (100 / 150) * y1 + (50 / 150) * 0.25  # y <- (t'/t) y + ((t - t')/t) (1/N)
    np.testing.assert_allclose(pm.histogram(), y2, rtol=1e-14)
    assert math.isclose(pm.mass, 1.0, rel_tol=1e-15)
    # a second query at the same t makes no second uniform update
    pm.answer(zero, np.array([150, 0, 0, 0], dtype=np.int64), 150)
    np.testing.assert_allclose(pm.histogram(), y2, rtol=1e-14)
    # then a hard query with r = f at t = 150
    q2 = DenseQuery([0.0, 0.0, 1.0, 0.25])
    ans = pm.answer(q2, np.array([0, 0, 150, 0], dtype=np.int64), 150)
    assert ans.kind == "hard" and ans.value > pm.spec.threshold_value
    np.testing.assert_allclose(
        pm.histogram(), _hand_mw(y2, [0, 0, 1, 0.25], 0.05, True), rtol=1e-14
    )


def test_lazy_mass_equals_dense_normalisation() -> None:
    rng = np.random.default_rng(7)
    cells = 64
    spec = precise(cells=cells, n=1000, alpha=0.2, threshold=0.01, cap=400, epsilon=1e5)
    pm = Pmwg(spec, NoiseKey.for_tests(4), COORDS)
    probs = rng.dirichlet(np.full(cells, 0.3))
    events = rng.choice(cells, size=5000, p=probs)
    hard = 0
    for t in range(1000, 5000, 50):
        counts = np.bincount(events[:t], minlength=cells).astype(np.int64)
        for _ in range(3):
            q = DenseQuery(rng.random(cells) * (rng.random(cells) < 0.4))
            ans = pm.answer(q, counts, t)
            hard += ans.kind == "hard"
            state = pm.to_state()
            z = np.frombuffer(state["histogram"], dtype="<f8")
            assert math.isclose(state["mass"], float(z.sum()), rel_tol=1e-12)
    assert hard > 50  # the check above ran over many multiplicative steps


def test_mass_is_rescaled_before_it_overflows() -> None:
    spec = precise(cells=2, n=100, alpha=0.9, threshold=0.01, cap=10, epsilon=1e4)
    pm = Pmwg(spec, NoiseKey.for_tests(5), COORDS)
    q = DenseQuery([1.0, 0.0])
    for _ in range(5000):
        pm._z *= 1e10  # simulate a long drift of the unnormalised histogram
        pm._mass *= 1e10
        pm._rescale_if_needed()
        assert 1e-200 <= pm.mass <= 1e200
    assert pm.answer(q, np.array([50, 50], dtype=np.int64), 100).kind in ("easy", "hard")


# --- hard-query budget ----------------------------------------------------------------------


def test_hard_query_bound_against_a_direct_loop() -> None:
    for n, cells, alpha in ((30, 3, 0.3), (21, 64, 0.1), (500, 2**10, 0.05)):
        spec = spec_of(n=n, universe_size=cells, alpha=alpha, mode="solved")
        total = math.log(cells)
        for t in range(n, n + 400):
            if t > n:
                total += math.log(cells) / t + math.log(t - 1) / t + math.log(t / (t - 1))
            bound = 36 / alpha**2 * total
            got = spec.hard_query_bound(t)
            if abs(bound - round(bound)) > 1e-6:
                assert got == math.floor(bound), (n, t)
            else:
                assert got in (math.floor(bound) - 1, math.floor(bound))
    assert hard_query_increment(3, 50, 50) == 0.0


def test_hard_query_increment_is_additive_over_jumps() -> None:
    whole = hard_query_increment(2**16, 1000, 3_000_000)
    parts = math.fsum(
        hard_query_increment(2**16, a, b)
        for a, b in ((1000, 1001), (1001, 77_777), (77_777, 2_999_999), (2_999_999, 3_000_000))
    )
    assert math.isclose(whole, parts, rel_tol=1e-13)


def test_bottom_halts_for_good_at_the_hard_query_cap() -> None:
    # alpha = 0.9, N = 2: cap at t = n is floor(36/0.81 log 2) = 30; threshold 0.01 keeps every
    # query hard until f(y) is within 0.01 of f(D) = 1, i.e. for ~31 multiplicative steps
    spec = precise(cells=2, n=100, alpha=0.9, threshold=0.01, cap=100, epsilon=1e4)
    assert spec.hard_query_bound(100) == 30
    pm = Pmwg(spec, NoiseKey.for_tests(6), COORDS)
    q = DenseQuery([1.0, 0.0])
    counts = np.array([100, 0], dtype=np.int64)
    answers = [pm.answer(q, counts, 100) for _ in range(30)]
    assert all(a.kind == "hard" for a in answers)
    last = pm.answer(q, counts, 100)
    assert last.kind == "bottom" and last.value is None and last.reason == HARD_BUDGET_EXCEEDED
    assert pm.hard_queries == 31 == pm.halted_rounds
    spent = pm.ledger.spent
    for t in (100, 150, 10**6):
        later = pm.answer(DenseQuery([0.5, 0.5]), np.array([t, 0], dtype=np.int64), t)
        assert (later.kind, later.value, later.reason) == ("bottom", None, HARD_BUDGET_EXCEEDED)
        assert later.hard_queries == 31 and later.spent == spent
    assert pm.rounds_started == 31  # nothing was drawn after the halt


def test_practical_mode_refuses_the_round_it_cannot_pay_and_halts() -> None:
    spec = precise(cells=2, n=100, alpha=0.9, threshold=0.01, cap=3, epsilon=30.0)
    charge = spec.round_charge(100)
    assert 3 * exact(charge.epsilon) <= exact(30.0) < 4 * exact(charge.epsilon)
    pm = Pmwg(spec, NoiseKey.for_tests(7), COORDS)
    assert pm.ledger.spent == 0
    q = DenseQuery([1.0, 0.0])
    counts = np.array([100, 0], dtype=np.int64)
    got = [pm.answer(q, counts, 100) for _ in range(3)]
    assert [a.kind for a in got] == ["hard"] * 3
    assert [a.spent for a in got] == [float(k * exact(charge.epsilon)) for k in (1, 2, 3)]
    refused = pm.answer(q, counts, 100)
    assert refused.kind == "bottom" and refused.reason == PRIVACY_BUDGET_EXHAUSTED
    assert pm.ledger.spent <= 30.0 and pm.rounds_started == 3
    later = pm.answer(q, np.array([10**6, 0], dtype=np.int64), 10**6)
    assert later.reason == PRIVACY_BUDGET_EXHAUSTED  # even though a later round is cheaper


def test_practical_mode_sizes_c_for_the_cap_and_charges_at_round_start() -> None:
    for accounting, delta in (("pure", 0.0), ("zcdp", 1e-6)):
        spec = precise(
            n=1000, cells=64, alpha=0.1, cap=50, epsilon=2.0, delta=delta, accounting=accounting
        )
        per = spec.round_charge(1000)
        cost = exact(per.epsilon if accounting == "pure" else per.rho)
        budget = exact(spec.budget)
        assert 50 * cost <= budget < 50 * cost * (1 + Fraction(1, 10**9))
        s = spec.sensitivity_bound(1000)
        expected = s * Fraction(9, 8) if accounting == "pure" else (s * s + (s / 8) ** 2) / 2
        assert expected <= cost <= expected * (1 + Fraction(1, 10**15))
        # later rounds are cheaper (xi Delta is non-increasing)
        later = spec.round_charge(4000)
        assert (later.epsilon if accounting == "pure" else later.rho) < float(cost)


# --- NSG: the double-halt issue ---------------------------------------------------------------


def _noisy_calls(spec: PmwgSpec, steps: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    cells = int(spec.universe_size)
    calls = []
    for k in range(steps):
        t = int(spec.n) + 10 * (k // 4)
        counts = rng.multinomial(t, np.full(cells, 1 / cells)).astype(np.int64)
        calls.append((DenseQuery(rng.random(cells)), counts, t))
    return calls


def _noisy_run(pm: Pmwg, steps: int, seed: int) -> list:
    return [pm.answer(*call) for call in _noisy_calls(pm.spec, steps, seed)]


def _often_halting_spec() -> PmwgSpec:
    # small xi: noise of the order of the threshold, so NSG halts often and on either f'
    return precise(n=1000, cells=8, alpha=0.3, cap=400, epsilon=5.0)


def test_halted_rounds_equal_hard_queries() -> None:
    spec = _often_halting_spec()
    pm = Pmwg(spec, NoiseKey.for_tests(8), COORDS)
    answers = _noisy_run(pm, 300, seed=1)
    kinds = [a.kind for a in answers]
    assert kinds.count("hard") > 20 and kinds.count("easy") > 20
    assert pm.halted_rounds == pm.hard_queries == kinds.count("hard")
    assert pm.rounds_started in (pm.halted_rounds, pm.halted_rounds + 1)


def test_asking_both_can_halt_two_rounds_for_one_hard_query() -> None:
    # Algorithm 1 read literally: f'_{2j} is sent after f'_{2j-1} halted (tests only)
    spec = _often_halting_spec()
    pm = Pmwg(spec, NoiseKey.for_tests(8), COORDS)
    pm._ask_both = True
    doubles = 0
    for call in _noisy_calls(spec, 300, seed=1):
        before = pm.halted_rounds
        a = pm.answer(*call)
        assert pm.halted_rounds - before <= (2 if a.kind == "hard" else 0)
        doubles += pm.halted_rounds - before == 2
    assert pm.halted_rounds > pm.hard_queries  # (B.1) would undercount this variant
    assert doubles > 0


def test_second_f_prime_is_not_asked_after_the_first_halts() -> None:
    key = RecordingKey(9)
    spec = precise()
    pm = Pmwg(spec, key, COORDS)  # type: ignore[arg-type]
    base = (*COORDS, "pmwg", spec.digest, "natg")
    pm.answer(DenseQuery([1.0, 0, 0, 0]), np.array([100, 0, 0, 0], dtype=np.int64), 100)
    assert key.calls == [(*base, 0, "threshold"), (*base, 0, 0, "f'", 1), (*base, 0, "answer")]
    key.calls.clear()
    # f(D) < f(y): f'_1 does not halt, f'_2 does (new round 1)
    pm.answer(DenseQuery([0, 0, 0, 1.0]), np.array([100, 0, 0, 0], dtype=np.int64), 100)
    assert key.calls == [
        (*base, 1, "threshold"),
        (*base, 1, 0, "f'", 1),
        (*base, 1, 0, "f'", 2),
        (*base, 1, "answer"),
    ]
    key.calls.clear()
    # an easy query asks both in the open round 2, then the next query has index 1
    zero = DenseQuery([0.0] * 4)
    pm.answer(zero, np.array([100, 0, 0, 0], dtype=np.int64), 100)
    pm.answer(zero, np.array([100, 0, 0, 0], dtype=np.int64), 100)
    assert key.calls == [
        (*base, 2, "threshold"),
        (*base, 2, 0, "f'", 1),
        (*base, 2, 0, "f'", 2),
        (*base, 2, 1, "f'", 1),
        (*base, 2, 1, "f'", 2),
    ]


def test_numeric_sparse_requires_an_open_round() -> None:
    nsg = NumericSparse(NoiseKey.for_tests(1), ("x",))
    with pytest.raises(InvalidParameterError, match="no NSG round is open"):
        nsg.compare(Fraction(0), 1)
    nsg.start_round(-40)
    with pytest.raises(InvalidParameterError, match="already open"):
        nsg.start_round(-40)
    assert nsg.compare(Fraction(10**6), 1)  # far above: halts
    value = nsg.answer(Fraction(3), -40)
    assert value.denominator <= 2**40 and abs(value - 3) < 1000
    assert not nsg.is_open and nsg.halted_rounds == 1 and nsg.round_index == 1


# --- state, replay ----------------------------------------------------------------------------


def _stream(seed: int, steps: int, cells: int = 16, n: int = 500):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(cells, 0.5))
    events = rng.choice(cells, size=n + 10 * steps, p=probs)
    calls = []
    for k in range(steps):
        t = n + 10 * (k // 3)
        counts = np.bincount(events[:t], minlength=cells).astype(np.int64)
        calls.append(
            (DenseQuery(rng.random(cells) * (rng.random(cells) < 0.5), f"q{k}"), counts, t)
        )
    return calls


def _stream_spec(**kw) -> PmwgSpec:
    """A practical spec over _stream's 16 cells from n = 500, with 60 hard queries."""
    return precise(n=500, cells=16, alpha=0.2, cap=60, epsilon=20.0, **kw)


@pytest.mark.parametrize("accounting", ["pure", "zcdp"])
def test_state_round_trip_gives_identical_answers(accounting) -> None:
    spec = _stream_spec(delta=0.0 if accounting == "pure" else 1e-6, accounting=accounting)
    calls = _stream(3, 120)
    key = NoiseKey.for_tests(10)
    a = Pmwg(spec, key, COORDS)
    for call in calls[:60]:
        a.answer(*call)
    state = pickle.loads(pickle.dumps(a.to_state()))
    b = Pmwg(spec, key, COORDS, state=state)
    assert b.to_state() == a.to_state()
    rest_a = [a.answer(*call) for call in calls[60:]]
    rest_b = [b.answer(*call) for call in calls[60:]]
    assert rest_a == rest_b
    assert sum(x.kind == "hard" for x in rest_a) > 3
    assert a.to_state() == b.to_state() and a.ledger == b.ledger


_ROUND_TRIP_SPEC = precise(n=500, cells=16, alpha=0.3, cap=30, epsilon=5.0)


@settings(max_examples=25, deadline=None)
@given(split=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_snapshot_restore_gives_identical_releases(split, seed) -> None:
    calls = _stream(seed, 40)
    key = NoiseKey.for_tests(seed)
    straight = Pmwg(_ROUND_TRIP_SPEC, key, COORDS)
    expected = [straight.answer(*c) for c in calls]
    first = Pmwg(_ROUND_TRIP_SPEC, key, COORDS)
    got = [first.answer(*c) for c in calls[:split]]
    resumed = Pmwg(_ROUND_TRIP_SPEC, key, COORDS, state=pickle.loads(pickle.dumps(
        first.to_state())))
    got += [resumed.answer(*c) for c in calls[split:]]
    assert got == expected


def test_state_of_another_spec_is_refused() -> None:
    spec = precise()
    pm = Pmwg(spec, NoiseKey.for_tests(1), COORDS)
    other = precise(alpha=0.2)
    with pytest.raises(InvalidParameterError, match="other parameters"):
        Pmwg(other, NoiseKey.for_tests(1), COORDS, state=pm.to_state())
    with pytest.raises(InvalidParameterError, match="malformed PMWG state"):
        Pmwg(spec, NoiseKey.for_tests(1), COORDS, state={"version": 1, "digest": spec.digest})


def test_replay_is_identical_and_coordinates_change_the_noise() -> None:
    spec = _stream_spec()
    calls = _stream(4, 90)
    key = NoiseKey.for_tests(11)
    first = Pmwg(spec, key, COORDS)
    run1 = [first.answer(*c) for c in calls]
    again = Pmwg(spec, key, COORDS)
    run2 = [again.answer(*c) for c in calls]
    assert run1 == run2
    other = Pmwg(spec, key, ("flow-instance", "pmwg", "key-2"))
    run3 = [other.answer(*c) for c in calls]
    hard1 = [a.value for a in run1 if a.kind == "hard"]
    assert hard1 and run3 != run1
    # the first hard answer differs only by its noise, which is different
    first_hard = next(i for i, a in enumerate(run1) if a.kind == "hard")
    if run3[first_hard].kind == "hard":
        assert run3[first_hard].value != run1[first_hard].value


def test_noise_is_bound_to_the_parameters() -> None:
    a = precise()
    b = precise(epsilon=999.0)
    assert a.digest != b.digest and a.digest == precise().digest


# --- input checks ----------------------------------------------------------------------------


def test_time_and_counts_checks() -> None:
    pm = Pmwg(precise(), NoiseKey.for_tests(1), COORDS)
    q = DenseQuery([1.0, 0, 0, 0])
    counts = np.array([100, 0, 0, 0], dtype=np.int64)
    pm.answer(q, counts, 120)
    with pytest.raises(InvalidParameterError, match="t must be non-decreasing: got 110 after 120"):
        pm.answer(q, counts, 110)
    with pytest.raises(InvalidParameterError, match="t must be an integer >= n = 100"):
        pm.answer(q, counts, True)  # type: ignore[arg-type]
    with pytest.raises(
        InvalidParameterError,
        match=r"counts must be an integer numpy array of "
        r"shape \(4,\), got shape \(3,\) and dtype int64",
    ):
        pm.answer(q, np.array([7, 8, 9], dtype=np.int64), 120)
    with pytest.raises(InvalidParameterError, match="dtype float64"):
        pm.answer(q, counts.astype(float), 120)


def test_protocol_is_satisfied_by_the_dense_query() -> None:
    q = _protocol_check(DenseQuery([0.25, 1.0]))
    assert q.support_size == 2
    assert q.weighted_count(np.array([4, 3])) == 4 * 16384 + 3 * 65536


# --- accounting ---------------------------------------------------------------------------------


def _independent_sum(n: int, cells: int, q: float, terms_to: int = 10**6):
    """Return (lower, upper) bounds of sum_{t>n} b_t t^-q by direct summation plus tails."""
    t = np.arange(n + 1, terms_to + 1, dtype=np.float64)
    b = math.log(cells) / t + np.log(t - 1) / t + np.log(t / (t - 1))
    exact_part = math.fsum((b * t**-q).tolist())
    big = float(terms_to)
    log_n = math.log(cells)
    # upper: decreasing majorants integrated from T
    upper = log_n * big**-q / q + big**-q * (math.log(big) / q + 1 / q**2) + (big - 1) ** -q / q
    # lower: integrals from T + 1 of minorants (log(t-1) >= log t - 1/(t-1), log(t/(t-1)) >= 1/t)
    b1 = big + 1
    lower = (
        log_n * b1**-q / q
        + b1**-q * (math.log(b1) / q + 1 / q**2)
        - big ** (-1 - q) / (1 + q)
        + b1**-q / q
    )
    return exact_part + lower, exact_part + upper


CONFIGS = [  # alpha, eps, N, n, p
    (0.05, 1.0, 2**16, 10**5, 0.5),
    (0.1, 0.5, 3, 21, 0.5),
    (0.3, 2.0, 1000, 5000, 0.25),
    (0.02, 1.0, 2**20, 300, 0.75),
    (0.2, 1.0, 64, 17, 0.9),
]


@pytest.mark.parametrize(("alpha", "eps", "cells", "n", "p"), CONFIGS)
def test_b1_numerics_against_an_independent_direct_summation(alpha, eps, cells, n, p) -> None:
    spec = spec_of(alpha=alpha, epsilon=eps, universe_size=cells, n=n, p=p, mode="solved")
    c = spec.xi_coefficient
    q = 1 - p
    lo, hi = _independent_sum(n, cells, q)
    k = 81 / (2 * alpha**2)
    head = (1 + k * math.log(cells)) * c * n**-q
    b1_lo, b1_hi = head + k * c * lo, head + k * c * hi
    got = spec.paper_sum()
    assert b1_lo * (1 - 1e-12) <= got <= b1_hi * (1 + 1e-12)
    assert (b1_hi - b1_lo) / got < 2e-5  # the two bounds pin the value down
    # the committed cost is (B.1) times the grid/float factor, and solved fills the budget
    worst = spec.worst_case_cost()
    assert got < worst <= eps and worst > eps * (1 - 1e-12)
    assert worst / got < 1 + 2e-9


@pytest.mark.parametrize(("alpha", "eps", "cells", "n", "p"), CONFIGS)
def test_tau_numerics_against_an_independent_direct_summation(alpha, eps, cells, n, p) -> None:
    delta = 1e-6
    spec = spec_of(
        alpha=alpha,
        epsilon=eps,
        universe_size=cells,
        n=n,
        p=p,
        mode="solved",
        accounting="zcdp",
        delta=delta,
    )
    c = spec.xi_coefficient
    q = 1 - p
    lo, hi = _independent_sum(n, cells, 2 * q)
    k2 = 585 / (16 * alpha**2)
    head = (1 + k2 * math.log(cells)) * c**2 * n ** (-2 * q)
    tau = spec.paper_sum()
    assert (head + k2 * c**2 * lo) * (1 - 1e-12) <= tau <= (head + k2 * c**2 * hi) * (1 + 1e-12)
    rho = spec.worst_case_cost()
    assert tau / 2 < rho <= spec.budget and rho > spec.budget * (1 - 1e-12)
    # Theorem 4 == rho + 2 sqrt(rho log(1/delta)) with rho = tau / 2
    thm4 = tau / 2 + math.sqrt(2 * tau * math.log(1 / delta))
    assert math.isclose(zcdp_to_approx_dp(tau / 2, delta), thm4, rel_tol=1e-14)
    assert spec.reported_epsilon(rho) <= eps


def test_paper_constants_fit_and_how_far_below_epsilon() -> None:
    # the brief's configuration: alpha = 0.05, eps = 1, N = 2^16, n = 10^6, p = 1/2
    spec = spec_of()
    b1 = spec.paper_sum()
    assert math.isclose(b1, 0.67155, rel_tol=1e-4)  # (B.1) is ~0.672 eps: 33% below eps
    # Theorem 5's closed-form bound (before its last, n >= 21 step) is above our number
    c, n, cells, a = spec.xi_coefficient, 10**6, 2**16, 0.05
    thm5 = (
        81
        * c
        / a**2
        * (2 * math.log(cells) / n**0.5 + (2 + math.log(n)) / n**0.5 + 1 / (n - 1) ** 0.5)
    )
    assert b1 <= thm5 <= 1.0
    assert spec.worst_case_cost() <= 1.0
    pm = Pmwg(spec, NoiseKey.for_tests(1), COORDS)
    assert pm.ledger.spent == float(exact(spec.worst_case_cost()))
    # delta > 0: tau, rho = tau / 2, and the Theorem-4 epsilon
    zspec = spec_of(accounting="zcdp", delta=1e-6)
    tau = zspec.paper_sum()
    assert math.isclose(tau, 0.0017524, rel_tol=1e-4)
    # Lemma 18: sqrt(tau) <= 12 c n^-q log^(1/2)(N n) / (alpha q), i.e. 2 sqrt(tau L) <= eps
    lemma18 = 12 * zspec.xi_coefficient * n**-0.5 * math.sqrt(math.log(cells * n)) / (a * 0.5)
    assert math.sqrt(tau) <= lemma18
    eps_reported = zspec.reported_epsilon(zspec.worst_case_cost())
    assert math.isclose(eps_reported, 0.22092, rel_tol=1e-4)


@pytest.mark.parametrize("p", [0.25, 0.5, 0.75, 0.95])
@pytest.mark.parametrize("n", [21, 100, 10**4])
def test_paper_constants_fit_for_n_at_least_21(n, p) -> None:
    for cells in (3, 2**16):
        for alpha in (0.01, 0.5, 0.99):
            for accounting, delta in (("pure", 0.0), ("zcdp", 1e-3)):
                spec = spec_of(
                    n=n, p=p, universe_size=cells, alpha=alpha, accounting=accounting, delta=delta
                )
                assert spec.worst_case_cost() <= spec.budget
                q = 1 - p
                if accounting == "pure" and p != 0.5:  # Lemma 14's bound
                    bound = (
                        126 * spec.xi_coefficient * math.log(cells * n) / (alpha**2 * q**2 * n**q)
                    )
                    assert spec.paper_sum() <= bound * (1 + 1e-12)


def test_worst_case_is_committed_and_spent_never_moves() -> None:
    spec = PmwgSpec(
        epsilon=1.0, delta=0.0, alpha=0.2, beta=0.05, n=500, universe_size=16, mode="solved"
    )
    pm = Pmwg(spec, NoiseKey.for_tests(12), COORDS)
    committed = pm.ledger.spent
    assert committed == float(exact(spec.worst_case_charge().epsilon)) <= 1.0
    answers = [pm.answer(*c) for c in _stream(5, 60)]
    assert {a.spent for a in answers} == {committed}
    assert pm.halted_rounds == pm.hard_queries


def test_guarantee_report() -> None:
    g = accuracy_guarantee(spec_of())
    assert g.theorem == "Theorem 5 (B.4)"
    assert math.isclose(g.xi_n, 0.619617, rel_tol=1e-5)
    assert math.isclose(g.answer_std_at_n, math.sqrt(2) * 8 / g.xi_n, rel_tol=1e-6)
    assert g.alpha_min > 1 and not g.accuracy_guaranteed
    assert g.hard_query_bound_at_n == math.floor(36 / 0.05**2 * math.log(2**16) * (1 - 1e-12))
    lines = g.lines()
    assert any("VIOLATED" in line and "alpha >=" in line for line in lines)
    # a configuration that meets Theorem 5
    ok = accuracy_guarantee(spec_of(n=10**8, universe_size=3, alpha=0.5))
    assert ok.accuracy_guaranteed and all(c.holds for c in ok.preconditions)
    assert ok.alpha_min < 0.5
    # Theorem 19 with delta > 0, and the beta precondition of Theorems 16/19
    z = accuracy_guarantee(spec_of(accounting="zcdp", delta=1e-6, beta=0.01))
    assert z.theorem.startswith("Theorem 19")
    beta_pre = next(c for c in z.preconditions if c.condition.startswith("beta"))
    assert not beta_pre.holds
    assert z.epsilon_reported <= 1.0
    # practical mode is never covered by the theorem
    assert not accuracy_guarantee(precise()).accuracy_guaranteed
