"""The continual schedule: ERM paper 004, Algorithm 4 (Theorem 4), sampled Algorithm 8.

``continual`` — Algorithm 4 (Theorem 4) with Algorithm 2 running alongside. At
``t = 2^k B`` the base ``f_g`` is Algorithm 2's level-``k`` model of ``D[0:t]``
(post-processing: it is released once, with ``role = "base"``, and its cost is Algorithm
2's); Algorithm 2's other levels are released as ``"multi-resolution"``. In between
(``i = t − t_g`` blocks after the base), lines 6–12: if ``i = 2^j``, an ``"update"`` (level
``j``) on ``D[t_g:t]`` (normaliser ``2^j b0``) centred at ``f_g``, saved as ``f_c``; otherwise
an ``"update"`` (level ``None``) on the last block centred at ``f_c``. Noise reference
``(b0, ε/2)``: a one-block update costs ``ε/2``, a ``2^j``-block update ``ε/(2·2^j)``. A block
pays for at most one one-block update and the ``2^j``-updates that cover it, which cover it
at most once per ``j``: at most ``ε/2 + ε/4 + ... < ε`` (the block right after the base is
the worst case). Algorithm 2 adds ``< ε``: **every event costs at most 2ε**
(``ScheduleSpec.budget()``; the paper's remark after Theorem 4). With ``sampling`` it is
Algorithm 8 (Theorem B.3): the ``2^j``-updates sample ``D[t_g:t]`` at rate ``q_j``, noise at
the full size (unamplified ``ε/2``), amplified ``<= ε/(2·2^j)``; Algorithm 2 itself is not
sampled (line 8 of Algorithm 8 names Algorithm 2).

**Noise and state.** The plan chooses computations and noise levels; the noise is exact and
replay-safe, drawn by :class:`~dpstream.core.erm.schedules.schedule.ReleaseSchedule` at each
computation's coordinates. Between steps the schedule keeps the base ``f_g`` and the last
saved update ``f_c`` (:meth:`ContinualPlan.kept_models`), the centres of later updates, and
every block.
"""

from __future__ import annotations

from collections.abc import Collection

from dpstream.core.erm.schedules.base import _Job
from dpstream.core.erm.schedules.multi_resolution import MultiResolutionPlan
from dpstream.core.erm.schedules.releases import Chain
from dpstream.core.erm.schedules.spec import _is_power_of_two

__all__ = [
    "ContinualPlan",
]


class ContinualPlan(MultiResolutionPlan):
    """Algorithm 4 (8 with sampling) on the bases of Algorithm 2, which runs alongside."""

    def jobs(self, step: int, t: int, kept: Collection[Chain]
             ) -> tuple[list[_Job], Chain | None, list[Chain]]:
        """Return Algorithm 2's releases and the update of ``t`` (Algorithm 4 lines 6-12)."""
        big_b = int(self.spec.base_blocks)
        jobs = self._multi_resolution_jobs(step, t, "base")
        if t < big_b or (t % big_b == 0 and _is_power_of_two(t // big_b)):
            return jobs, None, []  # before the first base, or a base step (released above)
        t_g = big_b << ((t // big_b).bit_length() - 1)
        i = t - t_g
        base: Chain = ((0, t_g - 1),)
        c_u = self._costs["update"]
        if _is_power_of_two(i):
            j = i.bit_length() - 1
            if self.spec.sampling and j > 0:
                noise = self._level("update-sampled", i, c_u)
                jobs.append(self._job(step, "update", j, t_g, t - 1, base, noise, "update",
                                      rate=self._rate("update", j, c_u), release_level=j))
            else:
                noise = self._level("update", 1, c_u)
                jobs.append(self._job(step, "update", j, t_g, t - 1, base, noise, "update",
                                      release_level=j))
        else:
            saved = 1 << (i.bit_length() - 1)
            centre = ((t_g, t_g + saved - 1), *base)
            noise = self._level("update", 1, c_u)
            jobs.append(self._job(step, "update", None, t - 1, t - 1, centre, noise, "update"))
        return jobs, None, []

    def kept_models(self, t: int, chain_keys: list[Chain]) -> list[Chain]:
        """The models later steps may use as centres."""
        big_b = int(self.spec.base_blocks)
        if t < big_b:
            return []
        t_g = big_b << ((t // big_b).bit_length() - 1)
        base: Chain = ((0, t_g - 1),)
        i = t - t_g
        if i == 0:
            return [base]
        saved = 1 << (i.bit_length() - 1)
        return [base, ((t_g, t_g + saved - 1), *base)]
