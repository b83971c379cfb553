"""The sliding-window schedule: ERM paper 004, Algorithm 5 (Theorem 7) and Example 1's chain.

``sliding-window`` — Algorithm 5 (Theorem 7) for ``w = 2^k − 1`` blocks, ``k >= 2``, with
Example 1's dependency chain generalised (see *The sliding-window chain* below). Base
bucket: Algorithm 1 at reference ``(2^(k−1) b0, ε/3)`` (``Δε = 6L/(λε2^(k−1))``). A bucket
of ``2^i`` blocks is trained with PBERM centred on the previous model of the chain, with
noise reference ``(b0, ε/6)`` (the proof's ``12L/(λ w0 ε)``), so it costs ``ε/(6·2^i)``.
Note that ``12L/(λw0ε)`` is *three times* Algorithm 4's update noise ``4L/(λb0ε)``.
Nothing is released before the first full window. Each block is in at most one base, one
right part and one left part (proved below), so it pays at most
``ε/3 + 2·(ε/6)(1 + 1/2 + ... + 1/2^(k−2)) < ε``. With ``sampling`` (the paper's
"fine-tuning sampling", Appendix B) a ``2^i``-block update is Poisson-sampled at rate
``p_i``, its noise is calibrated to the full bucket (unamplified ``ε/6``), and it costs
``<= ε/(6·2^i)``: the same sequence (reading 8). The base is not sampled (the paper's first
option).

**The sliding-window chain** (``w = 2^k − 1`` blocks, ``h = 2^(k−1)``). The first window is
complete at ``t = w``; the window is refreshed at ``t0 = w + m·h`` (``m = 0, 1, ...``): its base
bucket is the newest ``h`` blocks ``[t0 − h, t0 − 1]``. At ``t = t0 + r`` (``0 <= r < h``) the
window ``[t − w, t − 1]`` is the base, a *left* part of the ``h − 1 − r`` blocks just before it
and a *right* part of the ``r`` blocks after it. Each part is cut into power-of-two buckets
following the binary digits of its length, the larger buckets next to the base. The left
length is ``h − 1 − r``, the bitwise complement of ``r`` in ``k − 1`` bits: every size ``2^i``,
``i < k − 1``, occurs exactly once, on one side or the other. The chain is the base, then the
buckets by size descending; each bucket's model is trained on the bucket, centred on the
previous model in the chain; the end of the chain (always a one-block bucket) is released
(``role = "window"``). A model is identified by its bucket and its centre's identity
(recursively: the chain of ranges from the base down to it, which is its ``depends_on``) and
is trained once: at the next step it is reused if that identity is unchanged.
For ``w = 7`` this is Example 1 exactly:
``f[0] ← f[1:2] ← f[3:6]``, ``f[7] ← f[1:2] ← f[3:6]``, ``f[2] ← f[7:8] ← f[3:6]``,
``f[9] ← f[7:8] ← f[3:6]``, then the refresh ``f[4] ← f[5:6] ← f[7:10]``.

*Each model is trained once (the accounting needs it).* Let ``o_i(r)`` be the sum of the
binary digits of ``r`` above ``i``. A right bucket of ``2^i`` blocks is
``[t0 + o_i(r), t0 + o_i(r) + 2^i − 1]``; it exists exactly for the ``r`` with the same digits
above ``i`` and digit ``i`` set, an interval of ``r``. Over that interval the digits of ``r``
above ``i`` are fixed, hence so are those of the left length ``h − 1 − r`` (their complement):
every bucket larger than ``2^i``, on either side, is fixed, and so is the base. Everything
above the bucket in the chain is fixed while it exists, so its identity never changes and it
is trained exactly once. The same holds for a left bucket (digit ``i`` of ``r`` clear). Once a
bucket leaves the chain it never returns within the pass, and a new pass has a new base.

*Each block pays each size at most once per side, and has at most one base, one right part
and one left part.* In a pass, the right buckets of size ``2^i`` start at offsets that are
multiples of ``2^(i+1)`` and span ``2^i``: a block at a fixed offset lies in at most one of them;
likewise on the left. The base of the pass at ``t0`` is ``[t0 − h, t0 − 1]``; its right part is
``[t0, t0 + h − 2]``, inside the next base ``[t0, t0 + h − 1]``; its left part (at most
``h − 1`` blocks before its base) lies inside the previous base. Bases are disjoint, so a
block is in at most one base, in the right part of at most the pass before and in the left
part of at most the pass after. That is Theorem 7's three-way split of ``ε``: ``ε/3`` for the
base plus ``(ε/6)(1 + 1/2 + ... ) < ε/3`` per side.

**Noise and state.** The plan chooses computations and noise levels; the noise is exact and
replay-safe, drawn by :class:`~dpstream.core.erm.schedules.schedule.ReleaseSchedule` at each
computation's coordinates. Between steps the schedule keeps the chain's models (the centres
of the next step's buckets) and the blocks of the current window only.
"""

from __future__ import annotations

from collections.abc import Collection

from dpstream.core._checks import is_integer
from dpstream.core.erm.schedules.base import SchedulePlan, _Job
from dpstream.core.erm.schedules.releases import Chain
from dpstream.errors import InvalidParameterError

__all__ = [
    "SlidingWindowPlan",
]


class SlidingWindowPlan(SchedulePlan):
    """Algorithm 5: a window of ``w = 2^k − 1`` blocks, its base refreshed every ``2^(k−1)``."""

    def window_chain(self, t: int) -> list[tuple[int, int]]:
        """Return the sliding window's buckets at ``t`` blocks seen: the base, then by size.

        Raises:
            InvalidParameterError: ``t < w``.

        """
        w = int(self.spec.window_blocks)
        if not is_integer(t) or t < w:
            raise InvalidParameterError(f"the first window is complete at t = {w}, got {t!r}")
        k = self.spec.window_exponent
        h = 1 << (k - 1)
        t0 = w + ((t - w) // h) * h
        r = t - t0
        left = h - 1 - r
        buckets = [(t0 - h, t0 - 1)]
        for i in range(k - 2, -1, -1):
            size = 1 << i
            above = ~((size << 1) - 1)  # the binary digits above i
            if r & size:
                offset = r & above
                buckets.append((t0 + offset, t0 + offset + size - 1))
            else:
                offset = left & above
                buckets.append((t0 - h - offset - size, t0 - h - offset - 1))
        return buckets

    def jobs(self, step: int, t: int, kept: Collection[Chain]
             ) -> tuple[list[_Job], Chain | None, list[Chain]]:
        """Return the chain's new models, its end (released) and all its models."""
        if t < int(self.spec.window_blocks):
            return [], None, []
        buckets = self.window_chain(t)
        k = self.spec.window_exponent
        h = 1 << (k - 1)
        c_b, c_u = self._costs["base"], self._costs["update"]
        jobs: list[_Job] = []
        keys: list[Chain] = []
        centre: Chain = ()
        for position, (first, last) in enumerate(buckets):
            key: Chain = ((first, last), *centre)
            keys.append(key)
            if key not in kept:
                size = last - first + 1
                if position == 0:
                    noise = self._level("window-base", h, c_b)
                    jobs.append(self._job(step, "base", k - 1, first, last, (), noise, None))
                else:
                    i = size.bit_length() - 1
                    if self.spec.sampling and i > 0:
                        noise = self._level("window-sampled", size, c_u)
                        jobs.append(self._job(step, "update", i, first, last, centre, noise,
                                              None, rate=self._rate("window", i, c_u)))
                    else:
                        noise = self._level("window", 1, c_u)
                        jobs.append(self._job(step, "update", i, first, last, centre, noise,
                                              None))
            centre = key
        return jobs, keys[-1], keys

    def kept_models(self, t: int, chain_keys: list[Chain]) -> list[Chain]:
        """The chain's models: the centres of the next step's buckets."""
        return chain_keys

    def keep_from(self, t: int) -> int | None:
        """The first block of the current window (no later bucket lies before it)."""
        return max(0, t - int(self.spec.window_blocks))  # the current window
