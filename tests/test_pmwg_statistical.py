"""Statistical tests of PMWG and its exact-noise NSG (fixed seeds, derived tolerances).

Every tolerance below is ``Z`` standard deviations of the tested statistic under the correct
distribution (``Z = 5``: a false alarm has probability below 1e-6 per check), and each test
checks that plausible mistakes (wrong noise scales, wrong noise shape, a histogram that never
learns) would land outside it, so the tests have power.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from test_pmwg import DenseQuery

from dpstream.core.counting.admission_bounds import difference_tail
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.pmwg.mechanism import Pmwg
from dpstream.core.pmwg.sparse_vector import NumericSparse, dlap_variance
from dpstream.core.pmwg.spec import PmwgSpec

pytestmark = pytest.mark.statistical

Z = 5.0
GRID_EXPONENT = -40  # any grid: in eta-units the noise scales (4, 2, 8) do not depend on it


def laplace_sum_tail(d: float, b1: float, b2: float) -> float:
    """P(X + Y >= d), d >= 0, X ~ Lap(b1), Y ~ Lap(b2) independent, b1 != b2 (continuous)."""
    return (b1**2 * math.exp(-d / b1) - b2**2 * math.exp(-d / b2)) / (2 * (b1**2 - b2**2))


def halt_rate(value: Fraction, samples: int, seed: int) -> float:
    key = NoiseKey.for_tests(seed)
    halts = 0
    for i in range(samples):
        nsg = NumericSparse(key, ("natg-statistical", i))
        nsg.start_round(GRID_EXPONENT)
        halts += nsg.compare(value, 1)
    return halts / samples


@pytest.mark.parametrize(("distance", "seed"), [(8, 101), (4, 102)])
def test_natg_below_threshold_halts_with_the_exact_tail_probability(distance, seed) -> None:
    # A query whose eta-unit value is `distance` below the threshold halts iff
    # K_nu - K_eta >= distance / g, K_nu ~ DLap(4/g), K_eta ~ DLap(2/g): the exact discrete
    # tail is admission_bounds.difference_tail at epsilon = g (an independent closed form).
    g = 2.0**GRID_EXPONENT
    k = int(distance / g)
    exact_p = difference_tail(g, k)
    # the continuous Laplace limit agrees to O(g) (the lattice CDF is the continuous one up
    # to one grid step and a 1 + O(g) normaliser)
    assert math.isclose(exact_p, laplace_sum_tail(distance, 4, 2), rel_tol=1e-9)
    samples = 10_000
    sd = math.sqrt(exact_p * (1 - exact_p) / samples)
    tolerance = Z * sd
    rate = halt_rate(Fraction(-distance), samples, seed)
    assert abs(rate - exact_p) <= tolerance, (rate, exact_p, tolerance)
    # power: the wrong scales (threshold 4 instead of 2, or query noise 2 instead of 4) give
    # halting probabilities more than two tolerances away
    both_4 = (1 + distance / 8) * math.exp(-distance / 4) / 2  # Lap(4) + Lap(4)
    both_2 = (1 + distance / 4) * math.exp(-distance / 2) / 2  # Lap(2) + Lap(2)
    for wrong in (both_4, both_2, laplace_sum_tail(distance, 8, 2)):
        assert abs(wrong - exact_p) > 2 * tolerance


def test_natg_far_above_threshold_always_halts() -> None:
    # P(no halt) at 200 eta-units above = P(Lap(4) + Lap(2) < -200) ~ 16 e^-50 / 24 < 1e-21
    assert laplace_sum_tail(200, 4, 2) < 1e-21
    assert halt_rate(Fraction(200), 2000, 103) == 1.0
    # and a value at the threshold halts about half of the time (symmetry), a sanity check
    # with sd sqrt(1/4 / 2000) = 0.011
    assert abs(halt_rate(Fraction(0), 2000, 104) - 0.5) <= Z * math.sqrt(0.25 / 2000)


def test_one_threshold_per_round_correlates_the_queries_of_a_round() -> None:
    # Within a round the threshold is shared: P(first query below, second above) for two
    # queries at the same value differs from the independent-threshold product. At value 0:
    # shared eta: P(X1 < Y, X2 >= Y) = E[F(Y)(1 - F(Y))] with F the Lap(4) cdf, Y ~ Lap(2);
    # computed by quadrature on a fine grid.
    ys = np.linspace(-80, 80, 400_001)
    dy = ys[1] - ys[0]
    dens = np.exp(-np.abs(ys) / 2) / 4
    cdf = np.where(ys < 0, 0.5 * np.exp(ys / 4), 1 - 0.5 * np.exp(-ys / 4))
    shared = float(np.sum(dens * cdf * (1 - cdf)) * dy)
    independent = 0.25  # E[F(Y)] E[1 - F(Y)] with a fresh threshold per query
    samples = 30_000
    key = NoiseKey.for_tests(105)
    count = 0
    for i in range(samples):
        nsg = NumericSparse(key, ("shared", i))
        nsg.start_round(GRID_EXPONENT)
        first = nsg.compare(Fraction(0), 1)
        nsg.next_query()
        if not first and nsg.compare(Fraction(0), 1):
            count += 1
    rate = count / samples
    tolerance = Z * math.sqrt(shared * (1 - shared) / samples)
    assert abs(rate - shared) <= tolerance
    assert abs(independent - shared) > 2 * tolerance  # a per-query threshold would be caught


def test_hard_answer_noise_is_discrete_laplace_of_scale_8_over_xi() -> None:
    # xi_n = 100 at n = 1000 (xi Delta = 0.1; 10 rounds of 9/8 0.1 fill eps = 1.125).
    spec = PmwgSpec(epsilon=1.125, delta=0.0, alpha=0.3, beta=0.05, n=1000, universe_size=4,
                    mode="practical", hard_query_cap=10)
    t = 1000
    xi = spec.xi(t)
    assert math.isclose(xi, 100.0, rel_tol=1e-6)
    g = Fraction(2) ** spec.grid_exponent(t)
    expected_var = dlap_variance(Fraction(8) / g) * float(g) ** 2 / xi**2
    assert math.isclose(expected_var, 128 / xi**2, rel_tol=1e-9)
    # f(D) = 1, f(y) = 1/4: f'_1 is 0.55 above T = 0.2, i.e. 55 eta-units: it halts except
    # with probability ~ e^-13
    q = DenseQuery([1.0, 0.0, 0.0, 0.0])
    counts = np.array([t, 0, 0, 0], dtype=np.int64)
    key = NoiseKey.for_tests(106)
    noise = []
    for i in range(4000):
        answer = Pmwg(spec, key, ("answer-noise", i)).answer(q, counts, t)
        assert answer.kind == "hard"
        assert math.isclose(answer.noise_std or 0.0, math.sqrt(expected_var), rel_tol=1e-12)
        noise.append(answer.value - 1.0)
    x = np.asarray(noise)
    m = x.size
    # sample variance: relative sd sqrt((kurtosis - 1) / m), kurtosis 6 for the Laplace
    rel_sd = math.sqrt(5 / m)
    assert abs(x.var() / expected_var - 1) <= Z * rel_sd
    assert abs(x.mean()) <= Z * math.sqrt(expected_var / m)
    # shape: P(|X| > b) = e^-1 for the Laplace with scale b = 8 / xi
    b = 8 / xi
    frac = float(np.mean(np.abs(x) > b))
    tol = Z * math.sqrt(math.exp(-1) * (1 - math.exp(-1)) / m)
    assert abs(frac - math.exp(-1)) <= tol
    # power: scale 8 sqrt(2)/xi (variance x2) or 4/xi (x1/4) fail the variance check, and a
    # Gaussian of the same variance fails the shape check (P(|N| > b) = 0.4795)
    for ratio in (2.0, 0.25):
        assert abs(ratio - 1) > 2 * Z * rel_sd
    assert abs(math.erfc(b / math.sqrt(2 * 128 / xi**2)) - math.exp(-1)) > 2 * tol


def _growing_database(seed: int, cells: int, size: int):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(cells, 0.4))
    return rng, rng.choice(cells, size=size, p=probs)


def test_accuracy_on_a_growing_database_with_an_adaptive_query_stream() -> None:
    # N = 64, t from n = 2000 to 20000, practical mode with a generous eps so that xi is large:
    # xi_n = 2667 (eps = 300 for 200 rounds of 9/8 xi_n/n at n). NSG noise in fraction units
    # is then 4/xi = 0.0015 (query), 2/xi (threshold), 8/xi = 0.003 (answer): an easy answer
    # is within T + noise ~ 0.067 + 0.01 of the truth and a hard one within ~0.02, except with
    # probability ~ e^-12 per query, far below beta = 0.05.
    alpha, beta, cells, n = 0.1, 0.05, 64, 2000
    spec = PmwgSpec(epsilon=300.0, delta=0.0, alpha=alpha, beta=beta, n=n, universe_size=cells,
                    mode="practical", hard_query_cap=200)
    assert spec.xi(n) > 2000
    rng, events = _growing_database(107, cells, 20_000)
    pm = Pmwg(spec, NoiseKey.for_tests(107), ("accuracy", 1))
    answers, truths, naive = [], [], []
    previous = None
    for t in range(n, 20_001, 250):
        counts = np.bincount(events[:t], minlength=cells).astype(np.int64)
        for _ in range(4):
            if previous is not None and rng.random() < 0.5:
                # a follow-up chosen from the previous answer: drill into a large answer,
                # otherwise look at the complement
                weights, value = previous
                if value > 0.3:
                    keep = rng.random(cells) < 0.5
                    weights = weights * keep
                else:
                    weights = 1.0 - weights
            else:
                weights = (rng.random(cells) < rng.uniform(0.1, 0.6)).astype(float)
                if rng.random() < 0.3:
                    weights = weights * rng.random(cells)  # fractional weights
            q = DenseQuery(weights)
            a = pm.answer(q, counts, t)
            truth = q.weighted_count(counts) / (65536 * t)
            answers.append(a)
            truths.append(truth)
            naive.append(q.weighted_sum(np.full(cells, 1 / cells)))
            if a.value is not None:
                previous = (weights, a.value)
    values = [(a.value, tr) for a, tr in zip(answers, truths, strict=True) if a.value is not None]
    assert len(values) == len(answers)  # nothing hit a budget
    within = np.mean([abs(v - tr) <= alpha for v, tr in values])
    assert within >= 1 - beta, within
    # the hard-query count stays below Algorithm 1's bound (and the rounds paid for)
    assert pm.hard_queries == pm.halted_rounds
    assert 0 < pm.hard_queries <= spec.hard_query_bound(20_000)
    assert pm.rounds_started <= 200
    # power: answering from the initial uniform histogram (never learning) fails the criterion
    naive_within = np.mean([abs(u - tr) <= alpha for u, tr in zip(naive, truths, strict=True)])
    assert naive_within < 1 - beta, naive_within
