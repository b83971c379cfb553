"""What to compute for every key of a counters flow, and the digests that bind its noise.

**Stated as OpenDP states a measurement**

* input domain: a flow's event stream, split by key (declared keys, or an open universe);
  input metric: event level, one event of one key (``d_in = 1``); other keys' outputs do
  not depend on it.
* function: per key, in order: in the open universe, one threshold monitor per window of
  ``W`` steps until admission; the initial count (``DLap(1 / epsilon_initial)`` or
  ``N_Z(0, 1 / (2 rho_initial))``); the continual counter (tree or BLT).
* output measure: the flow's accounting, pure epsilon-DP or rho-zCDP, plus an additive
  ``delta``; privacy map: ``1 ↦ (sum of the key's charges, admission_delta)``: pure
  ``epsilon_monitor + epsilon_initial + epsilon_counter`` (basic composition, Dwork & Roth
  2014, Theorem 3.16; one window's monitor by parallel composition), zCDP the sum of the
  ``rho`` charges plus ``epsilon^2 / 2`` for each epsilon charge (BS16, Proposition 1.4);
  ``admission_delta`` the lazy start's delta
  (:func:`~dpstream.core.counting.admission_bounds.lazy_start_delta`). That sum is what
  :class:`~dpstream.core.counting.stage_ledgers.StageLedgers` holds for a key that paid
  every charge; releases report its delta plus ``admission_delta``.

:class:`StatisticsSpec` is the frozen specification shared by all keys of a flow: the key
universe (declared or open), the accounting (pure or zCDP), the budget, the continual counter
(the binary tree mechanism, Dwork, Naor, Pitassi, Rothblum 2010 and Chan, Shi, Song 2011,
Algorithm 2 of paper 001 -- :mod:`dpstream.core.counting.tree_counter`; or the BLT counter --
:mod:`dpstream.core.counting.blt_counter`), the threshold monitor (AboveThreshold, Dwork &
Roth 2014, Algorithm 1 -- :mod:`dpstream.core.counting.threshold_monitor`) and the initial
count's charge.

**Noise coordinates** bind every draw to the flow instance, the key, the mechanism and a
digest of the mechanism's parameters (pitfall 13): :func:`parameter_digest` is that digest
(explicitly encoded, :func:`~dpstream.core.noise.coordinates.encode_coordinates`), and
:attr:`StatisticsSpec.mechanisms_digest` is the one a resume must not change. The digests are
part of every lane: changing how one is computed would change every noise value.

The keys of the flow follow these rules (the columnar engine,
:class:`~dpstream.core.counting.key_table.KeyTable`, implements them). In the *declared*
universe every key's counter runs from step 0 (with the optional monitor over
``[0, horizon)``); in the *open* universe time is cut into global monitor windows of
``W = monitor.horizon`` steps, a key not yet admitted is watched in each window by a monitor
(AboveThreshold on that window's events, paper 002 Observation 1.8) from its first event to
the window's end; when it fires, the key is admitted (an alert), its count is released once
with fresh noise (the initial count) and its counter runs from the next step.

**Privacy of the open universe** (event-level, per key; other keys' outputs
do not depend on the key's events). The windows hold disjoint events and each
window's monitor depends only on its own window's events given what was
published before, so by (adaptive) parallel composition one event pays for one
window's monitor: ``epsilon_monitor``. The monitor's start is data-dependent
but its end is not, and its noise is keyed by the window and the step's index
in the window, so it decides exactly like a monitor started at the window's
beginning unless that one fires on a count of 0 before the key's first event:
:func:`~dpstream.core.counting.admission_bounds.lazy_start_delta` bounds the resulting
delta, which the configuration keeps within ``privacy.delta``. After admission
(a published, private output) the initial count and the counter are
``epsilon_initial`` and ``epsilon_counter`` DP with respect to one event.
Basic composition of the three gives the per-key charge the ledger holds.

**Presence and structure.** Nothing is published about a key before its
admission, and every field of a release but ``value`` is a function of public
things (the configuration and the admission step): the ledger's spend at the
first release is the sum of the configured charges. A charge refused before
admission is never announced (it would name the key); the configuration is
validated so that it cannot be refused.

A key's noise is drawn at the lanes (:mod:`dpstream.core.noise.bulk`) of
``(instance, key, "monitor", digest, window)``, ``(instance, key, "initial", digest, step)``
and ``(instance, key, "counter", digest, start_step)``.

No noise is drawn and no state is held here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from dpstream.core.accounting.ledger import PrivacyCharge, exact
from dpstream.core.counting.blt_counter import BltCounterSpec
from dpstream.core.counting.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.noise.coordinates import parameter_digest
from dpstream.errors import InvalidParameterError

__all__ = ["CounterSpec", "StatisticsSpec"]

CounterSpec = TreeCounterSpec | BltCounterSpec


def _fraction(value: float | None) -> str:
    return "none" if value is None else str(exact(value))


def _charge_digest(charge: PrivacyCharge | None) -> str:
    if charge is None:
        return parameter_digest("none")
    return parameter_digest("charge", _fraction(charge.epsilon), _fraction(charge.rho))


@dataclass(frozen=True)
class StatisticsSpec:
    """What to compute for every key (shared by all keys of a flow).

    ``instance`` is the flow instance's id: every noise coordinate starts with it, so two
    instances (two deployments with the same name, a reprocessing of the same topic) never
    share noise.
    """

    flow: str
    mode: Literal["declared", "open"]
    accounting: Literal["pure", "zcdp"]
    budget: float
    delta_budget: float
    counter: CounterSpec
    monitor: ThresholdMonitorSpec | None
    initial: PrivacyCharge | None = None
    admission_delta: float = 0.0
    instance: str = ""

    def __post_init__(self) -> None:
        if self.mode == "open" and (self.monitor is None or self.monitor.horizon is None):
            raise InvalidParameterError(
                "the open key universe needs a threshold monitor with a horizon (its window)")

    @functools.cached_property
    def monitor_digest(self) -> str:
        """Digest of the monitor's parameters (part of its noise coordinates)."""
        m = self.monitor
        if m is None:
            return parameter_digest("none")
        return parameter_digest("above-threshold", _fraction(m.epsilon), int(m.threshold),
                                -1 if m.horizon is None else int(m.horizon))

    @functools.cached_property
    def counter_digest(self) -> str:
        """Digest of the counter's parameters (part of its noise coordinates)."""
        c = self.counter
        if isinstance(c, TreeCounterSpec):
            return parameter_digest(c.mechanism, _fraction(c.epsilon), int(c.horizon))
        return parameter_digest(c.mechanism, _fraction(c.rho), int(c.horizon))

    @functools.cached_property
    def initial_digest(self) -> str:
        """Digest of the initial count's charge (part of its noise coordinates)."""
        return _charge_digest(self.initial)

    @functools.cached_property
    def mechanisms_digest(self) -> str:
        """One digest of every mechanism's parameters (what a resume must not change)."""
        return parameter_digest(self.mode, self.accounting, self.monitor_digest,
                                self.counter_digest, self.initial_digest)

    @property
    def window(self) -> int:
        """The length ``W`` of the open universe's monitor windows (``monitor.horizon``)."""
        assert self.monitor is not None and self.monitor.horizon is not None
        return int(self.monitor.horizon)
