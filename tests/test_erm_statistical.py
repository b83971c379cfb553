"""Statistical tests of private ERM's exact noise and of Poisson subsampling (fixed seeds).

Every tolerance is derived, not guessed: a chi-square statistic is compared with the
chi-square quantile at false-alarm probability ``ALPHA = 1e-6``, a mean or a variance with
``Z = 5`` standard deviations of its sampling distribution (false alarm below ``1e-6``). Each
test also checks its power: the plausible mistakes (a scale 10% off, the other noise family,
a rate off by a few percent) would land far outside the tolerance.

The noise is observed the way an attacker of the release would see it: ``released integers -
rounded minimiser`` of :func:`private_erm` on a real block, with ``p = 2000`` parameters, so
each release gives 2000 iid draws at the computed scale.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy.stats import chi2

from dpstream.core.erm.grid import round_to_grid
from dpstream.core.erm.output_noise import NoiseLevel, private_erm
from dpstream.core.erm.sampling import poisson_sample, sampling_rate
from dpstream.core.erm.solver import _precision_float, solve
from dpstream.core.erm.spec import ErmSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_gaussian_variance, discrete_laplace_variance

pytestmark = pytest.mark.statistical

ALPHA = 1e-6
Z = 5.0
KEY = NoiseKey.for_tests(2024)
DIMENSION = 1999  # p = 2000 parameters (binary, intercept)
NORMALIZER = 300.0
RELEASES = 10  # 20000 noise draws per test


def level_for(spec: ErmSpec, delta: Fraction) -> NoiseLevel:
    """The level whose integer noise at ``delta`` is DLap(t = 3) (pure) or N_Z(0, 9) (zCDP).

    Pure: ``t = D1 / cost``, so ``cost = D1 / 3``. zCDP: ``sigma^2 = (1 + 10^-12) D2^2 / (2 rho)``,
    so ``rho = (1 + 10^-12) D2^2 / 18``. (Costs far above any real budget: only the shape of the
    noise at the computed scale is under test here.)
    """
    if spec.accounting == "pure":
        return NoiseLevel(delta, Fraction(spec.grid_l1_sensitivity, 3))
    d2 = spec.grid_l2_sensitivity
    return NoiseLevel(delta, (1 + Fraction(1, 10**12)) * d2 * d2 / 18)


@functools.cache
def noise_draws(accounting: str) -> np.ndarray:
    """Return the noise of RELEASES releases: released integers - rounded minimiser."""
    spec = ErmSpec((0, 1), DIMENSION, 1.0, 0.1, accounting=accounting)
    rng = np.random.default_rng(7)
    x = rng.normal(size=(int(NORMALIZER), DIMENSION))
    y = (x[:, 0] + rng.normal(size=len(x)) > 0).astype(int)
    block = spec.block(x, y.tolist())
    delta = spec.sensitivity(NORMALIZER)
    level = level_for(spec, delta)
    tau = _precision_float(spec.precision(NORMALIZER))
    # warm-started at the minimiser (to keep the test fast); private_erm makes the very same
    # deterministic solve, so `rounded` is exactly what it rounds
    start = solve(spec, block, NORMALIZER, None, precision=tau).params
    solution = solve(spec, block, NORMALIZER, None, precision=tau, initial=start)
    rounded = np.array(round_to_grid(solution.params, spec.grid(delta)))
    assert np.abs(rounded).max() > 1000  # a real, non-trivial minimiser under the noise
    draws = []
    for i in range(RELEASES):
        model = private_erm(
            spec,
            block,
            normalizer=NORMALIZER,
            center=None,
            level=level,
            rng=KEY.stream("erm-statistical", accounting, i),
            initial=start,
        )
        assert model.grid == spec.grid(delta)
        draws.append(np.array(model.integers) - rounded)
    out = np.concatenate(draws)
    out.setflags(write=False)
    return out


def chi_square(draws: np.ndarray, pmf, half_width: int) -> tuple[float, float, int]:
    """Return (statistic, critical value at ALPHA, bins): values -w..w and the two tails."""
    n = len(draws)
    values = np.arange(-half_width, half_width + 1)
    probs = np.array([pmf(v) for v in values])
    tail = (1.0 - probs.sum()) / 2  # symmetric distributions
    expected = np.r_[tail, probs, tail] * n
    observed = np.r_[
        np.sum(draws < -half_width),
        [np.sum(draws == v) for v in values],
        np.sum(draws > half_width),
    ]
    assert expected.min() >= 5  # the chi-square approximation holds
    stat = float(np.sum((observed - expected) ** 2 / expected))
    df = len(expected) - 1
    return stat, float(chi2.isf(ALPHA, df)), df


def detects(n: int, pmf, wrong, half_width: int, critical: float) -> bool:
    """Whether the chi-square test rejects the ``wrong`` distribution with high probability.

    Under ``wrong`` the statistic is about noncentral chi-square with ``df`` degrees of freedom
    and noncentrality ``N sum (p_wrong - p)^2 / p``: mean ``df + ncp``, variance
    ``2 (df + 2 ncp)``. It is detected if its mean minus Z sds is above the critical value.
    """
    df = 2 * half_width + 2
    ncp = noncentrality(n, pmf, wrong, half_width)
    return df + ncp - Z * math.sqrt(2 * (df + 2 * ncp)) > critical


def noncentrality(n: int, pmf, wrong, half_width: int) -> float:
    """N sum (p_wrong - p)^2 / p over the same bins: the chi-square shift a mistake causes."""
    values = range(-half_width, half_width + 1)
    p = np.array([pmf(v) for v in values])
    q = np.array([wrong(v) for v in values])
    p = np.r_[(1 - p.sum()) / 2, p, (1 - p.sum()) / 2]
    q = np.r_[(1 - q.sum()) / 2, q, (1 - q.sum()) / 2]
    return float(n * np.sum((q - p) ** 2 / p))


def dlap(t: float):
    r = math.exp(-1.0 / t)
    return lambda x: (1 - r) / (1 + r) * r ** abs(x)


def dgauss(s2: float):
    support = range(-int(40 * math.sqrt(s2)) - 2, int(40 * math.sqrt(s2)) + 3)
    total = sum(math.exp(-k * k / (2 * s2)) for k in support)
    return lambda x: math.exp(-x * x / (2 * s2)) / total


def test_pure_noise_is_discrete_laplace_at_the_scale_the_cost_implies():
    draws = noise_draws("pure")
    t = 3.0
    pmf = dlap(t)
    stat, critical, df = chi_square(draws, pmf, 15)
    assert stat <= critical, (stat, critical, df)
    # mean 0 and the exact variance 2r/(1-r)^2: Z standard errors (4th moment for the variance)
    n = len(draws)
    var = discrete_laplace_variance(Fraction(3))
    assert abs(draws.mean()) <= Z * math.sqrt(var / n)
    fourth = sum(pmf(k) * k**4 for k in range(-400, 401))
    var_tolerance = Z * math.sqrt((fourth - var**2) / n)
    assert abs(draws.var() - var) <= var_tolerance
    # power: the chi-square rejects the other noise family (a discrete Gaussian of the same
    # variance) and a scale 25% off; the variance test rejects a scale 10% off (a wrong value
    # more than 2 tolerances away lands outside the tolerance)
    for wrong in (dgauss(var), dlap(t * 1.25), dlap(t / 1.25)):
        assert detects(n, pmf, wrong, 15, critical)
    for wrong_t in (Fraction(33, 10), Fraction(30, 11)):
        assert abs(discrete_laplace_variance(wrong_t) - var) > 2 * var_tolerance


def test_zcdp_noise_is_discrete_gaussian_at_the_variance_the_cost_implies():
    draws = noise_draws("zcdp")
    s2 = 9.0
    pmf = dgauss(s2)
    stat, critical, df = chi_square(draws, pmf, 8)
    assert stat <= critical, (stat, critical, df)
    n = len(draws)
    var = discrete_gaussian_variance(Fraction(9))
    assert abs(var - 9.0) < 1e-12  # sigma^2 >= 1: the discrete variance is sigma^2 here
    fourth = sum(pmf(k) * k**4 for k in range(-200, 201))
    var_tolerance = Z * math.sqrt((fourth - var**2) / n)
    assert abs(draws.mean()) <= Z * math.sqrt(var / n)
    assert abs(draws.var() - var) <= var_tolerance
    # power: the variance test rejects a variance 10% off; the chi-square rejects the other
    # noise family (the discrete Laplace of the same variance 9: 2r/(1-r)^2 = 9 at
    # r = 9/(10 + sqrt(19))) and a variance 30% off
    assert 0.1 * var > 2 * var_tolerance
    t_same = 1 / math.log((10 + math.sqrt(19)) / 9)
    assert abs(discrete_laplace_variance(t_same) - 9) < 1e-9
    for wrong in (dlap(t_same), dgauss(s2 * 1.3), dgauss(s2 / 1.3)):
        assert detects(n, pmf, wrong, 8, critical)


def test_noise_coordinates_are_independent():
    # lag-1 correlation of the 20000 draws (in release order): under independence its sd is
    # 1/sqrt(n); a sampler that reused or shifted draws across coordinates would give ~1
    draws = noise_draws("pure")
    a = draws[:-1] - draws.mean()
    b = draws[1:] - draws.mean()
    corr = float(a @ b / math.sqrt((a @ a) * (b @ b)))
    assert abs(corr) <= Z / math.sqrt(len(a))


@pytest.mark.parametrize("rate", [Fraction(3, 10), sampling_rate(Fraction(1, 2), Fraction(1, 8))])
def test_poisson_sample_keeps_rows_at_the_rate_independently(rate):
    # 200000 rows: the kept fraction has sd sqrt(q(1-q)/N) ~ 0.001; Z = 5 gives 0.005, so a
    # rate off by 0.015 (5% of 0.3; more than 2 tolerances) is detected. Disjoint pairs of rows
    # are both kept with probability q^2 (sd sqrt(q^2(1-q^2)/N')); a sampler reusing one draw
    # for both rows would give q.
    n = 200_000
    q = float(rate)
    mask = poisson_sample(KEY.stream("erm-poisson", str(rate)), n, rate)
    tolerance = Z * math.sqrt(q * (1 - q) / n)
    assert abs(mask.mean() - q) <= tolerance
    assert 0.015 > 2 * tolerance
    pairs = mask[0::2] & mask[1::2]
    pair_tolerance = Z * math.sqrt(q * q * (1 - q * q) / len(pairs))
    assert abs(pairs.mean() - q * q) <= pair_tolerance
    assert q - q * q > 2 * pair_tolerance
