"""Tests of the binary tree counter (dpstream.core.counting.tree_counter)."""

from __future__ import annotations

import json
import math
import pickle
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm
from support.recording import RecordingKey

from dpstream.core.accounting.ledger import PrivacyCharge
from dpstream.core.counting.estimate import CounterEstimate
from dpstream.core.counting.tree_counter import (
    TreeCounter,
    TreeCounterSpec,
    analytic_std,
    plain_tree_worst_std,
    worst_step_std,
)
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_laplace_variance
from dpstream.errors import InvalidParameterError

COORDS = ("flow", "tree-laplace", "key-1")



def run(counter: TreeCounter, increments) -> list[CounterEstimate]:
    return [counter.step(x) for x in increments]


# --- spec -------------------------------------------------------------------


def test_spec_validation_messages() -> None:
    with pytest.raises(InvalidParameterError, match=r"epsilon must be finite and > 0, got -1"):
        TreeCounterSpec(epsilon=-1)
    for bad in (0, 0.0, math.inf, math.nan, True, "1"):
        with pytest.raises(InvalidParameterError, match="epsilon"):
            TreeCounterSpec(epsilon=bad)  # type: ignore[arg-type]
    for bad in (0, 1, 3, 6, 2.0, -4, True):
        with pytest.raises(InvalidParameterError, match="horizon must be a power of two >= 2"):
            TreeCounterSpec(epsilon=1.0, horizon=bad)  # type: ignore[arg-type]
    TreeCounterSpec(epsilon=0.5, horizon=2)


def test_spec_charge_mechanism_and_epochs() -> None:
    spec = TreeCounterSpec(epsilon=0.5, horizon=8)
    assert spec.charge == PrivacyCharge(epsilon=0.5, label="tree counter")
    assert spec.mechanism == "tree-laplace" == TreeCounterSpec.mechanism
    assert [spec.epoch_bounds(j) for j in range(4)] == [(0, 8), (8, 16), (24, 32), (56, 64)]
    # every step lies in exactly one epoch, and epoch_of agrees with epoch_bounds
    for t in range(200):
        j = spec.epoch_of(t)
        start, length = spec.epoch_bounds(j)
        assert start <= t < start + length
    assert spec.levels(0) == 4 and spec.levels(2) == 6  # m_j + 1 = log2(H 2^j) + 1
    assert spec.noise_scale(1) == Fraction(5) / Fraction(0.5) == 10
    with pytest.raises(InvalidParameterError):
        spec.epoch_bounds(-1)


# --- determinism and coordinates ----------------------------------------------


INCREMENTS = [1, 0, 3, 2, 0, 0, 5, 1, 1, 0, 2, 0, 4, 1, 0, 0, 7, 2, 1, 1]


def test_same_key_and_coordinates_give_identical_releases() -> None:
    spec = TreeCounterSpec(epsilon=1.0, horizon=4)
    a = run(TreeCounter(spec, NoiseKey.for_tests(7), COORDS), INCREMENTS)
    b = run(TreeCounter(spec, NoiseKey.for_tests(7), COORDS), INCREMENTS)
    assert a == b
    assert [e.step for e in a] == list(range(len(INCREMENTS)))


def test_different_coordinates_or_key_give_different_releases() -> None:
    spec = TreeCounterSpec(epsilon=1.0, horizon=4)
    base = [e.value for e in run(TreeCounter(spec, NoiseKey.for_tests(7), COORDS), INCREMENTS)]
    other_coords = ("flow", "tree-laplace", "key-2")
    other = [
        e.value for e in run(TreeCounter(spec, NoiseKey.for_tests(7), other_coords), INCREMENTS)
    ]
    other_key = [e.value for e in run(TreeCounter(spec, NoiseKey.for_tests(8), COORDS), INCREMENTS)]
    # 20 releases agreeing by chance has probability far below 1e-6
    assert base != other
    assert base != other_key


def test_every_node_drawn_once_at_its_coordinates() -> None:
    spec = TreeCounterSpec(epsilon=1.0, horizon=4)
    key = RecordingKey()
    counter = TreeCounter(spec, key, COORDS)  # type: ignore[arg-type]
    run(counter, [1] * 28)  # epochs 0, 1, 2 complete: 4 + 8 + 16 steps
    assert len(key.calls) == len(set(key.calls))  # never the same node twice
    assert all(c[: len(COORDS) + 1] == (*COORDS, "tree") for c in key.calls)
    nodes = {c[len(COORDS) + 1 :] for c in key.calls}
    expected = set()
    for epoch in range(3):
        _, length = spec.epoch_bounds(epoch)
        for height in range(spec.levels(epoch)):
            expected |= {(epoch, height, i) for i in range(length >> height)}
    assert nodes == expected  # 2L - 1 nodes per epoch, one per (height, index)


def test_increment_validation() -> None:
    counter = TreeCounter(TreeCounterSpec(epsilon=1.0, horizon=4), NoiseKey.for_tests(0), COORDS)
    for bad in (-1, 1.5, True, "3", None):
        with pytest.raises(InvalidParameterError, match="increment must be an integer >= 0"):
            counter.step(bad)  # type: ignore[arg-type]
    assert counter.steps_done == 0  # a refused step changes nothing
    counter.step(np.int64(3))
    assert counter.steps_done == 1


def test_bad_coordinates_rejected() -> None:
    spec = TreeCounterSpec(epsilon=1.0)
    for bad in (["a"], ("a", 1.5), ("a", True)):
        with pytest.raises(InvalidParameterError, match="coordinates"):
            TreeCounter(spec, NoiseKey.for_tests(0), bad)  # type: ignore[arg-type]


# --- state --------------------------------------------------------------------


def test_state_round_trip_is_plain_data_without_the_key() -> None:
    spec = TreeCounterSpec(epsilon=1.0, horizon=4)
    raw_key = bytes(range(32))
    counter = TreeCounter(spec, NoiseKey(raw_key), COORDS)
    run(counter, INCREMENTS[:11])
    state = counter.to_state()
    restored_state = json.loads(json.dumps(state))
    assert restored_state == state
    assert raw_key not in pickle.dumps(state)
    assert raw_key.hex() not in json.dumps(state)
    resumed = TreeCounter(spec, NoiseKey(raw_key), COORDS, state=restored_state)
    assert resumed.steps_done == 11
    assert run(resumed, INCREMENTS[11:]) == run(counter, INCREMENTS[11:])


def test_state_from_another_spec_is_refused() -> None:
    counter = TreeCounter(TreeCounterSpec(epsilon=1.0, horizon=4), NoiseKey.for_tests(0), COORDS)
    run(counter, [1, 2, 3])
    state = counter.to_state()
    with pytest.raises(InvalidParameterError, match="another|epsilon="):
        TreeCounter(TreeCounterSpec(epsilon=2.0, horizon=4), NoiseKey.for_tests(0), COORDS, state)
    with pytest.raises(InvalidParameterError, match="malformed"):
        TreeCounter(TreeCounterSpec(epsilon=1.0, horizon=4), NoiseKey.for_tests(0), COORDS, {})


@settings(max_examples=60, deadline=None)
@given(
    increments=st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=40),
    horizon=st.sampled_from([2, 4, 8]),
    data=st.data(),
)
def test_snapshot_restore_gives_identical_remaining_releases(increments, horizon, data) -> None:
    split = data.draw(st.integers(min_value=0, max_value=len(increments)))
    spec = TreeCounterSpec(epsilon=0.8, horizon=horizon)
    key = NoiseKey.for_tests(3)
    straight = run(TreeCounter(spec, key, COORDS), increments)
    first = TreeCounter(spec, key, COORDS)
    head = run(first, increments[:split])
    state = json.loads(json.dumps(first.to_state()))
    tail = run(TreeCounter(spec, key, COORDS, state=state), increments[split:])
    assert head + tail == straight


def test_memory_is_logarithmic() -> None:
    spec = TreeCounterSpec(epsilon=1.0, horizon=4)
    counter = TreeCounter(spec, NoiseKey.for_tests(0), COORDS)
    longest = 0
    for n in range(1, 2001):
        counter.step(n % 2)
        stack = counter.to_state()["stack"]
        longest = max(longest, len(stack))
        assert len(stack) <= math.floor(math.log2(n)) + 1
    assert longest >= 8  # the bound is reached, not vacuous


# --- analytic error -------------------------------------------------------------


def test_release_std_equals_analytic_std() -> None:
    spec = TreeCounterSpec(epsilon=0.7, horizon=4)
    counter = TreeCounter(spec, NoiseKey.for_tests(1), COORDS)
    for t in range(100):
        assert counter.step(t % 3).std == analytic_std(spec, t)


def test_analytic_std_small_cases_by_hand() -> None:
    spec = TreeCounterSpec(epsilon=1.0, horizon=2)
    v0 = discrete_laplace_variance(Fraction(2))  # epoch 0: 2 levels, scale 2
    v1 = discrete_laplace_variance(Fraction(3))  # epoch 1: 3 levels, scale 3
    root0 = v0 * 2 * v0 / (v0 + 2 * v0)
    assert analytic_std(spec, 0) == pytest.approx(math.sqrt(v0))
    assert analytic_std(spec, 1) == pytest.approx(math.sqrt(root0))
    assert analytic_std(spec, 2) == pytest.approx(math.sqrt(root0 + v1))
    h1 = v1 * 2 * v1 / (3 * v1)
    assert analytic_std(spec, 4) == pytest.approx(math.sqrt(root0 + h1 + v1))


@pytest.mark.parametrize("horizon", [2, 4, 8, 16])
def test_worst_step_std_matches_brute_force(horizon: int) -> None:
    spec = TreeCounterSpec(epsilon=0.9, horizon=horizon)
    stds = np.array([analytic_std(spec, t) for t in range(400)])
    for T in (1, 2, 3, 5, horizon, horizon + 1, 3 * horizon, 7 * horizon + 3, 400):
        assert worst_step_std(spec, T) == pytest.approx(stds[:T].max(), rel=1e-12)


def test_worst_step_std_reference_values() -> None:
    spec = TreeCounterSpec(epsilon=1.0, horizon=2**20)
    combined = worst_step_std(spec, 2**20)
    plain = plain_tree_worst_std(spec, 2**20)
    # plain: 20 nodes of variance 2 b^2 (b = 21) -> sqrt(17640) = 132.8 (a hair less, discrete)
    assert plain == pytest.approx(math.sqrt(20 * 2 * 21**2), rel=1e-3)
    assert plain < math.sqrt(20 * 2 * 21**2)
    assert 97.0 < combined < 98.5
    assert worst_step_std(spec, 2**21) > combined  # the next epoch adds a level and a base


# --- statistical tests ------------------------------------------------------------

STAT_SPEC = TreeCounterSpec(epsilon=1.0, horizon=2)
STAT_INCREMENTS = [1, 0, 3, 2, 0, 0, 5, 1, 1, 0, 2, 0, 4, 1]  # epochs [0,2), [2,6), [6,14)
STAT_REPS = 2500
# Family false-alarm rate 1e-4 over 2 * 14 two-sided checks (Bonferroni).
Z_STAR = float(norm.ppf(1 - 1e-4 / (2 * 2 * len(STAT_INCREMENTS))))


def _discrete_laplace_excess_kurtosis(scale: float) -> float:
    p = math.exp(-1 / scale)
    xs = np.arange(-4000, 4001)
    w = p ** np.abs(xs)
    w /= w.sum()
    m2 = float((w * xs**2).sum())
    m4 = float((w * xs**4).sum())
    return m4 / m2**2 - 3


@pytest.fixture(scope="module")
def stat_errors() -> np.ndarray:
    """Errors (estimate - true prefix count) of STAT_REPS independent counters."""
    truth = np.cumsum(STAT_INCREMENTS)
    key = NoiseKey.for_tests(2024)
    errors = np.empty((STAT_REPS, len(STAT_INCREMENTS)))
    for rep in range(STAT_REPS):
        counter = TreeCounter(STAT_SPEC, key, ("stat", rep))
        errors[rep] = [e.value for e in run(counter, STAT_INCREMENTS)] - truth
    return errors


def _variance_ratio_tolerance() -> float:
    # The error at a step is a fixed linear combination sum_i w_i X_i of independent discrete
    # Laplace noises. Its 4th cumulant is sum w_i^4 k4_i and its variance sum w_i^2 s_i^2, so
    # its excess kurtosis is at most max_i k4_i / s_i^4 = the largest excess kurtosis kappa of
    # the discrete Laplace at the scales used (2, 3, 4 here). For N i.i.d. errors the sample
    # variance s^2 has sd ~ sigma^2 sqrt((2 + kappa) / N), and by the CLT s^2 / sigma^2 - 1
    # is within Z_STAR of those sds except with the stated probability.
    kappa = max(_discrete_laplace_excess_kurtosis(b) for b in (2.0, 3.0, 4.0))
    return Z_STAR * math.sqrt((2 + kappa) / STAT_REPS)


def _variance_check(errors: np.ndarray, sigmas: np.ndarray, tol: float) -> np.ndarray:
    ratio = errors.var(axis=0, ddof=1) / sigmas**2
    return np.abs(ratio - 1) <= tol


@pytest.mark.statistical
def test_estimates_are_unbiased(stat_errors: np.ndarray) -> None:
    # Mean of N i.i.d. errors with sd sigma_t is ~ N(0, sigma_t^2 / N) under unbiasedness.
    sigmas = np.array([analytic_std(STAT_SPEC, t) for t in range(len(STAT_INCREMENTS))])
    z = stat_errors.mean(axis=0) / (sigmas / math.sqrt(STAT_REPS))
    assert np.all(np.abs(z) <= Z_STAR), z


@pytest.mark.statistical
def test_variance_equals_analytic_std_squared(stat_errors: np.ndarray) -> None:
    sigmas = np.array([analytic_std(STAT_SPEC, t) for t in range(len(STAT_INCREMENTS))])
    tol = _variance_ratio_tolerance()
    assert tol < 0.25  # the test is sharp enough to mean something
    ok = _variance_check(stat_errors, sigmas, tol)
    assert ok.all(), (stat_errors.var(axis=0, ddof=1) / sigmas**2, tol)


@pytest.mark.statistical
def test_variance_check_has_power(stat_errors: np.ndarray) -> None:
    # A counter whose errors were 1.25x too large (variance 1.5625x; e.g. the plain tree is
    # 1.2-1.5x worse at these steps) shifts the ratio by 0.5625, more than 2x the tolerance;
    # the ratio's own sd is ~1.6 * 0.045, so every step is rejected except with negligible
    # probability.
    sigmas = np.array([analytic_std(STAT_SPEC, t) for t in range(len(STAT_INCREMENTS))])
    tol = _variance_ratio_tolerance()
    assert not _variance_check(1.25 * stat_errors, sigmas, tol).any()
    assert not _variance_check(0.8 * stat_errors, sigmas, tol).any()


@pytest.mark.statistical
def test_neighbouring_inputs_leaf_release() -> None:
    # Horizon 2, epsilon 1: 2 levels, node scale 2. The release at step 0 is the noisy leaf
    # y0 = x0 + Z. For S = {y0 >= 1}: P(S | x0=1) / P(S | x0=0) = P(Z >= 0) / P(Z >= 1)
    # = (1/(1+p)) / (p/(1+p)) = 1/p = e^{1/2} = e^{eps / levels}: the leaf's share of the
    # budget, and <= e^eps. By the delta method log(p1_hat/p0_hat) has sd
    # sqrt((1-p1)/(N p1) + (1-p0)/(N p0)); we allow 4.5 sds (false alarm < 1e-5).
    # Power: a node scale of 1/eps (sensitivity ignored) would make the ratio e^1, 0.5 away.
    spec = TreeCounterSpec(epsilon=1.0, horizon=2)
    key = NoiseKey.for_tests(99)
    n = 15000
    hits = {}
    for x0 in (0, 1):
        hits[x0] = sum(
            TreeCounter(spec, key, ("nb", x0, rep)).step(x0).value >= 1 for rep in range(n)
        )
    p0, p1 = hits[0] / n, hits[1] / n
    log_ratio = math.log(p1 / p0)
    sd = math.sqrt((1 - p1) / (n * p1) + (1 - p0) / (n * p0))
    assert abs(log_ratio - 0.5) <= 4.5 * sd, (log_ratio, sd)
    assert log_ratio <= spec.epsilon + 4.5 * sd


@pytest.mark.statistical
def test_neighbouring_inputs_full_epoch_transcript() -> None:
    # The whole transcript of epoch 0 (2 releases, 3 nodes) on inputs (0, 1) vs (1, 1), which
    # differ by one event. For S = {release_0 >= 1 and release_1 >= 2} the true log ratio is
    # at most eps = 1 (pure DP); same delta-method tolerance as above.
    spec = TreeCounterSpec(epsilon=1.0, horizon=2)
    key = NoiseKey.for_tests(100)
    n = 8000
    hits = {}
    for x0 in (0, 1):
        count = 0
        for rep in range(n):
            counter = TreeCounter(spec, key, ("nb2", x0, rep))
            first, second = counter.step(x0), counter.step(1)
            count += first.value >= 1 and second.value >= 2
        hits[x0] = count
    p0, p1 = hits[0] / n, hits[1] / n
    sd = math.sqrt((1 - p1) / (n * p1) + (1 - p0) / (n * p0))
    log_ratio = math.log(p1 / p0)
    assert log_ratio > 0  # the event is more likely with the extra event: the test sees it
    assert log_ratio <= spec.epsilon + 4.5 * sd, (log_ratio, sd)
