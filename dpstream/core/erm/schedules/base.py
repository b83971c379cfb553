"""The shared machinery of the ERM schedules' plans: noise levels, sampling rates, jobs.

Every schedule of Watson et al., "Continual and Sliding Window Release for Private Empirical Risk
Minimization" (paper 004) plans, at each step, the computations it runs
(:class:`SchedulePlan.jobs`; one subclass per schedule). A computation's noise is a
:class:`~dpstream.core.erm.output_noise.NoiseLevel` fixed by a *reference* (a normaliser and the
cost at it): the same real noise at another normaliser costs exactly ``cost_ref·Δ/Δ_ref`` (pure ε)
or ``cost_ref·(Δ/Δ_ref)²`` (zCDP ρ); a sampled computation's rate is
:func:`~dpstream.core.erm.schedules.spec.sampling_rate_at_most` and it charges the amplified cost.
At ``unit = "user"`` (``ErmSpec.unit_rows = r``) the cost amplified is ``kappa_r`` times the
computation's (:func:`~dpstream.core.erm.grid.rows_l1_factor`; 1 at the event level): a person's
``r`` rows of a block are sampled independently, and only a bound linear in the rows amplifies
row by row (:mod:`dpstream.core.erm.contribution` derives it).
Levels and rates are cached by plan; a plan draws no noise and holds no state a snapshot needs (it
is rebuilt from the specs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from dpstream.core.erm.grid import rows_l1_factor
from dpstream.core.erm.output_noise import NoiseLevel
from dpstream.core.erm.sampling import amplified_epsilon
from dpstream.core.erm.schedules.releases import Chain, Computation
from dpstream.core.erm.schedules.spec import ScheduleSpec, sampling_rate_at_most
from dpstream.core.erm.spec import ErmSpec

__all__ = [
    "SchedulePlan",
]

_CENTRED_LEVELS: Final = frozenset({"update", "update-sampled", "window", "window-sampled"})
"""The noise levels of centred computations (Algorithm 3/7), which use the updates' λ."""


@dataclass(frozen=True)
class _Job:
    """A planned computation, its noise level and how it is released (``None``: not)."""

    computation: Computation
    noise: NoiseLevel
    expected_cost: Fraction  # the unamplified cost the trained model must report
    release_role: str | None
    release_level: int | None


class SchedulePlan(ABC):
    """Plans the computations of one schedule, step by step (one subclass per schedule).

    Args:
        spec: the schedule.
        erm: the model (its λ for the uncentred computations, Algorithm 1).
        update_erm: the model with the updates' λ (the centred computations, Algorithm 3/7).

    """

    def __init__(self, spec: ScheduleSpec, erm: ErmSpec, update_erm: ErmSpec) -> None:
        self.spec = spec
        self.erm = erm
        self.update_erm = update_erm
        self._b0 = int(spec.block_size)
        self._costs = spec.reference_costs()
        self._levels: dict[tuple[str, int], NoiseLevel] = {}
        self._rates: dict[tuple[str, int], Fraction] = {}
        self._rows = rows_l1_factor(erm.parameter_count, int(erm.unit_rows))  # 1: event level

    @abstractmethod
    def jobs(self, step: int, t: int, kept: Collection[Chain]
             ) -> tuple[list[_Job], Chain | None, list[Chain]]:
        """Return the step's jobs, the released chain end (or None) and the chain's models.

        ``kept`` are the models already trained and kept as centres (:meth:`kept_models`).
        """

    def kept_models(self, t: int, chain_keys: list[Chain]) -> list[Chain]:
        """The models later steps may use as centres (none by default)."""
        return []

    def keep_from(self, t: int) -> int | None:
        """The first block later steps may use, or None to keep every block (the default)."""
        return None

    def model_spec(self, centred: bool) -> ErmSpec:
        """The λ of a computation: the updates' (centred, Algorithm 3/7) or the model's."""
        return self.update_erm if centred else self.erm

    def _sensitivity(self, blocks: int, centred: bool) -> Fraction:
        erm = self.model_spec(centred)
        return Fraction(erm.sensitivity(float(blocks * self._b0)))

    def _level(self, name: str, blocks: int, cost: Fraction) -> NoiseLevel:
        """The noise level whose cost at ``blocks`` blocks is ``cost`` (cached)."""
        key = (name, blocks)
        level = self._levels.get(key)
        if level is None:
            level = NoiseLevel(
                reference_sensitivity=self._sensitivity(blocks, name in _CENTRED_LEVELS),
                reference_cost=cost,
            )
            self._levels[key] = level
        return level

    def _rate(self, name: str, j: int, unamplified: Fraction) -> Fraction:
        key = (name, j)
        rate = self._rates.get(key)
        if rate is None:
            rate = sampling_rate_at_most(unamplified * self._rows, unamplified / (1 << j))
            self._rates[key] = rate
        return rate

    def _job(
        self,
        step: int,
        role: str,
        level: int | None,
        first: int,
        last: int,
        centre: Chain,
        noise: NoiseLevel,
        release_role: str | None,
        *,
        rate: Fraction = Fraction(1),
        release_level: int | None = None,
    ) -> _Job:
        blocks = last - first + 1
        normalizer = float(blocks * self._b0)
        centred = bool(centre)
        cost = noise.cost_at(self.model_spec(centred), self._sensitivity(blocks, centred))
        if rate == 1:
            return _Job(
                Computation(step, role, level, first, last, centre, normalizer, None, cost),
                noise, cost, release_role, release_level,
            )
        charge = amplified_epsilon(cost * self._rows, rate)
        return _Job(
            Computation(step, role, level, first, last, centre, normalizer, rate, charge),
            noise, cost, release_role, release_level,
        )
