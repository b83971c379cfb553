"""A near-optimal continual counter in O(1) memory: a buffered linear Toeplitz mechanism.

**Stated as OpenDP states a measurement**

* input domain: unbounded streams of integer increments ``x_0, x_1, ... >= 0``, one per
  step; input metric: event level, ``d_in = sum_t |x_t - x'_t|`` (``d_in = 1``: one event).
* function: per epoch of ``n = horizon`` steps, the integers ``Y_t + Z_t``: ``Y`` the
  grid-rounded ``C x`` on ``Z / G`` (``G = 2^40``), ``Z_t ~ N_Z(0, sigma_G^2)`` exact, with
  ``sigma_G^2 = ceil(Delta_G^2 / (2 rho (1 - 10^-12)))``; the estimate ``B (Y + Z) / G`` is
  post-processing.
* output measure: rho-zCDP; privacy map: ``d_in ↦ rho d_in^2`` (with ``sensitivity = L``:
  ``d_in ↦ rho d_in^2 / L^2``, below). An epoch costs
  ``Delta_G^2 / (2 sigma_G^2) <= rho (1 - 10^-12)`` plus CKS 2020 Theorem 14's discreteness
  term (checked below ``10^-12 rho``); epochs hold disjoint events (parallel composition).
  The ledger charges ``BltCounterSpec.charge = PrivacyCharge(rho=rho)`` once for the whole
  stream; a pure ledger refuses it.

The counter releases, at every step t, an estimate of the prefix count
``x_0 + ... + x_t`` under rho-zero-concentrated DP (event level: neighbouring
streams differ by one in a single increment). It is the *matrix factorization*
mechanism of Dvijotham, McMahan, Pillutla, Steinke and Thakurta (2024),
"Efficient and Near-Optimal Noise Generation for Streaming Differential
Privacy" (BLT = buffered linear Toeplitz), with the exact discrete Gaussian of
Canonne, Kamath and Steinke (2020) as its noise and an integer grid that makes
the two compatible.

**Factorization.** Over one epoch of ``n`` steps the prefix sums are ``A x``
with ``A`` the lower-triangular matrix of ones. We write ``A = B C`` with
``C`` lower-triangular Toeplitz, ``c_0 = 1`` and
``c_i = sum_j omega_j theta_j^(i-1)`` (``0 < theta_j < 1``, ``omega_j > 0``,
``d`` buffers). The mechanism releases ``C x + z`` and post-processes it into
``B (C x + z) = A x + B z``. ``C x`` streams with ``d`` buffers
(``y_t = x_t + sum_j omega_j b_j``, then ``b_j <- theta_j b_j + x_t``) and
``C^{-1}`` streams with the same buffers in feedback form, so the counter's
state is ``O(d)`` numbers whatever the horizon. The parameters
(:mod:`dpstream.core.counting.blt_parameters`) are optimised offline by
``tools/optimize_blt.py`` for each horizon ``2^4 .. 2^24`` (shipped
in ``blt_parameters.json``; ``d = 4``, or ``d = 5`` from ``2^20`` on, where the
fifth buffer gains 1-2%). Only accuracy depends on that table, never privacy:
the sensitivity is recomputed from the dyadic parameters actually used,
and the inverse is checked to be stable (its poles interlace the thetas and lie
in ``(-1, 1)``).

**The integer grid (pitfall 2).** Integer noise added to a *real* ``C x``
would leave the fractional part of ``C x`` visible: neighbouring inputs would
have disjoint output supports. So ``C x`` is computed *exactly* on the grid
``Z / G`` (``G = 2^40``): ``theta_j`` and ``omega_j`` are dyadic rationals
``T_j / 2^P``, ``W_j / 2^P`` (``P = 48``), the buffers are Python integers in
grid units, and every product is rounded to the grid by a deterministic
integer rule (round half up)::

    Y_t  = x_t G + sum_j round(W_j B_j / 2^P)
    B_j <- round(T_j B_j / 2^P) + x_t G

The released integer is ``Yhat_t = Y_t + Z_t`` with ``Z_t ~ N_Z(0, sigma_G^2)``
drawn exactly (CKS 2020, Algorithm 3) from the replay-safe stream of the
counter's lane at ``(TAG_BLT, epoch, 0, t)`` (:mod:`dpstream.core.noise.bulk`).
Everything after that is post-processing and may use floating point.

**Sensitivity of the rounded map.** Rounding makes ``x -> Y`` slightly
non-linear, so its sensitivity is bounded directly. Let ``x' = x + e_tau``.
Writing each rounding as the exact product plus an error in ``[-1/2, 1/2)``,
a buffer is its exact value plus an error ``e_j`` obeying
``e_j <- theta_j e_j + r`` with ``|r| <= 1/2``. Both runs are identical up to
step ``tau``; afterwards the two error sequences differ by less than
``sum_k theta_j^k = 1/(1 - theta_j)``. Hence ``Y_tau - Y'_tau = G`` exactly and,
for ``t > tau``, ``|Y_t - Y'_t| < G c_{t-tau} + eta`` with
``eta = sum_j omega_j / (1 - theta_j) + d`` (the buffer errors weighted by
``omega_j`` plus one output rounding per buffer). Over an epoch::

    ||Y - Y'||_2^2 <= Delta_G^2 = G^2 + sum_{i=1}^{n-1} (G c_i + eta)^2,

evaluated in exact rational arithmetic (closed-form geometric sums; the powers
``theta^(n-1)`` are bounded from below in fixed point, which bounds the sum
from above). ``sigma_G^2 = ceil(Delta_G^2 / (2 rho'))`` with
``rho' = rho (1 - 10^-12)``.

**Privacy.** CKS 2020 (Theorem 14, multivariate discrete Gaussian) gives
``(Delta_G^2 / (2 sigma_G^2) + extra)``-zCDP for an epoch, where the extra term
comes from the discreteness and is of order ``n e^(-pi^2 sigma_G^2)``. Since
``Delta_G >= G = 2^40``, ``sigma_G^2 >= 2^80 / (2 rho)``: for any practical rho
the term is below ``10^-300``. It is bounded generously and checked against the
``10^-12 rho`` reserved above when the spec is built (a rho so large that it
would not fit is refused). Each event lies in exactly one
epoch and epochs use disjoint noise coordinates and disjoint data, so the whole
unbounded stream costs ``rho`` (parallel composition); an epoch's carried base
is post-processing of its own releases.

**Sensitivity ``L`` (user-level privacy).** When one person may add up to ``L`` events to
the stream (``contribution.max_per_key``), the spec's ``sensitivity = L`` calibrates the noise
to ``sigma_G^2 = ceil(L^2 Delta_G^2 / (2 rho'))``, so that the charge ``rho`` covers all ``L``
events. Derivation: let ``x`` and ``x'`` be two non-negative streams with
``sum_t |x_t - x'_t| <= L``. There is a chain ``x = x^0, x^1, ..., x^k = x'`` of non-negative
streams, ``k <= L``, each differing from the next by one event (remove the events ``x`` has
in excess, one at a time, then add those of ``x'``). The bound above holds for *every* pair of
streams one event apart, whatever the other increments (the rounding errors were bounded for
arbitrary buffers), so by the triangle inequality ``||Y(x) - Y(x')||_2 <= sum_i
||Y(x^i) - Y(x^(i+1))||_2 <= L Delta_G`` in each epoch (the rounded map is not linear, but the
chain argument needs no linearity). The epoch's releases then cost ``(L Delta_G)^2 / (2
sigma_G^2) <= rho'`` plus the discreteness term, which depends on ``sigma_G`` only and shrinks
as it grows; the person's events in several epochs cost ``L_j^2 Delta_G^2 / (2 sigma_G^2)``
each with ``sum_j L_j <= L``, whose sum is at most that of a single epoch holding all ``L``
(``sum_j L_j^2 <= (sum_j L_j)^2``). So the whole stream costs ``rho`` against ``L`` events,
and the noise std grows by ``L`` (up to the ceiling). ``L = 1`` is the event level: the same
``sigma_G^2``, the same noise, the same releases. A tighter multi-participation bound
(banded or multi-epoch matrix factorization) is not used: the triangle inequality is tight
when the ``L`` events fall in the same step.

**Accuracy.** With ``P_k`` the prefix sums of the impulse response of
``C^{-1}`` (``B_{t,s} = P_{t-s}``), the estimate at step ``t`` of an epoch has
standard deviation ``sigma sqrt(sum_{k<=t} P_k^2)``, ``sigma^2`` the variance
of ``Z_t / G``. It grows with ``t`` and is worst at the end of the epoch. Past
the horizon, epochs restart and their errors add: the variance after ``e``
full epochs is ``e`` times the end-of-epoch variance plus the current
epoch's, so the error grows like ``sqrt(#epochs)``. Choose ``horizon`` at least
the expected stream length.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import increment as checked_increment
from dpstream.core._checks import integer_at_least, positive_finite
from dpstream.core.accounting.ledger import PrivacyCharge, exact
from dpstream.core.counting.blt_parameters import (
    _GRID,
    _horizon_message,
    _load_table,
    _Parameters,
    _parameters,
    _unit_variance_table,
)
from dpstream.core.counting.estimate import CounterEstimate
from dpstream.core.noise.bulk_gaussian import gaussian_one
from dpstream.core.noise.coordinates import TAG_BLT, Coordinate
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_gaussian_variance
from dpstream.errors import InvalidParameterError

__all__ = [
    "BltCounter",
    "BltCounterSpec",
    "analytic_std",
    "factorization_lower_bound",
    "plain_tree_zcdp_worst_std",
    "worst_step_std",
]

_STATE_VERSION: Final = 1
_RHO_RESERVE: Final = Fraction(1, 10**12)  # share of rho kept for the CKS discreteness term
_MECHANISM: Final = "blt-gaussian"

FloatArray = npt.NDArray[np.float64]


# --- the specification ----------------------------------------------------------------------


@dataclass(frozen=True)
class BltCounterSpec:
    """A BLT continual counter: its privacy parameter and epoch length.

    Attributes:
        rho: the zCDP parameter the whole (unbounded) stream costs.
        horizon: the epoch length ``n``, a power of two with parameters in the
            shipped table. Accuracy is best up to ``horizon`` steps; beyond, the
            error grows like the square root of the number of epochs.
        sensitivity: ``L``, the most events one protected unit adds to the stream (1: one
            event; ``contribution.max_per_key`` at the user level). The noise is calibrated to
            the L2 sensitivity ``L Delta_G`` (module docstring), so ``rho`` covers ``L`` events.

    """

    rho: float
    horizon: int = 2**20
    sensitivity: int = 1

    def __post_init__(self) -> None:
        positive_finite("rho", self.rho)
        h = self.horizon
        if isinstance(h, bool) or not isinstance(h, int) or h not in _load_table():
            raise InvalidParameterError(_horizon_message(h))
        if isinstance(self.sensitivity, bool) or not isinstance(self.sensitivity, int) or (
                self.sensitivity < 1):
            raise InvalidParameterError(
                f"sensitivity must be an integer >= 1, got {self.sensitivity!r}")
        _check_discreteness_term(self)
        if _sigma2_grid(self) >= 1 << 112:  # bulk_noise.gaussian's int64 range
            raise InvalidParameterError(
                f"rho = {self.rho!r} is too small for the BLT counter: its noise would have a "
                f"standard deviation of about {self.noise_std:.3g} counts per release (the "
                "exact sampler's int64 range ends there); use a larger rho")

    @property
    def charge(self) -> PrivacyCharge:
        """What the counter costs, once, for the whole stream."""
        return PrivacyCharge(rho=self.rho, label="BLT counter")

    @property
    def mechanism(self) -> str:
        """The mechanism's name on releases."""
        return _MECHANISM

    @property
    def buffers(self) -> int:
        """The number ``d`` of buffers (the counter's memory is ``O(d)``)."""
        return _parameters(self.horizon).buffers

    @property
    def sigma2_grid(self) -> Fraction:
        """The discrete Gaussian's ``sigma_G^2``, an integer, in grid units squared."""
        return _sigma2_grid(self)

    @property
    def l2_sensitivity(self) -> float:
        """The (rounded-up) L2 sensitivity ``L Delta_G / G`` of an epoch's releases, in counts."""
        p = _parameters(self.horizon)
        return self.sensitivity * math.nextafter(math.sqrt(float(p.delta2)), math.inf) / _GRID

    @property
    def noise_std(self) -> float:
        """The standard deviation of each release's noise ``Z_t / G``, in counts."""
        return math.sqrt(discrete_gaussian_variance(self.sigma2_grid)) / _GRID


@functools.lru_cache(maxsize=256)
def _sigma2_grid(spec: BltCounterSpec) -> Fraction:
    delta2 = _parameters(spec.horizon).delta2 * (spec.sensitivity * spec.sensitivity)
    rho = exact(spec.rho) * (1 - _RHO_RESERVE)
    q = delta2 / (2 * rho)
    return Fraction(-(-q.numerator // q.denominator))  # ceil, exactly


def _check_discreteness_term(spec: BltCounterSpec) -> None:
    """Check that the discreteness term of CKS 2020 Theorem 14 fits in the reserved rho.

    Its size is governed by ``exp(-pi^2 sigma_G^2)`` per coordinate; we bound it
    generously by ``50 n exp(-pi^2 sigma_G^2) / (1 - exp(-pi^2 sigma_G^2))`` and
    require that to be below the ``10^-12 rho`` kept in reserve.
    """
    s2 = float(_sigma2_grid(spec))
    log_term = math.log(50.0 * spec.horizon) - math.pi**2 * s2 - math.log1p(
        -math.exp(-math.pi**2 * s2)
    )
    if log_term > math.log(float(_RHO_RESERVE) * spec.rho):
        raise InvalidParameterError(
            f"rho = {spec.rho!r} is too large for the BLT counter's grid (sigma_G^2 = {s2:.3g})"
        )


# --- accuracy -------------------------------------------------------------------------------


def _variance(spec: BltCounterSpec, epoch: int, step_in_epoch: int) -> float:
    table = _unit_variance_table(spec.horizon)
    s2 = spec.noise_std**2
    return s2 * (epoch * float(table[-1]) + float(table[step_in_epoch]))


def analytic_std(spec: BltCounterSpec, t: int) -> float:
    """Return the standard deviation of the counter's estimate at (0-based) step ``t``."""
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise InvalidParameterError(f"t must be an integer >= 0, got {t!r}")
    epoch, s = divmod(t, spec.horizon)
    return math.sqrt(_variance(spec, epoch, s))


def worst_step_std(spec: BltCounterSpec, steps: int) -> float:
    """Return the largest standard deviation over the first ``steps`` steps.

    The variance never decreases from one step to the next (within an epoch
    it adds ``sigma^2 P_t^2``; at an epoch boundary the finished epoch's full
    variance is carried), so this is the standard deviation at ``steps - 1``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidParameterError(f"steps must be an integer >= 1, got {steps!r}")
    return analytic_std(spec, steps - 1)


def plain_tree_zcdp_worst_std(rho: float, steps: int) -> float:
    """Return the worst-step std of the plain binary tree counter with discrete Gaussian noise.

    For comparison: with ``L = ceil(log2 steps) + 1`` levels an event changes
    ``L`` nodes by one (L2 sensitivity ``sqrt(L)``), so every node gets
    ``N_Z(0, L / (2 rho))``; a prefix sums one node per set bit of ``t + 1``, at
    most ``floor(log2(steps + 1))`` of them.
    """
    positive_finite("rho", rho)
    integer_at_least("steps", steps, 1)
    levels = (steps - 1).bit_length() + 1
    nodes = (steps + 1).bit_length() - 1
    return math.sqrt(nodes * discrete_gaussian_variance(Fraction(levels) / (2 * Fraction(rho))))


def factorization_lower_bound(rho: float, steps: int) -> float:
    """Return a lower bound on the worst-step std of any factorization mechanism.

    For ``A = B C`` with Gaussian noise calibrated to the column norm of ``C``
    the worst-step std is ``max_row ||B|| max_col ||C|| / sqrt(2 rho)``, at
    least ``gamma_2(A) / sqrt(2 rho)``, and ``gamma_2(A) >= ||A||_* / n`` (trace
    norm). The singular values of the ``n x n`` prefix-sum matrix are
    ``1 / (2 sin((2k - 1) pi / (2 (2n + 1))))``, ``k = 1..n``.
    """
    positive_finite("rho", rho)
    integer_at_least("steps", steps, 1)
    k = np.arange(1, steps + 1, dtype=np.float64)
    singular = 0.5 / np.sin((2.0 * k - 1.0) * math.pi / (2.0 * (2 * steps + 1)))
    return float(np.sum(singular)) / steps / math.sqrt(2.0 * rho)


# --- the counter ----------------------------------------------------------------------------


def _round_shift(value: int, bits: int) -> int:
    """Return ``round(value / 2^bits)``, halves rounded up (exact integer arithmetic)."""
    return (value + (1 << (bits - 1))) >> bits


def _grid_step(p: _Parameters, buffers: list[int], x: int) -> int:
    """Return ``Y_t``, the grid value of ``G (C x)_t``, and advance the integer buffers in place.

    ``Y_t = x G + sum_j round(W_j B_j / 2^P)``, then
    ``B_j <- round(T_j B_j / 2^P) + x G``: exact integer arithmetic, so the
    released ``Y_t + Z_t`` lives on the integer grid whatever the input.
    """
    bits = p.precision_bits
    xg = x * _GRID
    y = xg
    for j, b in enumerate(buffers):
        y += _round_shift(p.omega_num[j] * b, bits)
        buffers[j] = _round_shift(p.theta_num[j] * b, bits) + xg
    return y


def _inverse_step(p: _Parameters, buffers: list[float], w: float) -> float:
    """Return ``(C^{-1} w)_t`` and advance the float buffers (feedback form, post-processing).

    ``u = w - sum_j omega_j b_j``, then ``b_j <- theta_j b_j + u``.
    """
    u = w
    for j, b in enumerate(buffers):
        u -= p.omega[j] * b
    for j, b in enumerate(buffers):
        buffers[j] = p.theta[j] * b + u
    return u


class BltCounter:
    """A running BLT counter for one stream.

    Args:
        spec: the counter's specification.
        noise_key: the secret key the noise is derived from (never stored).
        coordinates: identifies this counter's noise (flow, key, ...); the step's
            noise is drawn at its lane's ``(TAG_BLT, epoch, 0, step_in_epoch)``, so
            a replayed step reproduces its release exactly.
        state: a :meth:`to_state` snapshot to resume from.

    Raises:
        InvalidParameterError: bad coordinates, or a state that does not belong
            to this specification.

    """

    __slots__ = (
        "spec", "_key", "_coordinates", "_lane", "_p", "_sigma2", "_epoch", "_s",
        "_grid_buffers", "_inverse_buffers", "_partial", "_base_value",
    )

    def __init__(
        self,
        spec: BltCounterSpec,
        noise_key: NoiseKey,
        coordinates: tuple[Coordinate, ...],
        state: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(coordinates, tuple) or any(
            isinstance(c, bool) or not isinstance(c, (str, int)) for c in coordinates
        ):
            raise InvalidParameterError(
                f"coordinates must be a tuple of str and int, got {coordinates!r}"
            )
        self.spec = spec
        self._key = noise_key
        self._coordinates = coordinates
        self._lane = noise_key.lane(*coordinates)
        self._p = _parameters(spec.horizon)
        self._sigma2 = spec.sigma2_grid
        d = self._p.buffers
        self._epoch = 0
        self._s = 0
        self._grid_buffers = [0] * d
        self._inverse_buffers = [0.0] * d
        self._partial = 0.0
        self._base_value = 0.0
        if state is not None:
            self._restore(state)

    @property
    def steps_done(self) -> int:
        """How many steps this counter has processed."""
        return self._epoch * self.spec.horizon + self._s

    def step(self, increment: int) -> CounterEstimate:
        """Add the next step's increment and return the private prefix-count estimate.

        Args:
            increment: the number of events in this step (an integer >= 0).

        """
        x = checked_increment(increment)
        y = _grid_step(self._p, self._grid_buffers, x)
        released = y + gaussian_one(self._key, self._lane, self._sigma2, TAG_BLT, self._epoch, 0,
                                    self._s)
        # Post-processing of the integer release: C^{-1}, then the prefix sum.
        self._partial += _inverse_step(self._p, self._inverse_buffers, float(released) / _GRID)
        value = self._base_value + self._partial
        step = self.steps_done
        std = math.sqrt(_variance(self.spec, self._epoch, self._s))
        self._s += 1
        if self._s == self.spec.horizon:
            self._next_epoch(value)
        return CounterEstimate(step=step, value=value, std=std)

    def _next_epoch(self, value: float) -> None:
        """Carry the finished epoch's final estimate into the base and reset the buffers."""
        d = self._p.buffers
        self._base_value = value
        self._epoch += 1
        self._s = 0
        self._grid_buffers = [0] * d
        self._inverse_buffers = [0.0] * d
        self._partial = 0.0

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Return a plain-data snapshot (no key; holds true-count buffers: keep it secret).

        The grid buffers are unbounded integers, stored as decimal strings so
        that the snapshot survives JSON codecs limited to 64-bit integers.
        """
        return {
            "mechanism": _MECHANISM,
            "version": _STATE_VERSION,
            "rho": self.spec.rho,
            "horizon": self.spec.horizon,
            "parameters": self._p.digest,
            **({} if self.spec.sensitivity == 1 else {"sensitivity": self.spec.sensitivity}),
            "epoch": self._epoch,
            "step_in_epoch": self._s,
            "grid_buffers": [str(b) for b in self._grid_buffers],
            "inverse_buffers": list(self._inverse_buffers),
            "partial": self._partial,
            "base_value": self._base_value,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        mine = self.to_state()
        for field in ("mechanism", "version", "rho", "horizon", "parameters", "sensitivity"):
            if state.get(field) != mine.get(field):
                raise InvalidParameterError(
                    f"the snapshot's {field} is {state.get(field)!r} but this BLT counter's is "
                    f"{mine.get(field)!r}: it belongs to another counter specification"
                )
        d = self._p.buffers
        try:
            epoch, s = int(state["epoch"]), int(state["step_in_epoch"])
            grid = [int(b) for b in state["grid_buffers"]]
            inverse = [float(b) for b in state["inverse_buffers"]]
            partial, base = float(state["partial"]), float(state["base_value"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidParameterError(f"malformed BLT counter snapshot: {exc!r}") from None
        if epoch < 0 or not 0 <= s < self.spec.horizon or len(grid) != d or len(inverse) != d:
            raise InvalidParameterError(
                f"malformed BLT counter snapshot: epoch {epoch}, step {s}, "
                f"{len(grid)}/{len(inverse)} buffers (expected {d})"
            )
        self._epoch, self._s = epoch, s
        self._grid_buffers, self._inverse_buffers = grid, inverse
        self._partial, self._base_value = partial, base

    def __repr__(self) -> str:
        return (
            f"BltCounter(rho={self.spec.rho}, horizon={self.spec.horizon}, "
            f"steps_done={self.steps_done})"
        )
