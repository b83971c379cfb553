"""The counters flow kind: private per-key counts released at every step.

Events ``{"key": ..., "ts": ...}`` -> the shared step clock -> one shard of keyed statistics
per ``flow.shards`` (:class:`~dpstream.kinds.counters.shard.ShardState`: threshold monitor, initial
count, binary tree or BLT counter per key) -> ``dpstream.release/1``, ``dpstream.alert/1``
and ``dpstream.status/1`` records. Its configuration tables are ``[privacy]``,
``[counter]``, ``[monitor]``, ``[admission]`` and ``[release]``
(``deploy/counters.example.toml``).

**User level** (``[contribution] unit = "user"``, caps ``max_keys = L0`` and ``max_per_key =
Linf`` per period): the bounding stage hands the kind, per closed step, the events it kept
and, per event, whether it is its person's first kept event at its key in the period
(:meth:`~dpstream.kinds.counters.events.PartitionClock.route_bounded`). Every configured
parameter (``counter.epsilon`` or ``counter.rho``, ``monitor.epsilon``,
``admission.initial_*``, ``privacy.budget``) then means what one person's bounded
contribution to one key costs: the counter's and the initial count's noise are scaled by
``Linf`` (their sensitivity), the monitor counts distinct people (sensitivity 1), and the
person's total is ``L0`` times a key's (:func:`~dpstream.core.counting.statistics_spec.
person_privacy`; derivations in :mod:`dpstream.core.counting.statistics_spec`): pure
``L0 (epsilon_monitor + epsilon_initial + epsilon_counter)``, zCDP ``L0`` times the key's rho,
``L0`` admission deltas plus the hash-collision delta. With ``monitor.threshold`` left to its
default it is chosen so that ``L0`` admission deltas stay within ``privacy.delta``.
:meth:`CountersConfig.describe` (``check-config``, the start-up log) and every release
(``privacy.unit = "user"``, ``privacy.person``) report it.

``release.every = k`` (default 1) publishes the counters' periodic releases only at the steps
``s`` with ``(s + 1) % k == 0``; initial counts (an open key's release at its admission),
alerts and budget statuses are published at every step. Every key still steps, draws its
noise and pays its ledger at every step exactly as with ``k = 1``: leaving releases out is
post-processing of private outputs, so it costs no privacy and the releases that are
published are byte for byte those of ``k = 1``. There is no ``only_changed`` option: every
release carries fresh noise, so its value differs from the last one anyway, and publishing
only when the *true* count changed would reveal, by the release's presence, whether the key
had an event in that step (that is not post-processing: it would leak).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Literal

import bytewax.operators as op
from bytewax.dataflow import Stream

from dpstream.config import FlowConfig, Section, build_spec, parse_common, positive
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger, approx_dp, exact
from dpstream.core.counting.admission_bounds import lazy_start_delta, minimal_threshold
from dpstream.core.counting.blt_counter import BltCounterSpec
from dpstream.core.counting.blt_counter import worst_step_std as blt_worst_std
from dpstream.core.counting.statistics_spec import PersonPrivacy, StatisticsSpec, person_privacy
from dpstream.core.counting.threshold_monitor import ThresholdMonitorSpec
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.counting.tree_counter import worst_step_std as tree_worst_std
from dpstream.core.noise.samplers import discrete_gaussian_variance, discrete_laplace_variance
from dpstream.errors import ConfigError, InvalidParameterError
from dpstream.kind import ClockFactory, FlowKind, FlowParts
from dpstream.kinds.counters.events import EventRules, PartitionClock
from dpstream.kinds.counters.layout import DeclaredLayout
from dpstream.kinds.counters.metrics import register_metrics
from dpstream.kinds.counters.operator import keyed_statistics
from dpstream.kinds.counters.records import RecordEncoder
from dpstream.kinds.counters.shard import ShardState
from dpstream.messages import Encoded
from dpstream.stream.barrier import end_step_of
from dpstream.stream.clock import ShardUpdate
from dpstream.stream.encoded import EncodedBatch

__all__ = ["AdmissionConfig", "CountersConfig", "KIND", "PrivacyConfig", "event_rules",
           "statistics_spec"]

TOPICS: Final = {"input_topic": "events", "releases_topic": "releases",
                 "alerts_topic": "alerts", "dead_letter_topic": "dead-letters"}


@dataclass(frozen=True)
class PrivacyConfig:
    """The per-key budget and the mechanisms that spend it."""

    accounting: Literal["pure", "zcdp"]
    budget: float
    delta: float
    counter: TreeCounterSpec | BltCounterSpec
    monitor: ThresholdMonitorSpec | None

    @property
    def counter_charge(self) -> PrivacyCharge:
        """What starting one key's counter costs."""
        return self.counter.charge

    def new_ledger(self) -> PrivacyLedger:
        """A fresh per-key ledger with the configured budget."""
        return PrivacyLedger(self.accounting, self.budget, self.delta)


@dataclass(frozen=True)
class AdmissionConfig:
    """Which keys get statistics.

    ``declared``: a fixed key universe listed in the configuration; every
    declared key is released from step 0, pure DP. ``open``: keys come from the
    data; a key is admitted when its threshold monitor fires, its count up to
    then is released once with ``initial`` noise, and the counter runs from
    there. The monitor's lazy start costs the ``delta`` reported.
    """

    mode: Literal["declared", "open"]
    keys: tuple[str, ...] = ()
    initial: PrivacyCharge | None = None
    delta: float = 0.0


@dataclass(frozen=True, kw_only=True)
class CountersConfig(FlowConfig):
    """The whole configuration of a counters flow."""

    key_field: str
    privacy: PrivacyConfig
    admission: AdmissionConfig
    release_every: int = 1
    """``release.every``: publish the periodic releases of every k-th step only (free)."""

    @functools.cached_property
    def declared_layout(self) -> DeclaredLayout | None:
        """The declared keys by shard and row, built once (None in the open universe).

        Every input partition's clock and every shard of this process share it: its
        :class:`~dpstream.core.counting.key_index.KeyIndex` (about 16 bytes a key) checks that a key
        is declared and gives its row, and each shard's sorted key list is its table's.
        """
        if self.admission.mode != "declared":
            return None
        return DeclaredLayout(self.admission.keys, self.shards)

    def per_key_charges(self) -> list[PrivacyCharge]:
        """Every charge one key's statistics may make, in order."""
        charges = []
        if self.privacy.monitor is not None:
            charges.append(self.privacy.monitor.charge)
        if self.admission.initial is not None:
            charges.append(self.admission.initial)
        charges.append(self.privacy.counter_charge)
        return charges

    def person_privacy(self) -> PersonPrivacy | None:
        """What one person's bounded contribution costs in all (None at the event level).

        ``L0`` keys' worth of a key's committed charges (every key that publishes has paid
        them all) and deltas, plus the hash-collision delta: the figures every release's
        ``privacy.person`` carries (:func:`~dpstream.core.counting.statistics_spec.
        person_privacy`).
        """
        if not self.contribution.user_level:
            return None
        ledger = self.privacy.new_ledger()
        for charge in self.per_key_charges():
            ledger.charge(charge)
        return person_privacy(self.privacy.accounting, ledger.spent,
                              ledger.spent_delta + self.admission.delta,
                              self.contribution.cap("max_keys"), self.privacy.delta)

    def noise_std(self) -> dict[str, float]:
        """The noise std of each output at the configured caps (``check-config``, ``bounds``).

        ``counter``: a release's std at the worst step of the counter's horizon (the tree's
        and the BLT's analytic std; it grows beyond the horizon); ``initial``: the initial
        count's noise (open universe); ``monitor``: the noise of one threshold test,
        ``nu_t - rho`` (what a key's count, events or at the user level people, is compared
        with). At the user level the counter and the initial count are scaled by ``Linf``.
        """
        counter = self.privacy.counter
        out = {"counter": (tree_worst_std(counter, counter.horizon)
                           if isinstance(counter, TreeCounterSpec)
                           else blt_worst_std(counter, counter.horizon))}
        initial = self.admission.initial
        if initial is not None:
            linf = self.contribution.cap("max_per_key")
            out["initial"] = math.sqrt(
                discrete_laplace_variance(linf / exact(initial.epsilon)) if initial.epsilon
                else discrete_gaussian_variance(Fraction(linf * linf) / (2 * exact(initial.rho))))
        monitor = self.privacy.monitor
        if monitor is not None:
            out["monitor"] = math.sqrt(discrete_laplace_variance(monitor.query_scale)
                                       + discrete_laplace_variance(monitor.threshold_scale))
        return out

    def describe(self) -> str:
        """A human summary of the privacy guarantee (no secrets)."""
        ledger = self.privacy.new_ledger()
        for charge in self.per_key_charges():
            ledger.charge(charge)
        unit = ledger.unit
        person = self.person_privacy()
        lines = [
            f"flow {self.name!r}: one step = {self.step_seconds:g} s "
            f"from {self.origin.isoformat()}",
            self.describe_clock(),
            f"privacy unit: one event; accounting {self.privacy.accounting}; "
            f"per-key budget {ledger.budget:g} {unit}, committed at most {ledger.spent:g} {unit}"
            if person is None else
            f"{self.contribution.describe()}; accounting {self.privacy.accounting}; per-key "
            f"budget {ledger.budget:g} {unit} against one person, committed at most "
            f"{ledger.spent:g} {unit}",
            f"counter: {self.privacy.counter.mechanism} (horizon {self.privacy.counter.horizon})",
        ]
        if self.privacy.monitor is not None:
            m = self.privacy.monitor
            lines.append(f"monitor: AboveThreshold threshold={m.threshold} epsilon={m.epsilon:g}")
        if self.admission.mode == "open":
            lines.append(
                f"admission: open key universe, admission delta <= {self.admission.delta:.3g}"
            )
        else:
            lines.append(f"admission: {len(self.admission.keys)} declared keys")
        if self.release_every > 1:
            lines.append(f"releases: published every {self.release_every} steps "
                         "(post-processing, no privacy cost)")
        epsilon, delta = self.release_epsilon_delta()
        lines.append(f"as (epsilon, delta): ({epsilon:.4g}, {delta:.3g}) per key, as every "
                     "release reports it" + (" (privacy.approx_dp)"
                                             if self.privacy.accounting == "zcdp" else ""))
        if person is not None:
            linf = self.contribution.cap("max_per_key")
            rho = "" if person.rho is None else f"rho {person.rho:.4g}, "
            lines.append(
                f"per person ({self.contribution.cap('max_keys')} keys x one key's cost; "
                f"counter and initial count noise scaled by max_per_key = {linf}, the monitor "
                f"counts distinct people): {rho}(epsilon, delta) = ({person.epsilon:.4g}, "
                f"{person.delta:.3g}) with the hash-collision delta, as every release reports "
                "it (privacy.person)")
            lines.append("noise std: " + ", ".join(
                f"{name} {std:.4g}" for name, std in self.noise_std().items()))
        return "\n".join(lines)

    def release_epsilon_delta(self) -> tuple[float, float]:
        """The (epsilon, delta) a key's releases report once every charge is committed.

        Pure: epsilon spent and the delta of ``privacy.delta`` in a release (the ledger's
        delta plus the admission delta). zCDP: ``privacy.approx_dp`` of a release, converted
        at ``privacy.delta`` by :func:`~dpstream.core.accounting.ledger.approx_dp`, the function the
        record encoder calls, with the admission delta added. At the user level this is still
        one key's figure, against one person's bounded contribution to it; the person's total
        over their ``L0`` keys is :meth:`person_privacy`.
        """
        ledger = self.privacy.new_ledger()
        for charge in self.per_key_charges():
            ledger.charge(charge)
        extra = ledger.spent_delta + self.admission.delta
        if self.privacy.accounting == "zcdp":
            return approx_dp(ledger.spent, self.privacy.delta, extra)
        return ledger.spent, extra


def _privacy_section(privacy: Section) -> tuple[str, float, float]:
    accounting = privacy.get("accounting", "pure", str)
    if accounting not in ("pure", "zcdp"):
        raise ConfigError(f"privacy.accounting must be 'pure' or 'zcdp', got {accounting!r}")
    budget = positive(privacy.get("budget", 1.0, float), "privacy.budget")
    delta = privacy.get("delta", 1e-6, float)
    if not 0 <= delta < 1:
        raise ConfigError(f"privacy.delta must be in [0, 1), got {delta!r}")
    privacy.finish()
    return accounting, budget, delta


def _counter_section(counter: Section, accounting: str, budget: float,
                     sensitivity: int = 1) -> TreeCounterSpec | BltCounterSpec:
    horizon = counter.get("horizon", 2**20, int)
    scaled = {} if sensitivity == 1 else {"sensitivity": sensitivity}  # Linf at the user level
    spec: TreeCounterSpec | BltCounterSpec
    if accounting == "pure":
        eps = positive(counter.get("epsilon", budget * 0.7, float), "counter.epsilon")
        spec = build_spec(TreeCounterSpec, "[counter]", epsilon=eps, horizon=horizon, **scaled)
    else:
        rho = positive(counter.get("rho", budget * 0.7, float), "counter.rho")
        spec = build_spec(BltCounterSpec, "[counter]", rho=rho, horizon=horizon, **scaled)
    counter.finish()
    return spec


def _admission_section(admission: Section, accounting: str
                       ) -> tuple[str, list[str], float | None]:
    mode = admission.get("mode", "open", str)
    if mode not in ("open", "declared"):
        raise ConfigError(f"admission.mode must be 'open' or 'declared', got {mode!r}")
    keys = admission.get("keys", [], list)
    if mode == "declared" and (not keys or not all(isinstance(k, str) and k for k in keys)):
        raise ConfigError("admission.mode = 'declared' needs admission.keys: a non-empty list of "
                          f"non-empty strings, got {keys!r}")
    if mode == "open" and keys:
        raise ConfigError("admission.keys is only used with admission.mode = 'declared'")
    if len(set(keys)) != len(keys):
        raise ConfigError("admission.keys has duplicates")
    initial_value = admission.get("initial_epsilon" if accounting == "pure" else "initial_rho",
                                  None, float)
    admission.used.update({"initial_epsilon", "initial_rho"})
    wrong_initial = "initial_rho" if accounting == "pure" else "initial_epsilon"
    if wrong_initial in admission.data:
        raise ConfigError(f"admission.{wrong_initial} does not apply to accounting {accounting!r}")
    admission.finish()
    return mode, keys, initial_value


def _release_section(release: Section) -> int:
    every = release.get("every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"release.every must be an integer >= 1 (publish the periodic "
                          f"releases of every k-th step), got {every!r}")
    release.finish()
    return every


def _monitor_section(monitor: Section, mode: str, accounting: str, budget: float,
                     delta: float, max_keys: int = 1) -> ThresholdMonitorSpec | None:
    monitor_enabled = monitor.get("enabled", mode == "open", bool)
    spec = None
    if monitor_enabled:
        monitor_eps = positive(monitor.get("epsilon", budget * 0.1 if accounting == "pure"
                                           else math.sqrt(2 * budget * 0.1), float),
                               "monitor.epsilon")
        monitor_horizon = monitor.get("horizon", 86_400, int)
        threshold = monitor.get("threshold", None, int)
        if threshold is None:
            if mode != "open":
                raise ConfigError("monitor.threshold is required when the monitor is enabled "
                                  "with admission.mode = 'declared'")
            if not (isinstance(monitor_horizon, int) and monitor_horizon >= 1):
                raise ConfigError(f"monitor.horizon must be >= 1, got {monitor_horizon!r}")
            # the smallest threshold that keeps the admission delta within privacy.delta (at
            # the user level: L0 admission deltas, a person can make L0 keys appear)
            threshold = (minimal_threshold(monitor_eps, monitor_horizon, delta / max_keys)
                         if delta > 0 else 0)
        spec = build_spec(ThresholdMonitorSpec, "[monitor]", epsilon=monitor_eps,
                          threshold=threshold, horizon=monitor_horizon)
    else:
        for key in ("epsilon", "threshold", "horizon"):
            monitor.get(key, None)
    monitor.finish()
    return spec


def _admission(mode: str, keys: list[str], initial_value: float | None,
               monitor: ThresholdMonitorSpec | None, accounting: str, budget: float,
               delta: float, max_keys: int = 1) -> AdmissionConfig:
    if mode == "declared":
        if initial_value is not None:
            raise ConfigError("admission.initial_* is only used with admission.mode = 'open'")
        return AdmissionConfig(mode="declared", keys=tuple(keys))
    if monitor is None:
        raise ConfigError(
            "admission.mode = 'open' needs the threshold monitor ([monitor] enabled = true): "
            "keys from the data are only released after their monitor fires"
        )
    if initial_value is None:
        initial_value = budget * 0.2
    unit = "epsilon" if accounting == "pure" else "rho"
    positive(initial_value, f"admission.initial_{unit}")
    initial = PrivacyCharge(label="initial count", **{unit: initial_value})
    try:
        adm_delta = lazy_start_delta(monitor)
    except InvalidParameterError as exc:
        raise ConfigError(f"[monitor]: {exc}") from None
    if adm_delta * max_keys > delta:
        assert monitor.horizon is not None  # lazy_start_delta needs it
        need = minimal_threshold(monitor.epsilon, monitor.horizon, delta / max_keys)
        per_person = ("" if max_keys == 1 else
                      f" per key, {adm_delta * max_keys:.3g} for the contribution.max_keys = "
                      f"{max_keys} keys a person can make appear,")
        raise ConfigError(
            f"monitor.threshold = {monitor.threshold} with monitor windows of "
            f"monitor.horizon = {monitor.horizon} steps costs an admission delta of "
            f"{adm_delta:.3g}{per_person} above privacy.delta = {delta:g}; raise "
            f"monitor.threshold to at least {need}, or lower monitor.horizon, or raise "
            "monitor.epsilon"
        )
    return AdmissionConfig(mode="open", initial=initial, delta=adm_delta)


def parse_config(raw: dict[str, Any], source: str = "<dict>") -> CountersConfig:
    """Validate a counters configuration (as read from TOML)."""
    admission_raw = raw.get("admission", {})
    declared = isinstance(admission_raw, dict) and admission_raw.get("mode") == "declared"
    fields, tables = parse_common(
        raw, source,
        kind_tables=frozenset({"privacy", "counter", "monitor", "admission", "release"}),
        topics=TOPICS, caps=("max_keys", "max_per_key"),
        origin_required=(
            "with admission.mode = 'declared': declared keys are released from step 0, which "
            "starts at the origin (set it near the deployment time, e.g. origin = "
            "'2026-11-20T00:00:00Z')") if declared else None)
    events = tables["events"]
    key_field = events.get("key_field", "key", str)
    events.finish()
    accounting, budget, delta = _privacy_section(tables["privacy"])
    contribution = fields["contribution"]  # caps are 1 at the event level
    max_keys, linf = contribution.cap("max_keys"), contribution.cap("max_per_key")
    counter = _counter_section(tables["counter"], accounting, budget, linf)
    mode, keys, initial_value = _admission_section(tables["admission"], accounting)
    monitor = _monitor_section(tables["monitor"], mode, accounting, budget, delta, max_keys)
    admission = _admission(mode, keys, initial_value, monitor, accounting, budget, delta,
                           max_keys)
    release_every = _release_section(tables["release"])
    privacy = PrivacyConfig(accounting=accounting, budget=budget,  # type: ignore[arg-type]
                            delta=delta, counter=counter, monitor=monitor)
    config = CountersConfig(key_field=key_field, privacy=privacy, admission=admission,
                            release_every=release_every, **fields)
    _check_budget(config)
    return config


def _check_budget(config: CountersConfig) -> None:
    ledger = config.privacy.new_ledger()
    for charge in config.per_key_charges():
        if not ledger.can_afford(charge):
            costs = " + ".join(f"{c.label} {float(ledger.cost_of(c)):g}"
                               for c in config.per_key_charges())
            raise ConfigError(
                f"privacy.budget = {config.privacy.budget:g} {ledger.unit} per key cannot pay "
                f"for {costs} (delta {sum(c.delta for c in config.per_key_charges()):g}); "
                "raise the budget or lower the mechanisms' parameters"
            )
        ledger.charge(charge)


# -- wiring ----------------------------------------------------------------------------------


def statistics_spec(config: CountersConfig, instance: str = "") -> StatisticsSpec:
    """The per-key specification a flow configuration implies, for flow instance ``instance``."""
    p = config.privacy
    c = config.contribution
    contribution = () if not c.user_level else (
        ("period_steps", c.period_steps or 0), *c.caps)
    return StatisticsSpec(
        flow=config.name, mode=config.admission.mode, accounting=p.accounting, budget=p.budget,
        delta_budget=p.delta, counter=p.counter, monitor=p.monitor,
        initial=config.admission.initial, admission_delta=config.admission.delta,
        instance=instance, contribution=contribution,
    )


def event_rules(config: CountersConfig) -> EventRules:
    """How the flow reads events."""
    return EventRules(
        key_field=config.key_field, time_field=config.time_field, origin=config.origin,
        step_seconds=config.step_seconds, lateness_seconds=config.lateness_seconds,
        shards=config.shards, declared=config.declared_layout, clock=config.clock,
        max_skew_seconds=config.max_skew_seconds, end=config.end,
        user_field=config.contribution.user_field if config.contribution.user_level else None,
    )


class CountersKind:
    """The counters flow kind (see the module docstring)."""

    name: Final[str] = "counters"
    inputs: Final[tuple[str, ...]] = ("input_topic",)
    outputs: Final[Mapping[str, str]] = {"releases": "releases_topic", "alerts": "alerts_topic",
                                         "dead_letters": "dead_letter_topic"}
    topics: Final[Mapping[str, str]] = TOPICS

    def parse_config(self, raw: dict[str, Any], source: str) -> CountersConfig:
        """Validate a counters configuration."""
        return parse_config(raw, source)

    def binding(self, config: CountersConfig) -> StatisticsSpec:
        """What a flow instance binds (the mechanisms' digest)."""
        return statistics_spec(config)

    def clock(self, config: CountersConfig, bases: Mapping[str, int]) -> ClockFactory:
        """The counters' clock factory (one input topic: no partition bases to map)."""
        rules = event_rules(config)
        return lambda state: PartitionClock(rules, state)

    def wire(self, parts: FlowParts[CountersConfig], updates: Stream[tuple[str, ShardUpdate]]
             ) -> Stream[Encoded | EncodedBatch]:
        """Keyed statistics per shard, encoded as release, alert and status records.

        One :class:`~dpstream.stream.encoded.EncodedBatch` per closed step of a shard.
        """
        config = parts.config
        spec = statistics_spec(config, parts.instance)
        observe: Callable[[list[Any]], None] | None = None
        if parts.metrics is not None:
            ledger = config.privacy.new_ledger()
            parts.metrics.set_kind(self.name)
            parts.metrics.set_budget(spec.counter.mechanism, ledger.unit, ledger.budget)
            observe = functools.partial(register_metrics(parts.metrics).observe_outputs,
                                        mechanism=spec.counter.mechanism)
        shard_class = parts.options.get("shard_class", ShardState)
        outputs = keyed_statistics("statistics", updates, spec, parts.partitions,
                                   config.declared_layout, parts.noise, parts.metrics,
                                   observe, shard_class, config.release_every,
                                   end_step_of(config))
        encoder = RecordEncoder(config.name, config.origin, config.step_seconds,
                                config.privacy.delta, instance=parts.instance,
                                contribution=config.contribution)
        return op.map("encode", outputs, encoder.encode_item)


KIND: Final[FlowKind[CountersConfig, StatisticsSpec, Encoded | EncodedBatch]] = CountersKind()
