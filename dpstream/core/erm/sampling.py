"""Poisson subsampling and its privacy amplification (ERM paper 004, Algorithms 6-8).

**Poisson subsampling** (:func:`poisson_sample`, :func:`amplified_epsilon`). Keeping each event
independently with probability ``q`` before an epsilon-DP mechanism gives
``ln(1 + q (e^epsilon - 1))``-DP under add/remove (Li, Qardaji, Su 2012; Balle, Barthe, Gaboardi
2018, Poisson subsampling). *Reading of Algorithms 6-8:* with ``q = (e^{epsilon/(2 2^k)} - 1) /
(e^{epsilon/2} - 1)`` and a base mechanism that is ``epsilon/2``-DP, the amplified cost is
exactly ``epsilon/(2 2^k)`` as the paper claims. But the base mechanism is ``epsilon/2``-DP at
noise ``4L/(lambda 2^k B epsilon)`` only if the sampled objective is normalised by the FULL
public size ``n̄ = 2^k B``: normalised by the sample size ``n' ~ q 2^k B`` (Algorithm 7 line 2)
its sensitivity is about ``2^k`` times larger, the base mechanism is only about
``2^{k-1} epsilon``-DP, ``ln(1 + q (e^{2^{k-1} epsilon} - 1))`` is far above
``epsilon/(2 2^k)``, and ``n'`` itself is private. So the claim holds with the public
normaliser and is false with the sample size; we use the public one (the sampled data term is
then about ``q`` times lighter, i.e. the model leans on its centre). Sampling is for pure DP only.

**What is not taken from the paper.** Algorithm 7 line 2 normalises by ``n``, the size of the
data it is given, which in Algorithm 8 (line 12) is the Poisson sample; we keep the public
``2^j b0`` (see above).

**Exactness and replay-safety.** :func:`poisson_sample` draws one uniform integer per row from
the ``rng`` passed in (a ``NoiseKey.stream`` at the release's coordinates) and keeps a row iff it is
below the exact rational rate, so a replay keeps the same rows. The costs and rates are exact
fractions, rounded in the safe direction (costs up, rates down). The module holds no state.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction
from typing import Final

import numpy as np

from dpstream.core._checks import integer_at_least
from dpstream.core.erm.spec import BoolArray
from dpstream.core.noise.samplers import (
    RandomIntegers,
)
from dpstream.errors import InvalidParameterError

__all__ = [
    "amplified_epsilon",
    "poisson_sample",
    "sampling_rate",
]

_AMPLIFY_DIGITS: Final = 60  # decimal working precision of amplified_epsilon / sampling_rate
_COST_DENOMINATOR: Final = 10**18  # amplified costs are rounded up to this denominator
_RATE_DENOMINATOR: Final = 10**30  # sampling rates are rounded down to this denominator


def _check_rate(rate: object) -> Fraction:
    if isinstance(rate, bool) or not isinstance(rate, (Fraction, int)) or not 0 <= rate <= 1:
        raise InvalidParameterError(f"rate must be a Fraction in [0, 1], got {rate!r}")
    return Fraction(rate)


def poisson_sample(rng: RandomIntegers, size: int, rate: Fraction) -> BoolArray:
    """Return a mask keeping each of ``size`` rows independently with probability ``rate``.

    Row ``i`` is kept iff ``rng.randbelow(den) < num`` for ``rate = num/den``: exactly
    Bernoulli(rate), one draw per row in order (none when ``rate`` is 0 or 1), so the same
    stream gives the same mask.
    """
    n = integer_at_least("size", size, 0)
    q = _check_rate(rate)
    if q == 0:
        return np.zeros(n, dtype=np.bool_)
    if q == 1:
        return np.ones(n, dtype=np.bool_)
    num, den = q.numerator, q.denominator
    randbelow = rng.randbelow
    return np.fromiter((randbelow(den) < num for _ in range(n)), dtype=np.bool_, count=n)


def _check_epsilon(epsilon: object) -> Fraction:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (Fraction, int)) or epsilon <= 0:
        raise InvalidParameterError(f"epsilon must be a Fraction > 0, got {epsilon!r}")
    return Fraction(epsilon)


def _decimal_div(num: int, den: int) -> Decimal:
    """``num / den`` in the current decimal context (its rounding mode applies)."""
    return Decimal(num) / Decimal(den)


def amplified_epsilon(epsilon: Fraction, rate: Fraction) -> Fraction:
    """Return a rational upper bound on ``ln(1 + rate (e^epsilon - 1))``, never below it.

    The privacy of an epsilon-DP mechanism run on a Poisson subsample of rate ``rate`` under
    add/remove neighbours (Li, Qardaji, Su 2012; Balle, Barthe, Gaboardi 2018). Pure DP only.
    Computed with 60-digit decimals: ``exp`` and ``ln`` are correctly rounded (Python's
    ``decimal``), each result is stepped one unit up, every other operation rounds toward
    +infinity, and the result is rounded up to a denominator of ``10^18`` (and capped at
    ``epsilon``, which it never exceeds exactly). See the module docstring for why Algorithms
    6-8 need the full public normaliser for this to apply.
    """
    eps = _check_epsilon(epsilon)
    q = _check_rate(rate)
    if q == 0:
        return Fraction(0)
    if q == 1:
        return eps
    with localcontext() as ctx:
        ctx.prec = _AMPLIFY_DIGITS
        ctx.rounding = ROUND_CEILING
        eps_up = _decimal_div(eps.numerator, eps.denominator)
        growth = eps_up.exp().next_plus() - 1  # >= e^eps - 1
        x = growth * Decimal(q.numerator) / Decimal(q.denominator)
        value = (1 + x).ln().next_plus()
        bound = Fraction(value)
    up = -((-bound.numerator * _COST_DENOMINATOR) // bound.denominator)
    return min(Fraction(up, _COST_DENOMINATOR), eps)


def sampling_rate(epsilon: Fraction, target: Fraction) -> Fraction:
    """Return a rate ``q <= (e^target - 1) / (e^epsilon - 1)``, within ``10^-30`` of it.

    The Poisson rate that turns an ``epsilon``-DP mechanism into a ``target``-DP one
    (paper 004, Algorithms 6 and 8: ``epsilon/2`` and ``target = epsilon/(2 2^k)``). Rounded
    down, so :func:`amplified_epsilon` of it exceeds ``target`` by at most its own rounding.
    """
    eps = _check_epsilon(epsilon)
    tgt = _check_epsilon(target)
    if tgt >= eps:
        return Fraction(1)
    with localcontext() as ctx:
        ctx.prec = _AMPLIFY_DIGITS
        ctx.rounding = ROUND_FLOOR
        low = _decimal_div(tgt.numerator, tgt.denominator).exp().next_minus() - 1
        ctx.rounding = ROUND_CEILING
        high = _decimal_div(eps.numerator, eps.denominator).exp().next_plus() - 1
        ctx.rounding = ROUND_FLOOR
        ratio = Fraction(low / high)
    down = (ratio.numerator * _RATE_DENOMINATOR) // ratio.denominator
    return Fraction(max(down, 0), _RATE_DENOMINATOR)
