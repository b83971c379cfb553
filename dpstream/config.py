"""Typed configuration: a TOML file plus ``DPSTREAM_*`` environment overrides.

Everything is validated when the configuration is loaded, so a bad setting
stops the flow at start-up with a message that names the setting, the value
and what was expected, never mid-stream. See ``deploy/counters.example.toml``
for a commented example.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

from dpstream.core.blt_counter import BltCounterSpec
from dpstream.core.ledger import PrivacyCharge, PrivacyLedger
from dpstream.core.threshold_monitor import (
    ThresholdMonitorSpec,
    lazy_start_delta,
    minimal_threshold,
)
from dpstream.core.tree_counter import TreeCounterSpec
from dpstream.errors import ConfigError, InvalidParameterError

__all__ = [
    "AdmissionConfig",
    "CONFIG_ENV",
    "FlowConfig",
    "KafkaConfig",
    "PrivacyConfig",
    "load_config",
    "parse_config",
]

CONFIG_ENV: Final = "DPSTREAM_CONFIG"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
CLOCKS: Final = ("broker", "producer")


@dataclass(frozen=True)
class KafkaConfig:
    """Where events come from and where releases go."""

    brokers: tuple[str, ...] = ("127.0.0.1:9092",)
    input_topic: str = "events"
    releases_topic: str = "releases"
    alerts_topic: str = "alerts"
    dead_letter_topic: str = "dead-letters"
    tail: bool = True
    batch_size: int = 10_000
    add_config: dict[str, str] = field(default_factory=dict)
    start_offset: str = "earliest"
    """Where a partition without recovery state starts: earliest, latest or committed."""
    group_id: str = ""
    """The consumer group the input commits its position to (for lag tools)."""
    startup_timeout_seconds: float = 60.0
    """How long start-up waits for the Kafka cluster."""


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


@dataclass(frozen=True)
class FlowConfig:
    """The whole configuration of a counters flow."""

    name: str
    step_seconds: float
    origin: datetime
    lateness_seconds: float
    shards: int
    clock: Literal["broker", "producer"]
    key_field: str
    time_field: str
    kafka: KafkaConfig
    privacy: PrivacyConfig
    admission: AdmissionConfig
    metrics_port: int
    metrics_exact_counts: bool = True
    heartbeat_seconds: float = 0.0
    """Seconds between heartbeat ticks to every input partition (0: none)."""
    source: str = "<dict>"

    def per_key_charges(self) -> list[PrivacyCharge]:
        """Every charge one key's statistics may make, in order."""
        charges = []
        if self.privacy.monitor is not None:
            charges.append(self.privacy.monitor.charge)
        if self.admission.initial is not None:
            charges.append(self.admission.initial)
        charges.append(self.privacy.counter_charge)
        return charges

    def describe(self) -> str:
        """A human summary of the privacy guarantee (no secrets)."""
        ledger = self.privacy.new_ledger()
        for charge in self.per_key_charges():
            ledger.charge(charge)
        unit = ledger.unit
        lines = [
            f"flow {self.name!r}: one step = {self.step_seconds:g} s "
            f"from {self.origin.isoformat()}",
            f"privacy unit: one event; accounting {self.privacy.accounting}; "
            f"per-key budget {ledger.budget:g} {unit}, committed at most {ledger.spent:g} {unit}",
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
        if self.privacy.accounting == "zcdp":
            lines.append(
                f"as (epsilon, delta): ({ledger.epsilon_spent(self.privacy.delta):.4g}, "
                f"{self.privacy.delta:g}) per key"
            )
        return "\n".join(lines)


def parse_duration(value: Any, where: str) -> float:
    """Parse ``"1s"``, ``"500ms"``, ``"5m"``, ``"1h"``, ``"1d"`` or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise ConfigError(f"{where} must be a duration like '1s', '500ms', '5m', got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{where} must be a finite duration >= 0, got {value!r}")
    return seconds


def _parse_time(value: Any, where: str) -> datetime:
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ConfigError(
                f"{where} must be an ISO-8601 time like '2026-01-01T00:00:00Z', got {value!r}"
            ) from None
    else:
        raise ConfigError(f"{where} must be an ISO-8601 time string, got {value!r}")
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed


class _Section:
    """Reads one TOML table, remembering which keys were used to reject typos."""

    def __init__(self, data: dict[str, Any], name: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"[{name}] must be a table, got {type(data).__name__}")
        self.data, self.name = data, name
        self.used: set[str] = set()

    def get(self, key: str, default: Any, kind: type | tuple[type, ...] | None = None) -> Any:
        self.used.add(key)
        value = self.data.get(key, default)
        if kind is not None and value is not None:
            ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                names = (kind.__name__ if isinstance(kind, type)
                         else "/".join(k.__name__ for k in kind))
                raise ConfigError(f"{self.name}.{key} must be {names}, got {value!r}")
        return value

    def where(self, key: str) -> str:
        return f"{self.name}.{key}"

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ConfigError(
                f"unknown setting(s) in [{self.name}]: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(self.used))})"
            )


def _positive(value: float, where: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{where} must be finite and > 0, got {value!r}")
    return value


def _spec(builder: Any, where: str, **kwargs: Any) -> Any:
    try:
        return builder(**kwargs)
    except InvalidParameterError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_config(raw: dict[str, Any], source: str = "<dict>") -> FlowConfig:
    """Validate a configuration mapping (as read from TOML) into a :class:`FlowConfig`."""
    known_tables = {"flow", "events", "kafka", "privacy", "counter", "monitor", "admission",
                    "metrics"}
    unknown = sorted(set(raw) - known_tables)
    if unknown:
        raise ConfigError(
            f"{source}: unknown table(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known_tables))})"
        )
    flow = _Section(raw.get("flow", {}), "flow")
    name = flow.get("name", "counters", str)
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ConfigError(f"flow.name must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")
    step_seconds = parse_duration(flow.get("step", "1m"), flow.where("step"))
    if step_seconds < 0.001:
        raise ConfigError(f"flow.step must be at least 1ms, got {flow.data.get('step')!r}")
    origin_raw = flow.get("origin", None)
    origin = _parse_time(origin_raw, flow.where("origin")) if origin_raw is not None else None
    lateness = parse_duration(flow.get("lateness", "0s"), flow.where("lateness"))
    clock = flow.get("clock", "broker", str)
    if clock not in CLOCKS:
        raise ConfigError(f"flow.clock must be 'broker' or 'producer', got {clock!r}")
    shards = flow.get("shards", 16, int)
    if not 1 <= shards <= 4096:
        raise ConfigError(f"flow.shards must be between 1 and 4096, got {shards}")
    heartbeat_raw = flow.get("heartbeat", "auto", str)
    if heartbeat_raw == "auto":
        # With broker time, one tick per step (between 1 s and 1 min). With producer time
        # the ticks would carry the flow host's clock, not the producers': off unless asked.
        heartbeat = min(max(step_seconds, 1.0), 60.0) if clock == "broker" else 0.0
    elif heartbeat_raw == "off":
        heartbeat = 0.0
    else:
        heartbeat = parse_duration(heartbeat_raw, flow.where("heartbeat"))
        if heartbeat < 0.1:
            raise ConfigError(f"flow.heartbeat must be 'auto', 'off' or at least 100ms, "
                              f"got {heartbeat_raw!r}")
    flow.finish()

    events = _Section(raw.get("events", {}), "events")
    key_field = events.get("key_field", "key", str)
    time_field = events.get("time_field", "ts", str)
    events.finish()

    kafka = _Section(raw.get("kafka", {}), "kafka")
    brokers = kafka.get("brokers", ["127.0.0.1:9092"], (list, str))
    if isinstance(brokers, str):
        brokers = [b.strip() for b in brokers.split(",") if b.strip()]
    if not brokers or not all(isinstance(b, str) and ":" in b for b in brokers):
        raise ConfigError(f"kafka.brokers must be a list of 'host:port', got {brokers!r}")
    topics = {}
    for key, default in (("input_topic", "events"), ("releases_topic", "releases"),
                         ("alerts_topic", "alerts"), ("dead_letter_topic", "dead-letters")):
        topic = kafka.get(key, default, str)
        if not _TOPIC.match(topic):
            raise ConfigError(f"kafka.{key} is not a valid Kafka topic name: {topic!r}")
        topics[key] = topic
    if len(set(topics.values())) != len(topics):
        raise ConfigError(f"kafka topics must all differ, got {topics}")
    batch_size = kafka.get("batch_size", 10_000, int)
    if batch_size < 1:
        raise ConfigError(f"kafka.batch_size must be >= 1, got {batch_size}")
    add_config = kafka.get("add_config", {}, dict)
    start_offset = kafka.get("start_offset", "earliest", str)
    if start_offset not in ("earliest", "latest", "committed"):
        raise ConfigError(f"kafka.start_offset must be 'earliest', 'latest' or 'committed', "
                          f"got {start_offset!r}")
    group_id = kafka.get("group_id", f"dpstream.{name}", str)
    if not group_id:
        raise ConfigError("kafka.group_id must not be empty")
    startup_timeout = parse_duration(kafka.get("startup_timeout", "60s"),
                                     kafka.where("startup_timeout"))
    kafka_cfg = KafkaConfig(
        brokers=tuple(brokers), tail=kafka.get("tail", True, bool), batch_size=batch_size,
        add_config={str(k): str(v) for k, v in add_config.items()}, start_offset=start_offset,
        group_id=group_id, startup_timeout_seconds=startup_timeout, **topics,
    )
    kafka.finish()

    privacy = _Section(raw.get("privacy", {}), "privacy")
    accounting = privacy.get("accounting", "pure", str)
    if accounting not in ("pure", "zcdp"):
        raise ConfigError(f"privacy.accounting must be 'pure' or 'zcdp', got {accounting!r}")
    budget = _positive(privacy.get("budget", 1.0, float), "privacy.budget")
    delta = privacy.get("delta", 1e-6, float)
    if not 0 <= delta < 1:
        raise ConfigError(f"privacy.delta must be in [0, 1), got {delta!r}")
    privacy.finish()

    counter = _Section(raw.get("counter", {}), "counter")
    horizon = counter.get("horizon", 2**20, int)
    if accounting == "pure":
        eps = _positive(counter.get("epsilon", budget * 0.7, float), "counter.epsilon")
        counter_spec = _spec(TreeCounterSpec, "[counter]", epsilon=eps, horizon=horizon)
    else:
        rho = _positive(counter.get("rho", budget * 0.7, float), "counter.rho")
        counter_spec = _spec(BltCounterSpec, "[counter]", rho=rho, horizon=horizon)
    counter.finish()

    admission = _Section(raw.get("admission", {}), "admission")
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

    monitor = _Section(raw.get("monitor", {}), "monitor")
    monitor_enabled = monitor.get("enabled", mode == "open", bool)
    monitor_spec = None
    if monitor_enabled:
        monitor_eps = _positive(monitor.get("epsilon", budget * 0.1 if accounting == "pure"
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
            # the smallest threshold that keeps the admission delta within privacy.delta
            threshold = minimal_threshold(monitor_eps, monitor_horizon, delta) if delta > 0 else 0
        monitor_spec = _spec(ThresholdMonitorSpec, "[monitor]", epsilon=monitor_eps,
                             threshold=threshold, horizon=monitor_horizon)
    else:
        for key in ("epsilon", "threshold", "horizon"):
            monitor.get(key, None)
    monitor.finish()

    if origin is None:
        if mode == "declared":
            raise ConfigError(
                "flow.origin is required with admission.mode = 'declared': declared keys are "
                "released from step 0, which starts at the origin (set it near the deployment "
                "time, e.g. origin = '2026-11-20T00:00:00Z')"
            )
        origin = datetime(1970, 1, 1, tzinfo=UTC)

    admission_cfg: AdmissionConfig
    if mode == "open":
        if monitor_spec is None:
            raise ConfigError(
                "admission.mode = 'open' needs the threshold monitor ([monitor] enabled = true): "
                "keys from the data are only released after their monitor fires"
            )
        if initial_value is None:
            initial_value = budget * 0.2
        unit = "epsilon" if accounting == "pure" else "rho"
        _positive(initial_value, f"admission.initial_{unit}")
        initial = PrivacyCharge(label="initial count", **{unit: initial_value})
        try:
            adm_delta = lazy_start_delta(monitor_spec)
        except InvalidParameterError as exc:
            raise ConfigError(f"[monitor]: {exc}") from None
        if adm_delta > delta:
            need = minimal_threshold(monitor_spec.epsilon, monitor_spec.horizon, delta)
            raise ConfigError(
                f"monitor.threshold = {monitor_spec.threshold} with monitor windows of "
                f"monitor.horizon = {monitor_spec.horizon} steps costs an admission delta of "
                f"{adm_delta:.3g}, above privacy.delta = {delta:g}; raise "
                f"monitor.threshold to at least {need}, or lower monitor.horizon, or raise "
                "monitor.epsilon"
            )
        admission_cfg = AdmissionConfig(mode="open", initial=initial, delta=adm_delta)
    else:
        if initial_value is not None:
            raise ConfigError("admission.initial_* is only used with admission.mode = 'open'")
        admission_cfg = AdmissionConfig(mode="declared", keys=tuple(keys))

    metrics = _Section(raw.get("metrics", {}), "metrics")
    metrics_port = metrics.get("port", 9464, int)
    if not 0 <= metrics_port <= 65535:
        raise ConfigError(f"metrics.port must be in 0..65535 (0 = off), got {metrics_port}")
    exact_counts = metrics.get("exact_counts", True, bool)
    metrics.finish()

    privacy_cfg = PrivacyConfig(accounting=accounting, budget=budget, delta=delta,
                                counter=counter_spec, monitor=monitor_spec)
    config = FlowConfig(
        name=name, step_seconds=step_seconds, origin=origin, lateness_seconds=lateness,
        shards=shards, clock=clock, key_field=key_field, time_field=time_field, kafka=kafka_cfg,
        privacy=privacy_cfg, admission=admission_cfg, metrics_port=metrics_port,
        metrics_exact_counts=exact_counts, heartbeat_seconds=heartbeat, source=source,
    )
    ledger = privacy_cfg.new_ledger()
    for charge in config.per_key_charges():
        if not ledger.can_afford(charge):
            costs = " + ".join(f"{c.label} {float(ledger.cost_of(c)):g}"
                               for c in config.per_key_charges())
            raise ConfigError(
                f"privacy.budget = {budget:g} {ledger.unit} per key cannot pay for {costs} "
                f"(delta {sum(c.delta for c in config.per_key_charges()):g}); raise the budget or "
                "lower the mechanisms' parameters"
            )
        ledger.charge(charge)
    return config


_ENV_OVERRIDES: Final = {
    "DPSTREAM_BROKERS": ("kafka", "brokers"),
    "DPSTREAM_INPUT_TOPIC": ("kafka", "input_topic"),
    "DPSTREAM_RELEASES_TOPIC": ("kafka", "releases_topic"),
    "DPSTREAM_ALERTS_TOPIC": ("kafka", "alerts_topic"),
    "DPSTREAM_DEAD_LETTER_TOPIC": ("kafka", "dead_letter_topic"),
    "DPSTREAM_METRICS_PORT": ("metrics", "port"),
    "DPSTREAM_FLOW_NAME": ("flow", "name"),
}


def load_config(path: str | os.PathLike[str] | None = None,
                environ: dict[str, str] | None = None) -> FlowConfig:
    """Load the TOML file at ``path`` (or ``$DPSTREAM_CONFIG``) and apply environment overrides.

    Environment overrides: ``DPSTREAM_BROKERS`` (comma-separated), ``DPSTREAM_INPUT_TOPIC``,
    ``DPSTREAM_RELEASES_TOPIC``, ``DPSTREAM_ALERTS_TOPIC``, ``DPSTREAM_DEAD_LETTER_TOPIC``,
    ``DPSTREAM_METRICS_PORT``, ``DPSTREAM_FLOW_NAME``.
    """
    env = os.environ if environ is None else environ
    if path is None:
        path = env.get(CONFIG_ENV)
        if not path:
            raise ConfigError(f"no configuration: pass a TOML file or set ${CONFIG_ENV}")
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read configuration {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"configuration {path} is not valid TOML: {exc}") from None
    for var, (table, key) in _ENV_OVERRIDES.items():
        if var in env:
            value: Any = env[var]
            if key == "port":
                try:
                    value = int(value)
                except ValueError:
                    raise ConfigError(f"${var} must be an integer, got {value!r}") from None
            raw.setdefault(table, {})[key] = value
    return parse_config(raw, source=str(path))

