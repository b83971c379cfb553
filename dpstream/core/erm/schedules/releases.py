"""What an ERM release schedule trains and releases, and the trainer it calls (ERM paper 004).

A schedule of Watson et al., "Continual and Sliding Window Release for Private Empirical Risk
Minimization" (paper 004) runs *computations* (:class:`Computation`: one private model trained on a
range of blocks, centred on an earlier released model or not, at a noise level and maybe a Poisson
rate) and releases some of their models (:class:`Release`). A model's identity is its
:data:`Chain`: its own block range, then its centre's, and so on (``depends_on``). The trainer
(:class:`TrainFn`) is Algorithm 1, or 3/7 with a centre:
:func:`~dpstream.core.erm.output_noise.private_erm` by default, whose noise is exact and drawn from
the ``rng`` the schedule derives from the computation's coordinates (replay-safe). With
``ErmSpec.learner = "objective"`` the default trainer is
:func:`~dpstream.core.erm.objective.objective_perturbation` at the very cost the level gives output
perturbation, ``level.cost_at(spec, spec.sensitivity(n̄))``: the black box changes, the plan's
costs (and so the per-block ledger, the sampling rates and their amplified charges) do not.
These are frozen records: they hold no state of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.objective import objective_perturbation
from dpstream.core.erm.output_noise import NoiseLevel, private_erm
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.samplers import RandomIntegers

__all__ = [
    "Chain",
    "Computation",
    "Release",
    "TrainFn",
]

Chain: TypeAlias = tuple[tuple[int, int], ...]
"""A model's identity: its own block range, then its centre's, and so on (``depends_on``)."""


class TrainFn(Protocol):
    """Trains one private model (as :func:`~dpstream.core.erm.output_noise.private_erm`)."""

    def __call__(
        self,
        spec: ErmSpec,
        block: Block,
        *,
        normalizer: float,
        center: npt.NDArray[np.float64] | None,
        level: NoiseLevel,
        rng: RandomIntegers,
    ) -> PrivateModel:
        """Return the private model of ``block`` (Algorithm 1, or 3/7 with a centre)."""
        ...


def _default_train(
    spec: ErmSpec,
    block: Block,
    *,
    normalizer: float,
    center: npt.NDArray[np.float64] | None,
    level: NoiseLevel,
    rng: RandomIntegers,
) -> PrivateModel:
    if spec.learner == "objective":
        cost = level.cost_at(spec, spec.sensitivity(normalizer))
        return objective_perturbation(
            spec, block, normalizer=normalizer, center=center, cost=cost, rng=rng
        )
    return private_erm(
        spec, block, normalizer=normalizer, center=center, level=level, rng=rng
    )


@dataclass(frozen=True)
class Computation:
    """One training run of a schedule: what was trained, on which blocks, centred where.

    Attributes:
        step: the block (step) at which it ran.
        role: ``"multi-resolution"``, ``"base"``, ``"update"`` or ``"independent"``.
        level: the size exponent (``2^level`` blocks, or ``2^level B`` for Algorithm 2), or
            ``None`` for a one-block update centred on the last saved model (Algorithm 4
            line 11) and the independent baseline.
        first_step: the first block of its data.
        last_step: the last block of its data.
        centre: the centre model's ``depends_on`` (``()`` for Algorithm 1, no centre).
        normalizer: ``n̄ = (last_step − first_step + 1)·b0``.
        rate: the Poisson sampling rate, or ``None`` when not sampled.
        cost: what it charges every block of ``[first_step, last_step]`` (after
            amplification when sampled).

    """

    step: int
    role: str
    level: int | None
    first_step: int
    last_step: int
    centre: Chain
    normalizer: float
    rate: Fraction | None
    cost: Fraction

    @property
    def depends_on(self) -> Chain:
        """The model's identity: its own range, then its centre's chain."""
        return ((self.first_step, self.last_step), *self.centre)


@dataclass(frozen=True)
class Release:
    """One released model.

    Attributes:
        step: the block at which it was released.
        role: ``"multi-resolution"``, ``"base"`` (continual: Algorithm 2's top level, the
            base of Algorithm 4), ``"update"``, ``"window"`` or ``"independent"``.
        level: as in :class:`Computation` (``None`` for a window release).
        first_step: the first block of the model's *own* data.
        last_step: the last block of its own data.
        depends_on: its own range first, then its centre's, and so on: every block range the
            model depends on through its centre chain.
        model: the released model.
        cost: the charge of the computation that made it (amplified when sampled). For a
            window release the chain's other new models of this step were charged too (see
            :attr:`~dpstream.core.erm.schedules.schedule.ReleaseSchedule.trained`).
        rate: the computation's sampling rate (``None`` when not sampled).

    """

    step: int
    role: str
    level: int | None
    first_step: int
    last_step: int
    depends_on: Chain
    model: PrivateModel
    cost: Fraction
    rate: Fraction | None = None
