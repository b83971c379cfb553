"""Output perturbation: exact integer noise on the grid (ERM paper 004, Algorithms 1, 3 and 7).

**Stated as OpenDP states a measurement**

(:func:`private_erm` at a :class:`NoiseLevel`)

* input domain: a block of labelled, clipped rows (:class:`~dpstream.core.erm.spec.ErmSpec`)
  with a public normaliser ``n̄``; input metric: add or remove one row (``d_in = 1``), which
  moves the regularised minimiser by at most ``Delta = L / (lambda n̄)`` in L2.
* function: the certified minimiser, rounded onto the grid ``g = c_g Delta``, plus iid exact
  ``DLap(t)`` (pure) or ``N_Z(0, sigma^2)`` (zCDP) per coordinate; the model is
  ``g (r + Y)``.
* output measure: pure epsilon-DP or rho-zCDP; privacy map: ``1 ↦ D1 / t =
  cost_ref Delta / Delta_ref`` (pure; ``D1`` the grid's L1 sensitivity, Laplace mechanism)
  resp. ``1 ↦ (1 + 10^-12) D2^2 / (2 sigma^2) = cost_ref (Delta / Delta_ref)^2`` (zCDP, CKS
  2020 Theorem 14, the ``10^-12`` its discreteness term). Paper 004, Algorithm 1 and Lemma
  A.2, with the L1 correction below. :meth:`NoiseLevel.cost_at` is that map; the model's
  ``cost`` carries it, and the schedules charge it.

This is the static building block of the release schedules of Watson et al., "Continual and
Sliding Window Release for Private ERM" (paper 004; the schedules live in
:mod:`dpstream.core.erm.schedules`): **Algorithm 1** (PSGD, output perturbation, Wu et al. 2017),
**Algorithm 3** (PBERM: the same with the penalty centred at an earlier *released* model) and
**Algorithm 7** (PBERM on ``2^j b0`` events normalised by ``2^j b0``). All three are
:func:`private_erm`: solve the regularized problem to a certified precision, round the
minimiser onto a rational grid exactly, add exact integer noise.

**What is not taken from the paper.** Algorithm 1 line 3 and Lemma A.2 add ``Lap(Delta/epsilon)``
to each coordinate with ``Delta`` an *L2* sensitivity. The Laplace mechanism needs the *L1*
sensitivity, up to ``sqrt(p)`` times larger, so that calibration is not epsilon-DP. We charge
``sqrt(p)`` times the L2 bound (plus rounding) in L1.

**Noise level: constant noise, decreasing cost.** The paper's schedules keep the *real* noise
scale fixed by a reference computation and let larger datasets cost less. A :class:`NoiseLevel`
``(Delta_ref, cost_ref)`` fixes, for pure DP, the real scale ``b = D1 g(Delta_ref) / cost_ref``;
a computation at sensitivity ``Delta`` then uses the integer discrete Laplace scale
``t = b / g(Delta)`` and costs ``epsilon = D1 / t = D1 g(Delta) / b = cost_ref g(Delta) /
g(Delta_ref) = cost_ref Delta / Delta_ref``, exactly, because ``g`` is proportional to
``Delta`` with a constant factor and every quantity is a Fraction. For zCDP the real variance is
``V = (1 + 10^-12) D2^2 g(Delta_ref)^2 / (2 cost_ref)``, the integer variance
``sigma^2 = V / g(Delta)^2`` and ``rho = (1 + 10^-12) D2^2 / (2 sigma^2) =
cost_ref (Delta / Delta_ref)^2``, exactly. The factor ``1 + 10^-12`` reserves room for the
discreteness term of CKS 2020 Theorem 14 (bounded as in :mod:`dpstream.core.counting.blt_counter`
and
checked for every computation; it is below ``10^-100`` of rho unless rho exceeds ``10^5``).

**Privacy of one release.** Pure: the released integers are ``r + Y`` with ``Y_j`` iid discrete
Laplace of scale ``t`` (``P(y) ~ exp(-|y|/t)``, CKS 2020 Algorithm 2); for neighbours the density
ratio is at most ``exp(||r - r'||_1 / t) <= exp(D1 / t) = e^epsilon``. zCDP: ``Y_j`` iid
``N_Z(0, sigma^2)`` (CKS 2020 Algorithm 3) on ``r`` with ``||r - r'||_2 <= D2`` is
``(D2^2 / (2 sigma^2) + discreteness)``-zCDP (CKS 2020, Theorem 14). The grid ``g`` depends only
on public quantities (the spec and ``n̄``), the float parameters ``g (r + Y)`` are
post-processing, and the paper's per-coordinate scales are reproduced only as cost fractions.

**Exactness and replay-safety.** All randomness comes from the ``rng`` passed in, which the caller
derives from ``NoiseKey.stream(*coordinates)`` for the release's coordinates: :func:`private_erm`
draws coordinate ``j``'s noise from that one stream in row-major order, and
:func:`~dpstream.core.erm.sampling.poisson_sample` one uniform integer per row. Everything else is
deterministic (the solver is a fixed computation of its inputs), so a replayed release is
byte-identical to the first.

**State.** None here: the release is a :class:`~dpstream.core.erm.model.PrivateModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from dpstream.core.erm.grid import _SLACK, PRECISION_BITS, _params_from_integers, round_to_grid
from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.solver import CertificationError, _precision_float, solve
from dpstream.core.erm.spec import Block, ErmSpec, FloatArray, _as_fraction
from dpstream.core.noise.samplers import (
    RandomIntegers,
    discrete_gaussian,
    discrete_gaussian_variance,
    discrete_laplace,
    discrete_laplace_variance,
)
from dpstream.errors import InvalidParameterError

__all__ = [
    "NoiseLevel",
    "private_erm",
]

_ZCDP_RESERVE: Final = Fraction(1, 10**12)  # share of rho kept for the CKS discreteness term


def _log(x: Fraction) -> float:
    """Return ``ln(x)`` for a Fraction ``x > 0`` without converting ``x`` to a float."""
    return math.log(x.numerator) - math.log(x.denominator)


def _discreteness_fits(p: int, sigma2: Fraction, rho: Fraction) -> bool:
    """Whether CKS 2020 Theorem 14's discreteness term fits in the reserved share of ``rho``.

    The term is bounded generously, as in :mod:`dpstream.core.counting.blt_counter`, by
    ``50 p exp(-pi^2 sigma^2) / (1 - exp(-pi^2 sigma^2))``; it must stay below the reserved
    ``10^-12 / (1 + 10^-12)`` of the charged rho. Logarithms throughout (no underflow).
    """
    if sigma2 >= 10**300:
        return True
    x = math.pi**2 * float(sigma2)
    if x < 1e-3:
        return False
    log_term = math.log(50.0 * p) - x - math.log(-math.expm1(-x))
    return log_term < _log(_ZCDP_RESERVE) + _log(rho) - _log(1 + _ZCDP_RESERVE)


@dataclass(frozen=True)
class NoiseLevel:
    """A real noise scale fixed by a reference computation.

    The noise whose cost at sensitivity ``reference_sensitivity`` is ``reference_cost``
    (epsilon for pure, rho for zCDP): a computation at sensitivity ``Delta`` keeps that real
    noise and costs ``reference_cost * Delta / Delta_ref`` (pure) or
    ``reference_cost * (Delta / Delta_ref)^2`` (zCDP), exactly.

    Attributes:
        reference_sensitivity: ``Delta_ref > 0`` (a Fraction; an int or float is read exactly
            as its decimal).
        reference_cost: the cost at ``Delta_ref``, > 0.

    """

    reference_sensitivity: Fraction
    reference_cost: Fraction

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "reference_sensitivity",
            _as_fraction("reference_sensitivity", self.reference_sensitivity),
        )
        object.__setattr__(
            self, "reference_cost", _as_fraction("reference_cost", self.reference_cost)
        )

    def real_scale(self, spec: ErmSpec) -> Fraction:
        """Pure: the discrete Laplace scale in parameter units, ``b = D1 g(Delta_ref)/cost``."""
        _require(spec, "pure")
        return (
            spec.grid_l1_sensitivity * spec.grid(self.reference_sensitivity) / self.reference_cost
        )

    def real_variance(self, spec: ErmSpec) -> Fraction:
        """zCDP: the noise variance parameter in parameter units squared, ``sigma^2 g^2``."""
        _require(spec, "zcdp")
        g = spec.grid(self.reference_sensitivity)
        d2 = spec.grid_l2_sensitivity
        return (1 + _ZCDP_RESERVE) * d2 * d2 * g * g / (2 * self.reference_cost)

    def integer_scale(self, spec: ErmSpec, sensitivity: Fraction) -> Fraction:
        """Pure: the discrete Laplace scale ``t = b / g(Delta)`` on the grid of ``Delta``."""
        return self.real_scale(spec) / spec.grid(sensitivity)

    def integer_variance(self, spec: ErmSpec, sensitivity: Fraction) -> Fraction:
        """zCDP: the discrete Gaussian ``sigma^2 = V / g(Delta)^2`` on the grid of ``Delta``."""
        g = spec.grid(sensitivity)
        return self.real_variance(spec) / (g * g)

    def cost_at(self, spec: ErmSpec, sensitivity: Fraction) -> Fraction:
        """Return the exact cost of one computation at ``sensitivity`` (``Delta``, before slack).

        Computed from the mechanism: ``D1 / t`` (pure) or ``(1 + 10^-12) D2^2 / (2 sigma^2)``
        (zCDP). It equals ``reference_cost * Delta/Delta_ref`` resp.
        ``reference_cost * (Delta/Delta_ref)^2`` exactly (module docstring).

        Raises:
            InvalidParameterError: bad sensitivity, or (zCDP) a cost so large that the discrete
                Gaussian's discreteness term would not fit in the reserve.

        """
        if spec.accounting == "pure":
            return spec.grid_l1_sensitivity / self.integer_scale(spec, sensitivity)
        sigma2 = self.integer_variance(spec, sensitivity)
        d2 = spec.grid_l2_sensitivity
        rho = (1 + _ZCDP_RESERVE) * d2 * d2 / (2 * sigma2)
        if not _discreteness_fits(spec.parameter_count, sigma2, rho):
            raise InvalidParameterError(
                f"rho = {float(rho):.6g} is too large for the discrete Gaussian on the ERM grid "
                f"(sigma^2 = {float(sigma2):.3g})"
            )
        return rho


def _require(spec: ErmSpec, accounting: str) -> None:
    if spec.accounting != accounting:
        raise InvalidParameterError(
            f"this needs accounting {accounting!r}, the spec has {spec.accounting!r}"
        )


def private_erm(
    spec: ErmSpec,
    block: Block,
    *,
    normalizer: float,
    center: FloatArray | None,
    level: NoiseLevel,
    rng: RandomIntegers,
    initial: FloatArray | None = None,
) -> PrivateModel:
    """Release a private model: paper 004 Algorithm 1 (no centre), 3 and 7 (a centre).

    Solve ``J`` to the certified precision ``tau = Delta 2^-20``, round exactly onto the grid
    ``g = c_g Delta`` and add iid exact integer noise, coordinate ``j`` (row-major) drawn from
    ``rng`` in order: discrete Laplace of scale ``level.integer_scale`` (pure) or discrete
    Gaussian of variance ``level.integer_variance`` (zCDP). Derive ``rng`` from
    ``NoiseKey.stream(*coordinates)`` so that a replay is identical.

    Args:
        spec: the problem.
        block: the events (may be empty: the release is then the centre plus noise).
        normalizer: the public normaliser ``n̄`` (e.g. ``2^j b0``, never a private count).
        center: the penalty's centre: ``None`` (0) or a *released* model's params.
        level: the real noise scale; the cost is ``level.cost_at(spec, Delta)``.
        rng: the replay-safe uniform integers of this release.
        initial: optional warm start (public, or a function of this block only).

    Raises:
        InvalidParameterError: bad parameters, a block that does not fit the spec.
        CertificationError: float64 could not certify the minimiser (far outside the
            supported range); nothing is released.

    """
    if not isinstance(level, NoiseLevel):
        raise InvalidParameterError(f"level must be a NoiseLevel, got {type(level).__name__}")
    delta = spec.sensitivity(normalizer)
    cost = level.cost_at(spec, delta)  # validates the level before any work
    tau = delta / (1 << PRECISION_BITS)
    solution = solve(
        spec, block, normalizer, center, precision=_precision_float(tau), initial=initial
    )
    if not solution.certified:
        raise CertificationError(
            f"the ERM solver could not certify its minimiser to {float(tau):.3g} in float64 "
            f"(normalizer {normalizer!r}); nothing was released"
        )
    g = spec.grid(delta)
    rounded = round_to_grid(solution.params, g)
    if spec.accounting == "pure":
        scale = level.integer_scale(spec, delta)
        released = [r + discrete_laplace(rng, scale) for r in rounded]
        std = math.sqrt(discrete_laplace_variance(scale)) * float(g)
    else:
        sigma2 = level.integer_variance(spec, delta)
        released = [r + discrete_gaussian(rng, sigma2) for r in rounded]
        std = math.sqrt(discrete_gaussian_variance(sigma2)) * float(g)
    return PrivateModel(
        params=_params_from_integers(released, g, (spec.rows, spec.columns)),
        grid=g,
        noise_std=std,
        cost=cost,
        sensitivity=delta * _SLACK,
        normalizer=float(normalizer),
        size=block.size,
        integers=tuple(released),
    )
