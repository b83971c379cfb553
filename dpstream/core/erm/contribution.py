"""What one person costs an ERM release at ``unit = "user"``: per block, and in all.

At ``unit = "user"`` the contribution stage keeps, per person and period, rows in at most
``B = max_blocks`` distinct blocks (steps) and at most ``r = max_rows_per_block`` rows in each,
chosen from that person's own rows alone. Neighbouring streams differ by one person's events of
one period: after bounding, by at most ``r`` rows in each of at most ``B`` blocks (the rows of
one block may be spread over several model streams, at most ``r`` in all).

**Per block** (:mod:`dpstream.core.erm.spec`). ``ErmSpec.unit_rows = r`` makes every
computation's sensitivity ``r L/(lambda n̄)``: the grid, the certified precision, the noise
level and the cost are calibrated on it, so each configured per-block charge, and the per-block
ledger of :class:`~dpstream.core.erm.schedules.schedule.ReleaseSchedule` that sums them
(``block_spend``, at most ``ScheduleSpec.budget()``), is what one person's ``<= r`` rows of
that block cost, for one model stream.

**A computation over several of the person's blocks.** A computation ``c`` on the blocks
``[a, b]`` may hold the person's rows in ``k_c = |S ∩ [a, b]| <= B`` blocks (``S`` the
person's blocks). Remove them one block at a time: each step is a change of ``<= r`` rows of
one block, with the normaliser fixed, so the rounded integer vectors (each a deterministic
function of its data set) move by at most ``D1`` in L1 resp. ``D2`` in L2 per step
(:mod:`dpstream.core.erm.grid`), and by the triangle inequality by at most ``k_c D1`` resp.
``k_c D2`` in all. With the computation's fixed noise that costs at most ``k_c cost_c`` (pure:
the discrete Laplace loss is ``L1 / t``) resp. ``k_c^2 rho_c`` (zCDP: ``L2^2 / (2 sigma^2)``;
CKS 2020 Theorem 14's discreteness term does not depend on the sensitivity and stays inside
the charged reserve).

**Several model streams.** A person's ``<= r`` rows of a block may go to ``S' <= min(S, r)``
streams (``S`` configured), ``j_s`` rows to stream ``s`` with ``sum j_s <= r``; each stream's
schedule is its own mechanism. For one stream (``S' = 1``) the factor below is exactly 1.
Otherwise stream ``s``'s minimisers move by at most ``(j_s/r) Delta`` plus the certified
precision ``2 tau = 2^-19 Delta`` (``Delta = r L/(lambda n̄)``), i.e. by at most
``2^12 s_p (j_s/r + 2^-19)`` grid units (``s_p = ceil(sqrt(p))``), and rounding adds less than
one unit per coordinate. Summed over the streams, one block of one person moves the streams'
integer vectors by less than ``sqrt(p) 2^12 s_p (1 + S' 2^-19) + S' p`` in L1 and
``s_p (2^12 (1 + S' 2^-19) + S')`` in (summed) L2. Dividing by the per-block bounds ``D1``
resp. ``D2`` gives the **stream factor** (:func:`stream_factor`)::

    pure:  kappa = min(S', (ceil_up(sqrt(p) 2^12 s_p (1 + S' 2^-19)) + S' p) / D1)
    zCDP:  kappa = min(S', ((2^12 (1 + S' 2^-19) + S') / (2^12 (1 + 2^-19) + 1))^2)

(zCDP: ``sum_s L2_s^2 <= (sum_s L2_s)^2``; the ``min`` is the trivial bound, each stream's
block costing at most its charge.) It exceeds 1 by about ``S' 2^-12``.

**A person in all** (:func:`person_cost`). Pure ε, over the computations ``c`` of every
stream: ``sum_c k_c cost_c = sum_{s in S} block_spend(s)`` (each computation's cost counted
once per person's block in its range), so a person pays at most

    epsilon_person <= kappa * sum_{s in S} block_spend(s) <= kappa * B * budget,

the per-block budget ``ScheduleSpec.budget()`` (``2ε`` continual, else ``ε``: the theorems'
bound on every ``block_spend``). For an unbounded stream that is the bound: per period, the
largest per-block total times ``B``. zCDP is **not** linear in the blocks: ``sum_c k_c^2
rho_c <= m sum_c k_c rho_c`` with ``m`` the most of a person's blocks one computation can
hold, ``m = min(B, span)`` (span: 1 for ``independent``, ``window_blocks`` for the sliding
window, unbounded for ``multi-resolution`` and ``continual``), so

    rho_person <= kappa * m * B * budget.

(Multiplying the per-block total by ``B`` alone would be wrong under zCDP: one computation
holding all ``B`` of a person's blocks costs ``B^2`` times its per-block charge.) **ERMG**: every
run is on all blocks so far with pure ε_t-DP output perturbation per ``r`` rows of a block, so a
person's ``B`` blocks make it ``kappa B ε_t``-DP, i.e. ``(kappa B ε_t)^2/2``-zCDP, and over the
runs ``rho_person <= kappa^2 B^2 rho`` (``rho = ε^2/(18 log(1/δ))``, BBImprover's budget),
reported as ``(ε_person, δ)`` (Bun–Steinke 2016, Prop. 1.3). **Collisions.** The stage's keyed
128-bit person hash can collide, and a collision breaks "only the person's own rows change";
:mod:`dpstream.core.contribution.people` bounds its probability by
``collision_delta(PEOPLE_BOUND) = 2^-64``, which every reported δ includes
(:meth:`PersonCost.delta`): ``(ε_person, 2^-64)`` for pure ε, ``(ε_person, δ + 2^-64)`` from ρ.

**Sampling** (Algorithms 6–8, pure ε). A sampled computation keeps each row independently with
probability ``q``; a person's ``m <= k r`` rows in it (``k`` of their blocks) are kept in a
subset ``T``. Let ``ε_1`` bound one row's loss on the computation's grid: ``j`` rows move the
integers by at most ``j`` times the one-row L1 bound
(:func:`~dpstream.core.erm.grid.rows_l1_factor`), so the loss of a set ``T`` is at most ``|T|
ε_1``. Conditioning on the other rows' sample, ``P[M(S(D + G)) in E] = sum_T P(T) P[M(S(D) + T)
in E] <= E[e^{|T| ε_1}] P[M(S(D)) in E] = (1 + q(e^{ε_1} − 1))^m P[M(S(D)) in E]``, and the
other direction gives ``(1 − q + q e^{−ε_1})^{-m}``, no larger (``(1 − q + q e^{−x})(1 − q + q
e^{x}) >= 1``). So the person pays at most ``m f(ε_1) <= k r f(ε_1) <= k f(r ε_1)`` with ``f(x)
= ln(1 + q(e^x − 1))`` (convex, ``f(0) = 0``, so ``r f(x) <= f(r x)``). ``r ε_1 <= kappa_r
cost`` (the grid's rounding keeps one row's loss above ``cost/r``), so the plan charges
``amplified_epsilon(kappa_r cost, q)`` per block and picks ``q`` so that it is at most the
paper's ``cost/2^j`` (:class:`~dpstream.core.erm.schedules.base.SchedulePlan`; ``kappa_r = 1``
and nothing changes at the event level): the per-block charges, hence the sums, are the
configured ones. Several streams cost nothing more here: ``sum_s j_s f(ε_1) <= r f(ε_1)``.

**The objective learner** (``ErmSpec.learner = "objective"``,
:mod:`dpstream.core.erm.objective`). Everything above still holds, and ``kappa`` is exactly 1.
A release at cost ``C`` is ``C/r``-DP for *each* row added or removed (its privacy argument is
per row; the grid there only carries the output noise that covers the solver), so by group
privacy ``j`` rows cost ``j C/r`` (pure DP composes linearly over a group). Hence: ``r`` rows
of one block cost ``C`` (the per-block charge, as configured); a computation holding ``k_c`` of
a person's blocks costs at most ``k_c r C/r = k_c cost_c`` (so ``sum_c k_c cost_c`` as above);
several streams, ``j_s`` rows to stream ``s`` with ``sum j_s <= r``, cost ``sum_s j_s
cost/r <= cost``: the stream factor is 1, not output perturbation's grid factor
(:func:`stream_factor` returns 1); and under sampling one row's loss is ``eps_1 = C/r``, so
``r eps_1 = C <= kappa_r C``: the plan's charge ``amplified_epsilon(kappa_r cost, q)`` (kept
as for output perturbation, so the ledger charges the same) still covers a person's rows, with
room to spare. The objective learner is pure epsilon only, and ERMG keeps output perturbation.
:func:`noise_std` reports the objective learner's ``b/n̄`` std (the models' ``noise.std``).

**Periods.** The guarantee is per period (``contribution.period``). A person active in ``k``
periods is a group of ``k`` units: ``k epsilon_person`` (pure); under zCDP and ERMG, where one
computation may span periods, ``k^2 rho_person``.

**Noise** (:func:`noise_std`): the standard deviation of each released coordinate (parameter
units, as the records' ``noise.std``) of each output, at the configured ``unit_rows``; the
schedules keep one real noise per component ("constant noise, decreasing cost"), so it is
the std at the component's reference computation (for a sampled component, its level-1 one;
it halves with each level). Nothing here draws noise or holds state.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Final, Literal

from dpstream.core._checks import integer_at_least
from dpstream.core.accounting.ledger import exact, zcdp_to_approx_dp
from dpstream.core.contribution.people import PEOPLE_BOUND, collision_delta
from dpstream.core.erm.grid import GRID_BITS, PRECISION_BITS, _grid_constants, rows_l1_factor
from dpstream.core.erm.objective import linear_noise_std
from dpstream.core.erm.output_noise import NoiseLevel
from dpstream.core.erm.schedules.spec import ScheduleSpec
from dpstream.core.erm.spec import ErmSpec
from dpstream.core.noise.samplers import discrete_gaussian_variance, discrete_laplace_variance
from dpstream.errors import InvalidParameterError

if TYPE_CHECKING:
    from dpstream.core.erm.ermg import ErmgSpec

__all__ = ["PersonCost", "noise_std", "person_cost", "stream_factor", "widest_computation"]

_SLACK_BITS: Final = PRECISION_BITS - 1  # 2 tau / Delta = 2^-19


def _ceil_sqrt(n: int) -> int:
    return math.isqrt(n - 1) + 1


def stream_factor(erm: ErmSpec, streams: int, accounting: str) -> Fraction:
    """Return ``kappa``: one person's block over ``streams`` model streams, per charged block.

    ``accounting`` is ``"pure"`` (L1, discrete Laplace; also ERMG's box) or ``"zcdp"`` (L2
    squared). Exactly 1 when ``min(streams, unit_rows) == 1``, and for the objective learner
    (module docstring).
    """
    integer_at_least("streams", streams, 1)
    spread = min(int(streams), int(erm.unit_rows))
    if spread == 1 or erm.learner == "objective":
        return Fraction(1)
    p = erm.parameter_count
    if accounting == "pure":
        return min(Fraction(spread), rows_l1_factor(p, spread))
    s = _ceil_sqrt(p)
    d2 = _grid_constants(p)[2]
    stretch = 1 + Fraction(spread, 1 << _SLACK_BITS)
    if accounting != "zcdp":
        raise InvalidParameterError(f"accounting must be 'pure' or 'zcdp', got {accounting!r}")
    ratio = s * ((1 << GRID_BITS) * stretch + spread) / d2
    return min(Fraction(spread), ratio * ratio)


def widest_computation(spec: ScheduleSpec) -> int | None:
    """The most blocks one computation of ``spec`` can use (None: unbounded)."""
    if spec.algorithm == "independent":
        return 1
    if spec.algorithm == "sliding-window":
        return int(spec.window_blocks)
    return None


@dataclass(frozen=True)
class PersonCost:
    """What one person may cost in all, per period (module docstring).

    Attributes:
        accounting: ``"pure"`` (``total`` is ε), ``"zcdp"`` or ``"ermg"`` (``total`` is ρ).
        per_block: the per-block bound the ledger keeps (ε or ρ; ERMG: BBImprover's ρ).
        max_blocks: ``B``.
        stream_factor: ``kappa``.
        overlap: ``m`` (zCDP), ``B`` (ERMG, counted twice: ``B^2``) or 1 (pure).
        total: the bound: ``kappa B per_block`` (pure), ``kappa m B per_block`` (zCDP),
            ``kappa^2 B^2 per_block`` (ERMG).

    """

    accounting: Literal["pure", "zcdp", "ermg"]
    per_block: Fraction
    max_blocks: int
    stream_factor: Fraction
    overlap: int
    total: Fraction

    def epsilon(self, delta: float) -> float:
        """The ε of the person's guarantee: ``total`` (pure) or ρ's (ε, δ) (BS16, Prop. 1.3)."""
        if self.accounting == "pure":
            return float(self.total)
        return zcdp_to_approx_dp(float(self.total), delta)

    def delta(self, delta: float) -> float:
        """The δ of the person's guarantee: the hash-collision term, plus ``delta`` from ρ."""
        collision = collision_delta(PEOPLE_BOUND)
        return collision if self.accounting == "pure" else delta + collision


def person_cost(spec: ScheduleSpec | ErmgSpec, erm: ErmSpec, max_blocks: int,
                streams: int) -> PersonCost:
    """Return what one person may cost over at most ``max_blocks`` blocks (module docstring).

    Raises:
        InvalidParameterError: bad counts.

    """
    blocks = integer_at_least("max_blocks", max_blocks, 1)
    if isinstance(spec, ScheduleSpec):
        budget = spec.budget()
        kappa = stream_factor(erm, streams, spec.accounting)
        if spec.accounting == "pure":
            return PersonCost("pure", budget, blocks, kappa, 1, kappa * blocks * budget)
        span = widest_computation(spec)
        overlap = blocks if span is None else min(blocks, span)
        return PersonCost("zcdp", budget, blocks, kappa, overlap,
                          kappa * overlap * blocks * budget)
    rho = exact(spec._improver_spec(p=1.0, p_prime=1.0, p_double_prime=0.0, g=1.0).budget)
    kappa = stream_factor(erm, streams, "pure")
    return PersonCost("ermg", rho, blocks, kappa, blocks, (kappa * blocks) ** 2 * rho)


def _std(erm: ErmSpec, normalizer: float, cost: Fraction) -> float:
    """The std of one released coordinate of the computation at ``normalizer`` costing ``cost``.

    For the objective learner: the std of ``b/n̄`` (:func:`objective.linear_noise_std`).
    """
    if erm.learner == "objective":
        return linear_noise_std(erm, normalizer, cost)
    delta = erm.sensitivity(normalizer)
    level = NoiseLevel(reference_sensitivity=delta, reference_cost=cost)
    g = float(erm.grid(delta))
    if erm.accounting == "pure":
        return math.sqrt(discrete_laplace_variance(level.integer_scale(erm, delta))) * g
    return math.sqrt(discrete_gaussian_variance(level.integer_variance(erm, delta))) * g


def noise_std(spec: ScheduleSpec | ErmgSpec, erm: ErmSpec) -> dict[str, float]:
    """Return the noise std of each released coordinate, by output (module docstring).

    Keys: the models' roles (``multi-resolution``, ``base``, ``update``, ``window`` (the
    sliding window's updates), ``independent``, ``ermg``), with ``" (sampled, level 1)"`` for a
    sampled component and ``" (first run)"`` for ERMG, whose noise shrinks with ``t``.
    """
    b0 = int(spec.block_size)
    if not isinstance(spec, ScheduleSpec):
        t = spec.n
        epsilon = exact(spec._improver_spec(p=1.0, p_prime=1.0, p_double_prime=0.0,
                                            g=1.0).run_epsilon(t))
        return {"ermg (first run)": _std(erm, float(t), epsilon)}
    update = (erm if spec.update_regularization is None
              else dataclasses.replace(erm, regularization=spec.update_regularization))
    costs = spec.reference_costs()
    big_b = int(spec.base_blocks)
    out: dict[str, float] = {}
    if spec.algorithm in ("multi-resolution", "continual"):
        std = _std(erm, float(big_b * b0), costs["multi-resolution"])
        out["multi-resolution"] = std
        if spec.algorithm == "continual":
            out["base"] = std
        elif spec.sampling:
            out["multi-resolution (sampled, level 1)"] = _std(
                erm, float(2 * big_b * b0), costs["multi-resolution"])
    if spec.algorithm == "continual":
        out["update"] = _std(update, float(b0), costs["update"])
        if spec.sampling:
            out["update (sampled, level 1)"] = _std(update, float(2 * b0), costs["update"])
    if spec.algorithm == "sliding-window":
        h = (int(spec.window_blocks) + 1) // 2
        out["base"] = _std(erm, float(h * b0), costs["base"])
        out["window"] = _std(update, float(b0), costs["update"])
        if spec.sampling:
            out["window (sampled, level 1)"] = _std(update, float(2 * b0), costs["update"])
    if spec.algorithm == "independent":
        out["independent"] = _std(erm, float(b0), costs["independent"])
    return out
