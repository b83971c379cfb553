"""Runs an ERM release schedule over a stream of blocks: the ledger, training, noise, state.

**Stated as OpenDP states a measurement**

* input domain: a stream of blocks (one per step) of labelled, clipped rows; input metric:
  add or remove one row of one block (``d_in = 1``).
* function: the plan's computations, each
  :func:`~dpstream.core.erm.output_noise.private_erm` on a range of blocks (maybe Poisson
  sampled), and the models the plan releases.
* output measure: pure ε-DP or ρ-zCDP, per event; privacy map: ``1 ↦`` the largest, over
  blocks, sum of the charges of the computations whose range holds the block (basic
  composition resp. zCDP addition; disjoint ranges compose in parallel), at most
  ``ScheduleSpec.budget()``: ``2ε`` for continual (Theorem 4 and the remark after it), ``ε``
  otherwise (Theorems 1 and 7; B.1, B.3). A computation's charge is its
  ``NoiseLevel.cost_at``, or ``ln(1 + q(e^cost − 1))`` when sampled at rate ``q`` (Balle,
  Barthe, Gaboardi 2018); :meth:`ReleaseSchedule.block_spend` is the block's sum.

The schedules of Watson et al., "Continual and Sliding Window Release for Private Empirical Risk
Minimization" (paper 004) (Algorithms 2 and 4-8): a :class:`ReleaseSchedule` takes the blocks one
step at a time, asks its plan (:mod:`~dpstream.core.erm.schedules.multi_resolution`,
:mod:`~dpstream.core.erm.schedules.continual`, :mod:`~dpstream.core.erm.schedules.sliding`,
:mod:`~dpstream.core.erm.schedules.independent`) which computations the step runs, checks them
against the per-block ledger, trains them with the output perturbation of
:mod:`dpstream.core.erm.output_noise` and commits the step.

**Time and data** (blocks, the nominal block size ``b0``, why a computation over ``j`` blocks is
normalised by ``j·b0`` and what its noise costs at another normaliser) are stated once, in
:mod:`dpstream.core.erm.schedules.spec`.

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

**Exact, replay-safe noise.** Each computation draws its noise from
``noise.stream(*coordinates, "erm-release", binding, algorithm, role, level, first_step,
last_step, *centre, "noise")`` where ``binding`` is a digest of the schedule's and the
model's parameters (privacy pitfall 13), ``level`` is ``-1`` for none and ``centre`` is the
centre's ``depends_on`` flattened: unique per computation, identical on a replay. Sampling
bits come from the same coordinates ending in ``"sample"`` instead of ``"noise"``.

**Bounded history** (``ScheduleSpec.max_history = H``). At ``t`` blocks seen a computation
planned over ``[first, last]`` trains on the blocks of ``[max(first, t − H), last]`` only —
the last ``H`` blocks, the new one included — with the *nominal* normaliser
``n̄ = (last − first + 1)·b0`` and the noise level the plan gave it; the blocks before
``t + 1 − H`` are then dropped from the store (no later step reads them). *Privacy is
unchanged.* The sensitivity bound ``Δ = L/(λ n̄)`` of :mod:`dpstream.core.erm.spec` holds for
any data set whatever its number of rows, because ``n̄`` is public and the strong convexity
comes from the regulariser alone: adding one row to a block read turns ``J`` into
``J + l(·; e)/n̄`` exactly as before, and a row of a block not read changes nothing the
computation outputs. So the computation's noise covers it at its nominal cost
(``NoiseLevel.cost_at``, the cost the schedule's theorem sums), and Poisson sampling amplifies
row by row as before. The ledger charges that cost to every block the computation *reads*
(a block it does not read loses nothing to it): the live blocks' spend is what it is without
the bound, each retired block keeps its final spend in ``max_block_spend``, and every block
pays at most the theorem's budget. What changes is accuracy (a base over ``2^k B`` blocks
sees at most ``H`` of them) and state: the store holds at most ``H`` blocks between steps,
the ledger ``H`` spends.

**State** (:meth:`ReleaseSchedule.to_state`): the blocks still needed (all of them for the
cumulative algorithms, the window for the sliding window, none for the baseline; at most the
last ``H`` with a bounded history) as the block store's state — their arrays with the default
:class:`~dpstream.core.erm.history.MemoryBlockStore` (the bytes of snapshots made before
stores existed), a cursor with a :class:`~dpstream.core.erm.history.FileBlockStore` —, the
live blocks' spend, the largest spend of any block, and the released models still used as
centres. Training reads a computation's range from the store (one array of at most ``H + 1``
blocks with a bounded history), never the whole history at once.
It holds private data: the recovery store that keeps it (and a file store's directory) is
secret. It is bound to the schedule's spec and the model's spec
(:meth:`ReleaseSchedule.from_state` checks both).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Final

import numpy as np

from dpstream.core._checks import check_state, fraction_text, is_integer
from dpstream.core.erm.history import BlockStore, MemoryBlockStore
from dpstream.core.erm.model import PrivateModel
from dpstream.core.erm.sampling import poisson_sample
from dpstream.core.erm.schedules.base import SchedulePlan
from dpstream.core.erm.schedules.continual import ContinualPlan
from dpstream.core.erm.schedules.independent import IndependentPlan
from dpstream.core.erm.schedules.multi_resolution import MultiResolutionPlan
from dpstream.core.erm.schedules.releases import (
    Chain,
    Computation,
    Release,
    TrainFn,
    _default_train,
)
from dpstream.core.erm.schedules.sliding import SlidingWindowPlan
from dpstream.core.erm.schedules.spec import ScheduleSpec
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.coordinates import check_coordinates
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import BudgetExhaustedError, InvalidParameterError

__all__ = [
    "ReleaseSchedule",
]

_STATE_VERSION: Final = 1
_STATE_KIND: Final = "erm-release"
_PLANS: Final[dict[str, type[SchedulePlan]]] = {
    "multi-resolution": MultiResolutionPlan,
    "continual": ContinualPlan,
    "sliding-window": SlidingWindowPlan,
    "independent": IndependentPlan,
}
"""The plan of each algorithm (``ScheduleSpec.algorithm``)."""


class ReleaseSchedule:
    """Runs one release schedule over a stream of blocks (see the module docstring).

    Args:
        spec: the schedule.
        erm: the model (classes, features, λ, accounting); ``erm.accounting`` must equal
            ``spec.accounting``.
        noise: the secret key all noise and sampling bits are derived from.
        coordinates: the schedule's coordinates, e.g. ``(instance, flow, "erm", stream)``.
        train: the trainer (default :func:`dpstream.core.erm.output_noise.private_erm`);
            injectable for tests.
        store: where the blocks are kept (default: a new
            :class:`~dpstream.core.erm.history.MemoryBlockStore`). A given store starts a new,
            empty history (``restore(None, first=0)``: a file store's old segments are
            deleted); :meth:`from_state` restores a store to its snapshot instead.

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
        store: BlockStore | None = None,
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
        self._plan = _PLANS[spec.algorithm](spec, erm, self.update_erm)
        self._history = None if spec.max_history is None else int(spec.max_history)
        # mutable state
        self._t = 0  # blocks seen
        if store is None:
            store = MemoryBlockStore(erm.columns)
        elif store.columns != erm.columns:
            raise InvalidParameterError(
                f"the block store has {store.columns} feature columns, the model {erm.columns}")
        else:
            store.restore(None, first=0)
        self._store: BlockStore = store  # the blocks still needed, store.first .. t - 1
        self._first_live = 0  # the step of self._spend[0]
        self._spend: list[Fraction] = []
        self._max_spend = Fraction(0)  # over every block, retired ones included
        self._models: dict[Chain, PrivateModel] = {}
        self._trained: tuple[Computation, ...] = ()

    def window_chain(self, t: int) -> list[tuple[int, int]]:
        """Return the sliding window's buckets at ``t`` blocks seen: the base, then by size.

        Raises:
            InvalidParameterError: not a sliding-window schedule, or ``t < w``.

        """
        if not isinstance(self._plan, SlidingWindowPlan):
            raise InvalidParameterError("window_chain is for the sliding-window schedule")
        return self._plan.window_chain(t)

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

    def _window_start(self, t: int) -> int:
        """The first block a computation may train on at ``t`` blocks seen (``t − H``)."""
        return 0 if self._history is None else max(0, t - self._history)

    def _data(self, step: int, block: Block, first: int, last: int) -> Block:
        """The rows of blocks ``first .. last``: the stored ones, then the staged ``block``."""
        if first < self._store.first:
            raise InvalidParameterError(  # a bug, never data-dependent
                f"blocks {first}..{last} are no longer kept (kept from {self._store.first})"
            )
        if last == step:
            return self._store.read(first, step - 1, block)
        return self._store.read(first, last)

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
        jobs, chain_end, chain_keys = self._plan.jobs(step, t, self._models)

        # check: every block's spend plus this step's charges, against the budget
        lo = self._window_start(t)  # bounded history: the blocks a computation may read
        charges: dict[int, Fraction] = {}
        for job in jobs:
            c = job.computation
            if max(c.first_step, lo) < self._first_live:  # a bug, never data-dependent
                raise InvalidParameterError(
                    f"{c.role} {c.first_step}..{c.last_step} would use retired blocks"
                )
            for s in range(max(c.first_step, lo), c.last_step + 1):
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
        models = dict(self._models)
        releases: list[Release] = []
        for job in jobs:
            c = job.computation
            data = self._data(step, block, max(c.first_step, lo), c.last_step)
            coordinates = self._coordinates_of(c)
            if c.rate is not None:
                mask = poisson_sample(self._key.stream(*coordinates, "sample"),
                                      data.size, c.rate)
                data = Block(np.asarray(data.z[mask]), np.asarray(data.y[mask]))
            centre = None if not c.centre else models[c.centre].params
            model = self._train(self._plan.model_spec(centre is not None), data,
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
        self._store.append(step, block)
        self._spend.append(Fraction(0))
        for s, total in spent.items():
            self._spend[s - self._first_live] = total
        self._max_spend = max([self._max_spend, *spent.values()])
        self._t = t
        self._trained = tuple(job.computation for job in jobs)
        self._models = {key: models[key] for key in self._plan.kept_models(t, chain_keys)}
        self._retire(t)
        return releases

    def _retire(self, t: int) -> None:
        """Drop the blocks outside the current window (their final spend is kept in the max).

        No later computation can use them: a sliding window's buckets lie in its window, the
        independent baseline uses each block once, and with a bounded history the next step
        reads no block before ``t + 1 − H``.
        """
        keep_from = self._plan.keep_from(t)
        if self._history is not None:
            keep_from = max(keep_from or 0, self._window_start(t + 1))
        if keep_from is None:
            return
        self._store.drop_before(keep_from)
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
        return range(self._store.first, self._t)

    @property
    def store(self) -> BlockStore:
        """Where the kept blocks are."""
        return self._store

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
        """Return the state as plain data (it holds private data).

        The kept blocks are the store's :meth:`~dpstream.core.erm.history.BlockStore.state`:
        with a :class:`~dpstream.core.erm.history.MemoryBlockStore` the blocks' arrays under
        ``"blocks"`` (the bytes of snapshots made before block stores), with a file store its
        cursor under ``"history"`` (taken after the store made its blocks durable).
        """
        store = self._store
        kept = ({"blocks": store.state()} if isinstance(store, MemoryBlockStore)
                else {"history": store.state()})
        return {
            "version": _STATE_VERSION,
            "kind": _STATE_KIND,
            "spec": self.spec.to_dict(),
            "erm": self.erm.to_dict(),
            "t": self._t,
            "first_kept": store.first,
            **kept,
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
        store: BlockStore | None = None,
    ) -> ReleaseSchedule:
        """Rebuild from :meth:`to_state` with the same specs and key.

        ``store`` (default: a new :class:`~dpstream.core.erm.history.MemoryBlockStore`) is
        restored to the state's blocks: a file store to its cursor (bytes appended after the
        snapshot are cut off), or filled with the arrays of a snapshot that holds them.

        Raises:
            InvalidParameterError: the state is malformed or was made with another schedule
                or model spec.
            HistoryError: a file store cannot be restored to the snapshot (a segment is
                missing, short or corrupt: :mod:`dpstream.core.erm.history`).

        """
        schedule = cls(spec, erm, noise, coordinates, train=train)
        if store is None:
            store = schedule._store
        elif store.columns != erm.columns:
            raise InvalidParameterError(
                f"the block store has {store.columns} feature columns, the model {erm.columns}")
        try:
            check_state(state, _STATE_KIND, _STATE_VERSION, {
                "spec": ("schedule", spec.to_dict()), "erm": ("model", erm.to_dict())})
            t = int(state["t"])
            first_kept = int(state["first_kept"])
            kept = state["history"] if "history" in state else state["blocks"]
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
        if (first_live + len(spend) != t or not 0 <= first_kept <= t
                or not 0 <= first_live <= t):
            raise InvalidParameterError(f"malformed {_STATE_KIND} state: inconsistent steps")
        store.restore(kept, first=first_kept)
        if store.first != first_kept or store.end != t:
            raise InvalidParameterError(f"malformed {_STATE_KIND} state: inconsistent steps")
        schedule._t, schedule._store = t, store
        schedule._first_live, schedule._spend = first_live, spend
        if spend and max(spend) > max_spend:
            raise InvalidParameterError(f"malformed {_STATE_KIND} state: inconsistent spend")
        schedule._max_spend, schedule._models = max_spend, models
        return schedule

    def __repr__(self) -> str:
        return (f"ReleaseSchedule({self.spec.algorithm}, t={self._t}, max spend "
                f"{float(self.max_block_spend()):.6g}/{float(self._budget):.6g})")
