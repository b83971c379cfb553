"""The reference engine's key: monitor, counter and their ledger, one object per key.

The readable oracle the columnar :class:`~dpstream.core.counting.key_table.KeyTable` is tested
against (bit for bit, same noise key): production runs the table only. The specification
and the published records are the package's (:mod:`dpstream.core.counting.statistics_spec`,
:mod:`dpstream.core.counting.outputs`).

:class:`KeyStatistics` is driven one global time step at a time with the key's
increment for that step and returns what may be published for it:

* in the *declared* key universe the counter runs from step 0 (and the
  optional threshold monitor alongside it, over steps ``[0, horizon)``);
* in the *open* universe keys come from the data. Time is cut into fixed,
  global **monitor windows** of ``W = monitor.horizon`` steps (window ``k`` is
  ``[kW, (k+1)W)``). In each window a key that has not been admitted yet is
  watched by a threshold monitor (AboveThreshold on the count of *that
  window's* events, paper 002 Observation 1.8) that starts at the key's first
  event in the window and is tested until the window's end, a public time.
  When it fires, an :class:`Alert` is published (the admission), the key's
  count since its monitor started is released once with fresh noise (the
  *initial count*) and from the next step on the continual counter adds the
  increments that follow, for ever. A key whose monitor reaches the window's
  end without firing is forgotten entirely (no state, no retirement): its next
  event, in a later window, starts that window's monitor.

The privacy of the open universe (per key, event-level) and why every field but ``value``
is public are argued once, in :mod:`dpstream.core.counting.statistics_spec`.

**Noise coordinates** bind every draw to the flow instance, the key, the
mechanism and a digest of the mechanism's parameters (pitfall 13): the lanes
(:mod:`dpstream.core.noise.bulk`) of ``(instance, key, "monitor", digest, window)``,
``(instance, key, "initial", digest, step)`` and ``(instance, key, "counter", digest,
start_step)``.

Every mechanism is paid for on the key's :class:`PrivacyLedger` before it
produces anything; a refused charge of an admitted key becomes a
:class:`BudgetExhausted` status and the key stops releasing.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, exact
from dpstream.core.counting.blt_counter import BltCounter
from dpstream.core.counting.outputs import Alert, BudgetExhausted, Output, Release
from dpstream.core.counting.statistics_spec import CounterSpec, StatisticsSpec
from dpstream.core.counting.threshold_monitor import ThresholdMonitor
from dpstream.core.counting.tree_counter import TreeCounter, TreeCounterSpec
from dpstream.core.noise.bulk import laplace_one
from dpstream.core.noise.bulk_gaussian import gaussian_one
from dpstream.core.noise.coordinates import TAG_INITIAL
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_gaussian_variance, discrete_laplace_variance
from dpstream.errors import BudgetExhaustedError, InvalidParameterError

__all__ = ["KeyStatistics"]


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
        start_step: the global step of the first :meth:`step` call; in the open universe
            the key's first event in its monitor window.
        noise: the secret noise key (never stored in the state).
        state: a :meth:`to_state` snapshot to resume from.

    Raises:
        InvalidParameterError: ``state`` was made with other mechanism parameters.
    """

    def __init__(self, spec: StatisticsSpec, key: str, start_step: int, noise: NoiseKey,
                 state: dict[str, Any] | None = None) -> None:
        self.spec, self.key, self._noise = spec, key, noise
        self._coords: tuple[str, ...] = (spec.instance, key)
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
        self.window_end: int | None = None  # open universe: the first step after the window
        if spec.monitor is not None:
            window, first = 0, start_step
            if spec.mode == "open":
                window, first = divmod(start_step, spec.window)
                self.window_end = (window + 1) * spec.window
            if self._pay(spec.monitor.charge, start_step):
                self.monitor = ThresholdMonitor(
                    spec.monitor, noise, self._coords + ("monitor", spec.monitor_digest, window),
                    first_step=first)
        if spec.mode == "declared" and not self.exhausted:
            self._start_counter(start_step, initial=None)

    @property
    def admitted(self) -> bool:
        """Whether anything about the key may be published (declared, or its monitor fired)."""
        return self.spec.mode == "declared" or self.counter_start is not None

    # -- the one entry point --
    def step(self, increment: int) -> list[Output]:
        """Process the key's increment for the next global step; return what to publish."""
        step = self.next_step
        self.next_step += 1
        self.prefix += increment
        out, self._pending = self._pending, []
        if self.exhausted:
            return out
        if self.monitor is not None and not self.monitor.halted:
            if self.monitor.step(increment):
                assert self.spec.monitor is not None
                out.append(Alert(self.key, step, self.spec.monitor.threshold,
                                 self.spec.monitor.epsilon))
                if self.spec.mode == "open":
                    self._start_counter(step, initial=self.spec.initial)
                    if not self.exhausted:
                        out.append(self._release(step, self.initial_value, self.initial_var))
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
    def expired(self) -> bool:
        """Open universe: the key's monitor window is over and it was not admitted.

        Such a key is forgotten; an event in a later window starts that window's monitor.
        """
        return (self.spec.mode == "open" and not self.admitted and self.window_end is not None
                and self.next_step >= self.window_end)

    @property
    def retired(self) -> bool:
        """An admitted key that will never publish again (its budget is exhausted).

        Only its name is kept, so that a later event cannot start it again with a fresh
        ledger; its name is public already (declared, or published by its alert).
        """
        return self.exhausted and self.admitted and not self._pending

    # -- internals --
    def _pay(self, charge: PrivacyCharge, step: int) -> bool:
        try:
            self.ledger.charge(charge)
        except BudgetExhaustedError as exc:
            self.exhausted = True
            if self.admitted:  # never name a key before its admission
                self._pending.append(BudgetExhausted(
                    self.key, step, charge.label, str(exc), self.ledger.spent,
                    self.ledger.budget, self.ledger.unit))
            return False
        return True

    def _start_counter(self, step: int, initial: PrivacyCharge | None) -> None:
        self.counter_start = step  # admitted from here on, even if a charge is refused
        if initial is not None:
            if not self._pay(initial, step):
                return
            self.initial_value, self.initial_var = self._initial_count(initial, step)
        if not self._pay(self.spec.counter.charge, step):
            return
        self.counter = _new_counter(
            self.spec.counter, self._noise,
            self._coords + ("counter", self.spec.counter_digest, step))

    def _initial_count(self, charge: PrivacyCharge, step: int) -> tuple[float, float]:
        """Release the count since the monitor started once: sensitivity 1."""
        lane = self._noise.lane(*self._coords, "initial", self.spec.initial_digest, step)
        if charge.epsilon:
            scale = 1 / exact(charge.epsilon)
            noise = laplace_one(self._noise, lane, scale, TAG_INITIAL, 0, 0, 0)
            return float(self.prefix + noise), discrete_laplace_variance(scale)
        sigma2 = Fraction(1) / (2 * exact(charge.rho))  # rho = 1/(2 sigma^2), CKS 2020
        noise = gaussian_one(self._noise, lane, sigma2, TAG_INITIAL, 0, 0, 0)
        return float(self.prefix + noise), discrete_gaussian_variance(sigma2)

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
            "window_end": self.window_end,
            "mechanisms": self.spec.mechanisms_digest,
            "counter": None if self.counter is None else self.counter.to_state(),
            "counter_start": self.counter_start,
            "initial": (self.initial_value, self.initial_var),
            "pending": list(self._pending),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        """Resume from a snapshot made with the same mechanisms, under today's budget.

        The mechanisms' parameters cannot change under a running flow instance (the
        start-up check refuses it with a precise message; this is the second line of
        defence): a changed mechanism would need new noise and new charges, and a crash
        before the next snapshot could lose them (issue 5, item 8). The budget may change:
        an *admitted* key whose spend is now above it stops with a :class:`BudgetExhausted`
        status. A key not yet admitted never gets one (that would name it).
        """
        if state.get("mechanisms") != self.spec.mechanisms_digest:
            raise InvalidParameterError(
                "this key's state was made with other mechanism parameters; a flow instance's "
                "mechanisms cannot change (start a new flow instance)")
        self.next_step = state["next_step"]
        self.prefix = state["prefix"]
        self.exhausted = state["exhausted"]
        self.ledger = PrivacyLedger.from_state(state["ledger"])
        self.counter_start = state["counter_start"]
        self.window_end = state["window_end"]
        self.initial_value, self.initial_var = state["initial"]
        self._pending = list(state["pending"])
        self.monitor, self.counter = None, None
        if state["monitor"] is not None:
            assert self.spec.monitor is not None
            window = 0 if self.window_end is None else self.window_end // self.spec.window - 1
            self.monitor = ThresholdMonitor(
                self.spec.monitor, self._noise,
                self._coords + ("monitor", self.spec.monitor_digest, window), state["monitor"])
        if state["counter"] is not None:
            assert self.counter_start is not None
            self.counter = _new_counter(
                self.spec.counter, self._noise,
                self._coords + ("counter", self.spec.counter_digest, self.counter_start),
                state["counter"])
        if self.exhausted:
            return
        self.ledger.rebudget(PrivacyLedger(self.spec.accounting, self.spec.budget,
                                           self.spec.delta_budget))
        if self.ledger.remaining < 0 or self.ledger.spent_delta > self.spec.delta_budget:
            self.exhausted = True
            if self.admitted:
                self._pending.append(BudgetExhausted(
                    self.key, self.next_step, "budget change",
                    f"the configured budget {self.ledger.budget:g} {self.ledger.unit} is below "
                    f"what this key has already spent ({self.ledger.spent:g})",
                    self.ledger.spent, self.ledger.budget, self.ledger.unit))
