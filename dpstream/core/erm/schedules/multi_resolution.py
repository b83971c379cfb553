"""The multi-resolution schedule: ERM paper 004, Algorithm 2 (Theorem 1), sampled Algorithm 6.

``multi-resolution`` — Algorithm 2 (Theorem 1). At every ``t`` that is a multiple of
``2^k B``, for every such ``k``, release the Algorithm-1 model of the last ``2^k B`` blocks
(``level = k``). Noise: the reference is ``(B·b0, ε/2)``, so level ``k`` costs
``ε/(2·2^k)``. The level-``k`` data sets are disjoint (aligned), so a block pays at most once
per level: ``Σ_k ε/2^(k+1) < ε``. The first block has spent exactly ``ε(1 − 2^-(K+1))``
after ``2^K B`` blocks. With ``sampling`` it is Algorithm 6 (Theorem B.1): level ``k``'s data
is Poisson-sampled at rate ``q_k`` (reading 8), its noise is calibrated to the full nominal
size (reference ``(2^k B b0, ε/2)``: unamplified cost ``ε/2``) and the amplified cost
``ln(1 + q_k(e^(ε/2) − 1)) <= ε/(2·2^k)``: the same sum.

**Noise and state.** The plan only chooses computations and their noise levels; the noise is
exact and replay-safe, drawn by :class:`~dpstream.core.erm.schedules.schedule.ReleaseSchedule`
at each computation's coordinates. The plan keeps no model as a centre and every block (the
levels grow over all of them).
"""

from __future__ import annotations

from collections.abc import Collection

from dpstream.core.erm.schedules.base import SchedulePlan, _Job
from dpstream.core.erm.schedules.releases import Chain

__all__ = [
    "MultiResolutionPlan",
]


class MultiResolutionPlan(SchedulePlan):
    """Algorithm 2 (6 with sampling): at every multiple of ``2^k B`` blocks, level ``k``."""

    def jobs(self, step: int, t: int, kept: Collection[Chain]
             ) -> tuple[list[_Job], Chain | None, list[Chain]]:
        """Return the step's releases of every level that ends at ``t``."""
        return self._multi_resolution_jobs(step, t, None), None, []

    def _multi_resolution_jobs(self, step: int, t: int, top_role: str | None) -> list[_Job]:
        """Algorithm 2 (6 when sampling and standalone: Algorithm 8 names Algorithm 2)."""
        big_b = int(self.spec.base_blocks)
        sampled = self.spec.sampling and top_role is None
        if t % big_b:
            return []
        c0 = self._costs["multi-resolution"]
        jobs = []
        k = 0
        while t % (big_b << k) == 0:
            size = big_b << k
            role = "multi-resolution"
            if top_role is not None and t == size:
                role = top_role  # continual: the top level over D[0:t] is Algorithm 4's base
            if sampled and k > 0:
                noise = self._level("mr-sampled", size, c0)
                rate = self._rate("mr", k, c0)
                jobs.append(self._job(step, role, k, t - size, t - 1, (), noise, role,
                                      rate=rate, release_level=k))
            else:
                noise = self._level("mr", big_b, c0)
                jobs.append(self._job(step, role, k, t - size, t - 1, (), noise, role,
                                      release_level=k))
            k += 1
        return jobs
