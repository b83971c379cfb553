"""What the counters publish for a key: releases, alerts, budget statuses, and a step of them.

One idea: the published records of the keyed statistics (the threshold monitor of Dwork &
Roth 2014, Algorithm 1, the continual counters of :mod:`dpstream.core.counting.tree_counter`
and :mod:`dpstream.core.counting.blt_counter`, and the ledger's refusals), as produced by
:class:`~dpstream.core.counting.key_table.KeyTable`. Nothing here draws noise or holds state:

* :class:`Release`, :class:`Alert` and :class:`BudgetExhausted` are one key's outputs
  (:data:`Output` is any of them);
* :class:`ReleaseColumns` and :class:`AlertColumns` hold the releases or alerts of one step that
  share every field but the key (and the value), as columns: a step of a million keys is not
  a million objects; :class:`StepOutputs` is everything one closed step publishes, in a
  deterministic order (statuses, alerts, releases).

Every field but a release's ``value`` is a function of public things (the configuration, the
step and the admission step), so grouping the outputs this way reveals nothing more.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dpstream.core.sequences import IndexedSequence

__all__ = ["Alert", "AlertColumns", "BudgetExhausted", "Output", "Release", "ReleaseColumns",
           "StepOutputs"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Release:
    """A private estimate of a key's count of events up to the end of ``step``."""

    key: str
    step: int
    value: float
    std: float
    mechanism: str
    spent: float
    budget: float
    unit: str
    delta: float


@dataclass(frozen=True)
class Alert:
    """The key's threshold monitor fired at ``step`` (published once, then it halts)."""

    key: str
    step: int
    threshold: int
    epsilon: float


@dataclass(frozen=True)
class BudgetExhausted:
    """A charge for an admitted key was refused; the key publishes nothing more."""

    key: str
    step: int
    label: str
    reason: str
    spent: float
    budget: float
    unit: str


Output = Release | Alert | BudgetExhausted


@dataclass(eq=False)
class ReleaseColumns:
    """Releases of one step that share every field but ``key`` and ``value``.

    ``periodic`` is True for a counter's release and False for an initial count released
    at admission. Item ``i`` is the :class:`Release` of ``keys[i]`` with value
    ``values[i]``. The arrays and lists are never mutated afterwards (a group's key list
    is shared by its releases of every step).
    """

    step: int
    keys: Sequence[str]
    values: FloatArray
    std: float
    mechanism: str
    spent: float
    budget: float
    unit: str
    delta: float
    periodic: bool = True

    def __len__(self) -> int:
        return len(self.keys)

    def release(self, i: int) -> Release:
        """The ``i``-th release as a :class:`Release` object."""
        return Release(self.keys[i], self.step, float(self.values[i]), self.std,
                       self.mechanism, self.spent, self.budget, self.unit, self.delta)

    def __iter__(self) -> Iterator[Release]:
        step, std, mechanism = self.step, self.std, self.mechanism
        spent, budget, unit, delta = self.spent, self.budget, self.unit, self.delta
        for key, value in zip(self.keys, self.values.tolist(), strict=True):
            yield Release(key, step, value, std, mechanism, spent, budget, unit, delta)


@dataclass(eq=False)
class AlertColumns(IndexedSequence[Alert]):
    """The alerts of one step's fired monitors, which share every field but ``key``.

    Item ``i`` is the :class:`Alert` of ``keys[i]``, made only when read (a step of an open
    universe can fire a monitor for most of its keys at once).
    """

    step: int
    keys: Sequence[str]
    threshold: int
    epsilon: float

    def __len__(self) -> int:
        return len(self.keys)

    def _item(self, index: int) -> Alert:
        return Alert(self.keys[index], self.step, self.threshold, self.epsilon)

    def __iter__(self) -> Iterator[Alert]:
        step, threshold, epsilon = self.step, self.threshold, self.epsilon
        for key in self.keys:
            yield Alert(key, step, threshold, epsilon)


@dataclass(eq=False)
class StepOutputs(IndexedSequence[Output]):
    """Everything one closed step publishes, in a deterministic order.

    As a sequence it holds the statuses, then the alerts, then every release of every
    :class:`ReleaseColumns` (materialized as :class:`Release` objects only when read).
    """

    step: int
    statuses: list[BudgetExhausted] = field(default_factory=list)
    alerts: Sequence[Alert] = field(default_factory=list)  # a list, or AlertColumns
    releases: list[ReleaseColumns] = field(default_factory=list)

    def count(self) -> tuple[int, int, int]:  # type: ignore[override]
        """Return ``(releases, alerts, statuses)`` without materializing anything."""
        return sum(len(r) for r in self.releases), len(self.alerts), len(self.statuses)

    def __len__(self) -> int:
        releases, alerts, statuses = self.count()
        return releases + alerts + statuses

    def __iter__(self) -> Iterator[Output]:
        yield from self.statuses
        yield from self.alerts
        for columns in self.releases:
            yield from columns

    def _item(self, index: int) -> Output:
        if index < len(self.statuses):
            return self.statuses[index]
        index -= len(self.statuses)
        if index < len(self.alerts):
            return self.alerts[index]
        index -= len(self.alerts)
        ends = list(itertools.accumulate(len(r) for r in self.releases))
        which = bisect.bisect_right(ends, index)
        return self.releases[which].release(index - (ends[which - 1] if which else 0))
