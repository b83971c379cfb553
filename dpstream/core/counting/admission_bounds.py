"""The admission bounds of the threshold monitor: how often a one-event key is admitted.

The open key universe admits a key when its threshold monitor (AboveThreshold, Dwork & Roth
2014, Algorithm 1; :mod:`dpstream.core.counting.threshold_monitor`) fires, and starts the
monitor lazily at the key's first event. Both are only safe if a key with a single event is
admitted with a small probability ``delta``: this module bounds it.

* :func:`difference_tail` is the exact tail ``P(nu - rho >= k)`` of the monitor's two discrete
  Laplace noises (``nu ~ DLap(4 / epsilon)``, ``rho ~ DLap(2 / epsilon)``), in closed form
  (three geometric series, evaluated in log space);
* :func:`admission_delta` bounds, by the union bound over the ``horizon`` tested steps, the
  probability that a key with one event ever fires its monitor;
* :func:`lazy_start_delta` is the delta the lazy start costs (see
  :mod:`dpstream.core.counting.statistics_spec`), and :func:`minimal_threshold` the smallest
  threshold that keeps it within a configured delta.

No noise is drawn and no state is held here.
"""

from __future__ import annotations

import math

from dpstream.core._checks import is_integer
from dpstream.core.counting.threshold_monitor import (
    ThresholdMonitorSpec,
    _check_epsilon,
    _check_horizon,
)
from dpstream.errors import InvalidParameterError

__all__ = ["admission_delta", "difference_tail", "lazy_start_delta", "minimal_threshold"]


def _log_dlap_params(scale: float) -> tuple[float, float]:
    """Return ``(log p, log((1 - p) / (1 + p)))`` for DLap(scale), p = exp(-1/scale)."""
    log_p = -1.0 / scale
    one_minus_p = -math.expm1(log_p)
    return log_p, math.log(one_minus_p) - math.log1p(math.exp(log_p))


def _log_upper_tail(k: int, nu_scale: float, rho_scale: float) -> float:
    """Return ``log P(nu - rho >= k)`` for ``k >= 1``, nu ~ DLap(nu_scale), rho ~ DLap(rho_scale).

    With ``a = exp(-1/nu_scale)``, ``c = exp(-1/rho_scale)``, the tail of nu is
    ``P(nu >= m) = a^m / (1 + a)`` for ``m >= 1`` and ``1 - a^(1 - m) / (1 + a)``
    for ``m <= 0``. Summing it over the pmf ``C_rho c^|r|`` of rho splits into
    three geometric series, which give the closed form

        P = C_rho a^k / (1 + a) [1 / (1 - a c) + c (1 - (c/a)^(k-1)) / (a - c)]
          + C_rho c^k (1 - a^2 c) / ((1 - c)(1 + a)(1 - a c)),

    evaluated here in log space so that large ``k`` does not underflow.
    """
    log_a = -1.0 / nu_scale  # the normaliser of nu is folded into its tail
    log_c, log_norm_c = _log_dlap_params(rho_scale)
    a, c = math.exp(log_a), math.exp(log_c)
    log_one_minus_ac = math.log(-math.expm1(log_a + log_c))
    log_one_plus_a = math.log1p(a)
    # c (1 - (c/a)^(k-1)) / (a - c), stable also when a is close to c
    ell = log_c - log_a
    if ell == 0.0:
        middle = float(k - 1)
    else:
        middle = (c / a) * math.expm1((k - 1) * ell) / math.expm1(ell)
    bracket_a = math.exp(-log_one_minus_ac) + middle
    term_a = log_norm_c + k * log_a - log_one_plus_a + math.log(bracket_a)
    log_factor_c = (
        math.log(-math.expm1(2 * log_a + log_c))
        - math.log(-math.expm1(log_c))
        - log_one_plus_a
        - log_one_minus_ac
    )
    term_c = log_norm_c + k * log_c + log_factor_c
    hi, lo = max(term_a, term_c), min(term_a, term_c)
    return hi + math.log1p(math.exp(lo - hi))


def difference_tail(epsilon: float, k: int) -> float:
    """Return ``P(nu - rho >= k)`` for the monitor's noises at ``epsilon``.

    ``nu ~ DLap(4/epsilon)`` and ``rho ~ DLap(2/epsilon)`` are independent.
    ``nu - rho`` is symmetric, so for ``k <= 0`` this is ``1 - P(nu - rho >= 1 - k)``.
    """
    eps = _check_epsilon(epsilon)
    if not is_integer(k):
        raise InvalidParameterError(f"k must be an integer, got {k!r}")
    k = int(k)
    nu_scale, rho_scale = 4.0 / eps, 2.0 / eps
    if k >= 1:
        return math.exp(_log_upper_tail(k, nu_scale, rho_scale))
    return -math.expm1(_log_upper_tail(1 - k, nu_scale, rho_scale))


def admission_delta(spec: ThresholdMonitorSpec) -> float:
    """Bound the probability that a key with a single event ever fires its monitor.

    A monitor started at a key's first event sees prefix counts ``c_t <= 1``
    if that is the key's only event, and fires at step ``t`` only if
    ``1 + nu_t - rho >= threshold``. By the union bound over the ``horizon``
    tested steps (nu_t identically distributed, rho shared), the probability
    of ever firing is at most ``horizon * P(nu - rho >= threshold - 1)``.
    The result is clamped to 1; a value below the smallest positive double is
    reported as that double, never as 0.

    Raises:
        InvalidParameterError: ``spec.horizon`` is not set (the bound is infinite).

    """
    if spec.horizon is None:
        raise InvalidParameterError(
            "admission_delta needs a horizon: without one, a single event fires eventually"
        )
    k = int(spec.threshold) - 1
    eps = float(spec.epsilon)
    if k <= 0:
        return 1.0
    log_delta = math.log(int(spec.horizon)) + _log_upper_tail(k, 4.0 / eps, 2.0 / eps)
    if log_delta >= 0.0:
        return 1.0
    return max(math.exp(log_delta), math.ulp(0.0))


def lazy_start_delta(spec: ThresholdMonitorSpec) -> float:
    """Return the delta a monitor started lazily, at a key's first event in a window, costs.

    The open key universe watches a key in fixed global windows of ``spec.horizon`` steps;
    in each window its monitor counts only that window's events and starts at the key's
    first event there, at index ``f`` in the window (see
    :mod:`dpstream.core.counting.statistics_spec`).
    Compare it with the ideal monitor ``M*`` that starts at index 0 for every possible key:
    ``M*`` is ``epsilon``-DP (Dwork & Roth, Thm 3.23). Both draw the threshold noise at the
    window's coordinates and the query noise of index ``t`` at ``t``'s coordinates, so they
    decide identically unless ``M*`` fires at one of the indices before ``f``, where its count
    is 0. By the union bound that has probability at most
    ``delta0 = horizon * P(nu - rho >= threshold)``. Coupling both neighbours to ``M*``,
    ``P[M(D) in S] <= P[M*(D) in S] + delta0 <= e^eps P[M*(D') in S] + delta0
    <= e^eps P[M(D') in S] + (1 + e^eps) delta0``, so the lazy monitor is
    ``(epsilon, (1 + e^epsilon) delta0)``-DP. Windows hold disjoint events and only the
    window of the differing event differs, so one such delta covers a key's whole life.

    Raises:
        InvalidParameterError: ``spec.horizon`` is not set (the bound is infinite).

    """
    if spec.horizon is None:
        raise InvalidParameterError(
            "lazy_start_delta needs a horizon: the monitor's window length"
        )
    eps = float(spec.epsilon)
    log_delta = (math.log(int(spec.horizon)) + math.log1p(math.exp(eps))
                 + _log_upper_tail(int(spec.threshold), 4.0 / eps, 2.0 / eps))
    if log_delta >= 0.0:
        return 1.0
    return max(math.exp(log_delta), math.ulp(0.0))


def minimal_threshold(epsilon: float, horizon: int, delta: float) -> int:
    """Return the smallest threshold whose :func:`lazy_start_delta` is at most ``delta``.

    Raises:
        InvalidParameterError: a parameter is out of range.

    """
    eps = _check_epsilon(epsilon)
    horizon = _check_horizon(horizon)
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise InvalidParameterError(f"delta must be in (0, 1), got {delta!r}")

    def ok(threshold: int) -> bool:
        return lazy_start_delta(ThresholdMonitorSpec(eps, threshold, horizon)) <= delta

    hi = 1
    while not ok(hi):
        hi *= 2
    lo = hi // 2  # not ok (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi
