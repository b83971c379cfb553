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

**User level** (``unit = "user"``: one person's events within one period are the unit; a
person contributes to at most ``L0 = max_keys`` keys and at most ``Linf = max_per_key`` events
to each, enforced before this stage by the contribution bounding). Per key, against one
person:

* the continual counter counts the key's *events*: the person moves them by at most ``Linf``,
  and the counter is calibrated to that sensitivity (``counter.sensitivity = Linf``: the tree's
  ``DLap(Linf (m_j + 1) / epsilon)``, the BLT's ``sigma_G`` times ``Linf``), so it still costs
  its configured charge;
* the threshold monitor counts the key's *distinct people* (DP-SQLP's key selection): each
  kept person adds one to a key's people count in the period of their first kept event for
  that key, and nothing else, so every prefix of the people count moves by at most one, the
  monitor's event-level premise: it costs ``epsilon_monitor``, and its lazy start's delta is
  that of the event level (a key's monitor starts at its first kept event, as before);
* the initial count releases the key's *events* since its monitor started (what the counter
  then continues): sensitivity ``Linf``, so its noise is ``DLap(Linf / epsilon_initial)`` or
  ``N_Z(0, Linf^2 / (2 rho_initial))`` and it still costs its configured charge.

So a key's charges are the configured ones against one person, and a person touches at most
``L0`` keys: by composition over those keys (the other keys' outputs do not depend on the
person), ``L0 (sum of the key's charges)`` in epsilon or rho and ``L0 admission_delta`` (a
person can make up to ``L0`` keys appear). The flow adds the hash-collision delta of the
bounding (two people whose keyed hashes collide share caps). These totals are computed by the
configuration (``CountersConfig.person_privacy``) and reported by every release;
:attr:`StatisticsSpec.contribution` binds the caps and the period into
:attr:`~StatisticsSpec.mechanisms_digest` (a resume under other caps is refused). At the event
level (``Linf = 1``, no contribution) every digest and every noise value is unchanged.

A key's noise is drawn at the lanes (:mod:`dpstream.core.noise.bulk`) of
``(instance, key, "monitor", digest, window)``, ``(instance, key, "initial", digest, step)``
and ``(instance, key, "counter", digest, start_step)``.

No noise is drawn and no state is held here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

from dpstream.core.accounting.ledger import PrivacyCharge, approx_dp, exact
from dpstream.core.contribution.people import PEOPLE_BOUND, collision_delta
from dpstream.core.counting.blt_counter import BltCounterSpec
from dpstream.core.counting.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.noise.coordinates import parameter_digest
from dpstream.errors import InvalidParameterError

__all__ = ["CounterSpec", "PersonPrivacy", "StatisticsSpec", "person_privacy"]

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
    contribution: tuple[tuple[str, int], ...] = ()
    """At the user level: ``("period_steps", n or 0 for lifetime)``, then the caps
    (``max_keys``, ``max_per_key``) as ``(name, value)`` pairs; empty at the event level."""
    person_field: str = ""
    """At the user level: ``contribution.user_field``, the field that names the person (bound
    by :attr:`mechanisms_digest`: another field is another unit); empty at the event level."""

    @property
    def user_level(self) -> bool:
        """Whether one person (not one event) is the unit: the monitor counts people."""
        return bool(self.contribution)

    @property
    def max_per_key(self) -> int:
        """``Linf``: the most events one unit adds to one key (1 at the event level)."""
        return dict(self.contribution).get("max_per_key", 1)

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
        scaled = () if c.sensitivity == 1 else (int(c.sensitivity),)  # the event level's as was
        if isinstance(c, TreeCounterSpec):
            return parameter_digest(c.mechanism, _fraction(c.epsilon), int(c.horizon), *scaled)
        return parameter_digest(c.mechanism, _fraction(c.rho), int(c.horizon), *scaled)

    @functools.cached_property
    def initial_digest(self) -> str:
        """Digest of the initial count's charge (part of its noise coordinates)."""
        if self.max_per_key != 1 and self.initial is not None:
            return parameter_digest("scaled", _charge_digest(self.initial), self.max_per_key)
        return _charge_digest(self.initial)

    def mechanisms_hint(self, recorded: object) -> str:
        """What explains a store's other mechanisms digest ``recorded``: nothing to add here."""
        return ""

    @functools.cached_property
    def mechanisms_digest(self) -> str:
        """One digest of every mechanism's parameters (what a resume must not change).

        At the user level it also binds the contribution (the period, the caps and the field
        that names the person).
        """
        unit = () if not self.contribution else (parameter_digest(
            "contribution", *(part for pair in self.contribution for part in pair),
            *((self.person_field,) if self.person_field else ())),)
        return parameter_digest(self.mode, self.accounting, self.monitor_digest,
                                self.counter_digest, self.initial_digest, *unit)

    @property
    def window(self) -> int:
        """The length ``W`` of the open universe's monitor windows (``monitor.horizon``)."""
        assert self.monitor is not None and self.monitor.horizon is not None
        return int(self.monitor.horizon)


@dataclass(frozen=True)
class PersonPrivacy:
    """What one person's bounded contribution costs over the whole flow (user level).

    Attributes:
        epsilon: pure: ``L0`` times a key's epsilon spend; zCDP: the epsilon of ``rho`` at
            ``conversion_delta`` (BS16, Proposition 1.3).
        delta: ``L0`` times a key's delta (ledger delta plus admission delta), plus the
            hash-collision delta (zCDP: plus the conversion delta).
        rho: zCDP only: ``L0`` times a key's rho spend (None under pure accounting).
    """

    epsilon: float
    delta: float
    rho: float | None = None


def person_privacy(accounting: str, spent: float, key_delta: float, max_keys: int,
                   conversion_delta: float, people: int = PEOPLE_BOUND) -> PersonPrivacy:
    """A person's total cost from one key's: group privacy over the ``L0`` keys they touch.

    Derivation (see the module docstring for the per-key charges): a person's bounded
    contribution changes the inputs of at most ``L0 = max_keys`` keys and no other key's
    outputs, and each key's outputs cost at most the key's spend ``spent`` (epsilon or rho)
    and ``key_delta`` against the person. Composition over those keys (Dwork & Roth 2014,
    Theorem 3.16 for (epsilon, delta); BS16, Lemma 2.3 for zCDP, the deltas adding) gives
    ``L0 spent`` and ``L0 key_delta``. The bounding adds ``collision_delta(people)``: with
    probability at most that, the person's keyed hash collides with another's and their caps
    are shared (then nothing is claimed). Under zCDP the ``(epsilon, delta)`` pair converts
    ``L0 rho`` at ``conversion_delta``
    (:func:`~dpstream.core.accounting.ledger.approx_dp`, the releases' own conversion).

    Args:
        accounting: ``pure`` (``spent`` is epsilon) or ``zcdp`` (``spent`` is rho).
        spent: a key's spend once its charges are paid.
        key_delta: a key's delta (the ledger's delta plus the admission delta).
        max_keys: ``L0``.
        conversion_delta: ``privacy.delta``, the zCDP conversion's delta.
        people: a public bound on the people in the stream (default
            :data:`~dpstream.core.contribution.people.PEOPLE_BOUND`, ``2^64``: no stream has
            more; the collision delta is then ``2^-64``).
    """
    total = float(max_keys * exact(spent))
    delta = float(max_keys * exact(key_delta)) + collision_delta(people)
    if accounting == "zcdp":
        if conversion_delta <= 0:  # no conversion without a delta: rho is the guarantee
            return PersonPrivacy(epsilon=math.inf, delta=delta, rho=total)
        epsilon, delta = approx_dp(total, conversion_delta, delta)
        return PersonPrivacy(epsilon=epsilon, delta=delta, rho=total)
    return PersonPrivacy(epsilon=total, delta=delta)
