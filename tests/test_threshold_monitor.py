"""Tests of the AboveThreshold threshold monitor (dpstream.core.counting.threshold_monitor)."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.recording import RecordingKey

from dpstream.core.accounting.ledger import PrivacyCharge
from dpstream.core.counting.admission_bounds import (
    admission_delta,
    difference_tail,
    lazy_start_delta,
    minimal_threshold,
)
from dpstream.core.counting.threshold_monitor import ThresholdMonitor, ThresholdMonitorSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError

COORDS = ("flow", "monitor", "key-1")



def brute_difference_tail(epsilon: float, k: int, radius: int = 4000) -> float:
    """P(nu - rho >= k) by direct summation over both pmfs (independent oracle).

    The tail of nu is summed term by term from the far end (no closed form used); the
    truncation at +-radius drops mass below e^{-radius * epsilon / 4} (< 1e-40 here).
    """
    a, c = math.exp(-epsilon / 4), math.exp(-epsilon / 2)
    support = np.arange(-radius, radius + 1)
    pmf_nu = (1 - a) / (1 + a) * a ** np.abs(support)
    pmf_rho = (1 - c) / (1 + c) * c ** np.abs(support)
    tail_nu = np.cumsum(pmf_nu[::-1])[::-1]  # tail_nu[i] = P(nu >= support[i])
    lo = np.clip(k + support - (-radius), 0, None)  # index of k + r in support
    inside = lo <= 2 * radius
    return float(np.sum(pmf_rho[inside] * tail_nu[lo[inside]]))


# --- spec ------------------------------------------------------------------------


def test_spec_validation() -> None:
    with pytest.raises(InvalidParameterError, match=r"epsilon must be finite and > 0, got -1"):
        ThresholdMonitorSpec(epsilon=-1, threshold=5)
    for bad in (0, 0.5, -3, True, None):
        with pytest.raises(InvalidParameterError, match="threshold must be an integer >= 1"):
            ThresholdMonitorSpec(epsilon=1.0, threshold=bad)  # type: ignore[arg-type]
    for bad in (0, -1, 2.5, False):
        with pytest.raises(InvalidParameterError, match="horizon must be an integer >= 1"):
            ThresholdMonitorSpec(epsilon=1.0, threshold=3, horizon=bad)  # type: ignore[arg-type]
    spec = ThresholdMonitorSpec(epsilon=0.5, threshold=3)
    assert spec.charge == PrivacyCharge(epsilon=0.5, label="threshold monitor")
    assert spec.threshold_scale == 4 and spec.query_scale == 8


# --- the algorithm, line by line ---------------------------------------------------


def test_threshold_noise_once_query_noise_fresh_every_step() -> None:
    key = RecordingKey()
    monitor = ThresholdMonitor(
        ThresholdMonitorSpec(epsilon=1.0, threshold=10**6),
        key,
        COORDS,  # type: ignore[arg-type]
    )
    for _ in range(50):
        assert monitor.step(1) is False
    threshold_calls = [c for c in key.calls if c == (*COORDS, "monitor", "threshold")]
    query_calls = [c for c in key.calls if c[: len(COORDS) + 2] == (*COORDS, "monitor", "query")]
    assert len(threshold_calls) == 1
    assert query_calls == [(*COORDS, "monitor", "query", t) for t in range(50)]
    assert len(key.calls) == 51


def test_halts_after_firing_and_draws_nothing_more() -> None:
    key = RecordingKey()
    spec = ThresholdMonitorSpec(epsilon=1.0, threshold=5)
    monitor = ThresholdMonitor(spec, key, COORDS)  # type: ignore[arg-type]
    answers = [monitor.step(1000) for _ in range(3)]
    # with a count 995 above the threshold it fires at once (probability 1 - 1e-100)
    assert answers == [True, False, False]
    assert monitor.fired and monitor.halted and monitor.fired_at == 0
    assert monitor.count_steps == 3
    assert len(key.calls) == 2  # rho and nu_0 only
    with pytest.raises(InvalidParameterError):
        monitor.step(-1)


def test_horizon_expiry_never_fires() -> None:
    key = RecordingKey()
    spec = ThresholdMonitorSpec(epsilon=1.0, threshold=10**6, horizon=4)
    monitor = ThresholdMonitor(spec, key, COORDS)  # type: ignore[arg-type]
    assert [monitor.step(0) for _ in range(4)] == [False] * 4
    assert monitor.expired and monitor.halted and not monitor.fired
    assert [monitor.step(10**9) for _ in range(5)] == [False] * 5
    assert len(key.calls) == 5  # rho and nu_0..nu_3: nothing is tested after the horizon


def test_deterministic_and_coordinate_dependent() -> None:
    spec = ThresholdMonitorSpec(epsilon=0.5, threshold=30)

    def fire_step(key: NoiseKey, coords: tuple[str, ...]) -> int | None:
        monitor = ThresholdMonitor(spec, key, coords)
        for _ in range(200):
            if monitor.step(1):
                break
        return monitor.fired_at

    key = NoiseKey.for_tests(5)
    first = [fire_step(key, ("f", "m", str(i))) for i in range(10)]
    assert first == [fire_step(key, ("f", "m", str(i))) for i in range(10)]
    assert len(set(first)) > 1  # 10 keys all firing at one step: probability < 1e-6


def test_increment_and_coordinate_validation() -> None:
    spec = ThresholdMonitorSpec(epsilon=1.0, threshold=3)
    monitor = ThresholdMonitor(spec, NoiseKey.for_tests(0), COORDS)
    for bad in (-1, 0.5, True, "1"):
        with pytest.raises(InvalidParameterError, match="increment must be an integer >= 0"):
            monitor.step(bad)  # type: ignore[arg-type]
    assert monitor.count_steps == 0
    with pytest.raises(InvalidParameterError, match="coordinates"):
        ThresholdMonitor(spec, NoiseKey.for_tests(0), ["a"])  # type: ignore[arg-type]


def test_state_is_plain_data_without_key_or_noise() -> None:
    raw_key = bytes(range(32, 64))
    spec = ThresholdMonitorSpec(epsilon=1.0, threshold=10**6, horizon=100)
    monitor = ThresholdMonitor(spec, NoiseKey(raw_key), COORDS)
    for _ in range(5):
        monitor.step(2)
    state = monitor.to_state()
    assert json.loads(json.dumps(state)) == state
    assert raw_key not in pickle.dumps(state)
    assert set(state) == {
        "version",
        "epsilon",
        "threshold",
        "horizon",
        "steps",
        "count",
        "fired_at",
    }
    with pytest.raises(InvalidParameterError, match="another spec"):
        ThresholdMonitor(ThresholdMonitorSpec(1.0, 7), NoiseKey(raw_key), COORDS, state)
    with pytest.raises(InvalidParameterError, match="malformed"):
        ThresholdMonitor(spec, NoiseKey(raw_key), COORDS, {**state, "fired_at": 99})


@settings(max_examples=60, deadline=None)
@given(
    increments=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=40),
    threshold=st.integers(min_value=1, max_value=40),
    horizon=st.one_of(st.none(), st.integers(min_value=1, max_value=40)),
    data=st.data(),
)
def test_snapshot_restore_gives_identical_decisions(increments, threshold, horizon, data) -> None:
    split = data.draw(st.integers(min_value=0, max_value=len(increments)))
    spec = ThresholdMonitorSpec(epsilon=1.0, threshold=threshold, horizon=horizon)
    key = NoiseKey.for_tests(11)
    straight_monitor = ThresholdMonitor(spec, key, COORDS)
    straight = [straight_monitor.step(x) for x in increments]
    first = ThresholdMonitor(spec, key, COORDS)
    head = [first.step(x) for x in increments[:split]]
    resumed = ThresholdMonitor(spec, key, COORDS, json.loads(json.dumps(first.to_state())))
    tail = [resumed.step(x) for x in increments[split:]]
    assert head + tail == straight
    assert resumed.to_state() == straight_monitor.to_state()
    assert sum(straight) <= 1


# --- the admission bound ---------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0.1, 0.5, 1.0, 3.0])
def test_difference_tail_matches_direct_summation(epsilon: float) -> None:
    for k in (-7, -1, 0, 1, 2, 5, 17, 40):
        assert difference_tail(epsilon, k) == pytest.approx(
            brute_difference_tail(epsilon, k), rel=1e-10, abs=1e-300
        )


def test_difference_tail_is_a_distribution_tail() -> None:
    # symmetric around 0 and decreasing
    for eps in (0.3, 2.0):
        for k in range(-5, 6):
            assert difference_tail(eps, k) + difference_tail(eps, 1 - k) == pytest.approx(1.0)
        tails = [difference_tail(eps, k) for k in range(-50, 200)]
        assert all(x > y for x, y in zip(tails, tails[1:], strict=False))


def test_admission_delta_monotone_and_linear_in_horizon() -> None:
    deltas = [admission_delta(ThresholdMonitorSpec(1.0, tau, 10_000)) for tau in range(1, 400)]
    assert all(x >= y for x, y in zip(deltas, deltas[1:], strict=False))
    below_one = [d for d in deltas if d < 1.0]
    assert len(below_one) > 300
    assert all(x > y for x, y in zip(below_one, below_one[1:], strict=False))
    assert deltas[-1] > 0
    assert deltas[0] == 1.0  # threshold 1: a single event can always fire
    small = admission_delta(ThresholdMonitorSpec(1.0, 60, 10))
    assert admission_delta(ThresholdMonitorSpec(1.0, 60, 1000)) == pytest.approx(100 * small)
    assert small == pytest.approx(10 * difference_tail(1.0, 59))
    # very large thresholds stay positive (log space, no underflow to 0)
    assert 0 < admission_delta(ThresholdMonitorSpec(1.0, 10**6, 10**9)) < 1e-300


def test_admission_delta_needs_a_horizon() -> None:
    with pytest.raises(InvalidParameterError, match="horizon"):
        admission_delta(ThresholdMonitorSpec(1.0, 20))


@pytest.mark.parametrize(
    ("epsilon", "horizon", "delta"), [(1.0, 10**6, 1e-9), (0.1, 1000, 1e-6), (2.0, 1, 0.5)]
)
def test_minimal_threshold_is_minimal(epsilon: float, horizon: int, delta: float) -> None:
    tau = minimal_threshold(epsilon, horizon, delta)
    assert lazy_start_delta(ThresholdMonitorSpec(epsilon, tau, horizon)) <= delta
    if tau > 1:
        assert lazy_start_delta(ThresholdMonitorSpec(epsilon, tau - 1, horizon)) > delta


def test_lazy_start_delta_is_the_coupling_bound() -> None:
    # (1 + e^eps) * W * P(nu - rho >= tau): a monitor that would fire on a count of 0
    spec = ThresholdMonitorSpec(0.5, 150, 1000)
    expected = (1 + math.exp(0.5)) * 1000 * difference_tail(0.5, 150)
    assert 0 < expected < 1e-3
    assert lazy_start_delta(spec) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(InvalidParameterError):
        lazy_start_delta(ThresholdMonitorSpec(1.0, 20))


def test_a_lazily_started_monitor_decides_like_one_started_at_zero() -> None:
    """The coupling behind lazy_start_delta: same window noise, same decisions after f."""
    spec = ThresholdMonitorSpec(1.0, 8, 50)
    for seed in range(40):
        key = NoiseKey.for_tests(seed)
        full = ThresholdMonitor(spec, key, ("w", 0))
        lazy = ThresholdMonitor(spec, key, ("w", 0), first_step=10)
        early = [full.step(0) for _ in range(10)]
        increments = [1, 0, 2, 0, 3] * 8
        a = [full.step(i) for i in increments]
        b = [lazy.step(i) for i in increments]
        if not any(early):  # the full monitor did not fire on a count of 0 before step 10
            assert a == b


def test_minimal_threshold_validation() -> None:
    for bad in (0, 1, -0.1, 1.5):
        with pytest.raises(InvalidParameterError, match="delta"):
            minimal_threshold(1.0, 10, bad)
    with pytest.raises(InvalidParameterError, match="horizon"):
        minimal_threshold(1.0, 0, 0.1)


# --- statistical tests -----------------------------------------------------------


def _chernoff_style_tail(epsilon: float, margin: int) -> float:
    """An upper bound on P(|nu - rho| >= margin) independent of difference_tail.

    |nu - rho| >= M needs |nu| >= M/2 or |rho| >= M/2, and P(|X| >= m) = 2 p^m / (1 + p)
    for X ~ DLap(b), p = e^{-1/b}, m >= 1.
    """
    m = math.ceil(margin / 2)
    a, c = math.exp(-epsilon / 4), math.exp(-epsilon / 2)
    return 2 * a**m / (1 + a) + 2 * c**m / (1 + c)


@pytest.mark.statistical
def test_far_below_never_fires_far_above_fires_at_once() -> None:
    # With margin M = 160 at epsilon 1, one test errs with probability at most
    # 2e^{-20}/1.78 + 2e^{-40}/1.61 < 2.5e-9; the 100 * 60 + 100 tests below all go the right
    # way except with probability < 2e-5.
    eps, tau, margin = 1.0, 200, 160
    bound = _chernoff_style_tail(eps, margin)
    assert 6100 * bound < 2e-5
    spec = ThresholdMonitorSpec(epsilon=eps, threshold=tau)
    key = NoiseKey.for_tests(21)
    for rep in range(100):
        below = ThresholdMonitor(spec, key, ("below", rep))
        assert not any(below.step(tau - margin if t == 0 else 0) for t in range(60))
        above = ThresholdMonitor(spec, key, ("above", rep))
        assert above.step(tau + margin) is True


@pytest.mark.statistical
@pytest.mark.parametrize("count", [1, 8, 12])
def test_first_step_fire_probability_is_exact(count: int) -> None:
    # At step 0 with prefix count c the monitor fires iff nu_0 - rho >= tau - c, with
    # probability p = difference_tail(eps, tau - c) exactly. count = 1 is the single-event
    # key with horizon 1, where admission_delta is this probability (the union bound is
    # exact). The empirical frequency of N Bernoulli(p) trials is within 4.5 sqrt(p(1-p)/N)
    # of p except with probability < 1e-5.
    eps, tau, n = 1.0, 10, 5000
    spec = ThresholdMonitorSpec(epsilon=eps, threshold=tau, horizon=1)
    key = NoiseKey.for_tests(31)
    fires = sum(ThresholdMonitor(spec, key, ("p0", count, rep)).step(count) for rep in range(n))
    p = difference_tail(eps, tau - count)
    if count == 1:
        assert admission_delta(spec) == pytest.approx(p, rel=1e-12)
    assert abs(fires / n - p) <= 4.5 * math.sqrt(p * (1 - p) / n), (fires / n, p)


@pytest.mark.statistical
def test_admission_delta_bounds_monte_carlo_over_a_tiny_horizon() -> None:
    # A key with a single event: count 1 at every step of a horizon of 3. The true firing
    # probability q satisfies P(fire at step 0) <= q <= admission_delta (union bound). The
    # empirical frequency of N trials is within 4.5 sqrt(q(1-q)/N) <= 4.5 * 0.5 / sqrt(N) of
    # q except with probability < 1e-5.
    eps, tau, horizon, n = 1.0, 8, 3, 5000
    spec = ThresholdMonitorSpec(epsilon=eps, threshold=tau, horizon=horizon)
    key = NoiseKey.for_tests(41)
    fired = 0
    for rep in range(n):
        monitor = ThresholdMonitor(spec, key, ("adm", rep))
        fired += any(monitor.step(1 if t == 0 else 0) for t in range(horizon))
    tol = 4.5 * 0.5 / math.sqrt(n)
    bound = admission_delta(spec)
    first_step = difference_tail(eps, tau - 1)
    assert first_step - tol <= fired / n <= bound + tol, (fired / n, first_step, bound)
    # and the bound is not vacuous here
    assert bound < 0.5


@pytest.mark.statistical
def test_neighbouring_inputs_halting_distribution() -> None:
    # Inputs: no event vs one event at step 0, horizon 3, tau 3. For S0 = {fires at step 0}
    # and S_none = {never fires}, the log-ratio of the probabilities on the two inputs is at
    # most eps (pure DP; both directions). By the delta method log(p1_hat / p0_hat) has sd
    # sqrt((1-p1)/(N p1) + (1-p0)/(N p0)); 4.5 sds give a false alarm < 1e-5 per check.
    eps, n = 1.0, 4000
    spec = ThresholdMonitorSpec(epsilon=eps, threshold=3, horizon=3)
    key = NoiseKey.for_tests(51)
    outcomes: dict[int, list[int | None]] = {}
    for first in (0, 1):
        results = []
        for rep in range(n):
            monitor = ThresholdMonitor(spec, key, ("nbm", first, rep))
            for t in range(3):
                if monitor.step(first if t == 0 else 0):
                    break
            results.append(monitor.fired_at)
        outcomes[first] = results
    for event in (0, None):
        p0 = sum(r == event for r in outcomes[0]) / n
        p1 = sum(r == event for r in outcomes[1]) / n
        sd = math.sqrt((1 - p1) / (n * p1) + (1 - p0) / (n * p0))
        assert abs(math.log(p1 / p0)) <= eps + 4.5 * sd, (event, p0, p1)
    # step 0 alone: the exact ratio is P(D >= 2) / P(D >= 3), D = nu - rho
    p0 = sum(r == 0 for r in outcomes[0]) / n
    p1 = sum(r == 0 for r in outcomes[1]) / n
    sd = math.sqrt((1 - p1) / (n * p1) + (1 - p0) / (n * p0))
    exact = math.log(difference_tail(eps, 2) / difference_tail(eps, 3))
    assert abs(math.log(p1 / p0) - exact) <= 4.5 * sd
