"""The parameters of an ERM release schedule and what each component costs (ERM paper 004).

The schedules of Watson et al., "Continual and Sliding Window Release for Private Empirical Risk
Minimization" (paper 004), over the output-perturbation trainer of
:mod:`dpstream.core.erm.output_noise` (Algorithm 1 ``PSGD``; Algorithms 3 and 7 ``PBERM`` are the
same with a *centre*, an earlier released model, as the regularisation point).

**Time and data.** The unit of time is one *block*: the events of one flow step (block index = step
number, public). Blocks arrive through
:meth:`~dpstream.core.erm.schedules.schedule.ReleaseSchedule.add_block` with consecutive steps
``0, 1, 2, ...``; ``t`` below is the number of blocks seen (``t = step + 1``). A block may hold any
number of events, including none: an empty block still advances the schedule. The paper's ``b0`` is
the public *nominal* block size (``ScheduleSpec.block_size``), ``B = base_blocks`` blocks and
``w = window_blocks`` blocks (``w0`` = one block). A computation over ``j`` blocks is normalised by
``n̄ = j·b0``, never by the private count, so one event added or removed changes one block and
moves that computation's minimiser by at most ``Δ(n̄) = L/(λ n̄)`` (add/remove neighbours; the
paper's Lemma A.1 uses replace-one, ``2L/(λ n̄)``; :mod:`dpstream.core.erm.spec`). The noise of a
computation is a :class:`~dpstream.core.erm.output_noise.NoiseLevel` fixed by a *reference* (a
normaliser and the cost at it); at another normaliser the same real noise costs exactly
``cost_ref·Δ/Δ_ref`` (pure ε) or ``cost_ref·(Δ/Δ_ref)²`` (zCDP ρ). That is how the paper's
"constant noise, decreasing cost" sums are reproduced exactly: its noise constants ``4L/(λBε)``,
``12L/(λw0ε)``, ... appear here as the cost fractions they stand for.

**Algorithms** (``ScheduleSpec.algorithm``; ε below is ``ScheduleSpec.epsilon``, read as ρ
under ``accounting = "zcdp"``):

* ``multi-resolution``: Algorithm 2 (Theorem 1), Algorithm 6 with ``sampling``
  (:mod:`~dpstream.core.erm.schedules.multi_resolution`);
* ``continual``: Algorithm 4 (Theorem 4) with Algorithm 2 alongside, Algorithm 8 with
  ``sampling`` (:mod:`~dpstream.core.erm.schedules.continual`);
* ``sliding-window``: Algorithm 5 (Theorem 7) (:mod:`~dpstream.core.erm.schedules.sliding`);
* ``independent``: the baseline of the paper's Fig. 4d
  (:mod:`~dpstream.core.erm.schedules.independent`).

**zCDP** (``accounting = "zcdp"``, discrete Gaussian noise; ρ ∝ Δ²). A reference's cost
shrinks by ``4`` per doubling instead of ``2``, so the references are chosen for
``Σ_k 4^-k = 4/3``: multi-resolution ``(B b0, 3ρ/4)`` (a block pays ``< ρ``); continual
updates ``(b0, 3ρ/4)`` (``< ρ``; with Algorithm 2, ``< 2ρ``); sliding base ``(2^(k−1) b0, ρ/3)``
and updates ``(b0, ρ/4)`` (``ρ/3 + 2·(ρ/4)(4/3) = ρ``, strictly less for a finite window);
independent ``(b0, ρ)``. Sampling is refused under zCDP: amplification is implemented for
pure ε only (:func:`~dpstream.core.erm.sampling.amplified_epsilon`); a Poisson-subsampled zCDP
mechanism has no rate-proportional ρ (it needs Rényi or truncated-CDP accounting).

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

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Final, Literal

from dpstream.core._checks import integer_at_least, positive_finite
from dpstream.core.accounting.ledger import exact
from dpstream.core.erm.sampling import amplified_epsilon, sampling_rate
from dpstream.errors import InvalidParameterError

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "ScheduleSpec",
    "sampling_rate_at_most",
]

Algorithm = Literal["multi-resolution", "continual", "sliding-window", "independent"]
Accounting = Literal["pure", "zcdp"]
ALGORITHMS: Final = ("multi-resolution", "continual", "sliding-window", "independent")
_ACCOUNTINGS: Final = ("pure", "zcdp")
_RATE_TRIES: Final = 256


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def sampling_rate_at_most(unamplified: Fraction, target: Fraction) -> Fraction:
    """Return a Poisson rate whose charged (amplified) cost is at most ``target`` (pure ε only).

    Starts from the paper's rate ``(e^target − 1)/(e^unamplified − 1)`` (Algorithm 6 line 5,
    Algorithm 8 line 11) as :func:`dpstream.core.erm.sampling.sampling_rate` computes it
    (rounded down to a denominator of ``10^18``), then lowers it, by steps that double, until
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
        max_history: ``H``, the most recent blocks a computation may train on (``None``:
            all of them). At ``t`` blocks seen a computation over ``[first, last]`` trains
            on the blocks of ``[max(first, t − H), last]`` only, keeping its nominal
            normaliser and its noise (hence its cost); the older blocks are dropped from the
            schedule's block store, which then holds at most ``H`` blocks (see
            :mod:`~dpstream.core.erm.schedules.schedule`, *Bounded history*). Plans with a
            window of their own (sliding window) keep it; the bound applies on top.

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
    max_history: int | None = None

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
        if self.max_history is not None:
            integer_at_least("max_history", self.max_history, 1)
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
        """Return the parameters as JSON-safe data (for binding a state to its spec).

        ``max_history`` is bound only when set, so the snapshots and noise of schedules
        without it keep their bytes.
        """
        bounded = {} if self.max_history is None else {"max_history": int(self.max_history)}
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
            **bounded,
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
        if self.max_history is not None:
            text += (f"\nhistory bounded to the last {int(self.max_history)} blocks: every "
                     "computation trains on the blocks of its range among them (nominal "
                     "normaliser and cost kept)")
        return (f"{text}\nblock = one step of nominal b0 = {b0} events; every event costs at "
                f"most {float(self.budget()):.6g} {unit}")
