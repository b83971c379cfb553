"""The independent baseline of ERM paper 004's Fig. 4d: every block alone (Algorithm 1).

``independent`` — the baseline of the paper's Fig. 4d: every block alone, Algorithm 1 at
reference ``(b0, ε)``; every block pays ``ε`` once.

**Noise and state.** The one computation of a step draws exact, replay-safe noise at its
coordinates (:class:`~dpstream.core.erm.schedules.schedule.ReleaseSchedule`). No model is kept,
and a block is retired once the next one arrives: it is used once.
"""

from __future__ import annotations

from collections.abc import Collection

from dpstream.core.erm.schedules.base import SchedulePlan, _Job
from dpstream.core.erm.schedules.releases import Chain

__all__ = [
    "IndependentPlan",
]


class IndependentPlan(SchedulePlan):
    """Every block alone, Algorithm 1 at reference ``(b0, ε)``."""

    def jobs(self, step: int, t: int, kept: Collection[Chain]
             ) -> tuple[list[_Job], Chain | None, list[Chain]]:
        """Return the block's one computation, released."""
        return self._independent_jobs(step), None, []

    def _independent_jobs(self, step: int) -> list[_Job]:
        noise = self._level("independent", 1, self._costs["independent"])
        return [self._job(step, "independent", None, step, step, (), noise, "independent")]

    def keep_from(self, t: int) -> int | None:
        """The current block (each block is used once)."""
        return t - 1  # the current block
