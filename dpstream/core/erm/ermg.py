"""ERMG: private ERM on a growing database, by rerunning output perturbation (paper 003, §E.2).

**Stated as OpenDP states a measurement**

* input domain: a stream of blocks of labelled, clipped rows, public size ``t = j b0`` after
  ``j`` blocks; input metric: add or remove one row (``d_in = 1``).
* function: BBImprover (Algorithm 5) with output perturbation as its box: at every block
  with ``t >= n``, :func:`~dpstream.core.erm.output_noise.private_erm` on all blocks so far
  at a noise level that costs exactly ``ε_t`` at ``Δ(t) = L/(λt)``.
* output measure: ρ-zCDP, reported as ``(ε, δ)``-DP (BS16, Proposition 1.3); privacy map:
  ``1 ↦ Σ_t ε_t²/2 <= ε²/(18 log(1/δ))`` over the runs (Theorem 29, D.2; Theorem 31). The
  ledger charges ``run_charge(t) = PrivacyCharge(epsilon=ε_t)`` per run; the events of block
  ``s`` have paid :meth:`Ermg.block_rho`, the ``ε_t²/2`` of the runs from ``s`` on.

Cummings, Krehbiel, Lai, Tantipongpipat 2018, "Differential Privacy for Growing Databases",
Theorem 31: ERMG is BBImprover (their Algorithm 5, Theorem 29;
:class:`dpstream.core.pmwg.bb_improver.BBImprover`) run with a static ε-DP ERM algorithm as its
black box. At every database size ``t >= n`` it reruns the box on the whole database at
``ε_t = sqrt(c) ε / (3 sqrt(log(1/δ)) t^(1/2 + c))`` with ``β_t = β/(2t²)``; the ``ε_t``-DP runs
compose in zCDP (each is ``ε_t²/2``-zCDP) to ``(ε, δ)``-DP (Theorem 29, D.2). The schedule,
``α_t``, the ledger (``zcdp``, budget ``ρ = ε²/(18 log(1/δ))``) and the state come from
:class:`~dpstream.core.pmwg.bb_improver.BBImproverSpec` unchanged. ``δ > 0`` is required: Theorem 29
is ``(ε, δ)``-DP only.

**Time and data.** As in :mod:`dpstream.core.erm.schedules`, one block is one flow step with a
public nominal size ``b0`` (``ErmgSpec.block_size``). The public database size after ``j``
blocks is ``t = j·b0`` (the paper's ``x_t`` has ``t`` rows; here the normaliser of the
objective, never the private count). The box runs at every observed ``t >= n``
(``n = first_blocks·b0``), i.e. at every block from ``first_blocks`` on, on the concatenation
of all blocks so far. Skipping the ``t`` between multiples of ``b0`` only drops terms of
Theorem 29's series (a sub-sum of positive terms).

**The black box** (:class:`OutputPerturbation`): Algorithm 1 of
:mod:`dpstream.core.erm.output_noise`
(output perturbation of the λ-strongly convex objective centred at 0, normaliser ``t``),
with the noise level whose cost at ``Δ(t) = L/(λt)`` is exactly ``ε_t``: an ``ε_t``-DP run
under add/remove neighbours, exact discrete Laplace noise on a grid. Its synopsis is the
released model (:class:`ErmSynopsis`); it answers no linear query (the paper's only ERM query
is the empirical risk on the private database, which no synopsis can evaluate). ERMG stays on
output perturbation: its ``g`` (the accuracy constant BBImprover plans with) is output
perturbation's, so a model spec with ``learner = "objective"``
(:mod:`dpstream.core.erm.objective`) is refused here, and the ERM kind's configuration keeps
``learner = "output"`` for this algorithm.

*Its* ``(p, p', p'', g)`` *(appendix D.2's form), stated honestly.* Let ``P`` be the
parameter count, ``w*`` the minimiser of the regularised objective ``J_t`` and ``ν`` the
released model minus ``w*``. The noise is iid discrete Laplace per coordinate of scale at most
``b = √P Δ (1 + 2^-11)/ε_t`` in parameter units (``L1`` sensitivity ``√P (Δ + 2τ)`` on the grid
plus one unit per coordinate for rounding; the grid step is at most ``2^-12 Δ/√P``), and
``P(|X| >= b ln(2P/β)) <= β/P`` for each coordinate, so by a union bound (the Lemma A.2
argument of paper 004) ``||ν||_2 <= ||ν||_1 <= P b ln(2P/β)`` with probability ``1 − β``;
rounding and the solver's certified precision add at most ``2^-12 Δ``, which the factor
``1 + 2^-10`` below absorbs for ``ε_t <= 1``. The empirical loss is an average of
``L``-Lipschitz losses, so

    L̂_t(released) − L̂_t(w*) <= L ||ν|| <= (L²/(λ ε_t t)) P^(3/2) (1 + 2^-10) ln(2P/β),

and ``ln(2P/β) <= (1 + ln 2P) ln(1/β)`` for ``β <= 1/e`` (BBImprover's ``β_t = β/(2t²)`` is,
for ``t >= 2``). That is the Lipschitz form **p = 1, p' = 1, p'' = 0,
g = L² P^(3/2) (1 + ln 2P)(1 + 2^-10)/λ**. Where it differs from Theorem 31: (i) Theorem 31
uses the ε-DP algorithms of Bassily, Smith, Thakurta 2014 — ``(p, g) = (1, d)`` for 1-Lipschitz
losses over a unit-diameter set, ``(p, p', p'', g) = (2, 2, 1, d²/Δ)`` for Δ-strongly convex
ones; ours is output perturbation, whose ``g`` grows like ``P^(3/2) L²/λ`` (per-coordinate
Laplace calibrated to an L1 sensitivity). (ii) Our excess risk is measured against the
*regularised* minimiser ``w*``: the regularisation bias ``L̂_t(w*) − min L̂_t`` (at most
``λ||θ||²/2`` for a comparator ``θ``) is not privacy's and is not in ``g``. (iii) The smooth
form ``J_t(released) − J_t(w*) <= ((β_s + λ)/2)||ν||²`` (``β_s`` the loss's smoothness) would
give ``p = p' = 2`` with ``g ∝ (β_s + λ) L² P³/λ²``; we declare the Lipschitz form. The ``g``
only sets the reported ``α_t`` (:meth:`Ermg.accuracy`), never the privacy. At ``unit =
"user"`` (``ErmSpec.unit_rows = r``) ``Δ`` and hence the noise are ``r`` times larger, and so is
``g``; a person's total is derived in :mod:`dpstream.core.erm.contribution`.

**Accounting and reporting.** Every run uses every block seen so far, so the events of block
``s`` have paid ``ρ_s = Σ ε_t²/2`` over the runs at steps ``>= s``; the oldest block has paid
the ledger's total. :meth:`Ermg.block_spend` reports the ``ε`` of the ``(ε, δ)`` guarantee that
``ρ_s`` converts to (Bun & Steinke 2016, Proposition 1.3), :meth:`~Ermg.block_rho` the exact
``ρ_s``; the budget (:meth:`ErmgSpec.budget`) is ``ε``. A run is checked against the ledger
before the box runs and committed after (BBImprover's check-then-commit).

**Noise** is replay-safe: the run at ``t`` draws from ``noise.stream(*coordinates, "ermg",
binding, "bbimprover", box, t, "noise")`` (``binding``: a digest of the specs).

**State** (:meth:`Ermg.to_state`): every block (the database), the total ``ρ`` and its value
when each block arrived, and the BBImprover's state (ledger, last run, released model). It
holds private data.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Final

import numpy.typing as npt

from dpstream.core._checks import (
    check_state,
    fraction_text,
    integer_at_least,
    is_integer,
    positive_finite,
)
from dpstream.core.accounting.ledger import PrivacyLedger, exact, zcdp_to_approx_dp
from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.output_noise import NoiseLevel
from dpstream.core.erm.schedules.releases import Release, TrainFn, _default_train
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.coordinates import check_coordinates
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.pmwg.bb_improver import BBImprover, BBImproverSpec
from dpstream.core.pmwg.blackboxes import RngFor
from dpstream.errors import InvalidParameterError

__all__ = ["ErmSynopsis", "Ermg", "ErmgSpec", "OutputPerturbation"]

_STATE_VERSION: Final = 1
_STATE_KIND: Final = "ermg"
_SYNOPSIS_KIND: Final = "erm-model"


# --- the black box ------------------------------------------------------------------------


class ErmSynopsis:
    """What the ERM black box releases: a private model (it answers no linear query)."""

    __slots__ = ("model",)

    def __init__(self, model: PrivateModel) -> None:
        self.model = model

    def answer(self, weights: npt.NDArray[Any]) -> float:
        """Refuse: ERMG's query (the empirical risk on the private data) needs the data.

        Raises:
            InvalidParameterError: always.

        """
        raise InvalidParameterError(
            "an ERM synopsis answers no linear query: use its model (ErmSynopsis.model)"
        )

    def to_state(self) -> dict[str, Any]:
        """Return plain data that :meth:`from_state` turns back into it."""
        return {"kind": _SYNOPSIS_KIND, "model": self.model.to_state()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ErmSynopsis:
        """Load from :meth:`to_state`.

        Raises:
            InvalidParameterError: not an ERM synopsis state.

        """
        if not isinstance(state, dict) or state.get("kind") != _SYNOPSIS_KIND:
            raise InvalidParameterError(f"not an {_SYNOPSIS_KIND} synopsis state")
        return cls(PrivateModel.from_state(state["model"]))


class OutputPerturbation:
    """The static ε-DP ERM black box: Algorithm 1 (output perturbation) at normaliser ``n``.

    ``(p, p', p'', g) = (1, 1, 0, L² P^(3/2) (1 + ln 2P)(1 + 2^-10)/λ)`` (module docstring).

    Args:
        erm: the model (pure accounting).
        train: the trainer (default :func:`dpstream.core.erm.output_noise.private_erm`).

    """

    __slots__ = ("name", "p", "p_prime", "p_double_prime", "g", "erm", "_train")

    def __init__(self, erm: ErmSpec, train: TrainFn | None = None) -> None:
        if erm.learner != "output":  # ERMG's analysis (its g above) is output perturbation's
            raise InvalidParameterError(
                f"ERMG's black box is output perturbation: the model's learner must be "
                f"'output', got {erm.learner!r}"
            )
        self.name = "erm-output-perturbation"
        size = float(erm.parameter_count)
        self.p = 1.0
        self.p_prime = 1.0
        self.p_double_prime = 0.0
        self.g = float(
            erm.lipschitz ** 2 * size ** 1.5 * (1.0 + math.log(2.0 * size)) * (1.0 + 2.0**-10)
            * int(erm.unit_rows) / erm.regularization
        )
        self.erm = erm
        self._train: TrainFn = _default_train if train is None else train

    def run(
        self,
        counts: Any,
        n: int,
        epsilon: float,
        alpha: float,
        beta: float,
        rng_for: RngFor,
    ) -> ErmSynopsis:
        """Train on the database ``counts`` (a :class:`~dpstream.core.erm.spec.Block`) at ``ε``-DP.

        Raises:
            InvalidParameterError: the database is not a Block, or the trainer reported a
                cost other than ``epsilon``.

        """
        if not isinstance(counts, Block):
            raise InvalidParameterError(
                f"the ERM black box takes a Block, got {type(counts).__name__}"
            )
        integer_at_least("n", n, 1)
        cost = exact(epsilon)
        level = NoiseLevel(
            reference_sensitivity=Fraction(self.erm.sensitivity(float(n))), reference_cost=cost
        )
        model = self._train(self.erm, counts, normalizer=float(n), center=None, level=level,
                            rng=rng_for("noise"))
        if model.cost != cost:
            raise InvalidParameterError(
                f"the trainer reported cost {model.cost}, but the run was paid for {cost}"
            )
        return ErmSynopsis(model)


class _ErmImprover(BBImprover):
    """BBImprover over Blocks with an ERM synopsis."""

    def _synopsis_from_state(self, state: dict[str, Any]) -> ErmSynopsis:
        return ErmSynopsis.from_state(state)

    def observe_block(self, data: Block, t: int) -> ErmSynopsis | None:
        """BBImprover.observe for a Block database (Algorithm 5 of paper 003)."""
        t = self._advance(t)
        spec = self.spec
        if t < spec.n or t == self._run_t:
            self._last_t = t
            return None
        synopsis = self._run(data, t, t, spec.run_charge(t), spec.accuracy(t), spec.run_beta(t))
        if not isinstance(synopsis, ErmSynopsis):  # pragma: no cover - the box's contract
            raise InvalidParameterError("the ERM black box returned another synopsis")
        return synopsis


# --- the spec -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ErmgSpec:
    """Parameters of ERMG, validated at construction.

    Attributes:
        epsilon: the total ε of the ``(ε, δ)`` guarantee.
        delta: in ``(0, 1)``; ``0`` is refused (Theorem 29 is ``(ε, δ)``-DP only).
        block_size: ``b0``, the public nominal events per block; ``t = blocks·b0``.
        beta: the failure probability of all accuracy guarantees together, in ``(0, 1)``.
        first_blocks: the first run is after this many blocks (``n = first_blocks·b0``).
        c: BBImprover's exponent ``c > 0`` (accuracy improves with ``t`` for ``c < 1/4``).

    Raises:
        InvalidParameterError: a parameter out of range (the checks of
            :class:`~dpstream.core.pmwg.bb_improver.BBImproverSpec`, e.g. ``delta = 0``).

    """

    epsilon: float
    delta: float
    block_size: int
    beta: float = 0.05
    first_blocks: int = 8
    c: float = 0.1

    mechanism: ClassVar[str] = "ermg"

    def __post_init__(self) -> None:
        positive_finite("epsilon", self.epsilon)
        integer_at_least("block_size", self.block_size, 1)
        integer_at_least("first_blocks", self.first_blocks, 1)
        # the privacy checks do not depend on the black box's constants
        self._improver_spec(p=1.0, p_prime=1.0, p_double_prime=0.0, g=1.0)

    @property
    def n(self) -> int:
        """The database size of the first run: ``first_blocks·b0``."""
        return int(self.first_blocks) * int(self.block_size)

    def _improver_spec(self, *, p: float, p_prime: float, p_double_prime: float,
                       g: float) -> BBImproverSpec:
        return BBImproverSpec(
            epsilon=self.epsilon, delta=self.delta, beta=self.beta, n=self.n, c=self.c, p=p,
            p_prime=p_prime, p_double_prime=p_double_prime, g=g,
        )

    def improver_spec(self, box: OutputPerturbation) -> BBImproverSpec:
        """Return the BBImprover spec for ``box``'s ``(p, p', p'', g)``."""
        return self._improver_spec(p=box.p, p_prime=box.p_prime,
                                   p_double_prime=box.p_double_prime, g=box.g)

    def budget(self) -> Fraction:
        """Return the per-event bound: the ``ε`` of the ``(ε, δ)`` guarantee."""
        return exact(self.epsilon)

    def to_dict(self) -> dict[str, Any]:
        """Return the parameters as JSON-safe data (for binding a state to its spec)."""
        return {
            "epsilon": float(self.epsilon),
            "delta": float(self.delta),
            "block_size": int(self.block_size),
            "beta": float(self.beta),
            "first_blocks": int(self.first_blocks),
            "c": float(self.c),
        }

    def describe(self) -> str:
        """Return a human summary of the schedule and its accounting."""
        probe = self._improver_spec(p=1.0, p_prime=1.0, p_double_prime=0.0, g=1.0)
        return (
            f"ERMG (paper 003, Theorem 31): output perturbation on all blocks so far at every "
            f"step from step {int(self.first_blocks) - 1} on (t = (step + 1) x "
            f"{int(self.block_size)} events), epsilon_t = sqrt(c) eps / "
            f"(3 sqrt(log(1/delta)) t^(1/2+c)), c = {float(self.c):g}\n"
            f"zCDP ledger: rho = {probe.budget:.6g} -> "
            f"({probe.guaranteed_epsilon:.6g}, {float(self.delta):g})-DP per event"
        )


# --- ERMG ---------------------------------------------------------------------------------


class Ermg:
    """ERMG over a stream of blocks (see the module docstring).

    Args:
        spec: the schedule.
        erm: the model; its accounting must be ``"pure"`` (the black box is ε-DP).
        noise: the secret key.
        coordinates: the schedule's coordinates.
        train: the trainer (default :func:`dpstream.core.erm.output_noise.private_erm`).

    Raises:
        InvalidParameterError: zCDP accounting, or bad coordinates.

    """

    def __init__(
        self,
        spec: ErmgSpec,
        erm: ErmSpec,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
        *,
        train: TrainFn | None = None,
    ) -> None:
        if erm.accounting != "pure":
            raise InvalidParameterError(
                "ERMG's black box is (epsilon, 0)-DP output perturbation (discrete Laplace); "
                "the composition is BBImprover's own zCDP accounting (Theorem 29): build the "
                f"model with accounting 'pure', got {erm.accounting!r}"
            )
        self.spec = spec
        self.erm = erm
        self.black_box = OutputPerturbation(erm, train)
        self.improver_spec = spec.improver_spec(self.black_box)
        binding = hashlib.blake2b(
            json.dumps([spec.to_dict(), erm.to_dict()], sort_keys=True, default=str).encode(),
            digest_size=8,
        ).hexdigest()
        self._noise = noise
        self._coordinates = (*check_coordinates(coordinates), _STATE_KIND, binding)
        self._improver = _ErmImprover(self.improver_spec, self.black_box, noise,
                                      self._coordinates)
        self._blocks: list[Block] = []
        self._rho_total = Fraction(0)  # the exact rho of every run so far (the ledger's)
        self._rho_before: list[Fraction] = []  # _rho_total when each block arrived

    # -- a step --
    def add_block(self, step: int, block: Block) -> list[Release]:
        """Take the block of ``step`` (consecutive from 0); rerun the box once ``t >= n``.

        Raises:
            InvalidParameterError: a step out of order or a malformed block.
            BudgetExhaustedError: the run does not fit the ledger (Theorem 29 says it always
                does; nothing changes).

        """
        expected = len(self._blocks)
        if not is_integer(step) or step != expected:
            raise InvalidParameterError(
                f"blocks arrive with consecutive steps from 0: expected step {expected}, "
                f"got {step!r}"
            )
        if not isinstance(block, Block):
            raise InvalidParameterError(f"block must be a Block, got {type(block).__name__}")
        if (block.z.ndim != 2 or block.z.shape[1] != self.erm.columns or block.y.ndim != 1
                or block.y.shape[0] != block.z.shape[0]):
            raise InvalidParameterError(
                f"a block needs (m, {self.erm.columns}) features and (m,) labels"
            )
        step = int(step)
        blocks = [*self._blocks, block]
        t = len(blocks) * int(self.spec.block_size)
        data = Block.concat(blocks, self.erm.columns) if len(blocks) > 1 else block
        synopsis = self._improver.observe_block(data, t)  # checks, runs, commits the ledger
        self._blocks = blocks
        self._rho_before.append(self._rho_total)
        if synopsis is None:
            return []
        epsilon_t = exact(self._improver.run_epsilon or 0.0)
        self._rho_total += epsilon_t * epsilon_t / 2  # what the ledger charged, exactly
        return [Release(step, "ermg", None, 0, step, ((0, step),), synopsis.model, epsilon_t)]

    # -- reporting --
    @property
    def ledger(self) -> PrivacyLedger:
        """BBImprover's zCDP ledger (budget ``ε²/(18 log(1/δ))``)."""
        return self._improver.ledger

    @property
    def blocks_seen(self) -> int:
        """How many blocks were added."""
        return len(self._blocks)

    def accuracy(self, t: int) -> float:
        """Return ``α_t`` (Theorem 29 with this black box's ``(p, p', p'', g)``)."""
        return self.improver_spec.accuracy(t)

    def block_rho(self, step: int) -> Fraction:
        """Return the exact ρ the events of block ``step`` have paid so far.

        Raises:
            InvalidParameterError: ``step`` was not added yet.

        """
        if not is_integer(step) or not 0 <= step < len(self._rho_before):
            raise InvalidParameterError(
                f"step must be a block already added (0..{len(self._rho_before) - 1}), got "
                f"{step!r}"
            )
        return self._rho_total - self._rho_before[int(step)]

    def block_spend(self, step: int) -> Fraction:
        """Return the ε that block ``step``'s ρ converts to at the spec's δ (BS16, Prop. 1.3).

        Raises:
            InvalidParameterError: ``step`` was not added yet.

        """
        return exact(zcdp_to_approx_dp(float(self.block_rho(step)), float(self.spec.delta)))

    def max_block_spend(self) -> Fraction:
        """Return the largest :meth:`block_spend` (the oldest block's; 0 before any block)."""
        return self.block_spend(0) if self._rho_before else Fraction(0)

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Return the state as plain data (the blocks as arrays: it holds private data)."""
        return {
            "version": _STATE_VERSION,
            "kind": _STATE_KIND,
            "spec": self.spec.to_dict(),
            "erm": self.erm.to_dict(),
            "blocks": [b.to_state() for b in self._blocks],
            "rho_total": fraction_text(self._rho_total),
            "rho_before": [fraction_text(r) for r in self._rho_before],
            "improver": self._improver.to_state(),
        }

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        spec: ErmgSpec,
        erm: ErmSpec,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
        *,
        train: TrainFn | None = None,
    ) -> Ermg:
        """Rebuild from :meth:`to_state` with the same specs and key.

        Raises:
            InvalidParameterError: the state is malformed or was made with other specs.

        """
        ermg = cls(spec, erm, noise, coordinates, train=train)
        try:
            check_state(state, _STATE_KIND, _STATE_VERSION, {
                "spec": ("specs of ERMG", spec.to_dict()),
                "erm": ("specs of the model", erm.to_dict())})
            blocks = [Block.from_state(b, erm.columns) for b in state["blocks"]]
            rho_total = Fraction(state["rho_total"])
            rho_before = [Fraction(r) for r in state["rho_before"]]
            improver = _ErmImprover.from_state(state["improver"], ermg.improver_spec,
                                               ermg.black_box, noise, ermg._coordinates)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed {_STATE_KIND} state: {exc!r}") from None
        if len(rho_before) != len(blocks) or any(r > rho_total for r in rho_before):
            raise InvalidParameterError(f"malformed {_STATE_KIND} state: inconsistent blocks")
        ermg._blocks, ermg._improver = blocks, improver
        ermg._rho_total, ermg._rho_before = rho_total, rho_before
        return ermg

    def __repr__(self) -> str:
        return f"Ermg(t={len(self._blocks)} blocks, {self.ledger!r})"
