"""Certified objective perturbation with exact noise: the ``"objective"`` ERM learner.

**Stated as OpenDP states a measurement**

(:func:`objective_perturbation` at a cost ``C``)

* input domain: a block of labelled rows feature-mapped by an
  :class:`~dpstream.core.erm.spec.ErmSpec` with ``learner = "objective"`` (rows clipped to the
  L1 ball, ``||z||_1 <= 1``), a public normaliser ``n̄`` and a public centre ``c``; input
  metric: add or remove ``r = unit_rows`` rows (``d_in = 1`` unit).
* function: draw ``b`` (exact discrete Laplace on a dyadic lattice), minimise
  ``J_b(w) = (1/n̄) sum_i l(w; z_i) + (Lambda/2) ||w - c||^2 + <b, w>/n̄`` to a certified
  precision, round onto the public grid ``g`` and add exact discrete Laplace noise of scale
  ``t``; the model is ``g (round(w/g) + Y)``.
* output measure: pure epsilon-DP; privacy map: ``1 ↦ C`` exactly (``C = r (eps_b + eps_jac +
  eps_out)``, Fractions, below). The schedules pass ``C = NoiseLevel.cost_at(spec, Delta)``,
  the very cost output perturbation would have at that computation, so the per-block ledger
  charges exactly what it charges for :func:`~dpstream.core.erm.output_noise.private_erm`.

Chaudhuri, Monteleoni, Sarwate 2011 (JMLR, "Differentially Private Empirical Risk Minimization",
Algorithm 2 and Theorem 9: objective perturbation), Kifer, Smith, Thakurta 2012 ("Private Convex
ERM and High-Dimensional Regression", objective perturbation in any norm: here L1, with noise
of density ``~ exp(-beta ||b||_1)``), made
exact with the coupling of Iyengar, Near, Song, Thakkar, Thakurta, Wang 2019 ("Towards Practical
Differentially Private Convex Optimization", Algorithm 1, *approximate minima perturbation*: output
noise covers the distance between the computed and the exact minimiser).

**The split of the budget** (per row: ``e = C / r``; by group privacy ``r`` rows cost ``r e =
C``, linear under pure DP)::

    eps_out = e / 100                                   (output noise, covers the solver)
    eps_jac = rank * ln(1 + c_l / (n̄ Lambda))          (Jacobian of the coupling)
    eps_b   = e - eps_out - eps_jac                     (the linear term's noise)

with ``rank = 1, c_l = 1/4 m`` (binary logistic) resp. ``rank = K - 1, c_l = 1/2 m`` (softmax,
Böhning 1992), ``m = max ||z||_2^2``: ``1/2`` with an intercept (``z = [x/R, 1]/2``, so
``||z||_2^2 <= ||x/R||_1^2/4 + 1/4``), else ``1`` (:func:`_curvature`; mechanism version 4;
5 and 6 with the joint bound below, 6 solving it without cancellation).
``Lambda = lambda`` if then ``eps_jac <= e/2``; otherwise ``Lambda`` is raised to a float
making ``eps_jac <= e/2``, within a relative ``2^-30`` above the smallest such value (it
starts at ``1 + 2^-30`` times the analytic threshold ``c_l / (n̄ expm1(e / (2 rank)))`` and
steps by that factor until the rounded-up ``eps_jac`` fits: Chaudhuri et al. Algorithm 2's
``Delta``; it depends on ``n̄`` and ``C`` only, both public). So ``eps_b >= e (1 - 1/100 - 1/2)
> 0``. ``ln`` is a rational upper bound (:func:`_log1p_up`): the float ``log1p`` of the float
nearest ``x`` times ``1 + 2^-40`` (``ln(1 + x)`` moves by a relative ``x/((1 + x) ln(1 + x)) <=
1`` times the relative error of ``x``, ``2^-53``, and ``log1p`` is within a few ulps, far below
``2^-40``), and never above ``x`` itself (``ln(1 + x) <= x``, exact). Here ``n̄`` is
``1/fl(1/n̄)``, the normaliser of the objective the solver minimises (it multiplies by the float
inverse), so every term below is exact for that objective.

**The noise ``b``.** Let ``gamma = 2^(v - q)`` with ``q = ceil(log2 p) + 20`` and ``v =
min(20, floor(log2 s) + 3)`` if ``s > 1`` (``s`` below: 1 unless the per-row budget is tiny),
else ``v = -max(0, ceil(log2 e) - 20)`` (0 unless ``e > 2^20``), all public; ``v <= 20`` keeps
``gamma p <= 1``,
``L1 = 1`` (binary: ``||(sigmoid(s) - y) z||_1 <= ||z||_1 <= 1``) resp. ``2`` (softmax:
``||(p - e_y) z^T||_1 = ||p - e_y||_1 ||z||_1 <= 2``) the per-row L1 bound of the loss gradient,
and ``beta = eps_b / (L1 + gamma p)``. Each coordinate ``b_j = gamma (k_j + 1/2)`` with
``k_j`` iid exact discrete Laplace of scale ``1/(beta gamma)`` (CKS 2020 Algorithm 2,
:func:`~dpstream.core.noise.samplers.discrete_laplace`), so ``P(k) ~ exp(-beta gamma |k|)``.
In the analysis ``b`` is the cell centre of a *virtual* continuous "staircase" sample ``B_j =
gamma (k_j + U_j)``, ``U_j`` iid uniform on ``[0, 1)``: ``B`` has the density
``f(x) ~ prod_j exp(-beta gamma |floor(x_j / gamma)|)``, and for any shift ``v``,
``| |floor((x + v)/gamma)| - |floor(x/gamma)| | <= |v|/gamma + 1`` per coordinate, so
``f(x) / f(x + v) <= exp(beta ||v||_1 + beta gamma p)``. ``||b - B||_inf <= gamma / 2``; the
solver gets ``b_fp``, each ``(2k + 1) gamma / 2`` rounded to the nearest float (exact while
``|2k + 1| < 2^53``), a deterministic function of ``k`` within ``2^-26 s`` of ``b`` in L2
(*Floating point*), so ``||b_fp - B||_2 <= gamma sqrt(p) / 2 + 2^-26 s``.

**Privacy (pure, add/remove one row).** Let ``w*(B)`` be the exact minimiser of ``J_B`` on
``D`` (strongly convex: unique). The first-order condition ``sum_i grad l(w; z_i) +
n̄ Lambda (w - c) + B = 0`` makes ``B -> w*`` a bijection with inverse
``B(w) = -sum_i grad l(w; z_i) - n̄ Lambda (w - c)``, whose Jacobian is ``-(H_D(w) + n̄ Lambda
I)``. Coupling: on ``D' = D + {z}`` the same ``w`` is the minimiser for ``B' = B(w) - grad l(w;
z)``, a shift of ``||grad l(w; z)||_1 <= L1``. The densities of ``w*`` under ``D'`` and ``D``
are ``f(B'(w)) |det(H_D + H_z + n̄ Lambda I)|`` and ``f(B(w)) |det(H_D + n̄ Lambda I)|``; their
ratio is at most ``exp(beta (L1 + gamma p))`` times ``det(I + A^-1/2 H_z A^-1/2)`` with ``A =
H_D + n̄ Lambda I >= n̄ Lambda I``. ``H_z`` is ``sigmoid' z z^T`` (rank 1, ``<= ||z||_2^2/4``)
resp. ``(diag(p) - p p^T) (x) z z^T`` (rank ``<= K - 1``, ``<= ||z||_2^2 / 2``), so the
determinant is at most ``(1 + c_l / (n̄ Lambda))^rank = exp(eps_jac)`` (``||z||_2^2 <= m``), and
in the other direction it is at most 1. With ``beta (L1 + gamma p) = eps_b``: the exact
minimiser ``w*`` is ``(eps_b + eps_jac)``-DP (the argument of CMS 2011, Theorem 9, in the L1
norm as KST 2012 do).

**The joint bound** (binary models). Both factors of the ratio above are taken at the *same*
``w``, hence at the same margin ``s = <w, z>``: the shift is ``ell'(s) z`` and the Jacobian
factor ``1 + ell''(s) z^T A^-1 z``. For the logistic loss, with ``a = |sigmoid(s) - y|`` in
``[0, 1]``, ``|ell'(s)| = a`` and ``ell''(s) = sigmoid(s)(1 - sigmoid(s)) = a (1 - a)``: a row
the model fits badly moves ``B`` far but bends the loss little. So the privacy loss of adding
``z`` at ``w`` is at most ``beta a ||z||_1 + beta gamma p + ln(1 + a (1 - a) ||z||_2^2 /
(n̄ Lambda))``, at most ``h(a) + beta gamma p`` with ``h(a) = beta a + ln(1 + a (1 - a) K)``,
``K = m / (n̄ Lambda)`` (``||z||_1 <= 1``, ``||z||_2^2 <= m``). Removing ``z`` costs at most
``beta (1 + gamma p)`` (its Jacobian factor is at most 1). With ``ln(1 + x) <= x``,
``h(a) <= beta a + a (1 - a) K``, a concave quadratic: if ``K <= beta`` its derivative
``beta + K (1 - 2a)`` is ``>= 0`` on ``[0, 1]``, so ``sup h = h(1) = beta`` (the Jacobian costs
nothing); otherwise ``sup h <= (beta + K)^2 / (4 K)`` (the quadratic's maximum over all
``a``). The separate bound ``sup h <= beta + ln(1 + K/4)`` always holds too. The learner takes
the largest ``beta`` (exact rational check, :func:`_joint_beta`) with ``bound(beta) + beta
gamma p <= e - eps_out``, and never less than the separate bound's ``beta``; it then reports
``eps_b = beta (L1 + gamma p)`` and ``eps_jac = e - eps_out - eps_b`` (0 when ``K <= beta``),
so the three still sum to ``e`` exactly. ``Lambda``'s floor (the cap above) is the separate
bound's, unchanged; ``S'`` and ``s`` below use the separate bound's ``eps_b``, an upper bound on
``1/beta`` for the larger ``beta`` too. Softmax models keep the separate bound.

**The computed minimiser and the output noise** (Iyengar et al. 2019). The solver
(:func:`~dpstream.core.erm.solver.solve` with ``linear = b``) certifies ``||w_hat - argmin
J_b_fp|| <= tau = 2^-20 s / (n̄ Lambda)``, with ``s = max(1, S' sqrt(p) 2^-21)`` and ``S' = (L1
+ 1)/eps_b >= 1/beta`` (as ``gamma p <= 1``) a public bound on the scale of ``b`` (``s = 1``
unless the per-row budget ``e`` is below ``(L1 + 1) sqrt(p) 2^-21 / 0.49``, as ``eps_b >= 0.49
e``; see *Floating point*); ``argmin J_b_fp`` and ``argmin J_B`` differ by at most ``||b_fp -
B||_2 / (n̄ Lambda) <= (gamma sqrt(p) / 2 + 2^-26 s) / (n̄ Lambda)`` (strong convexity: the
linear term moves the minimiser by its change over ``n̄ Lambda``). So ``||w_hat - w*|| <=
tau_total = tau + (gamma sqrt(p) / 2 + 2^-26 s) / (n̄ Lambda)``, with ``w_hat`` a deterministic
function of ``k`` and ``w*`` of ``(k, U)``. The release rounds ``w_hat`` onto the public grid
``g = tau / ceil(sqrt(p))`` (exactly, :func:`~dpstream.core.erm.grid.round_to_grid`) and adds
iid ``DLap(t)``: for any ``u, u'`` with ``||u - u'|| <= 2 tau_total`` the rounded integers
differ by at most ``D1 = 2 sqrt(p) tau_total / g + p`` in L1 (``sqrt(p)`` rounded up to a
rational), and ``t = D1 / eps_out`` makes their output laws within ``exp(eps_out)``. For an
output event ``E`` let ``h(u) = P[round(u/g) + Y in E]``, ``h+(w) = sup h`` and ``h-(w) = inf
h`` over the ball of radius ``tau_total`` around ``w`` (so ``h+ <= e^eps_out h-``). Then
``P_D(E) = E[h(w_hat_D)] <= E[h+(w*_D)] <= e^(eps_b + eps_jac) E[h+(w*_D')] <= e^(eps_b +
eps_jac + eps_out) E[h-(w*_D')] <= e^(e) P_D'(E)``, and symmetrically. One row costs ``e =
C/r``, a unit of ``r`` rows ``C``: the model's ``cost``, exactly.

**Floating point.** ``g``, ``t``, ``tau``, ``D1`` and every epsilon are Fractions (``Lambda``
and ``n̄ = 1/fl(1/n̄)`` are the exact values of the floats the solver uses); the output noise is
exact integers on the exact grid (pitfall 2: the fractional part of ``w_hat / g`` is never
visible). The solver's certificate rests on its documented floating-point error model
(:mod:`~dpstream.core.erm.solver`). The linear term ``b/n̄`` and the penalty ``Lambda (w - c)``
nearly cancel, each of size about ``||b|| / n̄``, so their rounding adds at most about
``3 2^-52 ||b||_2 / n̄`` to the computed gradient; the check ``||b||_inf sqrt(p) <= 2^27 s``
(exact, on the integers ``2k + 1``, before solving) keeps that at most ``3 2^-25 s / n̄``,
``3/16`` of the solver's allowance ``Lambda tau / 2 = 2^-21 s / n̄``. That is why ``tau``
widens with ``s``: at a tiny per-row budget ``b`` is large (``S ~ 1/e``) and float64 cannot
certify the minimiser to ``2^-20 / (n̄ Lambda)``. The same check bounds the rounding of ``b``
to floats: ``|b_fp,j - b_j| <= 2^-53 |b_j| <= 2^-26 s / sqrt(p)``, at most ``2^-26 s`` in L2
(in ``tau_total`` above).

*The check fails with probability below* ``2^-60`` *a release, for every cost and every*
``p <= 2^30`` (``ErmSpec`` refuses larger ``p`` for this learner; pitfall 16: a refusal that
depends on the noise alone replays on every restart, so it must be negligible). Its per-
coordinate limit ``2^27 s / sqrt(p)`` is at least ``64 S' >= 64 / beta`` (``s >= S' sqrt(p)
2^-21``), so a coordinate fails only if ``|k + 1/2| > 64 sigma``, with ``sigma = 1/(beta gamma)``
(``k``'s scale); ``P(k >= m) = a^ceil(m) / (1 + a) <= a^m`` with ``a = exp(-1/sigma)`` gives a
probability at most ``2 e^-64 a^-1/2 <= 2 e^-63.5`` a coordinate when ``sigma >= 1``, and ``p 2
e^-63.5 < 2^-60`` for ``p <= 2^30``. ``sigma >= 1`` always: ``sigma >= 1/(e gamma) = 2^(q -
v)/e``, at least ``2^(ceil(log2 e))/e >= 1`` when ``s = 1`` (``v <= 0``) and at least ``2^21
sqrt(p)/7 > 1`` when ``s > 1`` (``v <= 20`` and then ``e < 3 sqrt(p) 2^-21 / 0.49``). The lattice
``v`` and the rounding make every draw usable: no bound on ``|k|`` beyond this check, so no
per-row cost is too small for the noise (only below about ``2^-1000``, where ``2^27 s``
would leave float64, is the cost refused, on public values). ``tests/test_erm_objective.py``
sweeps ``e`` and ``p`` and computes this probability exactly. The price of ``s``: the output
noise's std is about ``500 sqrt(p) n̄ Lambda tau`` times ``b``'s effect on ``w`` (``S / (n̄
Lambda)``), i.e. ``0.4 %`` at ``p = 65`` while ``s = 1``, growing as ``1/e`` below. A draw
outside the check (a function of the noise alone, never of the data) raises
:class:`~dpstream.core.erm.solver.CertificationError`: nothing is released.

**What the model reports.** ``cost = C``; ``noise_std``: the per-coordinate standard deviation
of ``b / n̄``, the linear term's noise, public and analytic (``gamma sqrt(Var k) / n̄``);
``grid = g``; ``sensitivity``: ``2 tau_total``, the L2 distance between two computed minimisers
that the output noise covers (the analogue of output perturbation's ``Delta + 2 tau``).

**Exactness and replay-safety.** All randomness comes from ``rng`` (the caller derives it from
``NoiseKey.stream(*coordinates)``): first ``k_1..k_p``, then the output noise, row-major. The
solver is deterministic, so a replayed release is byte-identical. The mechanism's version and
every constant that shapes what it computes from those integers
(:func:`~dpstream.core.erm.spec.learner_binding`, defined next to ``ErmSpec``) are bound into
``ErmSpec.to_dict()``, hence into the noise coordinates: a changed mechanism never redraws a
stored stream's integers (pitfall 13; bump ``VERSION`` on every change of a rule).

**State.** None: the release is a :class:`~dpstream.core.erm.model.PrivateModel`. zCDP is not
supported here (``ErmSpec`` refuses the combination); ERMG stays on output perturbation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

import numpy as np

from dpstream.core.erm.grid import _params_from_integers, round_to_grid
from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.solver import CertificationError, _precision_float, solve
from dpstream.core.erm.spec import (  # the learner's constants live with its binding
    JACOBIAN_CAP,
    LATTICE_BITS,
    LINEAR_BITS,
    OUTPUT_SHARE,
    RAISE_STEP_BITS,
    SOLVER_BITS,
    WIDE_BITS,
    Block,
    ErmSpec,
    FloatArray,
    _as_fraction,
    learner_binding,
)
from dpstream.core.noise.samplers import RandomIntegers, discrete_laplace
from dpstream.errors import InvalidParameterError

__all__ = [
    "ObjectiveBudget",
    "learner_binding",
    "linear_noise_std",
    "objective_budget",
    "objective_perturbation",
]

_LOG_MARGIN: Final = 1 + Fraction(1, 1 << 40)
_FLOAT_LIMIT: Final = Fraction(2) ** 1000  # |b| must stay far inside float64's range


def _log1p_up(x: Fraction) -> Fraction:
    """Return a rational upper bound on ``ln(1 + x)`` for a Fraction ``x > 0``.

    ``min(x, Fraction(log1p(float(x))) (1 + 2^-40))`` (module docstring); ``x`` alone when
    ``float(x)`` would be subnormal.
    """
    xf = float(x)
    if xf < 2.0**-1000:
        return x
    return min(x, Fraction(math.log1p(xf)) * _LOG_MARGIN)


def _sqrt_up(p: int) -> Fraction:
    """Return a rational ``>= sqrt(p)`` within ``2^-40``."""
    return Fraction(math.isqrt(p << 80) + 1, 1 << 40)


@dataclass(frozen=True)
class ObjectiveBudget:
    """The public constants of one objective-perturbation release (exact but ``regularization``).

    Attributes:
        per_row: ``e = C / r``.
        output: ``eps_out``; jacobian: ``eps_jac``; linear: ``eps_b`` (they sum to ``e``;
            binary models: ``eps_b = beta (L1 + gamma p)`` under the joint bound and
            ``eps_jac`` the rest, at most ``rank ln(1 + c_l / (n̄ Lambda))``).
        regularization: ``Lambda`` (a float: the one the solver uses).
        gamma: the lattice step of ``b``, ``2^-q``.
        beta: ``eps_b / (L1 + gamma p)``.
        noise_scale: the discrete Laplace scale ``1/(beta gamma)`` of ``k``.
        widening: ``s`` (1 unless the per-row budget is tiny).
        precision: the solver's ``tau`` (widened by ``s``); distance: ``tau_total``.
        grid: ``g``; l1_sensitivity: ``D1``; output_scale: ``t = D1 / eps_out``.

    """

    per_row: Fraction
    output: Fraction
    jacobian: Fraction
    linear: Fraction
    regularization: float
    gamma: Fraction
    beta: Fraction
    noise_scale: Fraction
    widening: Fraction
    precision: Fraction
    distance: Fraction
    grid: Fraction
    l1_sensitivity: Fraction
    output_scale: Fraction


def _widening(scale: Fraction, root: Fraction) -> Fraction:
    """``s = max(1, S sqrt(p) 2^-WIDE_BITS)``: how much the certified precision widens."""
    return max(Fraction(1), scale * root / (1 << WIDE_BITS))


def _curvature(spec: ErmSpec) -> Fraction:
    """``c_l``: the loss's curvature bound times ``max ||z||_2^2`` (module docstring).

    ``1/4`` (binary) resp. ``1/2`` (softmax) times ``||z||_2^2 <= 1/2`` with an intercept
    (``z = [x/R, 1]/2``: ``||x/R||_2^2/4 <= ||x/R||_1^2/4 <= 1/4``, plus ``1/4``), ``<= 1``
    without.
    """
    loss = Fraction(1, 4) if spec.binary else Fraction(1, 2)
    return loss * (Fraction(1, 2) if spec.intercept else 1)


def _jacobian(spec: ErmSpec, n: Fraction, lam: float) -> Fraction:
    """``rank * ln(1 + c_l / (n̄ Lambda))`` rounded up (module docstring)."""
    rank = 1 if spec.binary else len(spec.classes) - 1
    return rank * _log1p_up(_curvature(spec) / (n * Fraction(lam)))


def _joint_beta(rest: Fraction, k: Fraction, lattice: Fraction) -> Fraction:
    """The largest ``beta`` (within ``2^-40``) with ``bound(beta) + beta gamma p <= rest``.

    ``bound(beta)`` upper-bounds ``sup_a beta a + ln(1 + a (1 - a) K)`` over ``a`` in
    ``[0, 1]`` (binary models, *The joint bound* in the module docstring): ``beta`` when
    ``K <= beta``, else ``(beta + K)^2 / (4 K)``. Returns 0 when no positive ``beta`` fits.
    """
    top = rest / (1 + lattice)  # K <= beta: the Jacobian term costs nothing
    if k <= top:
        return top
    if k >= 4 * rest:  # (beta + K)^2/(4K) >= K/4 >= rest: no positive beta (and no float work)
        return Fraction(0)
    # (beta + K)^2/(4K) + beta gamma p = rest is homogeneous in (beta, K, rest): with rest = 1
    # and kappa = K/rest in (1/(1 + gp), 4), beta/rest = -P + sqrt(P^2 + R), P = kappa(1 +
    # 2 gp), R = kappa (4 - kappa) > 0 (4 - kappa from the Fractions: no cancellation near
    # kappa = 4), computed as R/(P + sqrt(P^2 + R)) (no overflow or underflow), then shrunk
    # until the exact check holds
    kappa, gp = float(k / rest), float(lattice)
    big_p, r = kappa * (1 + 2 * gp), kappa * float((4 * rest - k) / rest)
    guess = r / (big_p + math.sqrt(big_p * big_p + r))
    if not (math.isfinite(guess) and guess > 0.0):
        return Fraction(0)
    beta = Fraction(guess) * rest
    for _ in range(64):
        if (beta + k) ** 2 / (4 * k) + beta * lattice <= rest:
            return min(beta, top)
        beta *= 1 - Fraction(1, 1 << 40)
    return Fraction(0)


def objective_budget(spec: ErmSpec, normalizer: float, cost: Fraction) -> ObjectiveBudget:
    """Return the split of ``cost`` and the public constants of one release (module docstring).

    Raises:
        InvalidParameterError: a spec that is not ``learner = "objective"``, a bad normaliser or
            cost.

    """
    if spec.learner != "objective":
        raise InvalidParameterError(
            f"objective perturbation needs an ErmSpec with learner 'objective', got "
            f"{spec.learner!r}"
        )
    c = _as_fraction("cost", cost)
    # n̄' = 1/fl(1/n̄): the normaliser of the objective the solver minimises (it multiplies
    # by the float inverse), within 2^-53 relative of n̄
    n = 1 / Fraction(1.0 / spec._check_normalizer(normalizer))
    e = c / int(spec.unit_rows)
    cap = e * JACOBIAN_CAP
    lam = float(spec.regularization)
    if _jacobian(spec, n, lam) > cap:  # raise Lambda (Chaudhuri et al. 2011, Algorithm 2)
        rank = 1 if spec.binary else len(spec.classes) - 1
        c_l = float(_curvature(spec))
        room = math.expm1(float(cap) / rank)
        if not room > 0.0:
            raise InvalidParameterError(f"cost {float(c):.3g} is too small for this model")
        step = 1.0 + 2.0**-RAISE_STEP_BITS
        lam = max(lam, c_l / (float(n) * room) * step)
        while math.isfinite(lam) and _jacobian(spec, n, lam) > cap:
            lam = math.nextafter(lam * step, math.inf)
        if not math.isfinite(lam):
            raise InvalidParameterError(f"cost {float(c):.3g} is too small for this model")
    jac = _jacobian(spec, n, lam)
    out = e * OUTPUT_SHARE
    lin = e - out - jac
    p = spec.parameter_count
    l1 = 1 if spec.binary else 2
    root = _sqrt_up(p)
    widening = _widening((l1 + 1) / lin, root)  # (L1 + 1)/eps_b >= S = 1/beta: public
    if widening > 1:  # a coarser lattice keeps k smaller (docstring)
        wide = min(LATTICE_BITS, (widening.numerator // widening.denominator).bit_length() + 2)
    else:  # a finer one above e = 2^20 keeps k's scale >= 1 (docstring)
        wide = -max(0, (math.ceil(e) - 1).bit_length() - 20)
    q = (p - 1).bit_length() + LATTICE_BITS - wide  # gamma = 2^-q, q >= 1
    gamma = Fraction(1, 1 << q)
    beta = lin / (l1 + gamma * p)
    if spec.binary:  # the joint bound: never below the separate one (module docstring)
        k = 4 * _curvature(spec) / (n * Fraction(lam))  # max ||z||_2^2 / (n̄ Lambda)
        beta = max(beta, _joint_beta(e - out, k, gamma * p))
        lin = beta * (l1 + gamma * p)
        jac = e - out - lin  # what the coupling's Jacobian takes under the joint bound
    if Fraction(1 << LINEAR_BITS) * widening / root > _FLOAT_LIMIT:  # public: e near 2^-1000
        raise InvalidParameterError(f"cost {float(c):.3g} is too small for this model")
    n_lam = n * Fraction(lam)
    tau = Fraction(1, 1 << SOLVER_BITS) * widening / n_lam
    # ||b_fp - B||_2 <= gamma sqrt(p)/2 (lattice) + 2^(LINEAR_BITS - 53) s (float rounding)
    rounding = Fraction(1, 1 << (53 - LINEAR_BITS)) * widening
    distance = tau + (gamma * root / 2 + rounding) / n_lam
    grid = tau / (math.isqrt(p - 1) + 1)
    d1 = 2 * root * distance / grid + p
    return ObjectiveBudget(
        per_row=e, output=out, jacobian=jac, linear=lin, regularization=lam, gamma=gamma,
        beta=beta, noise_scale=1 / (beta * gamma), widening=widening, precision=tau,
        distance=distance,
        grid=grid, l1_sensitivity=d1, output_scale=d1 / out,
    )


def _dlap_variance(scale: Fraction) -> float:
    """``2 p / (1 - p)^2`` with ``p = exp(-1/scale)``, accurate for large scales (``expm1``)."""
    x = 1.0 / float(scale)
    return 2.0 * math.exp(-x) / math.expm1(-x) ** 2


def linear_noise_std(spec: ErmSpec, normalizer: float, cost: Fraction) -> float:
    """The per-coordinate std of ``b / n̄`` of a release at ``cost``: a model's ``noise_std``."""
    budget = objective_budget(spec, normalizer, cost)
    return float(budget.gamma) * math.sqrt(_dlap_variance(budget.noise_scale)) / float(normalizer)


def _linear_noise(rng: RandomIntegers, budget: ObjectiveBudget, p: int) -> list[float]:
    """Draw ``b_j = gamma (k_j + 1/2)`` for ``j < p``, rounded to the nearest float.

    Raises:
        CertificationError: ``||b||_inf sqrt(p) > 2^LINEAR_BITS s`` (the solver's
            floating-point allowance), probability below ``2^-60`` a release (docstring).

    """
    denominator = 2 * budget.gamma.denominator  # (2k + 1) gamma / 2 = odd / denominator
    # the check |odd| / denominator <= 2^LINEAR_BITS s / sqrt(p), sqrt(p) rounded up, exactly
    limit = Fraction(1 << LINEAR_BITS) * budget.widening * denominator / _sqrt_up(p)
    out = []
    for _ in range(p):
        odd = 2 * discrete_laplace(rng, budget.noise_scale) + 1
        if abs(odd) > limit:
            raise CertificationError(
                "an objective-perturbation noise draw exceeds the solver's floating-point "
                "allowance; nothing was released"
            )
        out.append(odd / denominator)  # int / int: correctly rounded (exact below 2^53)
    return out


def objective_perturbation(
    spec: ErmSpec,
    block: Block,
    *,
    normalizer: float,
    center: FloatArray | None,
    cost: Fraction,
    rng: RandomIntegers,
    initial: FloatArray | None = None,
) -> PrivateModel:
    """Release a private model by certified objective perturbation at exactly ``cost``.

    Draw ``b`` (``p`` exact discrete Laplace draws from ``rng``), minimise ``J_b`` with
    ``Lambda`` (:func:`objective_budget`) to the certified precision ``tau``, round onto the
    grid ``g`` and add ``p`` exact discrete Laplace draws of scale ``t`` (module docstring).

    Args:
        spec: the problem, ``learner = "objective"`` (pure accounting).
        block: the events (may be empty).
        normalizer: the public normaliser ``n̄``.
        center: the penalty's centre: ``None`` (0) or a *released* model's params.
        cost: ``C``, the exact pure epsilon of one unit of ``unit_rows`` rows.
        rng: the replay-safe uniform integers of this release.
        initial: optional warm start (public, or a function of this block only).

    Raises:
        InvalidParameterError: bad parameters, a block that does not fit the spec (also a row
            with ``||z||_1 > 1``).
        CertificationError: the solver could not certify its minimiser, or a noise draw is
            outside the exactly handled range; nothing is released.

    """
    budget = objective_budget(spec, normalizer, cost)
    if block.size and block.z.shape[1] == spec.columns:
        widest = float(np.max(np.sum(np.abs(block.z), axis=1)))
        # c_l and the joint bound use max ||z||_2^2 = 1/2 with an intercept (the map's)
        square = float(np.max(np.einsum("ij,ij->i", block.z, block.z)))
        if not (widest <= 1.0 and square <= (0.5 if spec.intercept else 1.0)):  # also NaN
            raise InvalidParameterError(
                "block features must come from ErmSpec.features with learner 'objective': a "
                "row has L1 norm > 1, a squared L2 norm above the map's bound (1/2 with an "
                "intercept), or is not finite"
            )
    p = spec.parameter_count
    shape = (spec.rows, spec.columns)
    b = np.array(_linear_noise(rng, budget, p), dtype=np.float64)
    solver_spec = (spec if budget.regularization == float(spec.regularization)
                   else dataclasses.replace(spec, regularization=budget.regularization))
    solution = solve(
        solver_spec, block, normalizer, center, precision=_precision_float(budget.precision),
        initial=initial, linear=b.reshape(shape),
    )
    if not solution.certified:
        raise CertificationError(
            f"the ERM solver could not certify the objective-perturbation minimiser to "
            f"{float(budget.precision):.3g} in float64 (normalizer {normalizer!r}); nothing "
            "was released"
        )
    g = budget.grid
    rounded = round_to_grid(solution.params, g)
    released = [r + discrete_laplace(rng, budget.output_scale) for r in rounded]
    total = int(spec.unit_rows) * (budget.linear + budget.jacobian + budget.output)
    if total != _as_fraction("cost", cost):  # by construction; a self-check of the exact arithmetic
        raise InvalidParameterError(f"objective perturbation split {cost} into {total}")
    std = float(budget.gamma) * math.sqrt(_dlap_variance(budget.noise_scale))
    return PrivateModel(
        params=_params_from_integers(released, g, shape),
        grid=g,
        noise_std=std / float(normalizer),  # = linear_noise_std(spec, normalizer, cost)
        cost=total,
        sensitivity=2 * budget.distance,
        normalizer=float(normalizer),
        size=block.size,
        integers=tuple(released),
    )
