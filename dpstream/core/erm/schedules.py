"""Release schedules for private ERM on a stream of blocks: multi-resolution, continual, sliding.

The schedules of Watson et al., "Continual and Sliding Window Release for Private Empirical
Risk Minimization" (paper 004), over the output-perturbation trainer of
:mod:`dpstream.core.erm.output_noise` (Algorithm 1 ``PSGD``; Algorithms 3 and 7 ``PBERM`` are the
same
with a *centre*, an earlier released model, as the regularisation point).

**Time and data.** The unit of time is one *block*: the events of one flow step (block index =
step number, public). Blocks arrive through :meth:`ReleaseSchedule.add_block` with
consecutive steps ``0, 1, 2, ...``; ``t`` below is the number of blocks seen (``t = step + 1``).
A block may hold any number of events, including none: an empty block still advances the
schedule. The paper's ``b0`` is the public *nominal* block size (``ScheduleSpec.block_size``),
``B = base_blocks`` blocks and ``w = window_blocks`` blocks (``w0`` = one block). A computation
over ``j`` blocks is normalised by ``n̄ = j·b0``, never by the private count, so one event
added or removed changes one block and moves that computation's minimiser by at most
``Δ(n̄) = L/(λ n̄)`` (add/remove neighbours; the paper's Lemma A.1 uses replace-one,
``2L/(λ n̄)``; :mod:`dpstream.core.erm.spec`). The noise of a computation is a
:class:`~dpstream.core.erm.output_noise.NoiseLevel` fixed by a *reference* (a normaliser and the
cost at
it); at another normaliser the same real noise costs exactly ``cost_ref·Δ/Δ_ref`` (pure ε) or
``cost_ref·(Δ/Δ_ref)²`` (zCDP ρ). That is how the paper's "constant noise, decreasing cost"
sums are reproduced exactly: its noise constants ``4L/(λBε)``, ``12L/(λw0ε)``, ... appear here
as the cost fractions they stand for.

**Algorithms** (``ScheduleSpec.algorithm``; ε below is ``ScheduleSpec.epsilon``, read as ρ
under ``accounting = "zcdp"``):

* ``multi-resolution`` — Algorithm 2 (Theorem 1). At every ``t`` that is a multiple of
  ``2^k B``, for every such ``k``, release the Algorithm-1 model of the last ``2^k B`` blocks
  (``level = k``). Noise: the reference is ``(B·b0, ε/2)``, so level ``k`` costs
  ``ε/(2·2^k)``. The level-``k`` data sets are disjoint (aligned), so a block pays at most once
  per level: ``Σ_k ε/2^(k+1) < ε``. The first block has spent exactly ``ε(1 − 2^-(K+1))``
  after ``2^K B`` blocks. With ``sampling`` it is Algorithm 6 (Theorem B.1): level ``k``'s data
  is Poisson-sampled at rate ``q_k`` (reading 8), its noise is calibrated to the full nominal
  size (reference ``(2^k B b0, ε/2)``: unamplified cost ``ε/2``) and the amplified cost
  ``ln(1 + q_k(e^(ε/2) − 1)) <= ε/(2·2^k)``: the same sum.
* ``continual`` — Algorithm 4 (Theorem 4) with Algorithm 2 running alongside. At
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
* ``sliding-window`` — Algorithm 5 (Theorem 7) for ``w = 2^k − 1`` blocks, ``k >= 2``, with
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
* ``independent`` — the baseline of the paper's Fig. 4d: every block alone, Algorithm 1 at
  reference ``(b0, ε)``; every block pays ``ε`` once.

**zCDP** (``accounting = "zcdp"``, discrete Gaussian noise; ρ ∝ Δ²). A reference's cost
shrinks by ``4`` per doubling instead of ``2``, so the references are chosen for
``Σ_k 4^-k = 4/3``: multi-resolution ``(B b0, 3ρ/4)`` (a block pays ``< ρ``); continual
updates ``(b0, 3ρ/4)`` (``< ρ``; with Algorithm 2, ``< 2ρ``); sliding base ``(2^(k−1) b0, ρ/3)``
and updates ``(b0, ρ/4)`` (``ρ/3 + 2·(ρ/4)(4/3) = ρ``, strictly less for a finite window);
independent ``(b0, ρ)``. Sampling is refused under zCDP: amplification is implemented for
pure ε only (:func:`~dpstream.core.erm.sampling.amplified_epsilon`); a Poisson-subsampled zCDP
mechanism has no rate-proportional ρ (it needs Rényi or truncated-CDP accounting).

**The per-block ledger.** Every computation charges each block of its own data range its
actual cost (amplified when sampled); :meth:`ReleaseSchedule.block_spend` and
:meth:`~ReleaseSchedule.max_block_spend` report it, exactly (``Fraction``). The charges of a
step are all known before any training (they are data-independent), so a step is checked
first — every block's spend plus the step's charges against the per-event budget
``ScheduleSpec.budget()`` — and committed only after every model of the step is trained:
a refused or failed step raises and changes nothing. The theorems say the budget is never
reached; the check is a self-check and raises
:class:`~dpstream.errors.BudgetExhaustedError` rather than exceed it. A block whose data can
no longer be used (it left the sliding window; the independent baseline's block once the next
one arrives) is *retired*: its data and its spend are dropped, its final spend is kept in
``max_block_spend``.

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

**Exact, replay-safe noise.** Each computation draws its noise from
``noise.stream(*coordinates, "erm-release", binding, algorithm, role, level, first_step,
last_step, *centre, "noise")`` where ``binding`` is a digest of the schedule's and the
model's parameters (privacy pitfall 13), ``level`` is ``-1`` for none and ``centre`` is the
centre's ``depends_on`` flattened: unique per computation, identical on a replay. Sampling
bits come from the same coordinates ending in ``"sample"`` instead of ``"noise"``.

**State** (:meth:`ReleaseSchedule.to_state`): the blocks still needed (all of them for the
cumulative algorithms, the window for the sliding window, none for the baseline) as arrays,
the live blocks' spend, the largest spend of any block, and the released models still used as
centres.
It holds private data: the recovery store that keeps it is secret. It is bound to the
schedule's spec and the model's spec (:meth:`ReleaseSchedule.from_state` checks both).

**Readings of the paper** (ambiguities and inconsistencies, resolved):

1. *Blocks, not points.* ``t``, ``B``, ``b0``, ``w`` are counted in blocks of nominal size
   ``b0``; objectives are normalised by blocks × ``b0`` (public). The paper's points are our
   blocks (its ``b0``-point batches).
2. *Algorithm 2's schedule.* "``t = 2^k q B`` for ``q, k``" is read as: at every ``t``, every
   ``k >= 0`` with ``2^k B | t`` releases a level-``k`` model (Fig. 1's hierarchy).
3. *Algorithm 4's update normaliser.* Algorithm 3 prints ``1/b0`` in front of a sum over
   ``D[t_g+1:t]``, which holds ``2^j b0`` points on line 8. With ``1/b0`` the sensitivity would
   not shrink and Theorem 4's proof (costs ``ε/(2·2^j)``) would fail. We normalise by the
   data's nominal size ``2^j b0``, as Algorithm 7 (``1/n``) and the proof do. ``j`` runs from
   ``0`` (whether ``j = 0`` is included changes only which model is saved as ``f_c`` at
   ``t_g + 1``, never an output: that ``f_c`` is replaced at ``t_g + 2`` before it is used).
4. *Algorithm 4's base* is Algorithm 2's top-level release at the same step, not a new
   computation (the proof of Theorem 4); Algorithm 2 runs alongside and is released too.
5. *Algorithm 8's cases* "``t`` of the form ``2^j b0``" are read relative to the base
   (``t − I_b = 2^j b0``), as in Algorithm 4 and as its ``[I_b:t]`` sample needs.
6. *Sliding-window constants.* Theorem 7's proof uses update noise ``12L/(λ w0 ε)`` (cost
   ``ε/(6·2^i)``), Theorem 8's proof says ``6L/(λ w0 ε)``; we use the privacy proof's. The
   proof's partition ``D^L, D^R, D^R+`` has inconsistent sizes; the three-way split proved
   above is what our chain does. The chain for a general ``w`` ("involved", not given) is
   the construction above; it reproduces Example 1 and Fig. 3's ``w = 15``.
7. *The independent baseline* (Fig. 4d: "each batch ... sanitized independently") is
   Algorithm 1 on every block alone at ``ε``.
8. *Sampling.* The paper samples "without replacement" (substitution neighbours); under
   add/remove neighbours we use Poisson sampling, whose amplification is
   ``ln(1 + q(e^ε − 1))`` (Balle, Barthe, Gaboardi 2018) — the paper's "Further notes on
   sampling" allow it. The rate is the paper's
   ``q = (e^(a/2^j) − 1)/(e^a − 1)`` (``a`` the unamplified cost), rounded *down* until
   :func:`~dpstream.core.erm.sampling.amplified_epsilon` (rounded up) is at most ``a/2^j``
   (:func:`sampling_rate_at_most`); that bound is what is charged. The sampled objective is
   normalised by the *full* nominal size of its blocks (blocks × ``b0``), as
   :mod:`dpstream.core.erm.sampling` explains: only then is the sensitivity the one the noise is
   calibrated to ("noise calibrated to the full bucket size"); normalising by the sample's
   size would multiply the unamplified cost by ``2^j``. The sliding window's sampling text
   gives two calibrations (rate ``1/2^j`` with noise ``4L/(λ 2^j b0 ε)``, then "the same
   sequence ``ε/6 + ε/12 + ...``"); we follow the sequence: unamplified ``ε/6``, rate
   ``p_i`` from the formula (rate ``1/2^i`` would cost slightly *more* than ``ε/(6·2^i)``).
   A level whose rate is 1 (``j = 0``) is not sampled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Final, Literal, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import (
    check_state,
    fraction_text,
    integer_at_least,
    is_integer,
    positive_finite,
)
from dpstream.core.accounting.ledger import exact
from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.output_noise import NoiseLevel, private_erm
from dpstream.core.erm.sampling import amplified_epsilon, poisson_sample, sampling_rate
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.coordinates import check_coordinates
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import RandomIntegers
from dpstream.errors import BudgetExhaustedError, InvalidParameterError

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Computation",
    "Release",
    "ReleaseSchedule",
    "ScheduleSpec",
    "TrainFn",
    "sampling_rate_at_most",
]

Algorithm = Literal["multi-resolution", "continual", "sliding-window", "independent"]
Accounting = Literal["pure", "zcdp"]
ALGORITHMS: Final = ("multi-resolution", "continual", "sliding-window", "independent")
_ACCOUNTINGS: Final = ("pure", "zcdp")
_STATE_VERSION: Final = 1
_STATE_KIND: Final = "erm-release"
_RATE_TRIES: Final = 256

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
    return private_erm(
        spec, block, normalizer=normalizer, center=center, level=level, rng=rng
    )


_CENTRED_LEVELS: Final = frozenset({"update", "update-sampled", "window", "window-sampled"})
"""The noise levels of centred computations (Algorithm 3/7), which use the updates' λ."""


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def sampling_rate_at_most(unamplified: Fraction, target: Fraction) -> Fraction:
    """Return a Poisson rate whose charged (amplified) cost is at most ``target`` (pure ε only).

    Starts from the paper's rate ``(e^target − 1)/(e^unamplified − 1)`` (Algorithm 6 line 5,
    Algorithm 8 line 11) as :func:`dpstream.core.erm.sampling.sampling_rate` computes it
    (rounded down
    to a denominator of ``10^18``), then lowers it, by steps that double, until
    :func:`~dpstream.core.erm.sampling.amplified_epsilon` — an upper bound on
    ``ln(1 + q(e^unamplified − 1))``, rounded up — is at most ``target``: that bound is what is
    charged, so the paper's sums hold exactly. Rate 1 when ``target >= unamplified``.

    Raises:
        InvalidParameterError: ``target`` is not > 0, or no such rate was found.

    """
    if target >= unamplified:
        return Fraction(1)
    if target <= 0:
        raise InvalidParameterError(f"a sampled cost target must be > 0, got {target}")
    rate = sampling_rate(unamplified, target)
    num, den = rate.numerator, rate.denominator
    step = max(1, num >> 40)
    for _ in range(_RATE_TRIES):
        if num <= 0:
            break
        rate = Fraction(num, den)
        if amplified_epsilon(unamplified, rate) <= target:
            return rate
        num -= step
        step *= 2
    raise InvalidParameterError(
        f"no sampling rate amplifies a cost of {float(unamplified):.6g} down to "
        f"{float(target):.6g}"
    )


# --- the spec -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleSpec:
    """Parameters of a release schedule, validated at construction.

    Attributes:
        algorithm: ``"multi-resolution"`` (Algorithm 2/6), ``"continual"`` (Algorithm 4/8
            with Algorithm 2), ``"sliding-window"`` (Algorithm 5) or ``"independent"``.
        epsilon: the privacy parameter of one component: ε (pure) or ρ (zCDP). Every event
            costs at most :meth:`budget` (``2ε`` for ``continual``, else ``ε``).
        block_size: ``b0``, the public nominal number of events per block (>= 1).
        base_blocks: ``B`` in blocks, a power of two (Algorithms 2, 4, 6, 8).
        window_blocks: ``w`` in blocks, ``2^k − 1`` with ``k >= 2`` (Algorithm 5).
        sampling: Algorithms 6, 8 and the sampled sliding window (pure only).
        accounting: ``"pure"`` (discrete Laplace, ε) or ``"zcdp"`` (discrete Gaussian, ρ);
            must equal the model's :attr:`~dpstream.core.erm.spec.ErmSpec.accounting`.
        update_regularization: the λ of the centred computations (Algorithm 3/7: the
            updates of Algorithm 4/8 and the buckets of Algorithm 5), or ``None`` for the
            model's λ. Algorithm 3 takes λ as its own input; Theorem 5 wants it small enough
            (λ <= 1/(||w* − w_g||² b0)) for the update to fit the new block, while a large λ
            keeps the update near its (better-trained) centre with less noise. The base
            models (Algorithm 1) keep the model's λ. Each computation's sensitivity uses its
            own λ, so the accounting is unchanged.

    Raises:
        InvalidParameterError: a parameter out of range, or sampling with zCDP or with the
            independent baseline.

    """

    algorithm: Algorithm
    epsilon: float
    block_size: int
    base_blocks: int = 1
    window_blocks: int = 3
    sampling: bool = False
    accounting: Accounting = "pure"
    update_regularization: float | None = None

    mechanism: ClassVar[str] = "erm-release"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise InvalidParameterError(
                f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}"
            )
        positive_finite("epsilon", self.epsilon)
        integer_at_least("block_size", self.block_size, 1)
        integer_at_least("base_blocks", self.base_blocks, 1)
        integer_at_least("window_blocks", self.window_blocks, 1)
        if self.algorithm in ("multi-resolution", "continual") and not _is_power_of_two(
            int(self.base_blocks)
        ):
            raise InvalidParameterError(
                f"base_blocks must be a power of two (B = 2^m blocks), got {self.base_blocks!r}"
            )
        if self.algorithm == "sliding-window" and (
            self.window_blocks < 3 or not _is_power_of_two(int(self.window_blocks) + 1)
        ):
            raise InvalidParameterError(
                "window_blocks must be 2^k - 1 with k >= 2 (3, 7, 15, ...; Algorithm 5), "
                f"got {self.window_blocks!r}"
            )
        if not isinstance(self.sampling, bool):
            raise InvalidParameterError(f"sampling must be a bool, got {self.sampling!r}")
        if self.accounting not in _ACCOUNTINGS:
            raise InvalidParameterError(
                f"accounting must be one of {_ACCOUNTINGS}, got {self.accounting!r}"
            )
        if self.sampling and self.accounting == "zcdp":
            raise InvalidParameterError(
                "sampling is refused under zCDP accounting: amplification by Poisson "
                "sampling is implemented for pure epsilon only (ln(1 + q(e^eps - 1))); a "
                "subsampled zCDP mechanism has no rate-proportional rho to charge. Use "
                "accounting 'pure' or sampling = false"
            )
        if self.update_regularization is not None:
            positive_finite("update_regularization", self.update_regularization)
        if self.sampling and self.algorithm == "independent":
            raise InvalidParameterError(
                "the independent baseline has no sampled variant (each block is used once, "
                "at full size); set sampling = false"
            )

    # -- the constants --
    @property
    def window_exponent(self) -> int:
        """``k`` with ``w = 2^k − 1`` (sliding window)."""
        return (int(self.window_blocks) + 1).bit_length() - 1

    def budget(self) -> Fraction:
        """Return the per-event bound the theorems give: ``2ε`` (continual) or ``ε``."""
        eps = exact(self.epsilon)
        return 2 * eps if self.algorithm == "continual" else eps

    def reference_costs(self) -> dict[str, Fraction]:
        """Return each noise reference's cost (ε or ρ), by component (module docstring).

        Keys: ``"multi-resolution"`` (reference ``B`` blocks), ``"update"`` (one block),
        ``"base"`` (the sliding window's ``2^(k−1)`` blocks), ``"independent"`` (one block).
        Sampled computations use the same unamplified cost at their full size.
        """
        eps = exact(self.epsilon)
        zcdp = self.accounting == "zcdp"
        if self.algorithm == "multi-resolution":
            return {"multi-resolution": eps * 3 / 4 if zcdp else eps / 2}
        if self.algorithm == "continual":
            half = eps * 3 / 4 if zcdp else eps / 2
            return {"multi-resolution": half, "update": half}
        if self.algorithm == "sliding-window":
            return {"base": eps / 3, "update": eps / 4 if zcdp else eps / 6}
        return {"independent": eps}

    def to_dict(self) -> dict[str, Any]:
        """Return the parameters as JSON-safe data (for binding a state to its spec)."""
        return {
            "algorithm": str(self.algorithm),
            "epsilon": float(self.epsilon),
            "block_size": int(self.block_size),
            "base_blocks": int(self.base_blocks),
            "window_blocks": int(self.window_blocks),
            "sampling": bool(self.sampling),
            "accounting": str(self.accounting),
            "update_regularization": (None if self.update_regularization is None
                                      else float(self.update_regularization)),
        }

    def describe(self) -> str:
        """Return a human summary of the schedule and its accounting."""
        unit = "rho" if self.accounting == "zcdp" else "epsilon"
        b0, big_b, w = int(self.block_size), int(self.base_blocks), int(self.window_blocks)
        costs = {k: float(v) for k, v in self.reference_costs().items()}
        sampled = " with Poisson sampling" if self.sampling else ""
        if self.algorithm == "multi-resolution":
            text = (f"Algorithm {6 if self.sampling else 2}{sampled}: at every multiple of "
                    f"2^k x {big_b} blocks, the model of the last 2^k x {big_b} blocks; level k "
                    f"costs {costs['multi-resolution']:.6g}/{'4' if unit == 'rho' else '2'}^k")
        elif self.algorithm == "continual":
            text = (f"Algorithm {8 if self.sampling else 4}{sampled} on bases from Algorithm 2 "
                    f"at 2^k x {big_b} blocks; a one-block update costs {costs['update']:.6g}, "
                    f"a 2^j-block update {costs['update']:.6g}/"
                    f"{'4' if unit == 'rho' else '2'}^j; Algorithm 2 and Algorithm 4 each "
                    f"cost an event < {float(self.epsilon):.6g}")
        elif self.algorithm == "sliding-window":
            text = (f"Algorithm 5{sampled}: window of {w} blocks; base of "
                    f"{(w + 1) // 2} blocks costs {costs['base']:.6g}, a 2^i-block update "
                    f"{costs['update']:.6g}/{'4' if unit == 'rho' else '2'}^i")
        else:
            text = f"independent baseline: every block alone at {costs['independent']:.6g}"
        return (f"{text}\nblock = one step of nominal b0 = {b0} events; every event costs at "
                f"most {float(self.budget()):.6g} {unit}")


# --- releases -----------------------------------------------------------------------------


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
            :attr:`ReleaseSchedule.trained`).
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


@dataclass(frozen=True)
class _Job:
    """A planned computation, its noise level and how it is released (``None``: not)."""

    computation: Computation
    noise: NoiseLevel
    expected_cost: Fraction  # the unamplified cost the trained model must report
    release_role: str | None
    release_level: int | None


# --- the schedule --------------------------------------------------------------------------


class ReleaseSchedule:
    """Runs one release schedule over a stream of blocks (see the module docstring).

    Args:
        spec: the schedule.
        erm: the model (classes, features, λ, accounting); ``erm.accounting`` must equal
            ``spec.accounting``.
        noise: the secret key all noise and sampling bits are derived from.
        coordinates: the schedule's coordinates, e.g. ``(instance, flow, "erm", stream)``.
        train: the trainer (default :func:`dpstream.core.erm.output_noise.private_erm`); injectable
        for
            tests.

    Raises:
        InvalidParameterError: bad coordinates, or accountings that differ.

    """

    def __init__(
        self,
        spec: ScheduleSpec,
        erm: ErmSpec,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
        *,
        train: TrainFn | None = None,
    ) -> None:
        if not isinstance(spec, ScheduleSpec):
            raise InvalidParameterError(f"spec must be a ScheduleSpec, got {type(spec).__name__}")
        if erm.accounting != spec.accounting:
            raise InvalidParameterError(
                f"the schedule's accounting {spec.accounting!r} differs from the model's "
                f"{erm.accounting!r}: build both with the same accounting"
            )
        self.spec = spec
        self.erm = erm
        self.update_erm = (erm if spec.update_regularization is None else
                           dataclasses.replace(erm, regularization=spec.update_regularization))
        self._key = noise
        self._coordinates = check_coordinates(coordinates)
        self._train: TrainFn = _default_train if train is None else train
        self._binding = hashlib.blake2b(
            json.dumps([spec.to_dict(), erm.to_dict()], sort_keys=True, default=str).encode(),
            digest_size=8,
        ).hexdigest()
        self._budget = spec.budget()
        self._b0 = int(spec.block_size)
        self._costs = spec.reference_costs()
        self._levels: dict[tuple[str, int], NoiseLevel] = {}
        self._rates: dict[tuple[str, int], Fraction] = {}
        # mutable state
        self._t = 0  # blocks seen
        self._first_kept = 0  # the step of self._blocks[0]
        self._blocks: list[Block] = []
        self._first_live = 0  # the step of self._spend[0]
        self._spend: list[Fraction] = []
        self._max_spend = Fraction(0)  # over every block, retired ones included
        self._models: dict[Chain, PrivateModel] = {}
        self._trained: tuple[Computation, ...] = ()

    # -- noise levels and rates --
    def _model_spec(self, centred: bool) -> ErmSpec:
        """The λ of a computation: the updates' (centred, Algorithm 3/7) or the model's."""
        return self.update_erm if centred else self.erm

    def _sensitivity(self, blocks: int, centred: bool) -> Fraction:
        erm = self._model_spec(centred)
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
            rate = sampling_rate_at_most(unamplified, unamplified / (1 << j))
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
        cost = noise.cost_at(self._model_spec(centred), self._sensitivity(blocks, centred))
        if rate == 1:
            return _Job(
                Computation(step, role, level, first, last, centre, normalizer, None, cost),
                noise, cost, release_role, release_level,
            )
        charge = amplified_epsilon(cost, rate)
        return _Job(
            Computation(step, role, level, first, last, centre, normalizer, rate, charge),
            noise, cost, release_role, release_level,
        )

    # -- the plans --
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

    def _continual_jobs(self, step: int, t: int) -> list[_Job]:
        big_b = int(self.spec.base_blocks)
        jobs = self._multi_resolution_jobs(step, t, "base")
        if t < big_b or (t % big_b == 0 and _is_power_of_two(t // big_b)):
            return jobs  # before the first base, or a base step (released above)
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
        return jobs

    def window_chain(self, t: int) -> list[tuple[int, int]]:
        """Return the sliding window's buckets at ``t`` blocks seen: the base, then by size.

        Raises:
            InvalidParameterError: not a sliding-window schedule, or ``t < w``.

        """
        if self.spec.algorithm != "sliding-window":
            raise InvalidParameterError("window_chain is for the sliding-window schedule")
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

    def _window_jobs(self, step: int, t: int) -> tuple[list[_Job], Chain | None, list[Chain]]:
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
            if key not in self._models:
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

    def _independent_jobs(self, step: int) -> list[_Job]:
        noise = self._level("independent", 1, self._costs["independent"])
        return [self._job(step, "independent", None, step, step, (), noise, "independent")]

    # -- a step --
    def _check_block(self, step: object, block: object) -> tuple[int, Block]:
        if not is_integer(step) or step != self._t:
            raise InvalidParameterError(
                f"blocks arrive with consecutive steps from 0: expected step {self._t}, "
                f"got {step!r}"
            )
        if not isinstance(block, Block):
            raise InvalidParameterError(f"block must be a Block, got {type(block).__name__}")
        z, y = block.z, block.y
        if not isinstance(z, np.ndarray) or z.ndim != 2 or z.shape[1] != self.erm.columns:
            raise InvalidParameterError(
                f"a block's features must be an (m, {self.erm.columns}) array"
            )
        if not isinstance(y, np.ndarray) or y.ndim != 1 or y.shape[0] != z.shape[0]:
            raise InvalidParameterError("a block's labels must be an (m,) array, one per row")
        return int(step), block

    def _data(self, blocks: list[Block], first_kept: int, first: int, last: int) -> Block:
        parts = blocks[first - first_kept: last - first_kept + 1]
        if len(parts) != last - first + 1 or first < first_kept:
            raise InvalidParameterError(  # a bug, never data-dependent
                f"blocks {first}..{last} are no longer kept (kept from {first_kept})"
            )
        if len(parts) == 1:
            return parts[0]
        return Block.concat(parts, self.erm.columns)

    def _coordinates_of(self, c: Computation) -> tuple[str | int, ...]:
        centre = tuple(x for pair in c.centre for x in pair)
        return (
            *self._coordinates, _STATE_KIND, self._binding, str(self.spec.algorithm), c.role,
            -1 if c.level is None else c.level, c.first_step, c.last_step, *centre,
        )

    def add_block(self, step: int, block: Block) -> list[Release]:
        """Take the block of ``step`` (consecutive from 0); return the models it releases.

        Every computation of the step is planned and checked against the per-block ledger
        first, then trained, then committed; an error leaves the schedule unchanged.

        Raises:
            InvalidParameterError: a step out of order or a malformed block (no data value
                is shown).
            BudgetExhaustedError: a block would exceed the per-event budget (the theorems
                say this never happens; it is a self-check).

        """
        step, block = self._check_block(step, block)
        t = step + 1
        algorithm = self.spec.algorithm
        chain_end: Chain | None = None
        chain_keys: list[Chain] = []
        if algorithm == "multi-resolution":
            jobs = self._multi_resolution_jobs(step, t, None)
        elif algorithm == "continual":
            jobs = self._continual_jobs(step, t)
        elif algorithm == "sliding-window":
            jobs, chain_end, chain_keys = self._window_jobs(step, t)
        else:
            jobs = self._independent_jobs(step)

        # check: every block's spend plus this step's charges, against the budget
        charges: dict[int, Fraction] = {}
        for job in jobs:
            c = job.computation
            if c.first_step < self._first_live:  # a bug, never data-dependent
                raise InvalidParameterError(
                    f"{c.role} {c.first_step}..{c.last_step} would use retired blocks"
                )
            for s in range(c.first_step, c.last_step + 1):
                charges[s] = charges.get(s, Fraction(0)) + c.cost
        spent = {s: (self._spend[s - self._first_live] if s < step else Fraction(0)) + charge
                 for s, charge in charges.items()}
        for s, total in sorted(spent.items()):
            if total > self._budget:
                raise BudgetExhaustedError(
                    f"refused step {step}: block {s} would spend {float(total):.6g} of its "
                    f"per-event budget {float(self._budget):.6g} (the schedule's theorem says "
                    "this cannot happen: nothing was released)"
                )

        # train (on staged data; nothing is committed yet)
        blocks = [*self._blocks, block]
        models = dict(self._models)
        releases: list[Release] = []
        for job in jobs:
            c = job.computation
            data = self._data(blocks, self._first_kept, c.first_step, c.last_step)
            coordinates = self._coordinates_of(c)
            if c.rate is not None:
                mask = poisson_sample(self._key.stream(*coordinates, "sample"),
                                      data.size, c.rate)
                data = Block(np.asarray(data.z[mask]), np.asarray(data.y[mask]))
            centre = None if not c.centre else models[c.centre].params
            model = self._train(self._model_spec(centre is not None), data,
                                normalizer=c.normalizer, center=centre,
                                level=job.noise, rng=self._key.stream(*coordinates, "noise"))
            if model.cost != job.expected_cost:
                raise InvalidParameterError(
                    f"the trainer reported cost {model.cost} for {c.role} "
                    f"{c.first_step}..{c.last_step}, but its noise level costs "
                    f"{job.expected_cost}: nothing was released"
                )
            models[c.depends_on] = model
            if job.release_role is not None:
                releases.append(Release(step, job.release_role, job.release_level,
                                        c.first_step, c.last_step, c.depends_on, model, c.cost,
                                        c.rate))
        if chain_end is not None:
            ends = [j.computation for j in jobs if j.computation.depends_on == chain_end]
            if not ends:  # the chain's end is new at every step (module docstring)
                raise InvalidParameterError(f"the window chain's end {chain_end} was not new")
            c_end = ends[0]
            releases.append(Release(step, "window", None, c_end.first_step, c_end.last_step,
                                    chain_end, models[chain_end], c_end.cost, c_end.rate))

        # commit
        self._blocks.append(block)
        self._spend.append(Fraction(0))
        for s, total in spent.items():
            self._spend[s - self._first_live] = total
        self._max_spend = max([self._max_spend, *spent.values()])
        self._t = t
        self._trained = tuple(job.computation for job in jobs)
        self._models = {key: models[key] for key in self._kept_models(t, chain_keys)}
        self._retire(t)
        return releases

    def _kept_models(self, t: int, chain_keys: list[Chain]) -> list[Chain]:
        """The models later steps may use as centres."""
        algorithm = self.spec.algorithm
        if algorithm == "sliding-window":
            return chain_keys
        if algorithm != "continual":
            return []
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

    def _retire(self, t: int) -> None:
        """Drop the blocks outside the current window (their final spend is kept in the max).

        No later computation can use them: a sliding window's buckets lie in its window, and
        the independent baseline uses each block once.
        """
        algorithm = self.spec.algorithm
        if algorithm == "sliding-window":
            keep_from = max(0, t - int(self.spec.window_blocks))  # the current window
        elif algorithm == "independent":
            keep_from = t - 1  # the current block
        else:
            return
        if keep_from > self._first_kept:
            del self._blocks[: keep_from - self._first_kept]
            self._first_kept = keep_from
        if keep_from > self._first_live:
            del self._spend[: keep_from - self._first_live]
            self._first_live = keep_from

    # -- reporting --
    @property
    def blocks_seen(self) -> int:
        """``t``: how many blocks were added (the next step expected)."""
        return self._t

    @property
    def trained(self) -> tuple[Computation, ...]:
        """The computations the last :meth:`add_block` ran (in order)."""
        return self._trained

    @property
    def kept_steps(self) -> range:
        """The steps whose blocks are still kept."""
        return range(self._first_kept, self._t)

    @property
    def models(self) -> Mapping[Chain, PrivateModel]:
        """The released models kept as future centres, by identity (``depends_on``)."""
        return dict(self._models)

    def block_spend(self, step: int) -> Fraction:
        """Return what the data of block ``step`` has been charged so far (ε or ρ), exactly.

        Raises:
            InvalidParameterError: ``step`` was not added yet, or was retired (its final spend
                is part of :meth:`max_block_spend`).

        """
        if not is_integer(step) or step < 0 or step >= self._t:
            raise InvalidParameterError(
                f"step must be a block already added (0..{self._t - 1}), got {step!r}"
            )
        if step < self._first_live:
            raise InvalidParameterError(
                f"block {step} was retired (no later computation can use it); its final "
                "spend is part of max_block_spend()"
            )
        return self._spend[int(step) - self._first_live]

    def max_block_spend(self) -> Fraction:
        """Return the largest spend of any block so far, retired ones included."""
        return self._max_spend

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Return the state as plain data (blocks as arrays; it holds private data)."""
        return {
            "version": _STATE_VERSION,
            "kind": _STATE_KIND,
            "spec": self.spec.to_dict(),
            "erm": self.erm.to_dict(),
            "t": self._t,
            "first_kept": self._first_kept,
            "blocks": [b.to_state() for b in self._blocks],
            "first_live": self._first_live,
            "spend": [fraction_text(s) for s in self._spend],
            "max_spend": fraction_text(self._max_spend),
            "models": [[[list(pair) for pair in key], model.to_state()]
                       for key, model in self._models.items()],
        }

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        spec: ScheduleSpec,
        erm: ErmSpec,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
        *,
        train: TrainFn | None = None,
    ) -> ReleaseSchedule:
        """Rebuild from :meth:`to_state` with the same specs and key.

        Raises:
            InvalidParameterError: the state is malformed or was made with another schedule
                or model spec.

        """
        schedule = cls(spec, erm, noise, coordinates, train=train)
        try:
            check_state(state, _STATE_KIND, _STATE_VERSION, {
                "spec": ("schedule", spec.to_dict()), "erm": ("model", erm.to_dict())})
            t = int(state["t"])
            first_kept = int(state["first_kept"])
            blocks = [Block.from_state(b, erm.columns) for b in state["blocks"]]
            first_live = int(state["first_live"])
            spend = [Fraction(s) for s in state["spend"]]
            max_spend = Fraction(state["max_spend"])
            models: dict[Chain, PrivateModel] = {
                tuple((int(a), int(b)) for a, b in key): PrivateModel.from_state(m)
                for key, m in state["models"]
            }
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed {_STATE_KIND} state: {exc!r}") from None
        if (first_kept + len(blocks) != t or first_live + len(spend) != t
                or not 0 <= first_kept <= t or not 0 <= first_live <= t):
            raise InvalidParameterError(f"malformed {_STATE_KIND} state: inconsistent steps")
        schedule._t, schedule._first_kept, schedule._blocks = t, first_kept, blocks
        schedule._first_live, schedule._spend = first_live, spend
        if spend and max(spend) > max_spend:
            raise InvalidParameterError(f"malformed {_STATE_KIND} state: inconsistent spend")
        schedule._max_spend, schedule._models = max_spend, models
        return schedule

    def __repr__(self) -> str:
        return (f"ReleaseSchedule({self.spec.algorithm}, t={self._t}, max spend "
                f"{float(self.max_block_spend()):.6g}/{float(self._budget):.6g})")

