"""The BLT counter's parameters: the factorization table, the inverse, the sensitivity bound.

One idea of the buffered linear Toeplitz mechanism (Dvijotham, McMahan, Pillutla, Steinke and
Thakurta 2024, "Efficient and Near-Optimal Noise Generation for Streaming Differential
Privacy"; the counter is :mod:`dpstream.core.counting.blt_counter`, whose module docstring has
the factorization, the integer grid and the privacy proof): for each horizon ``2^4 .. 2^24``,
the dyadic parameters ``theta_j = T_j / 2^P`` and ``omega_j = W_j / 2^P`` of
``c_i = sum_j omega_j theta_j^(i-1)`` (optimised offline by ``tools/optimize_blt.py``, shipped
in ``blt_parameters.json``), the poles and weights of ``C^{-1}`` in feedback form (checked
stable: every pole in ``(-1, 1)``), and the rigorous bound ``Delta_G^2`` on the squared
L2-sensitivity of the rounded map over one epoch::

    Delta_G^2 = G^2 + sum_{i=1}^{n-1} (G c_i + eta)^2,  eta = sum_j omega_j / (1 - theta_j) + d,

evaluated in exact rational arithmetic (closed-form geometric sums, the powers
``theta^(n-1)`` bounded from below in fixed point). Only accuracy depends on the table, never
privacy: the sensitivity is recomputed here from the parameters actually used.

No noise is drawn and no state is held here (the parsed table is cached).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dpstream.errors import InvalidParameterError

__all__ = ["GRID_BITS", "available_horizons"]

GRID_BITS: Final = 40
"""``G = 2^GRID_BITS`` grid units per count."""
_GRID: Final = 1 << GRID_BITS
_PARAMETERS_FILE: Final = Path(__file__).with_name("blt_parameters.json")
_FORMAT_VERSION: Final = 1
_POW_BITS: Final = 256  # fixed-point precision of the rigorous power bounds

FloatArray = npt.NDArray[np.float64]


# --- the parameter table --------------------------------------------------------------------


@dataclass(frozen=True)
class _Parameters:
    """The dyadic BLT parameters for one horizon and what follows from them."""

    horizon: int
    precision_bits: int
    theta_num: tuple[int, ...]  # theta_j = theta_num[j] / 2^precision_bits, increasing
    omega_num: tuple[int, ...]
    theta: tuple[float, ...]  # the same values as floats (exact: at most 53 bits)
    omega: tuple[float, ...]
    inverse_poles: tuple[float, ...]  # gamma_j: C^{-1}(z) = 1 - sum_j beta_j z / (1 - gamma_j z)
    inverse_weights: tuple[float, ...]  # beta_j
    eta: Fraction  # bound on the rounding part of |Y_t - Y'_t|, grid units
    delta2: Fraction  # Delta_G^2 >= ||Y - Y'||^2 over an epoch, grid units squared
    digest: str  # identifies the parameters in snapshots

    @property
    def buffers(self) -> int:
        return len(self.theta_num)


@functools.lru_cache(maxsize=1)
def _load_table() -> dict[int, dict[str, Any]]:
    try:
        raw = json.loads(_PARAMETERS_FILE.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidParameterError(
            f"cannot read the BLT parameter table {_PARAMETERS_FILE}: {exc}"
        ) from None
    if raw.get("format_version") != _FORMAT_VERSION:
        raise InvalidParameterError(
            f"{_PARAMETERS_FILE} has format_version {raw.get('format_version')!r}, "
            f"expected {_FORMAT_VERSION}"
        )
    table: dict[int, dict[str, Any]] = {}
    for key, entry in raw["horizons"].items():
        entry = dict(entry)
        entry["precision_bits"] = int(raw["precision_bits"])
        table[int(key)] = entry
    return table


def available_horizons() -> tuple[int, ...]:
    """Return the horizons (powers of two) that have optimised BLT parameters."""
    return tuple(sorted(_load_table()))


def _inverse_poles(theta: FloatArray, omega: FloatArray) -> FloatArray:
    """Return the poles gamma_j of C^{-1}, increasing.

    ``1/C(z)`` has poles ``1/gamma`` where ``gamma`` solves the secular equation
    ``1 + sum_j omega_j / (gamma - theta_j) = 0``. For increasing theta and
    positive omega the left side decreases from +inf to -inf between
    consecutive thetas, so there is exactly one root in each interval
    ``(theta_{j-1}, theta_j)`` and one below ``theta_1`` (interlacing). Bisection
    on each interval finds them to full double precision.
    """
    lo = np.empty_like(theta)
    lo[0] = theta[0] - float(np.sum(omega)) - 1.0
    lo[1:] = theta[:-1]
    hi = theta.copy()
    for _ in range(1100):  # the intervals shrink to adjacent doubles well before this
        mid = 0.5 * (lo + hi)
        done = (mid == lo) | (mid == hi)
        if bool(np.all(done)):
            break
        with np.errstate(divide="ignore", invalid="ignore"):  # only at finished intervals
            f = 1.0 + np.sum(omega[None, :] / (mid[:, None] - theta[None, :]), axis=1)
        positive = f > 0
        lo = np.where(positive & ~done, mid, lo)
        hi = np.where(~positive & ~done, mid, hi)
    result: FloatArray = 0.5 * (lo + hi)
    return result


def _inverse_weights(theta: FloatArray, gamma: FloatArray) -> FloatArray:
    """Return the partial-fraction weights beta_j > 0 of the inverse.

    ``C^{-1}(z) = 1 - sum_j beta_j z / (1 - gamma_j z)``, so the impulse response
    is ``r_0 = 1``, ``r_k = -sum_j beta_j gamma_j^(k-1)``.
    """
    d = len(theta)
    beta = np.empty(d)
    for j in range(d):
        num = float(np.prod(gamma[j] - theta))
        den = float(np.prod([gamma[j] - gamma[k] for k in range(d) if k != j]))
        beta[j] = -num / den
    return beta


def _pow_lower(num: int, bits: int, exponent: int) -> Fraction:
    """Return a lower bound on ``(num / 2^bits)^exponent`` (0 <= num < 2^bits).

    Square-and-multiply in fixed point with ``_POW_BITS`` fractional bits, each
    product floored: every intermediate is a lower bound on the exact value.
    """
    if bits > _POW_BITS:
        raise InvalidParameterError(f"precision {bits} exceeds {_POW_BITS} bits")
    base = num << (_POW_BITS - bits)
    result = 1 << _POW_BITS
    while exponent:
        if exponent & 1:
            result = (result * base) >> _POW_BITS
        exponent >>= 1
        if exponent:
            base = (base * base) >> _POW_BITS
    return Fraction(result, 1 << _POW_BITS)


def _sensitivity_bound(
    theta_num: tuple[int, ...], omega_num: tuple[int, ...], bits: int, horizon: int
) -> tuple[Fraction, Fraction]:
    """Return ``(eta, Delta_G^2)``: the rounding slack and a bound on the epoch's sensitivity.

    ``Delta_G^2 = G^2 + sum_{i=1}^{n-1} (G c_i + eta)^2
    = G^2 (1 + S2) + 2 G eta S1 + (n - 1) eta^2`` with
    ``S1 = sum_{i=1}^{n-1} c_i`` and ``S2 = sum_{i=1}^{n-1} c_i^2`` in closed
    form (geometric sums). All arithmetic is exact except the powers
    ``theta^(n-1)``, which enter with a minus sign and are bounded from below,
    so the result is a rigorous upper bound.
    """
    one = 1 << bits
    d = len(theta_num)
    n1 = horizon - 1
    eta = Fraction(d) + sum(
        (Fraction(w, one - t) for t, w in zip(theta_num, omega_num, strict=True)), Fraction(0)
    )
    s1 = Fraction(0)
    for t, w in zip(theta_num, omega_num, strict=True):
        s1 += Fraction(w, one - t) * (1 - _pow_lower(t, bits, n1))
    s2 = Fraction(0)
    for tj, wj in zip(theta_num, omega_num, strict=True):
        for tk, wk in zip(theta_num, omega_num, strict=True):
            tt = tj * tk
            s2 += Fraction(wj * wk, one * one - tt) * (1 - _pow_lower(tt, 2 * bits, n1))
    g = Fraction(_GRID)
    delta2 = g * g * (1 + s2) + 2 * g * eta * s1 + n1 * eta * eta
    return eta, delta2


@functools.cache
def _parameters(horizon: int) -> _Parameters:
    table = _load_table()
    if horizon not in table:
        raise InvalidParameterError(_horizon_message(horizon))
    entry = table[horizon]
    bits = int(entry["precision_bits"])
    pairs = sorted(zip(entry["theta_num"], entry["omega_num"], strict=True))
    theta_num = tuple(int(t) for t, _ in pairs)
    omega_num = tuple(int(w) for _, w in pairs)
    where = f"{_PARAMETERS_FILE} (horizon {horizon})"
    if not 1 <= bits <= 52:
        raise InvalidParameterError(f"{where}: precision_bits must be in [1, 52], got {bits}")
    if not theta_num or any(not 0 < t < (1 << bits) for t in theta_num):
        raise InvalidParameterError(f"{where}: every theta must lie in (0, 1)")
    if len(set(theta_num)) != len(theta_num):
        raise InvalidParameterError(f"{where}: the thetas must be distinct")
    if any(w <= 0 for w in omega_num):
        raise InvalidParameterError(f"{where}: every omega must be > 0")
    scale = float(1 << bits)
    theta = np.array(theta_num, dtype=np.float64) / scale
    omega = np.array(omega_num, dtype=np.float64) / scale
    gamma = _inverse_poles(theta, omega)
    if not bool(np.all(np.abs(gamma) < 1.0)):
        raise InvalidParameterError(
            f"{where}: C^{{-1}} is unstable (inverse poles {gamma.tolist()}); re-optimise"
        )
    beta = _inverse_weights(theta, gamma)
    eta, delta2 = _sensitivity_bound(theta_num, omega_num, bits, horizon)
    digest = hashlib.sha256(repr((bits, theta_num, omega_num)).encode()).hexdigest()[:16]
    return _Parameters(
        horizon=horizon,
        precision_bits=bits,
        theta_num=theta_num,
        omega_num=omega_num,
        theta=tuple(theta.tolist()),
        omega=tuple(omega.tolist()),
        inverse_poles=tuple(gamma.tolist()),
        inverse_weights=tuple(beta.tolist()),
        eta=eta,
        delta2=delta2,
        digest=digest,
    )


def _horizon_message(horizon: object) -> str:
    try:
        choices = ", ".join(f"2**{h.bit_length() - 1}" for h in available_horizons())
    except InvalidParameterError as exc:
        return str(exc)
    return (
        f"horizon must be a power of two with optimised BLT parameters ({choices}), "
        f"got {horizon!r}"
    )


@functools.lru_cache(maxsize=4)
def _unit_variance_table(horizon: int) -> FloatArray:
    """Return ``V[t] = sum_{k<=t} P_k^2`` for ``t < horizon`` (read-only, shared).

    ``P_k = 1 - sum_j beta_j (1 - gamma_j^k) / (1 - gamma_j)`` are the prefix
    sums of the impulse response of ``C^{-1}`` (closed form of the feedback
    recurrence), evaluated for all ``k`` at once. ``8 * horizon`` bytes.
    """
    p = _parameters(horizon)
    gamma = np.array(p.inverse_poles)
    a = np.array(p.inverse_weights) / (1.0 - gamma)
    k = np.arange(horizon, dtype=np.int64)
    prefix = np.full(horizon, 1.0 - float(np.sum(a)))
    for g, aj in zip(gamma, a, strict=True):
        prefix += aj * np.power(g, k)
    table: FloatArray = np.cumsum(prefix * prefix)
    table.setflags(write=False)
    return table
