"""Exact discrete Laplace and discrete Gaussian samplers (CKS 2020, Algorithms 1-3).

**Stated as OpenDP states a measurement**

The samplers are no measurement (they have no privacy map); they are the exact noise the
mechanisms' maps assume. Given exactly uniform ``randbelow``: :func:`discrete_laplace` at a
rational scale ``t`` returns ``y`` with probability ``(e^(1/t) - 1) / (e^(1/t) + 1)
e^(-|y|/t)`` (CKS 2020, Algorithm 2); :func:`discrete_gaussian` at a rational ``sigma^2``
returns ``y`` with probability proportional to ``e^(-y^2 / (2 sigma^2))`` (Algorithm 3);
:func:`bernoulli_exp` is ``True`` with probability exactly ``e^(-gamma)`` (Algorithm 1). No
float enters a draw.

Canonne, Kamath and Steinke 2020, "The Discrete Gaussian for Differential Privacy": Algorithm 1
(Bernoulli(exp(-gamma))), Algorithm 2 (discrete Laplace) and Algorithm 3 (discrete Gaussian, by
rejection from discrete Laplace proposals). They use only uniform integers and rational
arithmetic, so the output distribution is exactly the discrete Laplace / discrete Gaussian;
there is no floating-point inverse CDF whose holes could reveal the true value (Mironov 2012).

The uniform integers come from any :class:`RandomIntegers`; in dpstream it is always the keyed
BLAKE2b stream of a release, :meth:`dpstream.core.noise.keys.NoiseKey.stream`, so a draw is a
pure function of the secret and the release's coordinates and a replay reproduces it exactly.
The variances (:func:`discrete_laplace_variance`, :func:`discrete_gaussian_variance`, CKS 2020
Proposition 19) are what the mechanisms report as their accuracy.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Protocol

from dpstream.errors import InvalidParameterError

__all__ = [
    "RandomIntegers",
    "bernoulli_exp",
    "discrete_gaussian",
    "discrete_gaussian_variance",
    "discrete_laplace",
    "discrete_laplace_variance",
]


class RandomIntegers(Protocol):
    """A source of exactly uniform integers (what the samplers need)."""

    def randbelow(self, n: int) -> int:
        """Return an integer drawn uniformly from ``[0, n)``."""
        ...



# --- CKS 2020 exact samplers -------------------------------------------------


def _bernoulli(rng: RandomIntegers, num: int, den: int) -> bool:
    """Return True with probability num/den exactly (0 <= num <= den)."""
    return rng.randbelow(den) < num


def bernoulli_exp(rng: RandomIntegers, gamma: Fraction) -> bool:
    """Return True with probability exp(-gamma), gamma >= 0 rational.

    CKS 2020, Algorithm 1 (for gamma in [0, 1]) and its extension to gamma > 1
    by repeated Bernoulli(exp(-1)) trials.
    """
    if gamma < 0:
        raise InvalidParameterError(f"gamma must be >= 0, got {gamma}")
    num, den = gamma.numerator, gamma.denominator
    whole = num // den
    for _ in range(whole):
        if not _bernoulli_exp_unit(rng, 1, 1):
            return False
    return _bernoulli_exp_unit(rng, num - whole * den, den)


def _bernoulli_exp_unit(rng: RandomIntegers, num: int, den: int) -> bool:
    """CKS 2020 Algorithm 1: Bernoulli(exp(-num/den)) for num/den in [0, 1]."""
    k = 1
    while _bernoulli(rng, num, den * k):
        k += 1
    return k % 2 == 1


def discrete_laplace(rng: RandomIntegers, scale: Fraction) -> int:
    """Draw from the discrete Laplace distribution, P(x) proportional to exp(-|x|/scale).

    CKS 2020, Algorithm 2, with scale = t/s for integers s, t.
    """
    if scale <= 0:
        raise InvalidParameterError(f"discrete Laplace scale must be > 0, got {scale}")
    t, s = scale.numerator, scale.denominator
    while True:
        u = rng.randbelow(t)
        if not _bernoulli_exp_unit(rng, u, t):
            continue
        v = 0
        while _bernoulli_exp_unit(rng, 1, 1):
            v += 1
        y = (u + t * v) // s
        negative = rng.randbelow(2) == 1
        if negative and y == 0:
            continue
        return -y if negative else y


def discrete_gaussian(rng: RandomIntegers, sigma2: Fraction) -> int:
    """Draw from the discrete Gaussian N_Z(0, sigma2), P(x) proportional to exp(-x^2/(2 sigma2)).

    CKS 2020, Algorithm 3: discrete Laplace proposals with scale t = floor(sigma)+1,
    accepted with probability exp(-(|y| - sigma2/t)^2 / (2 sigma2)).
    """
    if sigma2 <= 0:
        raise InvalidParameterError(f"discrete Gaussian variance must be > 0, got {sigma2}")
    t = math.isqrt(sigma2.numerator // sigma2.denominator) + 1
    scale = Fraction(t)
    while True:
        y = discrete_laplace(rng, scale)
        gamma = (abs(y) - sigma2 / t) ** 2 / (2 * sigma2)
        if bernoulli_exp(rng, gamma):
            return y


def discrete_laplace_variance(scale: Fraction | float) -> float:
    """Return the exact variance 2p/(1-p)^2, p = exp(-1/scale), of the discrete Laplace."""
    p = math.exp(-1.0 / float(scale))
    return 2.0 * p / (1.0 - p) ** 2


def discrete_gaussian_variance(sigma2: Fraction | float) -> float:
    """Return the variance of N_Z(0, sigma2) (at most sigma2; CKS 2020, Proposition 19).

    For sigma2 >= 100 it equals sigma2 to double precision; below that it is
    summed over the support.
    """
    s2 = float(sigma2)
    if s2 >= 100.0:
        return s2
    bound = int(40 * math.sqrt(s2)) + 2
    weights = [math.exp(-(x * x) / (2 * s2)) for x in range(-bound, bound + 1)]
    total = sum(weights)
    return sum(w * x * x for w, x in zip(weights, range(-bound, bound + 1), strict=True)) / total
