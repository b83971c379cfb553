"""The sums of ``b_tau`` behind PMWG's hard-query cap and its worst-case privacy sum.

**Paper.** Cummings, Krehbiel, Lai, Tantipongpipat, *Differential Privacy for Growing
Databases* (NeurIPS 2018): Algorithm 1 (PMWG), Theorem 11 and its privacy sum (B.1),
Theorem 12 (B.2), Theorem 5, Lemma 14, the generalised noise (B.5) with Theorems 16 and 19,
Lemma 18 and its sum ``tau``; the sparse vector subroutines Algorithm 2 (NATG) and
Algorithm 3 (NSG) with Theorems 20-26 (appendices B and C); Theorem 4 (zCDP composition,
Bun & Steinke 2016) in the main body.

**What is summed.** Algorithm 1 (with Corollary 7) lets PMWG answer at most
``36/alpha^2 (log N + sum_{tau=n+1}^t b_tau)`` hard queries by time ``t``, with
``b_tau = log N/tau + log(tau-1)/tau + log(tau/(tau-1))``.
:func:`hard_query_increment` computes the sum over ``(after, upto]`` (the last part
telescopes to ``log(upto / after)``); :class:`~dpstream.core.pmwg.mechanism.Pmwg` keeps the
running total as a double-double (:func:`_fsum2`) so that it does not drift over a long run.
The worst-case privacy sum (B.1) (and ``tau`` for zCDP) weights the same ``b_t`` by
``t^-q``, ``q = 1 - p``; :func:`_weighted_b_sum` returns an **upper** bound of that infinite
sum: the terms up to ``max(10^7, n + 10^6)`` as an exact float sum, plus an analytic upper
bound of the tail (integrals of decreasing majorants: ``int_T^inf t^(-1-q) = T^-q / q``,
``int_T^inf log t t^(-1-q) = T^-q (log T / q + 1 / q^2)``,
``log(t/(t-1)) t^-q <= (t-1)^(-1-q)``). These are deterministic functions of public
parameters: no noise and no state.
"""

from __future__ import annotations

import functools
import math
from typing import Final

import numpy as np

from dpstream.errors import InvalidParameterError

__all__ = ["hard_query_increment"]

_EXACT_TERMS_TO: Final = 10**7
_CHUNK: Final = 1 << 20


def _fsum2(hi: float, lo: float, x: float) -> tuple[float, float]:
    """Add ``x`` to the double-double ``hi + lo`` (exact error term via fsum)."""
    new_hi = math.fsum((hi, lo, x))
    new_lo = math.fsum((hi, lo, x, -new_hi))
    return new_hi, new_lo


def hard_query_increment(universe_size: int, after: int, upto: int) -> float:
    """Return ``sum_{tau=after+1}^{upto} b_tau`` of Algorithm 1 (0 if ``upto <= after``).

    ``b_tau = log N / tau + log(tau - 1) / tau + log(tau / (tau - 1))``; the last part
    telescopes to ``log(upto / after)``, the rest is summed with numpy in chunks of
    ``2^20`` terms (pairwise summation, relative error far below ``1e-12``).

    Raises:
        InvalidParameterError: ``after < 2``.

    """
    if upto <= after:
        return 0.0
    if after < 2:
        raise InvalidParameterError(f"after must be >= 2, got {after}")
    log_n = math.log(universe_size)
    parts: list[float] = []
    lo = after + 1
    while lo <= upto:
        hi = min(upto, lo + _CHUNK - 1)
        tau = np.arange(lo, hi + 1, dtype=np.float64)
        parts.append(float(np.sum((log_n + np.log(tau - 1.0)) / tau)))
        lo = hi + 1
    parts.append(math.log1p((upto - after) / after))
    return math.fsum(parts)


@functools.lru_cache(maxsize=64)
def _weighted_b_sum(n: int, universe_size: int, q: float) -> float:
    """Return an upper bound of ``sum_{t=n+1}^inf b_t t^-q`` (``q > 0``).

    Terms up to ``T = max(10^7, n + 10^6)`` are summed exactly (float); the tail is bounded
    by integrals of decreasing majorants (see the module docstring).
    """
    log_n = math.log(universe_size)
    end = max(_EXACT_TERMS_TO, n + 10**6)
    parts: list[float] = []
    lo = n + 1
    while lo <= end:
        hi = min(end, lo + _CHUNK - 1)
        t = np.arange(lo, hi + 1, dtype=np.float64)
        b = (log_n + np.log(t - 1.0)) / t + np.log1p(1.0 / (t - 1.0))
        parts.append(float(np.sum(b * np.power(t, -q))))
        lo = hi + 1
    big = float(end)
    tail = (
        math.pow(big, -q) * (log_n / q + math.log(big) / q + 1.0 / (q * q))
        + math.pow(big - 1.0, -q) / q
    )
    parts.append(tail)
    return math.fsum(parts)
