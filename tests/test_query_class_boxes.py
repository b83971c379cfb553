"""Tests of the test-oracle black boxes MWEM and SmallDB (tests/support/query_class_boxes.py).

They also test the exact exponential mechanism and the query grid the two boxes share.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy.stats import chi2
from support.query_class_boxes import (
    MAX_SMALLDB_CANDIDATES,
    MWEM,
    QUERY_GRID,
    SmallDB,
    exponential_mechanism,
    quantize_queries,
)
from support.recording import RecordingKey

from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError


def rng_for(seed: int, *prefix: str | int):
    key = NoiseKey.for_tests(seed)
    return lambda *c: key.stream("test", *prefix, *c)


def max_error(queries: np.ndarray, truth: np.ndarray, values: np.ndarray) -> float:
    return float(np.max(np.abs(queries @ truth - queries @ values)))


# --- the query grid -----------------------------------------------------------------------


def test_quantize_queries() -> None:
    w = quantize_queries(np.array([[0.0, 1.0, 0.5, 1 / 3]]))
    assert w.tolist() == [[0, QUERY_GRID, QUERY_GRID // 2, round(QUERY_GRID / 3)]]
    for bad in (np.ones(3), np.ones((0, 3)), np.array([[1.5]]), np.array([[math.nan]])):
        with pytest.raises(InvalidParameterError, match="queries"):
            quantize_queries(bad)


# --- the exact exponential mechanism ------------------------------------------------------


@pytest.mark.statistical
def test_exponential_mechanism_distribution() -> None:
    utilities = [0, 1, 2, 3, 5]
    rate = Fraction(1, 2)
    draws = 20_000
    rng = NoiseKey.for_tests(11).stream("expmech")
    seen = np.bincount([exponential_mechanism(rng, utilities, rate) for _ in range(draws)],
                       minlength=len(utilities))
    weights = np.exp(0.5 * np.array(utilities, dtype=np.float64))
    expected = draws * weights / weights.sum()
    stat = float(np.sum((seen - expected) ** 2 / expected))
    # chi-square with 4 degrees of freedom: a correct sampler fails with probability 1e-6
    assert chi2.sf(stat, df=len(utilities) - 1) > 1e-6
    # power: the same counts are far from the distribution at rate 0.6 (a 20% error)
    wrong = np.exp(0.6 * np.array(utilities, dtype=np.float64))
    wrong_expected = draws * wrong / wrong.sum()
    assert chi2.sf(float(np.sum((seen - wrong_expected) ** 2 / wrong_expected)), df=4) < 1e-6
    with pytest.raises(InvalidParameterError, match="at least one candidate"):
        exponential_mechanism(rng, [], rate)


# --- MWEM ---------------------------------------------------------------------------------


def mwem_instance() -> tuple[np.ndarray, np.ndarray, int]:
    size = 16
    # 16 point queries and 4 random ones: k = 20
    queries = np.vstack([np.eye(size), np.random.default_rng(1).random((4, size))])
    counts = np.zeros(size, dtype=np.int64)
    counts[0], counts[3] = 60_000, 38_500
    counts[5:] = 150  # n = 100_150, skewed
    return queries, counts, int(counts.sum())


def test_mwem_parameters_and_rounds() -> None:
    queries, _, n = mwem_instance()
    box = MWEM(queries)
    assert (box.name, box.universe_size, box.query_count) == ("mwem", 16, 20)
    assert box.p == box.p_prime == pytest.approx(1 / 3) and box.p_double_prime == 0
    assert box.g == pytest.approx((math.log(16) * math.log(20)) ** (1 / 3))
    # with rounds=None, T minimises the derived bound over 1..max_rounds
    t_best = box.rounds_for(n, 1.0, 0.05)
    bounds = [MWEM(queries, rounds=t).error_bound(n, 1.0, 0.1, 0.05) for t in range(1, 400)]
    assert t_best == int(np.argmin(bounds)) + 1
    assert box.error_bound(n, 1.0, 0.1, 0.05) == pytest.approx(min(bounds))
    # the bound formula: 2 sqrt(ln N / T) + (M + S) / n + 2^-15
    fixed = MWEM(queries, rounds=100)
    m = 200 * math.log(400 / 0.05)
    s = 400 * (math.log(20) + math.log(200 / 0.05))
    assert fixed.error_bound(n, 1.0, 0.1, 0.05) == pytest.approx(
        2 * math.sqrt(math.log(16) / 100) + (m + s) / n + 2**-15, rel=1e-12
    )
    with pytest.raises(InvalidParameterError, match=r"MWEM needs N >= 2 cells and k >= 2"):
        MWEM(np.ones((1, 4)))
    with pytest.raises(InvalidParameterError, match="rounds must be an integer >= 1"):
        MWEM(queries, rounds=0)


@pytest.mark.statistical
def test_mwem_error_within_its_bound() -> None:
    # T = 100 rounds; the bound at beta = 1e-7 holds for each run with probability 1 - 1e-7,
    # so all 10 runs pass with probability >= 1 - 1e-6 (beta only enters the bound here).
    queries, counts, n = mwem_instance()
    box = MWEM(queries, rounds=100)
    bound = box.error_bound(n, 1.0, 0.1, 1e-7)
    truth = counts / n
    # power: the trivial (uniform) synopsis misses the point query of cell 0 by 0.54
    assert max_error(queries, truth, np.full(16, 1 / 16)) > bound + 0.05
    errors = []
    for seed in range(10):
        syn = box.run(counts, n, 1.0, 0.1, 0.05, rng_for(seed, "mwem"))
        assert syn.values.sum() == pytest.approx(1.0)
        errors.append(max_error(queries, truth, syn.values))
    assert max(errors) <= bound


def test_mwem_replay_and_coordinates() -> None:
    queries, counts, n = mwem_instance()
    box = MWEM(queries, rounds=5)
    assert box.run(counts, n, 1.0, 0.1, 0.05, rng_for(2)) == box.run(
        counts, n, 1.0, 0.1, 0.05, rng_for(2)
    )
    key = RecordingKey(2)
    box.run(counts, n, 1.0, 0.1, 0.05, lambda *s: key.stream(*s))
    assert key.calls == [("round", i) for i in range(5)]


def test_mwem_runs_with_chosen_rounds() -> None:
    queries, counts, n = mwem_instance()
    box = MWEM(queries, max_rounds=50)
    assert box.rounds_for(n, 1.0, 0.05) <= 50
    syn = box.run(counts, n, 1.0, 0.1, 0.05, rng_for(4))
    assert syn.size == 16


# --- SmallDB -------------------------------------------------------------------------------


def test_smalldb_sizes() -> None:
    box = SmallDB(np.eye(4))
    assert (box.name, box.p, box.p_prime, box.p_double_prime) == ("smalldb", 1 / 3, 1 / 3, 0)
    assert box.g == pytest.approx((math.log(4) * math.log(4)) ** (1 / 3))  # C = 1
    # m = ceil(ln 4 / 0.25^2) = ceil(22.18) = 23; K = C(4 + 23 - 1, 23) = C(26, 3) = 2600
    assert box.database_size(0.25) == 23
    assert box.candidate_count(0.25) == math.comb(26, 3) == 2600
    # k = 2: the Hoeffding term floor(ln 4 / (2 alpha^2)) + 1 takes over from ceil(ln 2 / alpha^2)
    two = SmallDB(np.eye(2))
    assert two.database_size(0.5) == max(math.ceil(math.log(2) / 0.25),
                                         math.floor(math.log(4) / 0.5) + 1) == 3
    bound = box.error_bound(1000, 1.0, 0.25, 0.05)
    assert bound == pytest.approx(0.25 + 2**-15 + 2 * (math.log(2600) + math.log(20)) / 1000)


def test_smalldb_refuses_a_big_universe() -> None:
    box = SmallDB(np.eye(64))
    with pytest.raises(InvalidParameterError,
                       match=r"about 10\^.* candidate databases \(N = 64, m = 416 rows .*"
                             r"more than 1000000: SmallDB takes exponential time and is only "
                             r"for tiny universes"):
        box.run(np.ones(64, dtype=np.int64), 64, 1.0, 0.1, 0.05, rng_for(1))
    assert box.candidate_count(0.1) is None
    assert MAX_SMALLDB_CANDIDATES == 10**6
    with pytest.raises(InvalidParameterError, match=r"SmallDB needs N >= 2 cells"):
        SmallDB(np.ones((3, 1)))


@pytest.mark.statistical
def test_smalldb_within_its_alpha() -> None:
    # N = 4, k = 4 point queries, n = 1000, eps = 1, alpha = 0.25. The bound at beta = 1e-7
    # holds per run w.p. 1 - 1e-7: all 10 runs pass w.p. >= 1 - 1e-6.
    queries = np.eye(4)
    counts = np.array([600, 250, 100, 50], dtype=np.int64)
    n = 1000
    box = SmallDB(queries)
    bound = box.error_bound(n, 1.0, 0.25, 1e-7)
    truth = counts / n
    # power: the uniform synopsis misses cell 0 by 0.35 > bound
    assert max_error(queries, truth, np.full(4, 0.25)) > bound
    for seed in range(10):
        syn = box.run(counts, n, 1.0, 0.25, 0.05, rng_for(seed, "smalldb"))
        assert syn.values.sum() == pytest.approx(1.0)
        assert np.array_equal(syn.values * 23, np.rint(syn.values * 23))  # m = 23 rows
        assert max_error(queries, truth, syn.values) <= bound


@pytest.mark.statistical
def test_smalldb_samples_the_exponential_mechanism_exactly() -> None:
    # N = 3, k = 2 queries, alpha = 0.7: m = 2, K = C(4, 2) = 6 candidates. With n = 4 and
    # eps = 1 the scores differ enough that a wrong rate is visible. Expected probabilities
    # are proportional to exp(-eps n err(y) / 2), err(y) = max_j |Q_j (x - y)| (sensitivity 1/n).
    queries = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    counts = np.array([3, 1, 0], dtype=np.int64)
    n, eps, draws = 4, 1.0, 4000
    box = SmallDB(queries)
    assert box.database_size(0.7) == 2 and box.candidate_count(0.7) == 6
    cands = [np.array(c) for c in [(2, 0, 0), (1, 1, 0), (1, 0, 1), (0, 2, 0), (0, 1, 1),
                                   (0, 0, 2)]]
    errs = np.array([np.max(np.abs(queries @ (counts / n - c / 2))) for c in cands])
    probs = np.exp(-eps * n * errs / 2)
    probs /= probs.sum()
    seen = np.zeros(6)
    index = {tuple(c): i for i, c in enumerate(cands)}
    key = NoiseKey.for_tests(21)
    for d in range(draws):
        syn = box.run(counts, n, eps, 0.7, 0.05, lambda *c, d=d: key.stream(d, *c))
        seen[index[tuple(np.rint(syn.values * 2).astype(int))]] += 1
    expected = draws * probs
    stat = float(np.sum((seen - expected) ** 2 / expected))
    assert chi2.sf(stat, df=5) > 1e-6
    # power: the same draws reject the mechanism at half the rate (a sensitivity of 2/n)
    half = np.exp(-eps * n * errs / 4)
    half = draws * half / half.sum()
    assert chi2.sf(float(np.sum((seen - half) ** 2 / half)), df=5) < 1e-6
