"""Tests of the BLT continual counter: privacy map, exactness, replay, snapshots, statistics."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

import dpstream.core.counting.blt_counter as blt
import dpstream.core.counting.blt_parameters as bp
from dpstream.core.accounting.ledger import PrivacyCharge
from dpstream.core.counting.blt_counter import (
    BltCounter,
    BltCounterSpec,
    analytic_std,
    factorization_lower_bound,
    plain_tree_zcdp_worst_std,
    worst_step_std,
)
from dpstream.core.counting.blt_parameters import available_horizons
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

G = 1 << bp.GRID_BITS
KEY = NoiseKey.for_tests(7)


def _run(counter: BltCounter, increments: list[int]) -> list[tuple[int, float, float]]:
    return [(e.step, e.value, e.std) for e in map(counter.step, increments)]


def _c_column(p: bp._Parameters, n: int) -> np.ndarray:
    """c_0 = 1, c_i = sum_j omega_j theta_j^(i-1), in float64."""
    i = np.arange(n - 1)
    c = np.ones(n)
    c[1:] = sum(w * np.power(t, i) for t, w in zip(p.theta, p.omega, strict=True))
    return c


# --- specification and privacy map ----------------------------------------------------------


def test_table_covers_the_advertised_horizons() -> None:
    horizons = available_horizons()
    assert all(h & (h - 1) == 0 for h in horizons)
    for k in range(4, 25):
        assert 2**k in horizons


@pytest.mark.parametrize("rho", [0, -1.0, math.nan, math.inf, "0.5", True, None])
def test_spec_rejects_bad_rho(rho: object) -> None:
    with pytest.raises(InvalidParameterError, match="rho"):
        BltCounterSpec(rho=rho)  # type: ignore[arg-type]


@pytest.mark.parametrize("horizon", [1000, 2**40, 0, -256, True, 256.0, "256"])
def test_spec_rejects_bad_horizon_and_lists_the_available_ones(horizon: object) -> None:
    with pytest.raises(InvalidParameterError, match=r"horizon must be a power of two .*2\*\*20"):
        BltCounterSpec(rho=0.5, horizon=horizon)  # type: ignore[arg-type]


def test_spec_properties() -> None:
    spec = BltCounterSpec(rho=0.5)
    assert spec.horizon == 2**20
    assert spec.charge == PrivacyCharge(rho=0.5, label="BLT counter")
    assert spec.mechanism == "blt-gaussian"
    s2 = spec.sigma2_grid
    assert isinstance(s2, Fraction) and s2.denominator == 1
    p = bp._parameters(spec.horizon)
    rho_kept = Fraction(0.5) * (1 - Fraction(1, 10**12))
    # the smallest integer variance giving Delta^2 / (2 sigma^2) <= rho_kept
    assert p.delta2 / (2 * s2) <= rho_kept < p.delta2 / (2 * (s2 - 1))
    assert spec.noise_std == pytest.approx(spec.l2_sensitivity, rel=1e-9)  # rho = 1/2


def test_sensitivity_bound_is_rigorous_and_tight() -> None:
    """Delta_G^2 covers the exact ||G c||^2 plus the rounding slack, and no more than that."""
    for horizon in (2**8, 2**12, 2**20):
        p = bp._parameters(horizon)
        c = _c_column(p, horizon)
        exact = float(np.sum(c * c)) * G * G
        bound = float(p.delta2)
        assert bound >= exact
        slack = float(2 * p.eta) * G * float(np.sum(c[1:])) + horizon * float(p.eta) ** 2
        assert bound <= exact * (1 + 1e-9) + slack


def test_power_lower_bound_is_a_lower_bound() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        num = int(rng.integers(1, 2**48))
        e = int(rng.integers(0, 5000))
        low = bp._pow_lower(num, 48, e)
        exact = Fraction(num, 2**48) ** e
        assert low <= exact
        assert exact - low <= Fraction(e + 2, 2**200)


def test_inverse_is_stable_and_interlaced_for_every_horizon() -> None:
    for horizon in available_horizons():
        p = bp._parameters(horizon)
        gamma, theta = p.inverse_poles, p.theta
        assert -1 < gamma[0] < theta[0]
        for j in range(1, len(theta)):
            assert theta[j - 1] < gamma[j] < theta[j]
        assert all(b > 0 for b in p.inverse_weights)


def test_variance_table_matches_the_feedback_recurrence() -> None:
    """The vectorised closed form equals running C^{-1} on an impulse (the counter's own code)."""
    horizon = 2**12
    p = bp._parameters(horizon)
    buffers = [0.0] * p.buffers
    prefix, acc, direct = 0.0, 0.0, []
    for t in range(horizon):
        prefix += blt._inverse_step(p, buffers, 1.0 if t == 0 else 0.0)
        acc += prefix * prefix
        direct.append(acc)
    table = bp._unit_variance_table(horizon)
    np.testing.assert_allclose(table, direct, rtol=1e-10)
    assert not table.flags.writeable


def test_inverse_inverts_c() -> None:
    p = bp._parameters(2**8)
    c = _c_column(p, 256)
    buffers = [0.0] * p.buffers
    out = [blt._inverse_step(p, buffers, float(v)) for v in c]
    np.testing.assert_allclose(out, np.eye(256)[0], atol=1e-12)


# --- the integer grid (pitfall 2) -----------------------------------------------------------


def test_grid_matches_exact_rational_reference() -> None:
    """Y_t differs from G (C x)_t (exact rationals) by at most the rounding bound eta / 2."""
    horizon = 2**8
    p = bp._parameters(horizon)
    rng = np.random.default_rng(11)
    x = [int(v) for v in rng.integers(0, 50, size=horizon)]
    theta = [Fraction(t, 2**p.precision_bits) for t in p.theta_num]
    omega = [Fraction(w, 2**p.precision_bits) for w in p.omega_num]
    exact_buffers = [Fraction(0)] * p.buffers
    grid_buffers = [0] * p.buffers
    half_eta = p.eta / 2
    worst = Fraction(0)
    for xt in x:
        exact = G * (xt + sum(w * b for w, b in zip(omega, exact_buffers, strict=True)))
        exact_buffers = [t * b + xt for t, b in zip(theta, exact_buffers, strict=True)]
        y = blt._grid_step(p, grid_buffers, xt)
        assert isinstance(y, int)
        worst = max(worst, abs(y - exact))
    assert worst <= half_eta
    assert worst > 0  # the rounding is real: this test would notice if it disappeared


def _grid_run(p: bp._Parameters, x: list[int]) -> np.ndarray:
    buffers = [0] * p.buffers
    return np.array([blt._grid_step(p, buffers, xt) for xt in x], dtype=object)


def test_sensitivity_holds_on_neighbouring_inputs() -> None:
    """||Y(x) - Y(x + e_tau)||_2 <= Delta_G, per coordinate <= G c_(t-tau) + eta, exact at tau."""
    horizon = 2**8
    p = bp._parameters(horizon)
    c = _c_column(p, horizon)
    rng = np.random.default_rng(5)
    delta2 = p.delta2
    for trial in range(40):
        scale = [1, 3, 1000, 10**9][trial % 4]
        x = [int(v) for v in rng.integers(0, scale + 1, size=horizon)]
        tau = int(rng.integers(0, horizon))
        x2 = list(x)
        x2[tau] += 1
        diff = _grid_run(p, x2) - _grid_run(p, x)
        assert all(d == 0 for d in diff[:tau])
        assert diff[tau] == G
        for t in range(tau + 1, horizon):
            assert abs(diff[t]) <= G * c[t - tau] * (1 + 1e-12) + float(p.eta)
        assert sum(int(d) * int(d) for d in diff) <= delta2


def test_released_values_are_integers_on_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise is added to the integer Y_t (not to a real number)."""
    seen: list[int] = []
    real = blt._grid_step

    def spy(p: bp._Parameters, buffers: list[int], x: int) -> int:
        y = real(p, buffers, x)
        seen.append(y)
        return y

    monkeypatch.setattr(blt, "_grid_step", spy)
    counter = BltCounter(BltCounterSpec(rho=0.5, horizon=2**8), KEY, ("grid",))
    _run(counter, [3, 0, 1, 7])
    assert len(seen) == 4 and all(type(y) is int for y in seen)


def test_noise_free_estimates_are_the_true_prefix_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the noise zeroed, post-processing recovers the prefix count (across epochs too)."""
    monkeypatch.setattr(blt, "gaussian_one", lambda *args: 0)
    horizon = min(available_horizons())
    counter = BltCounter(BltCounterSpec(rho=0.5, horizon=horizon), KEY, ("exact",))
    rng = np.random.default_rng(2)
    x = [int(v) for v in rng.integers(0, 1000, size=3 * horizon + 5)]
    truth = np.cumsum(x)
    values = [e.value for e in map(counter.step, x)]
    np.testing.assert_allclose(values, truth, rtol=0, atol=1e-6)


# --- determinism, replay and snapshots ------------------------------------------------------


def test_same_key_and_coordinates_give_identical_releases() -> None:
    spec = BltCounterSpec(rho=0.5, horizon=2**8)
    x = [1, 0, 4, 2, 0, 0, 9]
    a = _run(BltCounter(spec, KEY, ("flow", "k", 3)), x)
    b = _run(BltCounter(spec, NoiseKey.for_tests(7), ("flow", "k", 3)), x)
    assert a == b


def test_different_coordinates_or_keys_give_different_noise() -> None:
    spec = BltCounterSpec(rho=0.5, horizon=2**8)
    x = [1, 0, 4]
    base = _run(BltCounter(spec, KEY, ("flow", "k")), x)
    assert _run(BltCounter(spec, KEY, ("flow", "k2")), x) != base
    assert _run(BltCounter(spec, NoiseKey.for_tests(8), ("flow", "k")), x) != base


def test_state_round_trips_through_json_and_continues_identically() -> None:
    spec = BltCounterSpec(rho=0.3, horizon=2**8)
    rng = np.random.default_rng(9)
    x = [int(v) for v in rng.integers(0, 10**6, size=300)]  # large counts: big grid buffers
    whole = BltCounter(spec, KEY, ("snap",))
    expected = _run(whole, x)
    first = BltCounter(spec, KEY, ("snap",))
    head = _run(first, x[:270])
    state = json.loads(json.dumps(first.to_state()))
    assert "key" not in json.dumps(state).lower()
    second = BltCounter(spec, KEY, ("snap",), state)
    assert second.steps_done == 270
    assert head + _run(second, x[270:]) == expected
    assert second.to_state() == whole.to_state()


def test_state_of_another_spec_is_rejected() -> None:
    counter = BltCounter(BltCounterSpec(rho=0.5, horizon=2**8), KEY, ("s",))
    counter.step(1)
    state = counter.to_state()
    with pytest.raises(InvalidParameterError, match="rho"):
        BltCounter(BltCounterSpec(rho=0.4, horizon=2**8), KEY, ("s",), state)
    with pytest.raises(InvalidParameterError, match="horizon"):
        BltCounter(BltCounterSpec(rho=0.5, horizon=2**9), KEY, ("s",), state)
    broken = dict(state, grid_buffers=state["grid_buffers"][:-1])
    with pytest.raises(InvalidParameterError, match="malformed"):
        BltCounter(BltCounterSpec(rho=0.5, horizon=2**8), KEY, ("s",), broken)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None])
def test_step_rejects_bad_increments(bad: object) -> None:
    counter = BltCounter(BltCounterSpec(rho=0.5, horizon=2**8), KEY, ("s",))
    with pytest.raises(InvalidParameterError, match="increment"):
        counter.step(bad)  # type: ignore[arg-type]
    assert counter.steps_done == 0


def test_step_accepts_numpy_integers() -> None:
    counter = BltCounter(BltCounterSpec(rho=0.5, horizon=2**8), KEY, ("s",))
    other = BltCounter(BltCounterSpec(rho=0.5, horizon=2**8), KEY, ("s",))
    assert counter.step(np.int64(4)) == other.step(4)


def test_bad_coordinates_fail_at_construction() -> None:
    with pytest.raises(InvalidParameterError, match="coordinates"):
        BltCounter(BltCounterSpec(rho=0.5, horizon=2**8), KEY, ["list"])  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(
    increments=st.lists(st.integers(0, 2**40), min_size=1, max_size=40),
    cut=st.integers(0, 40),
    horizon_exp=st.sampled_from([4, 5, 8]),
)
def test_snapshot_restore_gives_identical_remaining_releases(
    increments: list[int], cut: int, horizon_exp: int
) -> None:
    spec = BltCounterSpec(rho=0.25, horizon=2**horizon_exp)
    cut = min(cut, len(increments))
    whole = _run(BltCounter(spec, KEY, ("prop",)), increments)
    first = BltCounter(spec, KEY, ("prop",))
    _run(first, increments[:cut])
    resumed = BltCounter(spec, KEY, ("prop",), json.loads(json.dumps(first.to_state())))
    assert _run(resumed, increments[cut:]) == whole[cut:]


# --- accuracy accounting --------------------------------------------------------------------


def test_reported_std_is_the_analytic_std() -> None:
    spec = BltCounterSpec(rho=0.5, horizon=min(available_horizons()))
    counter = BltCounter(spec, KEY, ("std",))
    n = spec.horizon
    for e in map(counter.step, [1] * (2 * n + 3)):
        assert e.std == analytic_std(spec, e.step)
    end = analytic_std(spec, n - 1) ** 2
    assert analytic_std(spec, 2 * n + 2) ** 2 == pytest.approx(2 * end + analytic_std(spec, 2) ** 2)


def test_std_is_monotone_and_worst_step_is_the_last() -> None:
    spec = BltCounterSpec(rho=0.5, horizon=2**8)
    stds = [analytic_std(spec, t) for t in range(3 * 256)]
    assert all(a <= b for a, b in zip(stds, stds[1:], strict=False))
    assert worst_step_std(spec, 3 * 256) == stds[-1]
    with pytest.raises(InvalidParameterError):
        worst_step_std(spec, 0)
    with pytest.raises(InvalidParameterError):
        analytic_std(spec, -1)


def test_near_optimal_accuracy() -> None:
    """Worst-step std at rho = 1/2: close to the factorization bound, far below the plain tree."""
    n16, n20 = 2**16, 2**20
    w16 = worst_step_std(BltCounterSpec(rho=0.5, horizon=n16), n16)
    w20 = worst_step_std(BltCounterSpec(rho=0.5, horizon=n20), n20)
    assert 4.5 < w16 < 4.7
    assert 5.4 < w20 < 5.8
    assert factorization_lower_bound(0.5, n20) < w20 < 1.15 * factorization_lower_bound(0.5, n20)
    assert plain_tree_zcdp_worst_std(0.5, n20) == pytest.approx(math.sqrt(20 * 21), rel=1e-9)
    # the table's reference values agree with what the mechanism actually achieves
    for horizon, entry in bp._load_table().items():
        if horizon > 2**20:  # their std tables take 16-128 MB; the tool checked them
            continue
        spec = BltCounterSpec(rho=0.5, horizon=horizon)
        assert worst_step_std(spec, horizon) == pytest.approx(entry["worst_std_rho_half"], rel=1e-5)


def test_factorization_lower_bound_matches_svd() -> None:
    n = 64
    a = np.tril(np.ones((n, n)))
    trace_norm = float(np.sum(np.linalg.svd(a, compute_uv=False)))
    assert factorization_lower_bound(0.5, n) == pytest.approx(trace_norm / n, rel=1e-12)


# --- statistical tests ----------------------------------------------------------------------
#
# Each repetition uses distinct coordinates, so its noise is independent of the others'. At a
# fixed step t the R errors e_i = value_i - truth_t are i.i.d. with mean 0 and variance s_t^2
# (the reported std): they are linear combinations of ~10^12-scale discrete Gaussians, normal
# to far better than these tests can resolve. With u_i = e_i / s_t:
#   * mean:     sqrt(R) * mean(u) ~ N(0, 1)          -> |.| <= z, z = Phi^-1(1 - alpha / 2)
#   * variance: sum(u_i^2) ~ chi^2_R (known mean 0)  -> in [chi2.ppf(alpha/2), chi2.ppf(1-alpha/2)]
# alpha is 1e-6 per test, split (Bonferroni) over its 2 * len(steps) checks. Power: the same
# acceptance region is applied to the data rescaled by a wrong std (x 0.8 and x 1.2) and must
# reject; the chance that it would not is also computed from chi^2 and asserted to be tiny
# (< 1e-9 with R = 2000). Likewise a bias of a quarter std must be rejected.

ALPHA = 1e-6
WRONG = (0.8, 1.2)
BIAS = 0.25  # in units of the std: sqrt(2000) * 0.25 = 11.2 >> z = 5.3


def _repetitions(spec: BltCounterSpec, reps: int, steps: int, tag: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = [int(v) for v in rng.integers(0, 4, size=steps)]
    truth = np.cumsum(x)
    errors = np.empty((reps, steps))
    for r in range(reps):
        counter = BltCounter(spec, KEY, ("stat", tag, r))
        errors[r] = [e.value for e in map(counter.step, x)] - truth
    return errors


def _accepts(u: np.ndarray, alpha: float) -> bool:
    r = len(u)
    z = scipy.stats.norm.ppf(1 - alpha / 2)
    lo, hi = scipy.stats.chi2.ppf([alpha / 2, 1 - alpha / 2], r)
    return bool(abs(np.mean(u)) * math.sqrt(r) <= z and lo <= float(np.sum(u * u)) <= hi)


def _check(spec: BltCounterSpec, errors: np.ndarray, steps: list[int]) -> None:
    alpha = ALPHA / (2 * len(steps))
    reps = errors.shape[0]
    lo, hi = scipy.stats.chi2.ppf([alpha / 2, 1 - alpha / 2], reps)
    for wrong in WRONG:
        # probability that a std off by this factor would still pass the variance check
        miss = scipy.stats.chi2.cdf(hi / wrong**2, reps) - scipy.stats.chi2.cdf(lo / wrong**2, reps)
        assert miss < 1e-9, (wrong, miss)
    for t in steps:
        std = analytic_std(spec, t)
        u = errors[:, t] / std
        assert _accepts(u, alpha), (t, float(np.mean(u)), float(np.mean(u * u)))
        for wrong in WRONG:  # power, on these very data
            assert not _accepts(errors[:, t] / (std * wrong), alpha), (t, wrong)
        assert not _accepts(u + BIAS, alpha), t


@pytest.mark.statistical
def test_unbiased_with_the_analytic_variance_within_an_epoch() -> None:
    spec = BltCounterSpec(rho=0.5, horizon=2**8)
    steps = [0, 7, 31]
    errors = _repetitions(spec, reps=2000, steps=32, tag="within", seed=1)
    _check(spec, errors, steps)


@pytest.mark.statistical
def test_unbiased_with_the_analytic_variance_across_epoch_boundaries() -> None:
    horizon = min(available_horizons())
    assert horizon <= 32, "the carry test needs a short horizon in the table"
    spec = BltCounterSpec(rho=0.5, horizon=horizon)
    steps = [horizon - 1, horizon, 2 * horizon + 3]  # end of epoch 0, start of 1, inside 2
    errors = _repetitions(spec, reps=2000, steps=2 * horizon + 4, tag="carry", seed=2)
    _check(spec, errors, steps)


def test_a_rho_too_small_for_the_exact_samplers_range_is_refused_at_start_up() -> None:
    """Below rho ~ 7e-10 the noise (std ~ 7e4 counts) would leave the bulk sampler's range."""
    BltCounterSpec(rho=1e-9)  # std ~ 5e4 counts: allowed
    with pytest.raises(InvalidParameterError, match="too small for the BLT counter"):
        BltCounterSpec(rho=5e-10)
