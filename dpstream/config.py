"""Typed configuration: a TOML file plus ``DPSTREAM_*`` environment overrides.

A configuration names its flow kind (``flow.kind``: ``counters``, the default, or ``pmwg``).
This module reads the sections every kind shares (``[flow]``, ``[events]``, ``[kafka]``,
``[metrics]``) into a :class:`FlowConfig`; the kind (:mod:`dpstream.kinds`) reads its own
tables with the same :class:`Section` helper and returns its subclass of :class:`FlowConfig`.

Everything is validated when the configuration is loaded, so a bad setting stops the flow at
start-up with a message that names the setting, the value and what was expected, never
mid-stream. See ``deploy/counters.example.toml`` and ``deploy/pmwg.example.toml``.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from dpstream.errors import ConfigError, InvalidParameterError

__all__ = [
    "CONFIG_ENV",
    "EVENT_LEVEL",
    "ContributionConfig",
    "FlowConfig",
    "KafkaConfig",
    "Section",
    "kind_name",
    "read_config",
    "parse_duration",
]

CONFIG_ENV: Final = "DPSTREAM_CONFIG"
SpecT = TypeVar("SpecT")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
CLOCKS: Final = ("broker", "producer")
COMMON_TABLES: Final = frozenset({"flow", "events", "kafka", "metrics", "contribution"})
UNITS: Final = ("event", "user")
CAPS: Final = ("max_keys", "max_per_key", "max_rows", "max_rows_per_block", "max_blocks")
"""Every contribution cap a kind may take (each kind names the ones it takes)."""
MAX_CAP: Final = 65_535
"""The largest value of any cap (the bounding state counts in 16-bit columns)."""


@dataclass(frozen=True)
class ContributionConfig:
    """The privacy unit and, at the user level, how much one person may contribute.

    ``[contribution]`` is shared by every kind: ``unit = "event"`` (the default: one event
    is protected) or ``unit = "user"`` with ``user_field`` (the event field naming the
    person; a record without it is a dead letter), ``period`` (``"lifetime"``, the default,
    or a duration that is a whole number of steps: a person's events within one period of
    the step clock are the unit, and a person active in k periods is protected by group
    privacy over k units: k times the per-period epsilon, but k squared times the per-period
    rho under zCDP) and the kind's caps, per period (all required with ``unit =
    "user"``): counters ``max_keys`` (L0) and ``max_per_key`` (Linf); PMWG ``max_rows``; ERM
    ``max_rows_per_block`` and ``max_blocks``.

    Attributes:
        unit: ``event`` or ``user``.
        user_field: the event field that names the person (``user`` only).
        period_steps: the period in steps (None: lifetime).
        caps: the kind's caps as ``(name, value)`` pairs (empty at the event level).
    """

    unit: Literal["event", "user"] = "event"
    user_field: str = ""
    period_steps: int | None = None
    caps: tuple[tuple[str, int], ...] = ()

    @property
    def user_level(self) -> bool:
        """Whether a person (not an event) is the unit."""
        return self.unit == "user"

    def cap(self, name: str) -> int:
        """One cap (at the event level every cap is 1: one event contributes once)."""
        return dict(self.caps).get(name, 1) if self.user_level else 1

    def period_of(self, step: int) -> int:
        """The period a step lies in (0 for every step with a lifetime period)."""
        return 0 if self.period_steps is None else step // self.period_steps

    def describe(self) -> str:
        """One line: the unit, the period and the caps (no secrets)."""
        if not self.user_level:
            return "privacy unit: one event"
        period = ("lifetime" if self.period_steps is None
                  else f"per period of {self.period_steps} steps (a person active in k periods "
                       "is protected by group privacy over k units: k times the per-period epsilon "
                       "under pure accounting)")
        caps = ", ".join(f"{name} = {value}" for name, value in self.caps)
        return f"privacy unit: one person (field {self.user_field!r}), {period}; caps {caps}"


EVENT_LEVEL: Final = ContributionConfig()
"""The default unit: one event."""


@dataclass(frozen=True)
class KafkaConfig:
    """Where a flow's records come from and go to.

    ``topics`` maps each topic setting of the flow kind (``input_topic``,
    ``dead_letter_topic``, and the kind's own, e.g. ``releases_topic``) to its topic.
    """

    brokers: tuple[str, ...] = ("127.0.0.1:9092",)
    topics: dict[str, str] = field(default_factory=dict)
    tail: bool = True
    batch_size: int = 10_000
    add_config: dict[str, str] = field(default_factory=dict)
    start_offset: str = "earliest"
    """Where a partition without recovery state starts: earliest, latest or committed."""
    group_id: str = ""
    """The consumer group the input commits its position to (for lag tools)."""
    startup_timeout_seconds: float = 60.0
    """How long start-up waits for the Kafka cluster."""

    @property
    def input_topic(self) -> str:
        """The events topic."""
        return self.topics["input_topic"]

    @property
    def dead_letter_topic(self) -> str:
        """Where unusable records go."""
        return self.topics["dead_letter_topic"]

    def topic(self, setting: str) -> str:
        """The topic of a kind's topic setting (e.g. ``releases_topic``)."""
        return self.topics[setting]


@dataclass(frozen=True, kw_only=True)
class FlowConfig:
    """The settings every flow kind shares; each kind's configuration extends it."""

    name: str
    kind: str = "counters"
    step_seconds: float
    origin: datetime
    lateness_seconds: float
    shards: int
    clock: Literal["broker", "producer"]
    time_field: str
    kafka: KafkaConfig
    metrics_port: int
    metrics_exact_counts: bool = False
    """Register the exact input counts (events, dead letters): operator data, off by default."""
    metrics_host: str = "127.0.0.1"
    """The address the metrics endpoint binds (``metrics.host``): this host only by default."""
    heartbeat_seconds: float = 0.0
    """Seconds between heartbeat ticks to every input partition (0: none)."""
    tick_delay_seconds: float = 2.0
    """With ``clock = "producer"``: how far behind the flow host's clock a heartbeat tick is
    stamped, so that ticks do not overtake producers' in-flight batches."""
    max_skew_seconds: float = 86400.0
    """With ``clock = "producer"``: how far ahead of the partition's trusted clock (its
    latest tick) a record's own time may place it; later times are clamped to it."""
    end: datetime | None = None
    """The public end of a bounded run (``flow.end``): steps from its step on never close."""
    contribution: ContributionConfig = EVENT_LEVEL
    """``[contribution]``: the privacy unit and a person's caps."""
    source: str = "<dict>"

    @property
    def origin_seconds(self) -> float:
        """The origin as Unix seconds."""
        return self.origin.timestamp()

    @property
    def end_seconds(self) -> float | None:
        """``flow.end`` as Unix seconds (None: not set)."""
        return None if self.end is None else self.end.timestamp()

    @property
    def end_step(self) -> int | None:
        """The step of ``flow.end``: it and every later step never close (None: not set)."""
        if self.end is None:
            return None
        return math.floor((self.end.timestamp() - self.origin_seconds) / self.step_seconds)

    @property
    def lateness(self) -> float:
        """Alias of ``lateness_seconds`` (for the step clock)."""
        return self.lateness_seconds

    def describe(self) -> str:
        """A human summary of the flow and its privacy guarantee (no secrets)."""
        return f"flow {self.name!r} ({self.kind})"

    def describe_clock(self) -> str:
        """One line on what closes steps and where a run ends (every kind's summary)."""
        if self.clock == "producer":
            trusted = (f"clock producer: records placed by their own times within "
                       f"[clock - {self.lateness_seconds:g} s, clock + {self.max_skew_seconds:g} "
                       f"s]; only heartbeat ticks (stamped {self.tick_delay_seconds:g} s behind "
                       f"the host's clock) and broker time move the clock")
        else:
            trusted = (f"clock broker: records placed within [broker time - "
                       f"{self.lateness_seconds:g} s, broker time]; broker time moves the clock")
        ticks = (f"heartbeat every {self.heartbeat_seconds:g} s" if self.heartbeat_seconds
                 else "heartbeat off")
        if self.end is None:
            end = "no flow.end: the steps close as the clock passes them"
        else:
            end = f"flow.end {self.end.isoformat()}: steps from {self.end_step} on never close"
        return f"{trusted}; {ticks}; {end}"


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


def parse_time(value: Any, where: str) -> datetime:
    """Parse an ISO-8601 time (naive times are UTC)."""
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


class Section:
    """Reads one TOML table, remembering which keys were used to reject typos.

    Every flow kind reads its own tables with it: ``get`` a setting (type-checked), and
    ``finish`` to refuse settings nobody read (a typo), listing the known ones.
    """

    def __init__(self, data: dict[str, Any], name: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"[{name}] must be a table, got {type(data).__name__}")
        self.data, self.name = data, name
        self.used: set[str] = set()

    def get(self, key: str, default: Any, kind: type | tuple[type, ...] | None = None) -> Any:
        """The setting ``key`` (or ``default``), checked to be of type ``kind``."""
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
        """The setting's name for messages (``table.key``)."""
        return f"{self.name}.{key}"

    def finish(self) -> None:
        """Refuse settings that were never read."""
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ConfigError(
                f"unknown setting(s) in [{self.name}]: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(self.used))})"
            )


def positive(value: float, where: str) -> float:
    """Return ``value`` if finite and > 0, else a configuration error naming ``where``."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{where} must be finite and > 0, got {value!r}")
    return value


def build_spec(builder: Callable[..., SpecT], where: str, **kwargs: Any) -> SpecT:
    """Build a mechanism spec, turning its parameter error into a configuration error."""
    try:
        return builder(**kwargs)
    except InvalidParameterError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_common(raw: dict[str, Any], source: str, *, kind_tables: frozenset[str],
                 topics: dict[str, str], origin_required: str | None = None,
                 caps: tuple[str, ...] = ()
                 ) -> tuple[dict[str, Any], dict[str, Section]]:
    """Read the shared tables; return :class:`FlowConfig`'s fields and the kind's tables.

    Args:
        raw: the whole configuration mapping.
        source: where it came from (for messages).
        kind_tables: the tables the flow kind reads itself.
        topics: the kind's ``[kafka]`` topic settings and their defaults (input and
            dead-letter topics included).
        origin_required: if set, ``flow.origin`` is required and this explains why; else it
            defaults to the Unix epoch.
        caps: the ``[contribution]`` caps the kind takes (:data:`CAPS`).
    """
    known = COMMON_TABLES | kind_tables
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"{source}: unknown table(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )
    fields = _flow_section(Section(raw.get("flow", {}), "flow"), origin_required)
    events = Section(raw.get("events", {}), "events")
    kind_sections = {table: Section(raw.get(table, {}), table) for table in kind_tables
                     if not isinstance(raw.get(table), list)}  # arrays of tables: the kind's
    kind_sections["events"] = events  # the kind reads its event fields, then finishes it
    fields["time_field"] = events.get("time_field", "ts", str)
    fields["kafka"] = _kafka_section(Section(raw.get("kafka", {}), "kafka"), fields["name"],
                                     topics)
    _check_bounded_end(fields)
    metrics = Section(raw.get("metrics", {}), "metrics")
    fields["metrics_port"] = metrics.get("port", 9464, int)
    if not 0 <= fields["metrics_port"] <= 65535:
        raise ConfigError(f"metrics.port must be in 0..65535 (0 = off), "
                          f"got {fields['metrics_port']}")
    fields["metrics_exact_counts"] = metrics.get("exact_counts", False, bool)
    host = metrics.get("host", "127.0.0.1", str)
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"metrics.host must be an address such as '127.0.0.1' or '0.0.0.0' "
                          f"(every interface), got {host!r}")
    fields["metrics_host"] = host
    metrics.finish()
    fields["contribution"] = parse_contribution(
        Section(raw.get("contribution", {}), "contribution"), caps, fields["step_seconds"],
        fields["kind"])
    fields["source"] = source
    return fields, kind_sections


def parse_contribution(table: Section, caps: tuple[str, ...], step_seconds: float,
                       kind: str) -> ContributionConfig:
    """Read ``[contribution]`` (see :class:`ContributionConfig`)."""
    unit = table.get("unit", "event", str)
    if unit not in UNITS:
        raise ConfigError(f"contribution.unit must be 'event' or 'user', got {unit!r}")
    if unit == "event":
        given = sorted(set(table.data) - {"unit"})
        if given:
            raise ConfigError(f"contribution.{given[0]} is only used with contribution.unit = "
                              "'user' (the event level protects one event: nothing to cap)")
        return EVENT_LEVEL
    user_field = table.get("user_field", None, str)
    if not user_field:
        raise ConfigError("contribution.unit = 'user' needs contribution.user_field: the event "
                          "field that names the person (e.g. user_field = 'user')")
    period_raw = table.get("period", "lifetime")
    period_steps: int | None = None
    if period_raw != "lifetime":
        seconds = parse_duration(period_raw, table.where("period"))
        steps = seconds / step_seconds
        if seconds <= 0 or abs(steps - round(steps)) > 1e-9 * max(1.0, steps) or round(steps) < 1:
            raise ConfigError(f"contribution.period must be 'lifetime' or a whole number of "
                              f"steps (flow.step = {step_seconds:g} s), got {period_raw!r}")
        period_steps = round(steps)
    values: dict[str, int] = {}
    for name in caps:
        value = table.get(name, None, int)
        if value is None:
            raise ConfigError(
                f"contribution.{name} is required with contribution.unit = 'user' ({kind} "
                f"takes {', '.join(caps)}); `dpstream bounds` shows, per candidate cap, the "
                "events kept against the noise")
        if not 1 <= value <= MAX_CAP:
            raise ConfigError(f"contribution.{name} must be an integer in 1..{MAX_CAP}, "
                              f"got {value!r}")
        values[name] = value
    others = sorted((set(table.data) & set(CAPS)) - set(caps))
    if others:
        raise ConfigError(f"contribution.{others[0]} does not apply to flow.kind = {kind!r} "
                          f"(it takes {', '.join(caps) or 'no caps'})")
    table.finish()
    return ContributionConfig(unit="user", user_field=user_field, period_steps=period_steps,
                              caps=tuple(values.items()))


def _flow_section(flow: Section, origin_required: str | None) -> dict[str, Any]:
    name = flow.get("name", None, str)
    kind = flow.get("kind", "counters", str)
    if name is None:
        name = kind
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise ConfigError(f"flow.name must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")
    step_seconds = parse_duration(flow.get("step", "1m"), flow.where("step"))
    if step_seconds < 0.001:
        raise ConfigError(f"flow.step must be at least 1ms, got {flow.data.get('step')!r}")
    origin_raw = flow.get("origin", None)
    if origin_raw is None and origin_required is not None:
        raise ConfigError(f"flow.origin is required {origin_required}")
    origin = (parse_time(origin_raw, flow.where("origin")) if origin_raw is not None
              else datetime(1970, 1, 1, tzinfo=UTC))
    lateness = parse_duration(flow.get("lateness", "0s"), flow.where("lateness"))
    clock = flow.get("clock", "broker", str)
    if clock not in CLOCKS:
        raise ConfigError(f"flow.clock must be 'broker' or 'producer', got {clock!r}")
    shards = flow.get("shards", 16, int)
    if not 1 <= shards <= 4096:
        raise ConfigError(f"flow.shards must be between 1 and 4096, got {shards}")
    heartbeat_raw = flow.get("heartbeat", "auto", str)
    if heartbeat_raw == "auto":
        # One tick per step (between 1 s and 1 min), with either clock: under the broker clock
        # they keep idle partitions moving, under the producer clock they are the only records
        # that move the watermark (dpstream.stream.clock).
        heartbeat = min(max(step_seconds, 1.0), 60.0)
    elif heartbeat_raw == "off":
        heartbeat = 0.0
    else:
        heartbeat = parse_duration(heartbeat_raw, flow.where("heartbeat"))
        if heartbeat < 0.1:
            raise ConfigError(f"flow.heartbeat must be 'auto', 'off' or at least 100ms, "
                              f"got {heartbeat_raw!r}")
    tick_delay = parse_duration(flow.get("tick_delay", "2s"), flow.where("tick_delay"))
    max_skew = parse_duration(flow.get("max_skew", "1d"), flow.where("max_skew"))
    end_raw = flow.get("end", None)
    end = parse_time(end_raw, flow.where("end")) if end_raw is not None else None
    if end is not None and (end - origin).total_seconds() < step_seconds:
        raise ConfigError(
            f"flow.end must be at least one step (flow.step) after flow.origin "
            f"({origin.isoformat()}), got {end_raw!r}: no step would ever close")
    flow.finish()
    return {"name": name, "kind": kind, "step_seconds": step_seconds, "origin": origin,
            "lateness_seconds": lateness, "clock": clock, "shards": shards,
            "heartbeat_seconds": heartbeat, "tick_delay_seconds": tick_delay,
            "max_skew_seconds": max_skew, "end": end}


def _check_bounded_end(fields: dict[str, Any]) -> None:
    """Refuse a bounded run (``kafka.tail = false``) without a configured end.

    The last step a bounded run releases must be public (pitfall 14). Without ``flow.end``
    it would be where the partitions' trusted clocks stand at the end of the input: under
    the producer clock the last tick (a bounded run writes none: usually nothing would be
    released), under the broker clock the broker time of each partition's last record, which
    one event more, arriving late, moves (one record took a run from 12 release records to
    2,004). With ``flow.end`` the steps from its step on never close and every step before it
    closes at the end of the input, whatever the input held. A tailing flow needs no end: its
    steps close by broker time or heartbeat ticks as time passes. (A tailing producer-clock
    flow with ``flow.heartbeat = "off"`` is allowed: ticks may come from another writer, e.g.
    a dedicated ticker process; the runner warns at start-up.)
    """
    if not fields["kafka"].tail and fields["end"] is None:
        raise ConfigError(
            "kafka.tail = false needs flow.end: the last step a bounded run releases must be "
            "public, and without flow.end it would follow the input's last records (their "
            "broker time, or the last heartbeat tick under flow.clock = 'producer'), so one "
            "event more could change which steps exist (set flow.end to the end of the data, "
            "e.g. '2026-01-02T00:00:00Z')")


def _kafka_section(kafka: Section, name: str, topic_defaults: dict[str, str]) -> KafkaConfig:
    brokers = kafka.get("brokers", ["127.0.0.1:9092"], (list, str))
    if isinstance(brokers, str):
        brokers = [b.strip() for b in brokers.split(",") if b.strip()]
    if not brokers or not all(isinstance(b, str) and ":" in b for b in brokers):
        raise ConfigError(f"kafka.brokers must be a list of 'host:port', got {brokers!r}")
    topics = {}
    for key, default in topic_defaults.items():
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
    tail = kafka.get("tail", True, bool)
    kafka.finish()
    return KafkaConfig(
        brokers=tuple(brokers), topics=topics, tail=tail,
        batch_size=batch_size, add_config={str(k): str(v) for k, v in add_config.items()},
        start_offset=start_offset, group_id=group_id, startup_timeout_seconds=startup_timeout)


def kind_name(raw: dict[str, Any]) -> object:
    """The flow kind a configuration mapping names (``flow.kind``; ``counters`` by default).

    The platform's registry (:data:`dpstream.platform.KINDS`) turns it into the kind, which
    parses the whole mapping (:func:`dpstream.platform.parse_config`). It is the value as
    read (any TOML value): the registry refuses one that names no kind.
    """
    flow = raw.get("flow", {})
    return flow.get("kind", "counters") if isinstance(flow, dict) else "counters"


_ENV_OVERRIDES: Final = {
    "DPSTREAM_BROKERS": ("kafka", "brokers"),
    "DPSTREAM_METRICS_PORT": ("metrics", "port"),
    "DPSTREAM_METRICS_HOST": ("metrics", "host"),
    "DPSTREAM_FLOW_NAME": ("flow", "name"),
    "DPSTREAM_FLOW_CLOCK": ("flow", "clock"),
}


def read_config(path: str | os.PathLike[str] | None, environ: Mapping[str, str] | None,
                topic_settings: Callable[[object], Iterable[str]]) -> tuple[dict[str, Any], str]:
    """Read the TOML file at ``path`` (or ``$DPSTREAM_CONFIG``) and apply environment overrides.

    Returns the raw mapping and its source, for the flow kind to parse
    (:func:`dpstream.platform.load_config`); ``topic_settings`` gives the topic settings of
    the kind the mapping names (:func:`kind_name`).

    Environment overrides: ``DPSTREAM_BROKERS`` (comma-separated), ``DPSTREAM_METRICS_PORT``,
    ``DPSTREAM_METRICS_HOST``, ``DPSTREAM_FLOW_NAME``, ``DPSTREAM_FLOW_CLOCK`` (``producer`` for
    a trial on the embedded broker, which ignores LogAppendTime), and a topic setting as
    ``DPSTREAM_<SETTING>`` (e.g.
    ``DPSTREAM_INPUT_TOPIC``, ``DPSTREAM_RELEASES_TOPIC``, ``DPSTREAM_ANSWERS_TOPIC``).
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
    overrides = dict(_ENV_OVERRIDES)
    settings = topic_settings(kind_name(raw))
    overrides.update({f"DPSTREAM_{s.upper()}": ("kafka", s) for s in settings})
    for var, (table, key) in overrides.items():
        if var in env:
            value: Any = env[var]
            if key == "port":
                try:
                    value = int(value)
                except ValueError:
                    raise ConfigError(f"${var} must be an integer, got {value!r}") from None
            raw.setdefault(table, {})[key] = value
    return raw, str(path)
