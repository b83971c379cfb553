"""PMWG's worst-case privacy cost: the sum (B.1) (or ``tau``) and the noise coefficient.

**Paper.** Cummings, Krehbiel, Lai, Tantipongpipat, *Differential Privacy for Growing
Databases* (NeurIPS 2018): Algorithm 1 (PMWG), Theorem 11 and its privacy sum (B.1), the
generalised noise (B.5), Lemma 18 and its sum ``tau``, Theorem 24 (the NSG telescoping);
Theorem 4 (zCDP composition, Bun & Steinke 2016).

:class:`~dpstream.core.pmwg.spec.PmwgSpec` uses these functions to choose the coefficient
``c`` of its noise function ``xi_t = c t^p`` (per mode) and to state what the mechanism
commits to its ledger. One round started at ``t0`` and halted at ``t1`` costs at most
``S_t0 + S_t1 / 8``, ``S_t = xi_t Delta_t (1 + 10^-12) + g_t <= sigma c t^(p-1)``,
``sigma = (1 + 2^-50)(1 + 10^-12)(1 + 2^-32)`` (:mod:`dpstream.core.pmwg.sparse_vector`).

**A person, not an event** (``sensitivity = m``, the ``max_rows`` cap of the user level).
When one person may add up to ``m`` rows, a query value ``f(D_t) = sum w_i count_i / t``
moves by at most ``Delta_t = m / t`` (``m`` cells move by one each, weights in ``[0, 1]``,
``t`` public), so ``S_t = xi_t m / t (1 + 10^-12) + g_t`` with the grid proportional to
``xi_t m / t``: every bound below holds with ``c`` replaced by ``c m`` (the sums are
functions of ``xi_t Delta_t = c m t^(p-1)`` alone). :func:`cost_of_coefficient` therefore
evaluates the cost at ``c m`` (rounded **up** to a float), and the modes choose ``c``
``m`` times smaller, so that the noise (scale ``4 / xi_t`` and ``8 / xi_t`` in fraction
units) is ``m`` times larger and each charge is the configured one, now for one person's
``m`` rows. At ``m = 1`` every function is the event-level one, operation for operation.

**Accounting** (recorded in a :class:`~dpstream.core.accounting.ledger.PrivacyLedger`, which is
part of
the state; :attr:`~dpstream.core.pmwg.mechanism.Answer.spent` is its total).

* *pure, modes paper/solved.* Theorem 24's telescoping: round ``j``'s ATG part starts no
  earlier than round ``j-1``'s halt, so over a run
  ``eps <= S_n + sum_{halted rounds} (S_t1 + S_t1/8)``; the released hard queries satisfy
  ``H(t) <= C(t) = 36/alpha^2 (log N + sum_{n<tau<=t} b_tau)`` at every ``t`` (the cap is
  the floor of ``(1 - 10^-12) C(t)``), and since ``S`` is non-increasing, Abel summation
  gives ``sum_k S_(t_k) <= sum_t (C(t) - C(t-1)) S_t`` (Theorem 11's "set
  ``h_t = 36/alpha^2 b_t``", ``b_n = log N``). This is a bound on the privacy loss of
  *every* transcript (pure DP composes pointwise), so the run is eps-DP with
  ``eps = sigma (B.1)``, (B.1) being ``(1 + 81/(2 alpha^2) log N) c n^(p-1)
  + 81/(2 alpha^2) sum_{t>n} b_t c t^(p-1)`` (``81/2 = 36 * 9/8``). The sum is evaluated as an
  exact float sum of its terms up to ``max(10^7, n + 10^6)`` plus an analytic **upper**
  bound of the tail (integrals of decreasing majorants:
  ``int_T^inf t^(-1-q) = T^-q / q``,
  ``int_T^inf log t t^(-1-q) = T^-q (log T / q + 1 / q^2)``,
  ``log(t/(t-1)) t^-q <= (t-1)^(-1-q)``, with ``q = 1 - p``), inflated by ``10^-9`` for
  float error. That worst case is committed to the ledger when the mechanism starts.
  The round that exceeds the hard-query cap releases no numeric answer and starts no round,
  so it costs nothing beyond its ATG part, already counted.
* *zcdp, modes paper/solved.* Each round is an ATG part (``S_t0``-DP, fixed when the
  round starts) and, once it has halted at ``t1``, a Laplace part (``S_t1/8``-DP, fixed
  before its noise is drawn); an ``eps``-DP part is ``eps^2/2``-zCDP (BS16, Prop. 1.4) and
  the parts compose adaptively (Rényi filter, Feldman & Zrnic 2021, Thm 3.1, at every
  order). Telescoping as above gives the paper's
  ``tau = (1 + 585/(16 alpha^2) log N) (xi_n Delta_n)^2
  + 585/(16 alpha^2) sum_{t>n} b_t (xi_t Delta_t)^2`` (``585/16 = 36 (1 + 1/64)``), with
  ``sigma^2`` and the same numerics; ``rho = tau / 2`` is committed, and
  ``(rho + 2 sqrt(rho log(1/delta)), delta)`` reported (== Theorem 4).
* *practical mode: a privacy filter.* Each round is charged **when it starts**, at public
  time ``t0``, for both parts bounded from ``t0`` (``S_t1 <= S_t0``): pure
  ``eps = S_t0 + S_t0/8``, zcdp ``rho = (S_t0^2 + (S_t0/8)^2) / 2``. Every charge is fixed
  before the part it pays for runs, so basic composition with adaptively chosen epsilons
  and a stopping rule is valid (privacy filters, Rogers, Roth, Ullman, Vadhan 2016; for
  pure DP basic composition is a valid filter) and likewise for zCDP (Feldman & Zrnic
  2021, Thm 3.1). A round the ledger cannot pay ends the mechanism ("privacy budget
  exhausted", for good). ``c`` is chosen so that ``hard_query_cap`` rounds started at time
  ``n`` exactly fit the budget; Algorithm 1's hard-query cap is kept as well.

Every cost the ledger is charged is rounded **up** to a float whose decimal value is at least
the exact one (:func:`float_at_least`). No noise and no state: these are deterministic
functions of public parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Final

from dpstream.core.accounting.ledger import exact
from dpstream.core.pmwg.hard_query_sums import _weighted_b_sum
from dpstream.core.pmwg.sparse_vector import GRID_BITS

__all__ = [
    "cost_of_coefficient",
    "fits",
    "float_at_least",
    "paper_coefficient",
    "practical_coefficient",
    "round_cost",
    "scaled_coefficient",
    "solved_coefficient",
    "sum_factor",
]

SIGMA: Final = (1 + 2.0**-50) * (1 + 1e-12) * (1 + 2.0**-GRID_BITS)
"""``S_t <= SIGMA c t^(p-1)``: float error of ``xi_t``, its slack, and the grid."""
SUM_SLACK: Final = 1e-9
"""Relative inflation of numerically evaluated privacy sums (float summation error)."""
_HALF: Final = 0.5


def float_at_least(x: Fraction) -> float:
    """Return a float ``f`` with ``exact(f) >= x`` (what the ledger charges is never less)."""
    f = float(x)
    while exact(f) < x:
        f = math.nextafter(f, math.inf)
    return f


def paper_coefficient(
    accounting: str, epsilon: float, delta: float, alpha: float, n: int, cells: int, p: float
) -> float:
    """Return ``c`` of Algorithm 1 / (B.5), ``xi_t = c t^p``."""
    log_nn = math.log(cells * n)
    q = 1.0 - p
    if accounting == "pure":
        if p == _HALF:
            return alpha**2 * math.sqrt(n) * epsilon / (162.0 * log_nn)
        return alpha**2 * q**2 * math.pow(n, q) * epsilon / (126.0 * log_nn)
    return (
        alpha * q * math.pow(n, q) * epsilon
        / (24.0 * math.sqrt(log_nn) * math.sqrt(math.log(1.0 / delta)))
    )


def sum_factor(accounting: str, alpha: float, n: int, cells: int, q: float) -> float:
    """Return ``K(c) / c`` (pure) or ``tau(c) / c^2`` (zcdp) with the upper-bounded sum."""
    log_n = math.log(cells)
    if accounting == "pure":
        k = 81.0 / (2.0 * alpha * alpha)
        return math.pow(n, -q) * (1.0 + k * log_n) + k * _weighted_b_sum(n, cells, q)
    k2 = 585.0 / (16.0 * alpha * alpha)
    return math.pow(n, -2 * q) * (1.0 + k2 * log_n) + k2 * _weighted_b_sum(n, cells, 2 * q)


def scaled_coefficient(c: float, sensitivity: int = 1) -> float:
    """Return a float at least ``c m`` exactly (``m = sensitivity``): ``xi_t Delta_t / t^(p-1)``."""
    if sensitivity == 1:
        return c
    return float_at_least(Fraction(c) * sensitivity)


def cost_of_coefficient(accounting: str, factor: float, c: float, sensitivity: int = 1) -> float:
    """Return the worst-case cost (ledger units) of coefficient ``c`` (modes paper/solved).

    ``factor`` is :func:`sum_factor`'s; ``sensitivity`` is ``m`` (``Delta_t = m / t``): the
    cost is that of ``c m`` at ``m = 1`` (module docstring).
    """
    c = scaled_coefficient(c, sensitivity)
    if accounting == "pure":
        return c * factor * SIGMA * (1.0 + SUM_SLACK)
    return c * c * factor * SIGMA * SIGMA * (1.0 + SUM_SLACK) / 2.0


def fits(cost: float, budget: float) -> bool:
    """Whether ``cost`` (rounded up as it will be charged) fits the ledger's ``budget``."""
    return exact(float_at_least(Fraction(cost))) <= exact(budget)


def round_cost(accounting: str, s: Fraction) -> Fraction:
    """Return the practical-mode cost of one round of sensitivity bound ``s`` (both parts)."""
    if accounting == "pure":
        return s * Fraction(9, 8)
    return (s * s + (s / 8) ** 2) / 2


def solved_coefficient(accounting: str, budget: float, factor: float,
                       sensitivity: int = 1) -> float:
    """Return mode ``"solved"``'s ``c``: the largest whose computed worst case fits ``budget``.

    With ``sensitivity = m`` the worst case is evaluated at ``c m``, so ``c`` is ``m`` times
    smaller (module docstring).
    """
    factor_slack = factor * (1.0 + SUM_SLACK)
    if accounting == "pure":
        c = budget / (factor_slack * SIGMA)
    else:
        c = math.sqrt(2.0 * budget / factor_slack) / SIGMA
    if sensitivity != 1:
        c /= sensitivity
    while not fits(cost_of_coefficient(accounting, factor, c, sensitivity), budget):
        c = math.nextafter(c, 0.0)
    return c


def practical_coefficient(
    accounting: str, budget: float, cap: int, n: int, q: float,
    sensitivity_at_n: Callable[[float], Fraction], sensitivity: int = 1,
) -> float:
    """Return mode ``"practical"``'s ``c``: ``cap`` rounds started at ``n`` fit ``budget``.

    ``sensitivity_at_n(c)`` is the exact ``S_n`` of coefficient ``c`` (it includes the
    factor ``m = sensitivity`` of ``Delta_t = m / t``; the first guess divides by ``m`` so
    that the search starts next to the answer).
    """
    # cap rounds at n: cap * round_cost(S_n) <= budget, S_n ~ c n^-q (1 + slack)
    per_round = budget / cap
    if accounting == "pure":
        s_target = per_round * 8.0 / 9.0
    else:
        s_target = math.sqrt(per_round * 128.0 / 65.0)
    c = s_target / (math.pow(n, -q) * SIGMA)
    if sensitivity != 1:
        c /= sensitivity
    ledger_budget = exact(budget)
    while cap * exact(float_at_least(round_cost(accounting, sensitivity_at_n(c)))) \
            > ledger_budget:
        c = math.nextafter(c, 0.0)
    return c
