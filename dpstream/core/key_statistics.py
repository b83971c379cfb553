"""Everything dpstream keeps for one key: monitor, counter and their ledger.

:class:`KeyStatistics` is driven one time step at a time with the key's
increment for that step and returns what may be published for it:

* in the *declared* key universe the counter runs from step 0 (and the
  optional threshold monitor alongside it);
* in the *open* universe the key is first watched by a threshold monitor
  (AboveThreshold on the prefix count, paper 002 Observation 1.8); when it
  fires, an :class:`Alert` is published, the count up to that step is released
  once with fresh noise (the *initial count*), and from the next step on the
  continual counter adds the increments that follow. The counter's tree (or
  BLT) is aligned to the admission step, which is itself a published, private
  output, so its structure reveals nothing more. Before admission nothing is
  published for the key, so rare keys do not reveal themselves by appearing.

Every mechanism is paid for on the key's :class:`PrivacyLedger` before it
produces anything; a refused charge becomes a :class:`BudgetExhausted` status
and the key stops releasing. The composition is charged basically (sum of
the costs), an upper bound of the true cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from dpstream.core.blt_counter import BltCounter, BltCounterSpec
from dpstream.core.ledger import PrivacyCharge, PrivacyLedger, exact
from dpstream.core.noise import (
    NoiseKey,
    discrete_gaussian,
    discrete_gaussian_variance,
    discrete_laplace,
    discrete_laplace_variance,
)
from dpstream.core.threshold_monitor import ThresholdMonitor, ThresholdMonitorSpec
from dpstream.core.tree_counter import TreeCounter, TreeCounterSpec
from dpstream.errors import BudgetExhaustedError

__all__ = ["Alert", "BudgetExhausted", "KeyStatistics", "Release", "StatisticsSpec"]

CounterSpec = TreeCounterSpec | BltCounterSpec


@dataclass(frozen=True)
class StatisticsSpec:
    """What to compute for every key (shared by all keys of a flow)."""

    flow: str
    mode: Literal["declared", "open"]
    accounting: Literal["pure", "zcdp"]
    budget: float
    delta_budget: float
    counter: CounterSpec
    monitor: ThresholdMonitorSpec | None
    initial: PrivacyCharge | None = None
    admission_delta: float = 0.0


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
    """A charge for the key was refused; the key publishes nothing more."""

    key: str
    step: int
    label: str
    reason: str
    spent: float
    budget: float
    unit: str


Output = Release | Alert | BudgetExhausted


def _new_counter(spec: CounterSpec, noise: NoiseKey, coords: tuple[Any, ...],
                 state: dict[str, Any] | None = None) -> TreeCounter | BltCounter:
    if isinstance(spec, TreeCounterSpec):
        return TreeCounter(spec, noise, coords, state)
    return BltCounter(spec, noise, coords, state)


class KeyStatistics:
    """The monitor, initial count, counter and ledger of one key.

    Args:
        spec: the flow-wide specification.
        key: the key these statistics are for.
        start_step: the global step of the first :meth:`step` call.
        noise: the secret noise key (never stored in the state).
        state: a :meth:`to_state` snapshot to resume from.
    """

    def __init__(self, spec: StatisticsSpec, key: str, start_step: int, noise: NoiseKey,
                 state: dict[str, Any] | None = None) -> None:
        self.spec, self.key, self._noise = spec, key, noise
        self._coords = (spec.flow, key)
        if state is not None:
            self._restore(state)
            return
        self.next_step = start_step
        self.prefix = 0
        self.exhausted = False
        self.ledger = PrivacyLedger(spec.accounting, spec.budget, spec.delta_budget)
        self.monitor: ThresholdMonitor | None = None
        self.counter: TreeCounter | BltCounter | None = None
        self.counter_start: int | None = None
        self.initial_value = 0.0
        self.initial_var = 0.0
        self._pending: list[Output] = []
        self.generation = 0  # bumped by each restart after a configuration change
        self._monitor_coords: tuple[Any, ...] = self._coords + ("monitor",)
        self._counter_coords: tuple[Any, ...] = ()
        if spec.monitor is not None:
            if self._pay(spec.monitor.charge, start_step):
                self.monitor = ThresholdMonitor(spec.monitor, noise, self._monitor_coords)
        if spec.mode == "declared" and not self.exhausted:
            self._start_counter(start_step, initial=None)

    # -- the one entry point --
    def step(self, increment: int) -> list[Output]:
        """Process the key's increment for the next global step; return what to publish."""
        step = self.next_step
        self.next_step += 1
        self.prefix += increment
        out, self._pending = self._pending, []
        if self.exhausted:
            return out
        if self.monitor is not None and not self.monitor.fired and not self.monitor.expired:
            if self.monitor.step(increment):
                assert self.spec.monitor is not None
                out.append(Alert(self.key, step, self.spec.monitor.threshold,
                                 self.spec.monitor.epsilon))
                if self.spec.mode == "open":
                    self._start_counter(step, initial=self.spec.initial)
                    if not self.exhausted:
                        out.append(self._release(step, self.initial_value, self.initial_var))
                    else:
                        out.extend(self._pending)
                        self._pending = []
                    return out
        if self.counter is not None and self.counter_start is not None:
            if step > self.counter_start or self.spec.mode == "declared":
                estimate = self.counter.step(increment)
                out.append(self._release(step, self.initial_value + estimate.value,
                                         self.initial_var + estimate.std**2))
        return out

    @property
    def dormant(self) -> bool:
        """Whether the key will never publish anything again (expired monitor or exhausted)."""
        if self._pending:
            return False
        if self.exhausted:
            return True
        return self.counter is None and (self.monitor is None or self.monitor.expired)

    # -- internals --
    def _generation_coords(self) -> tuple[Any, ...]:
        """Coordinates of the mechanisms started now (generation 0 keeps the original ones)."""
        return self._coords if self.generation == 0 else self._coords + ("generation",
                                                                           self.generation)

    def _pay(self, charge: PrivacyCharge, step: int) -> bool:
        try:
            self.ledger.charge(charge)
        except BudgetExhaustedError as exc:
            self.exhausted = True
            self._pending.append(BudgetExhausted(
                self.key, step, charge.label, str(exc), self.ledger.spent, self.ledger.budget,
                self.ledger.unit))
            return False
        return True

    def _start_counter(self, step: int, initial: PrivacyCharge | None) -> None:
        if initial is not None:
            if not self._pay(initial, step):
                return
            self.initial_value, self.initial_var = self._initial_count(initial, step)
        if not self._pay(self.spec.counter.charge, step):
            return
        self.counter_start = step
        self._counter_coords = self._generation_coords() + ("counter", step)
        self.counter = _new_counter(self.spec.counter, self._noise, self._counter_coords)

    def _initial_count(self, charge: PrivacyCharge, step: int) -> tuple[float, float]:
        """Release the prefix count once: sensitivity 1 (one event changes it by one)."""
        rng = self._noise.stream(*self._generation_coords(), "initial", step)
        if charge.epsilon:
            scale = 1 / exact(charge.epsilon)
            return float(self.prefix + discrete_laplace(rng, scale)), discrete_laplace_variance(
                scale)
        sigma2 = Fraction(1) / (2 * exact(charge.rho))  # rho = 1/(2 sigma^2), CKS 2020
        return float(self.prefix + discrete_gaussian(rng, sigma2)), discrete_gaussian_variance(
            sigma2)

    def _release(self, step: int, value: float, var: float) -> Release:
        self.ledger.record_release()
        return Release(self.key, step, value, math.sqrt(var), self.spec.counter.mechanism,
                       self.ledger.spent, self.ledger.budget, self.ledger.unit,
                       self.ledger.spent_delta + self.spec.admission_delta)

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Plain-data snapshot (holds true counts: the recovery store is secret)."""
        return {
            "next_step": self.next_step, "prefix": self.prefix, "exhausted": self.exhausted,
            "ledger": self.ledger.to_state(),
            "monitor": None if self.monitor is None else self.monitor.to_state(),
            "generation": self.generation,
            "monitor_coords": list(self._monitor_coords),
            "counter_coords": list(self._counter_coords),
            "monitor_spec": repr(self.spec.monitor),
            "counter": None if self.counter is None else self.counter.to_state(),
            "counter_start": self.counter_start,
            "counter_spec": repr(self.spec.counter),
            "initial": (self.initial_value, self.initial_var),
            "pending": list(self._pending),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        """Resume from a snapshot under the configuration in force now.

        The budget is the configured one: if it is now below what the key has
        already spent, the key stops with a :class:`BudgetExhausted` status. A
        changed mechanism is not resumed from state made for another one: a
        changed counter is retired and a new one started at the resume step
        (paying again for a fresh initial count and the counter), and a changed
        monitor that had not fired yet is started afresh with fresh threshold
        noise (paying again). A refused charge is announced the same way.
        """
        self.next_step = state["next_step"]
        self.prefix = state["prefix"]
        self.exhausted = state["exhausted"]
        self.ledger = PrivacyLedger.from_state(state["ledger"])
        self.counter_start = state["counter_start"]
        self.initial_value, self.initial_var = state["initial"]
        self._pending = list(state["pending"])
        self.generation = state.get("generation", 0)
        self._monitor_coords = tuple(state["monitor_coords"])
        self._counter_coords = tuple(state.get("counter_coords") or
                                     self._coords + ("counter", self.counter_start))
        self.monitor, self.counter = None, None
        monitor_same = state["monitor_spec"] == repr(self.spec.monitor)
        counter_same = state["counter_spec"] == repr(self.spec.counter)
        if state["monitor"] is not None and monitor_same:
            assert self.spec.monitor is not None
            self.monitor = ThresholdMonitor(self.spec.monitor, self._noise, self._monitor_coords,
                                            state["monitor"])
        if state["counter"] is not None and counter_same:
            self.counter = _new_counter(self.spec.counter, self._noise, self._counter_coords,
                                        state["counter"])
        if self.exhausted:
            return
        self.ledger.rebudget(PrivacyLedger(self.spec.accounting, self.spec.budget,
                                           self.spec.delta_budget))
        if self.ledger.remaining < 0 or self.ledger.spent_delta > self.spec.delta_budget:
            self.exhausted = True
            self._pending.append(BudgetExhausted(
                self.key, self.next_step, "budget change",
                f"the configured budget {self.ledger.budget:g} {self.ledger.unit} is below what "
                f"this key has already spent ({self.ledger.spent:g})",
                self.ledger.spent, self.ledger.budget, self.ledger.unit))
            return
        restart_step = self.next_step - 1
        monitor_was_waiting = state["monitor"] is not None and state["counter_start"] is None
        restart_monitor = (not monitor_same and self.spec.monitor is not None
                           and monitor_was_waiting)
        restart_counter = state["counter"] is not None and not counter_same
        if restart_monitor or restart_counter:
            # Restarted mechanisms get coordinates of a new generation: noise drawn again at
            # the same coordinates with another scale would be correlated with the first one.
            self.generation += 1
        if restart_monitor:
            assert self.spec.monitor is not None
            if self._pay(self.spec.monitor.charge, restart_step):
                self._monitor_coords = self._generation_coords() + ("monitor", restart_step)
                self.monitor = ThresholdMonitor(self.spec.monitor, self._noise,
                                                self._monitor_coords)
        if restart_counter and not self.exhausted:
            restart = self.spec.initial or PrivacyCharge(
                epsilon=self.spec.counter.charge.epsilon, rho=self.spec.counter.charge.rho,
                label="initial count (restart)")
            self._start_counter(restart_step, initial=restart)
