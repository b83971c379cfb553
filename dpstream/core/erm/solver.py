"""The certified ERM solver: the exact minimiser within a proven distance (output perturbation).

Output perturbation (Watson et al., "Continual and Sliding Window Release for Private ERM", paper
004, Algorithms 1, 3 and 7; Chaudhuri, Monteleoni, Sarwate 2011) adds noise calibrated to the
sensitivity of the *exact* minimiser of the strongly convex objective of
:mod:`dpstream.core.erm.spec`; a model only near it would need more noise. This module finds a
minimiser and certifies its distance.

**Certificate.** Output perturbation needs the exact minimiser. For any ``w``, strong convexity
gives ``||w - w*|| <= ||grad J(w)|| / lambda``. :func:`solve` runs L-BFGS-B (scipy, warm-started at
the centre), then Newton-CG steps with exact Hessian-vector products, each accepted only if it
shrinks ``||grad J||`` at least by the factor ``1 - lambda/beta`` that a plain gradient step
``w - grad J(w)/beta`` guarantees (``beta = smoothness m/n̄ + lambda``, the smoothness of ``J``;
``grad J(w+) = (I - A/beta) grad J(w)`` with ``lambda I <= A <= beta I``); otherwise it takes that
gradient step. So the loop provably terminates. It stops when the computed
``||grad J|| <= lambda tau / 2`` with ``tau = Delta 2^-20``
(:data:`~dpstream.core.erm.grid.PRECISION_BITS`). The other half of ``lambda tau`` is the allowance
for the floating-point error of evaluating the gradient: that error is about ``u log2(m) m / n̄``
per coordinate for blocked summation (``u = 2^-53``; rounding errors that behave randomly give
``u sqrt(m) / n̄``), the allowance is ``L 2^-21 / n̄``, so it covers the pessimistic estimate while
``sqrt(p) m log2(m)`` stays below about ``4 10^9`` (``10^6`` events at ``p = 65`` with a 25-fold
margin) and the typical error far beyond. This is an error *model*, as in the design, not a proof.
Then the computed ``w`` lies within ``tau`` of ``w*`` and for neighbours
``||w(D) - w(D')|| <= Delta + 2 tau = (1 + 2^-19) Delta``: that is the sensitivity charged. How
``w`` was found (iterations, warm start) does not matter, only the certificate. scipy earns its
place: L-BFGS-B's line search (Moré-Thuente) reaches the neighbourhood of the optimum in a few
dozen iterations whatever the conditioning, which a hand-written method would have to replicate
(more code to audit); privacy never depends on it, since the certificate is checked afterwards. It
is imported lazily, so the rest of the core imports without scipy. If float64 cannot reach the
certificate (gradient steps stop shrinking the gradient: far beyond the sizes above),
:func:`~dpstream.core.erm.output_noise.private_erm` raises :class:`CertificationError` rather than
release an uncertified model; :func:`solve` itself never raises on data.

**A linear term** (objective perturbation, :mod:`dpstream.core.erm.objective`). :func:`solve`
also minimises ``J_b(w) = J(w) + <b, w>/n̄`` for a given vector ``b`` (``linear``). The term
adds ``b/n̄`` to the gradient and ``<b, w>/n̄`` to the value; the Hessian (and so the
Hessian-vector products, the smoothness ``beta`` and the strong convexity) is unchanged, so the
certificate above holds as it is. The term is evaluated as ``b * (1/n̄)`` in float64: its
rounding error, at most ``2^-52 ||b|| / n̄``, belongs to the same allowance (the objective
learner checks ``||b||_inf sqrt(p) <= 2^28`` before it solves, so it is below ``2^-24 / n̄``,
a sixth of the allowance). Without ``linear`` every byte is as before.

**Noise and state.** Nothing here is random: :func:`solve` is a fixed computation of its inputs,
so a replayed release solves to the same floats. A :class:`Solution` holds the non-private
minimiser: never persist or publish it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

import numpy as np

from dpstream.core._checks import positive_finite
from dpstream.core.erm.spec import Block, ErmSpec, FloatArray, _check_block, _check_params
from dpstream.errors import DpstreamError

__all__ = [
    "CertificationError",
    "Solution",
    "solve",
]

_MAX_POLISH_STEPS: Final = 10_000
_MAX_NEWTON_FAILURES: Final = 5  # then only the guaranteed gradient steps
_LBFGS_MAX_ITERATIONS: Final = 2_000


class CertificationError(DpstreamError):
    """The solver could not certify its minimiser to the required precision in float64.

    Raised by :func:`~dpstream.core.erm.output_noise.private_erm` instead of releasing a model
    whose distance to the exact minimiser is not bounded (the sensitivity argument would not
    cover it). It only happens far outside the supported range (the module docstring's
    *Certificate*: blocks of many millions of events).
    """


def _softmax(scores: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Return ``(softmax(scores), logsumexp(scores))`` row-wise, stably (max subtracted)."""
    top = scores.max(axis=1, keepdims=True)
    e = np.exp(scores - top)
    total = e.sum(axis=1, keepdims=True)
    lse: FloatArray = (top + np.log(total))[:, 0]
    prob: FloatArray = e / total
    return prob, lse


class _Objective:
    """``J`` and its derivatives on one block, vectorised (no per-row Python loop).

    Multinomial scores are kept as a ``(K, m)`` matrix so that the row-wise softmax reduces
    over the short leading axis (contiguous, fast).
    """

    __slots__ = ("z", "zt", "target", "inv_n", "lam", "center", "binary", "shape", "m",
                 "linear")

    def __init__(self, spec: ErmSpec, block: Block, normalizer: float, center: FloatArray,
                 linear: FloatArray | None = None) -> None:
        self.z = block.z
        self.zt = block.z.T
        self.m = block.size
        self.binary = spec.binary
        self.shape = (spec.rows, spec.columns)
        if self.binary:
            self.target = block.y.astype(np.float64)
        else:
            onehot = np.zeros((spec.rows, self.m), dtype=np.float64)
            onehot[block.y, np.arange(self.m)] = 1.0
            self.target = onehot
        self.inv_n = 1.0 / normalizer
        self.lam = float(spec.regularization)
        self.center = center.reshape(-1)
        # b / n̄ of the objective learner's J_b (None: the plain J, byte for byte)
        self.linear = None if linear is None else linear.reshape(-1) * self.inv_n

    def _evaluate(self, w: FloatArray, value: bool) -> tuple[float, FloatArray, FloatArray]:
        diff = w - self.center
        loss = 0.0
        if self.binary:
            s = self.z @ w
            e = np.exp(-np.abs(s))
            if value:  # log(1 + e^s) - y s, stably
                loss = float(np.sum(np.maximum(s, 0.0)) + np.sum(np.log1p(e)) - self.target @ s)
            prob: FloatArray = np.where(s >= 0.0, 1.0, e) / (1.0 + e)
            grad = (self.zt @ (prob - self.target)) * self.inv_n + self.lam * diff
        else:
            scores = w.reshape(self.shape) @ self.zt  # (K, m)
            top = scores.max(axis=0)
            shifted = np.exp(scores - top)
            total = shifted.sum(axis=0)
            prob = shifted / total
            if value:  # logsumexp(s) - s_y
                loss = float(np.sum(top) + np.sum(np.log(total)) - np.sum(scores * self.target))
            grad = ((prob - self.target) @ self.z).reshape(-1) * self.inv_n + self.lam * diff
        value_j = loss * self.inv_n + 0.5 * self.lam * float(diff @ diff)
        if self.linear is not None:
            grad = grad + self.linear
            if value:
                value_j += float(self.linear @ w)
        return value_j, grad, prob

    def value_and_gradient(self, w: FloatArray) -> tuple[float, FloatArray, FloatArray]:
        """Return ``(J(w), grad J(w), probabilities)`` for a flat ``w``."""
        return self._evaluate(w, True)

    def gradient(self, w: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Return ``(grad J(w), probabilities)`` for a flat ``w``."""
        _, grad, prob = self._evaluate(w, False)
        return grad, prob

    def hessian_product(self, prob: FloatArray, v: FloatArray) -> FloatArray:
        """Return ``H v`` at the point whose probabilities are ``prob``, for a flat ``v``."""
        if self.binary:
            u = (prob * (1.0 - prob)) * (self.z @ v)
            out: FloatArray = (self.zt @ u) * self.inv_n + self.lam * v
            return out
        u2 = v.reshape(self.shape) @ self.zt  # (K, m): V z_i
        t = prob * (u2 - np.sum(prob * u2, axis=0))
        out = (t @ self.z).reshape(-1) * self.inv_n + self.lam * v
        return out


def _conjugate_gradient(
    product: Callable[[FloatArray], FloatArray], b: FloatArray, tolerance: float, limit: int
) -> FloatArray | None:
    """Solve ``H x = b`` (``H`` symmetric positive definite) to ``||r|| <= tolerance``."""
    x = np.zeros_like(b)
    r = b.copy()
    d = r.copy()
    rs = float(r @ r)
    for _ in range(limit):
        if math.sqrt(rs) <= tolerance:
            break
        hd = product(d)
        curvature = float(d @ hd)
        if not curvature > 0.0:
            return None if not x.any() else x
        alpha = rs / curvature
        x += alpha * d
        r -= alpha * hd
        rs_new = float(r @ r)
        d = r + (rs_new / rs) * d
        rs = rs_new
    return x


@dataclass(frozen=True, eq=False)
class Solution:
    """The non-private minimiser of ``J`` and its certificate (never publish ``params``).

    Attributes:
        params: ``(rows, columns)`` float64 minimiser.
        gradient_norm: the computed ``||grad J(params)||``.
        certified_distance: a bound on ``||params - argmin J||``: ``gradient_norm / lambda``
            plus half the requested precision for the floating-point error of the gradient
            (0 for an empty block, whose minimiser is the centre exactly).
        iterations: L-BFGS-B iterations plus polishing steps.
        certified: whether the computed ``||grad J|| <= lambda precision / 2`` was reached
            (then ``certified_distance <= precision``).

    """

    params: FloatArray
    gradient_norm: float
    certified_distance: float
    iterations: int
    certified: bool = True


def solve(
    spec: ErmSpec,
    block: Block,
    normalizer: float,
    center: FloatArray | None,
    *,
    precision: float,
    initial: FloatArray | None = None,
    linear: FloatArray | None = None,
) -> Solution:
    """Minimise ``J`` (or ``J_b``: ``linear = b``) and certify the result within ``precision``.

    L-BFGS-B (scipy) from ``initial`` (default: the centre, or 0), then Newton-CG steps
    guarded by the guaranteed contraction of gradient steps ``1/beta``, until the computed
    ``||grad J|| <= lambda precision / 2`` (see the module docstring). Never raises on data:
    if float64 cannot reach the certificate, the result has ``certified=False``.

    Args:
        spec: the problem.
        block: the events (from :meth:`ErmSpec.block`); may be empty.
        normalizer: the public normaliser ``n̄ > 0``.
        center: the public centre of the penalty (``None``: 0), shape ``(rows, columns)``.
        precision: the required ``||params - argmin J||`` bound, > 0.
        initial: a starting point (performance only). It must be public (a released model) or
            a function of this block's data alone, like the centre.
        linear: the vector ``b`` of ``J_b(w) = J(w) + <b, w>/n̄``, shape ``(rows, columns)``
            (objective perturbation); ``None``: the plain ``J``.

    Raises:
        InvalidParameterError: bad parameters or a block that does not fit the spec.

    """
    n = positive_finite("normalizer", normalizer)
    tol = positive_finite("precision", precision)
    _check_block(spec, block)
    c = (
        np.zeros((spec.rows, spec.columns))
        if center is None
        else _check_params(spec, "center", center)
    )
    b = None if linear is None else _check_params(spec, "linear", linear)
    if block.size == 0 and b is None:  # J = (lambda/2)||w - c||^2: the centre, exactly
        return Solution(c.copy(), 0.0, 0.0, 0, True)
    start = c if initial is None else _check_params(spec, "initial", initial)
    objective = _Objective(spec, block, n, c, b)
    lam = objective.lam
    target = 0.5 * lam * tol
    beta = spec.smoothness * block.size / n + lam  # smoothness of J on ||z|| <= 1
    contraction = 1.0 - lam / beta

    from scipy.optimize import minimize  # type: ignore[import-untyped]  # lazy: see docstring

    def fun(w: FloatArray) -> tuple[float, FloatArray]:
        value, grad, _ = objective.value_and_gradient(w)
        return value, grad

    result = minimize(
        fun,
        start.reshape(-1).copy(),
        jac=True,
        method="L-BFGS-B",
        options={
            "maxiter": _LBFGS_MAX_ITERATIONS,
            "ftol": 1e-12,
            "gtol": target / math.sqrt(spec.parameter_count),
            "maxcor": 20,
        },
    )
    w = np.asarray(result.x, dtype=np.float64)
    if not bool(np.isfinite(w).all()):
        w = start.reshape(-1).copy()
    iterations = int(result.nit)
    grad, prob = objective.gradient(w)
    norm = float(np.linalg.norm(grad))
    cg_limit = min(spec.parameter_count, 250) + 10
    steps = 0
    newton_failures = 0
    while not norm <= target and steps < _MAX_POLISH_STEPS:
        steps += 1
        if newton_failures < _MAX_NEWTON_FAILURES:
            point = prob

            def product(v: FloatArray, point: FloatArray = point) -> FloatArray:
                return objective.hessian_product(point, v)

            direction = _conjugate_gradient(product, -grad, 1e-3 * norm, cg_limit)
            if direction is not None:
                trial = w + direction
                trial_grad, trial_prob = objective.gradient(trial)
                trial_norm = float(np.linalg.norm(trial_grad))
                if trial_norm <= contraction * norm:
                    w, grad, prob, norm = trial, trial_grad, trial_prob, trial_norm
                    continue
            newton_failures += 1
        trial = w - grad / beta  # contracts ||grad J|| by (1 - lambda/beta) in exact arithmetic
        trial_grad, trial_prob = objective.gradient(trial)
        trial_norm = float(np.linalg.norm(trial_grad))
        if not trial_norm < norm:
            break  # the float64 floor: no further progress is possible
        w, grad, prob, norm = trial, trial_grad, trial_prob, trial_norm
    certified = norm <= target
    distance = norm / lam + 0.5 * tol
    return Solution(
        w.reshape(spec.rows, spec.columns), norm, distance, iterations + steps, certified
    )


def _precision_float(tau: Fraction) -> float:
    """Return the largest float not above ``tau`` (so a certified distance <= it is <= tau)."""
    f = float(tau)
    while Fraction(f) > tau:
        f = math.nextafter(f, 0.0)
    return f
