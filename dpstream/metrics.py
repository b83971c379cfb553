"""Prometheus metrics: privacy spend per mechanism and operational counters.

Every metric lives in the registry passed in (tests make a fresh
``CollectorRegistry``). No metric carries a key or a question; the only labels are the
flow and its kind, the mechanism and ledger unit, configured histogram and model stream
names, the input partition, and small fixed sets (reason, role, client, answer kind).
Counters count work done by this process; after a recovery, replayed work is counted
again. docs/metrics.md lists every series.

**Trust model.** Metrics, logs and dead letters are *operator data*. The series fall in
three groups.

*Exact input counts* move by one with one input record. They are registered (or, for a
label value of a shared series, recorded) only with ``metrics.exact_counts = true``:
``dpstream_events_total``, ``dpstream_dead_letters_total``,
``dpstream_clamped_records_total`` (records placed at a limit of the producer clock's
clamp), ``dpstream_input_lag_records`` (records on the broker not yet read) and the
``role="dead_letters"`` series of ``dpstream_output_delivered_total``.

*Input timing* is a function of the broker timestamps of the input records, not of
their number: ``dpstream_partition_broker_time_seconds`` (the latest trusted broker
timestamp of a partition, which one record arriving on an idle partition moves),
``dpstream_partition_frontier_step``, and what is derived from the frontiers:
``dpstream_closed_step``, ``dpstream_steps_pending`` and ``dpstream_step_lag_seconds``.
Timing is outside the privacy guarantee (NOTES.md): *when* a step's releases appear
already tells that every partition received a record after the step ended; these
series say it per partition and to the second. They stay registered with
``exact_counts = false`` because the stall alerts need them.

*Published or configured data* is a function of what the flow publishes (releases,
alerts, status records, answers and models, which are private) and of the configuration:
``dpstream_releases_total``, ``dpstream_alerts_total``,
``dpstream_refused_releases_total``, ``dpstream_budget_exhausted``,
``dpstream_privacy_spent``, ``dpstream_privacy_remaining`` (both read from published
records), ``dpstream_privacy_budget``, ``dpstream_flow_info``,
``dpstream_flow_instance_info`` (the flow instance id, random), the PMWG series
(``dpstream_answers_total``, ``dpstream_bottom_answers_total``,
``dpstream_hard_queries``, ``dpstream_histogram_privacy_*``), the ERM series
(``dpstream_models_released_total``, ``dpstream_model_*``),
``dpstream_output_delivered_total`` for the roles but ``dead_letters``, and
``dpstream_up``. Also operational, but
counting *every* output record including dead letters (so a dead letter in flight moves
them while the broker is away): ``dpstream_output_pending_records`` and
``dpstream_output_retries_total``. ``dpstream_kafka_client_errors_total`` counts
librdkafka errors (broker and network state, not data).

With ``metrics.exact_counts = false`` the exact input counts are never registered or
recorded, for deployments whose dashboards are shown more widely than the input.

**Record warnings** (log lines, gated like the counts). An undecodable record (a dead letter
``undecodable record (<ExceptionType>)``) and a record placed at a limit of the producer
clock's clamp (stamped more than ``flow.max_skew`` ahead of its partition's trusted clock, or
more than ``flow.lateness`` behind it: INFO, as that record is counted in the open step, the
designed way to absorb a slow producer's batches) each log a WARNING. With ``exact_counts`` it names
``topic[partition]`` and the offset (never a value of the record), at most one line per
partition and kind a minute (:data:`RECORD_WARNING_SECONDS`), the next line saying how many
were not logged in between. Without ``exact_counts`` (an offset and a count of such records
are exact input data) each kind is logged once per process, naming no partition, offset or
count, and saying that the details need ``metrics.exact_counts = true``.

**Privacy series** (labelled ``flow``; ``mechanism`` is the counter's, PMWG's ``pmwg`` or
``histogram``, or the ERM release algorithm; ``unit`` is ``epsilon`` or ``rho``):
``dpstream_privacy_spent``, ``_budget`` and ``_remaining`` follow the key (counters),
histogram (pmwg) or model stream (erm) of the mechanism closest to exhaustion in this
process; ``dpstream_releases_total`` counts counter releases, PMWG answers that carry a
value and ERM models; ``dpstream_refused_releases_total`` counts status records, bottom
answers and ``exhausted`` model records, each of which sets
``dpstream_budget_exhausted`` to 1.

**Operational series** (all labelled ``flow``):

* ``dpstream_up`` -- 1 while the process serves metrics (count processes with ``sum``).
* ``dpstream_partition_frontier_step{partition}`` -- the first step the input partition
  (``partition="topic[p]"``: its topic and its partition there) has not closed;
  ``dpstream_partition_broker_time_seconds{partition}`` -- the latest
  trusted broker timestamp seen on it (Unix seconds).
* ``dpstream_closed_step`` -- the smallest step through which every shard of this
  process has closed (all releases up to it are out); absent while a shard that reported
  has closed nothing. ``dpstream_steps_pending`` -- the most steps a shard of this
  process holds open, waiting for a partition. ``dpstream_backlog_steps`` -- steps every
  partition has passed that the shards have not closed yet (a ``flow.origin`` in the past,
  or a restart after an outage): closed in chunks, each written out as it closes.
* ``dpstream_step_lag_seconds`` -- computed at scrape time: now minus the end of the
  closed step, ``origin + (closed_step + 1) * step``. A healthy flow stays between
  ``flow.lateness`` and ``flow.lateness + flow.step`` (plus the ingestion delay, and
  ``flow.tick_delay`` under the producer clock); negative only if the trusted clock is ahead
  of this host's or a bounded run closed through a ``flow.end`` that lies ahead;
  absent until :meth:`FlowMetrics.set_clock` was called and a closed step is known.
* ``dpstream_output_pending_records`` -- records handed to the Kafka sink and not yet
  confirmed; ``dpstream_output_delivered_total{role}`` (role: releases, alerts,
  dead_letters); ``dpstream_output_retries_total`` -- records sent again after a failed
  delivery.
* ``dpstream_kafka_client_errors_total{client}`` (client: consumer, producer, admin) --
  error-level librdkafka log lines and error callbacks.
* ``dpstream_input_lag_records{partition}`` -- exact; see above.
* ``dpstream_bounding_events_total{outcome}`` -- exact; at the user level, the events the
  contribution bounding kept (``outcome="kept"``) or dropped beyond a person's caps
  (``"dropped"``); never a person.
* ``dpstream_clamped_records_total{topic, bound}`` -- exact; records of an input topic
  placed at a limit of the producer clock's clamp (``bound="ahead"``: stamped more than
  ``flow.max_skew`` ahead of the partition's trusted clock; ``"behind"``: more than
  ``flow.lateness`` behind it). Starts at 0 for every input topic and bound.
* ``dpstream_topology_anomalies_total{topic, reason}`` -- a re-created, re-partitioned or
  truncated input topic (:mod:`dpstream.topology`): a changed partition count, a vanished
  partition, a recovery offset past a partition's end, offsets that went back.

Counters with a fixed set of label values (delivered, retries, client errors) start at 0,
so ``increase()`` sees their first increment.

**Where the series live.** This module holds what every kind shares (the privacy series, the
operational series, the record warnings); each kind registers its own series and moves the
shared ones from its outputs, in its package: ``dpstream.kinds.counters.metrics`` (releases,
alerts and statuses), ``dpstream.kinds.pmwg.metrics`` (answers) and
``dpstream.kinds.erm.metrics`` (models), each through a ``register_metrics(flow_metrics)``
that returns the kind's series object (one per :class:`FlowMetrics`:
:meth:`FlowMetrics.kind_series`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

__all__ = ["FlowMetrics", "RecordWarnings"]

T = TypeVar("T")

log = logging.getLogger("dpstream")

RECORD_WARNING_SECONDS: Final = 60.0
"""At most one record warning per input partition and kind in this many seconds."""
CLAMP_BOUNDS: Final = ("ahead", "behind")
"""The ``bound`` label values of ``dpstream_clamped_records_total``."""
_SKIP_HINT: Final = ("(if a record still crashes the flow, quarantine it with dpstream run "
                     "--skip-record)")
_CLAMPED: Final = {
    "ahead": ("stamped more than flow.max_skew ahead of its partition's clock (heartbeat "
              "ticks): counted at the limit"),
    "behind": ("stamped more than flow.lateness behind its partition's clock (heartbeat "
               "ticks): counted at the limit"),
}


class RecordWarnings:
    """The WARNING lines for undecodable and clamped input records (see the module doc).

    Args:
        exact_counts: ``metrics.exact_counts``: name partitions and offsets, rate-limited;
            without it, one line per kind and process, with neither.
        clock: monotonic seconds (``time.monotonic`` if None).
    """

    def __init__(self, exact_counts: bool, clock: Callable[[], float] | None = None) -> None:
        self.exact_counts = exact_counts
        self._clock = clock if clock is not None else time.monotonic
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._once: set[str] = set()

    def undecodable(self, partition: str, offset: int | None, reason: str) -> None:
        """A record of ``partition`` (``topic[p]``) at ``offset`` became a dead letter."""
        if not self.exact_counts:
            self._first("undecodable", "an input record could not be decoded (%s) and went to "
                        "the dead-letter topic %s; further undecodable records are not logged "
                        "and no line names where they are: that needs metrics.exact_counts = "
                        "true (the dead-letter topic holds them all)", reason, _SKIP_HINT)
            return
        more = self._allowed("undecodable", partition, 1)
        if more is not None:
            log.warning("input %s offset %s: %s -> dead letter %s%s", partition, offset, reason,
                        _SKIP_HINT, _more(more))

    def clamped(self, partition: str, bound: str, count: int, offset: int | None) -> None:
        """``count`` records of ``partition`` from ``offset`` on were placed at ``bound``."""
        what = _CLAMPED[bound]
        if not self.exact_counts:
            self._first("clamped_" + bound, "an input record was %s; further such records "
                        "are not logged and no line names where they are: that needs "
                        "metrics.exact_counts = true", what,
                        level=logging.WARNING if bound == "ahead" else logging.INFO)
            return
        more = self._allowed("clamped_" + bound, partition, count)
        if more is not None:  # behind: counted in the open step (a slow or overtaken producer)
            log.log(logging.WARNING if bound == "ahead" else logging.INFO,
                    "input %s offset %s: record %s%s", partition, offset, what, _more(more))

    def _first(self, kind: str, message: str, *args: object,
               level: int = logging.WARNING) -> None:
        with self._lock:
            if kind in self._once:
                return
            self._once.add(kind)
        log.log(level, message, *args)

    def _allowed(self, kind: str, partition: str, count: int) -> int | None:
        """None: not now (counted as suppressed); else how many were suppressed before."""
        now = self._clock()
        key = (kind, partition)
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < RECORD_WARNING_SECONDS:
                self._suppressed[key] = self._suppressed.get(key, 0) + count
                return None
            self._last[key] = now
            return self._suppressed.pop(key, 0) + count - 1


def _more(count: int) -> str:
    return f" ({count} more such record(s) since the last line not logged)" if count else ""

OUTPUT_ROLES: Final = ("releases", "alerts", "answers", "models", "dead_letters")
"""The ``role`` label values of ``dpstream_output_delivered_total``."""
KAFKA_CLIENTS: Final = ("consumer", "producer", "admin")
"""The ``client`` label values of ``dpstream_kafka_client_errors_total``."""


class FlowMetrics:
    """The metrics of one flow in one process.

    Args:
        flow: the flow's name (the ``flow`` label).
        registry: where to register; a fresh one if None.
        exact_counts: register the exact input counts (events, dead letters, input lag,
            delivered dead letters).
        clock: wall-clock time in Unix seconds, read at scrape time for
            ``dpstream_step_lag_seconds``; ``time.time`` if None.

    Every ``observe_*`` method is thread-safe and cheap enough to call once per batch.
    """

    def __init__(self, flow: str, registry: CollectorRegistry | None = None,
                 exact_counts: bool = True, *,
                 clock: Callable[[], float] | None = None) -> None:
        self.flow = flow
        self.registry = registry if registry is not None else CollectorRegistry()
        self.exact_counts = exact_counts
        r = self.registry
        self.record_warnings = RecordWarnings(exact_counts)
        if exact_counts:
            self.clamped = Counter(
                "dpstream_clamped_records",
                "Input records placed at a limit of the producer clock's clamp, by topic and "
                "bound (ahead: stamped more than flow.max_skew ahead of the partition's "
                "clock; behind: more than flow.lateness behind it) (exact: operator data).",
                ["flow", "topic", "bound"], registry=r)
            self.events = Counter("dpstream_events",
                                  "Events accepted into time steps (exact: operator data).",
                                  ["flow"], registry=r)
            self.dead_letters = Counter(
                "dpstream_dead_letters",
                "Records sent to the dead-letter topic, by reason (exact: operator data).",
                ["flow", "reason"], registry=r)
            self.bounding = Counter(
                "dpstream_bounding_events",
                "Events the contribution bounding kept or dropped at the user level, by "
                "outcome (exact: operator data).", ["flow", "outcome"], registry=r)
        self.releases = Counter("dpstream_releases", "Private counts released.",
                                ["flow", "mechanism"], registry=r)
        self.refused = Counter("dpstream_refused_releases",
                               "Charges refused by a ledger (the key stops releasing).",
                               ["flow", "mechanism"], registry=r)
        self.alerts = Counter("dpstream_alerts", "Threshold monitors that fired.",
                              ["flow"], registry=r)
        self.spent = Gauge("dpstream_privacy_spent",
                           "Largest privacy spend of any key (event-level), in the ledger unit.",
                           ["flow", "mechanism", "unit"], registry=r)
        self.budget = Gauge("dpstream_privacy_budget", "Per-key privacy budget.",
                            ["flow", "mechanism", "unit"], registry=r)
        self.remaining = Gauge("dpstream_privacy_remaining",
                               "Smallest remaining budget of any key, in the ledger unit.",
                               ["flow", "mechanism", "unit"], registry=r)
        self.exhausted = Gauge(
            "dpstream_budget_exhausted",
            "1 once this process published that a key, histogram or model stream of the "
            "mechanism can release no more (status record, bottom answer, exhausted model).",
            ["flow", "mechanism"], registry=r)
        self.info = Gauge("dpstream_flow_info", "1, labelled with the flow's kind.",
                          ["flow", "kind"], registry=r)
        self.instance_info = Gauge(
            "dpstream_flow_instance_info",
            "1, labelled with the flow instance this process runs (the records' 'instance').",
            ["flow", "flow_instance"], registry=r)
        self._lock = threading.Lock()
        self._spent_by_stream: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
        self._units: dict[str, str] = {}
        self._kind_series: dict[str, Any] = {}  # a kind's series object, by kind
        self._init_operational(r, clock if clock is not None else time.time)

    def _init_operational(self, r: CollectorRegistry, clock: Callable[[], float]) -> None:
        flow = self.flow
        self.up = Gauge("dpstream_up", "1 while this process of the flow serves metrics.",
                        ["flow"], registry=r)
        self.up.labels(flow).set(1)
        self.partition_frontier = Gauge(
            "dpstream_partition_frontier_step",
            "First step the input partition has not closed (input timing).",
            ["flow", "partition"], registry=r)
        self.partition_broker_time = Gauge(
            "dpstream_partition_broker_time_seconds",
            "Latest trusted broker timestamp seen on the input partition, Unix seconds "
            "(input timing).", ["flow", "partition"], registry=r)
        self.closed_step = Gauge(
            "dpstream_closed_step",
            "Smallest step through which every shard of this process has closed "
            "(all releases up to it are out).", ["flow"], registry=r)
        self.steps_pending = Gauge(
            "dpstream_steps_pending",
            "Largest number of steps a shard of this process holds open, waiting for a "
            "partition.", ["flow"], registry=r)
        self.backlog_steps = Gauge(
            "dpstream_backlog_steps",
            "Steps every input partition has passed that shards of this process have not "
            "closed yet (summed over the shards): a backlog being closed in chunks.",
            ["flow"], registry=r)
        self.output_pending = Gauge(
            "dpstream_output_pending_records",
            "Records handed to the Kafka sink and not yet confirmed delivered.",
            ["flow"], registry=r)
        self.output_pending.labels(flow).set(0)
        self.output_delivered = Counter(
            "dpstream_output_delivered",
            "Records the broker confirmed, by output role (dead_letters: exact, operator "
            "data).", ["flow", "role"], registry=r)
        self._delivered_roles = tuple(role for role in OUTPUT_ROLES
                                      if self.exact_counts or role != "dead_letters")
        self._delivered = {role: self.output_delivered.labels(flow, role)
                           for role in self._delivered_roles}
        self.output_retries = Counter(
            "dpstream_output_retries",
            "Output records sent again after a failed delivery (broker away).",
            ["flow"], registry=r)
        self._retries = self.output_retries.labels(flow)
        self.kafka_client_errors = Counter(
            "dpstream_kafka_client_errors",
            "Error-level librdkafka log lines and error callbacks, by client.",
            ["flow", "client"], registry=r)
        self._kafka_errors = {client: self.kafka_client_errors.labels(flow, client)
                              for client in KAFKA_CLIENTS}
        if self.exact_counts:
            self.input_lag = Gauge(
                "dpstream_input_lag_records",
                "Records on the broker not yet read, by partition (exact: operator data).",
                ["flow", "partition"], registry=r)
        self.topology_anomalies = Counter(
            "dpstream_topology_anomalies",
            "Input topology anomalies, by topic and reason (partition_count_changed, "
            "partition_vanished, offset_past_end, offsets_went_back): a re-created, "
            "re-partitioned or truncated input topic.", ["flow", "topic", "reason"], registry=r)
        self._clock = clock
        self._partition_names: list[str] = []
        self._origin_seconds: float | None = None
        self._step_seconds: float | None = None
        self._shard_closed: dict[int, int | None] = {}
        self._shard_pending: dict[int, int] = {}
        self._shard_backlog: dict[int, int] = {}
        self._closed: int | None = None
        r.register(_StepLagCollector(self))

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose the registry over HTTP on ``addr:port`` (this host only by default)."""
        start_http_server(port, addr=addr, registry=self.registry)

    def observe_input(self, name: str, amount: int) -> None:
        """Count parsed events (``events``) or dead letters (``dead_letter:<reason>``)."""
        if not self.exact_counts:
            return
        if name == "events":
            if amount:
                self.events.labels(self.flow).inc(amount)
        elif name.startswith("dead_letter:"):
            self.dead_letters.labels(self.flow, name.split(":", 1)[1]).inc(amount)

    def observe_bounding(self, kept: int, dropped: int) -> None:
        """Count the events a closed step's contribution bounding kept and dropped.

        Exact operator data (how much people contribute beyond the caps): recorded only with
        ``exact_counts``.
        """
        if self.exact_counts:
            if kept:
                self.bounding.labels(self.flow, "kept").inc(kept)
            if dropped:
                self.bounding.labels(self.flow, "dropped").inc(dropped)

    def observe_undecodable(self, partition: int, offset: int | None, reason: str) -> None:
        """Log an undecodable record (a dead letter; counted by :meth:`observe_input`)."""
        self.record_warnings.undecodable(self.partition_name(partition), offset, reason)

    def observe_clamped(self, partition: int, topic: str, bound: str, count: int,
                        offset: int | None) -> None:
        """Count ``count`` records of ``topic`` placed at a clamp's ``bound``, and log them.

        ``offset``: the first of them. The count is exact: recorded only with
        ``exact_counts`` (the log line is gated the same way: :class:`RecordWarnings`).
        """
        if bound not in CLAMP_BOUNDS:
            raise ValueError(f"bound must be one of {', '.join(CLAMP_BOUNDS)}, got {bound!r}")
        if self.exact_counts and count:
            self.clamped.labels(self.flow, topic, bound).inc(count)
        self.record_warnings.clamped(self.partition_name(partition), bound, count, offset)

    def kind_series(self, kind: str, make: Callable[[FlowMetrics], T]) -> T:
        """The series object of flow kind ``kind``, made by ``make(self)`` on the first call.

        Each kind registers its own series (its ``register_metrics``); this keeps one object
        per kind, so that its series are registered once in the registry.
        """
        with self._lock:
            series = self._kind_series.get(kind)
            if series is None:
                series = self._kind_series[kind] = make(self)
        return series

    def set_instance(self, instance: str) -> None:
        """Publish ``dpstream_flow_instance_info{flow_instance}`` (``dpstream budget --instance``).

        The label is ``flow_instance``: Prometheus gives ``instance`` to the scrape target.
        """
        self.instance_info.labels(self.flow, instance).set(1)

    def set_kind(self, kind: str) -> None:
        """Publish ``dpstream_flow_info{kind}`` (counters, pmwg, erm): rules select by it.

        A counters flow's monitor alerts start at 0 (other kinds have no monitor).
        """
        self.info.labels(self.flow, kind).set(1)
        if kind == "counters":
            self.alerts.labels(self.flow)

    def set_budget(self, mechanism: str, unit: str, budget: float, stream: str = "") -> None:
        """Publish a configured budget: per key (counters), or of one histogram or stream.

        Declares the mechanism's ledger unit (``epsilon`` or ``rho``) and starts its
        releases, refusals and exhaustion series at 0, so a dashboard shows them and
        ``increase()`` sees their first increment. ``stream`` names the histogram or model
        stream, "" for the counters' keys: their spent starts at 0 (a key commits its
        cost with its first release). A histogram or model stream counts in the spend
        series from its first published record in this process, so a restart shows a gap,
        not a false drop to 0 that a burn rate would read as spending.
        """
        flow = self.flow
        self.releases.labels(flow, mechanism)
        self.refused.labels(flow, mechanism)
        with self._lock:
            if mechanism not in self._units:  # a later stream must not reset it
                self.exhausted.labels(flow, mechanism).set(0)
            self._units[mechanism] = unit
            if stream:
                self.budget.labels(flow, mechanism, unit).set(budget)
                return
            streams = self._spent_by_stream.setdefault((mechanism, unit), {})
            spent = streams.get(stream, (0.0, budget))[0]
            streams[stream] = (spent, budget)
            self._publish_spend(mechanism, unit, streams)

    def track_spend(self, mechanism: str, unit: str, spent: float, budget: float,
                    stream: str = "") -> None:
        """Record a published spend; publish the key or stream closest to exhaustion."""
        with self._lock:
            streams = self._spent_by_stream.setdefault((mechanism, unit), {})
            known = streams.get(stream)
            if known is not None and spent <= known[0] and budget == known[1]:
                return
            streams[stream] = (max(spent, known[0]) if known else spent, budget)
            self._publish_spend(mechanism, unit, streams)

    def _publish_spend(self, mechanism: str, unit: str,
                       streams: dict[str, tuple[float, float]]) -> None:
        spent, budget = min(streams.values(), key=lambda sb: (sb[1] - sb[0], -sb[0]))
        labels = (self.flow, mechanism, unit)
        self.spent.labels(*labels).set(spent)
        self.budget.labels(*labels).set(budget)
        self.remaining.labels(*labels).set(budget - spent)

    def mark_exhausted(self, mechanism: str) -> None:
        """Set ``dpstream_budget_exhausted`` of ``mechanism`` to 1 (a published refusal)."""
        self.exhausted.labels(self.flow, mechanism).set(1)

    def track_declared(self, mechanism: str, spent: float, budget: float,
                       stream: str) -> None:
        """Track a histogram's or stream's spend if its mechanism's unit is declared."""
        unit = self._units.get(mechanism)
        if unit is not None:
            self.track_spend(mechanism, unit, spent, budget, stream)

    # -- operational series -----------------------------------------------------------------

    def set_clock(self, origin_seconds: float, step_seconds: float) -> None:
        """Set the flow's step grid (``flow.origin``, ``flow.step``) for the step lag.

        Raises:
            ValueError: origin not finite, or step not finite and > 0.
        """
        if not math.isfinite(origin_seconds):
            raise ValueError(f"origin_seconds must be finite, got {origin_seconds!r}")
        if not (math.isfinite(step_seconds) and step_seconds > 0):
            raise ValueError(f"step_seconds must be finite and > 0, got {step_seconds!r}")
        with self._lock:
            self._origin_seconds = float(origin_seconds)
            self._step_seconds = float(step_seconds)

    def observe_topology(self, topic: str, reason: str) -> None:
        """Count one input topology anomaly of ``topic`` (see :mod:`dpstream.topology`).

        Raises:
            ValueError: an unknown reason.
        """
        from dpstream.topology import REASONS

        if reason not in REASONS:
            raise ValueError(f"reason must be one of {', '.join(REASONS)}, got {reason!r}")
        self.topology_anomalies.labels(self.flow, topic, reason).inc()

    def declare_input_topics(self, topics: Iterable[str]) -> None:
        """Start ``dpstream_topology_anomalies_total`` at 0 for every input topic and reason.

        And, with ``exact_counts``, ``dpstream_clamped_records_total`` for every input topic
        and bound.

        The series then exist from the start (the alert's and the dashboards' selectors find
        them), and ``increase()`` sees a first anomaly.
        """
        from dpstream.topology import REASONS

        for topic in topics:
            for reason in REASONS:
                self.topology_anomalies.labels(self.flow, topic, reason)
            if self.exact_counts:
                for bound in CLAMP_BOUNDS:
                    self.clamped.labels(self.flow, topic, bound)

    def set_partition_names(self, names: Sequence[str]) -> None:
        """Name the flow's input partitions (``topic[partition]``), by flow partition number.

        A flow numbers the partitions of all its input topics one after the other; the
        ``partition`` label and the log lines name each by its topic and its own partition.
        """
        self._partition_names = list(names)

    def partition_name(self, partition: int) -> str:
        """``topic[partition]`` of a flow input partition (its number if it has no name)."""
        names = self._partition_names
        return names[partition] if 0 <= partition < len(names) else str(partition)

    def observe_partition(self, partition: int, frontier_step: int | None,
                          broker_seconds: float | None) -> None:
        """Publish an input partition's frontier and latest broker time (None: unchanged)."""
        label = self.partition_name(partition)
        if frontier_step is not None:
            self.partition_frontier.labels(self.flow, label).set(frontier_step)
        if broker_seconds is not None:
            self.partition_broker_time.labels(self.flow, label).set(broker_seconds)

    def observe_shard(self, shard: int, closed_step: int | None, pending_steps: int,
                      backlog_steps: int = 0) -> None:
        """Record a shard's progress and publish the aggregate over this process's shards.

        Args:
            shard: the shard's index.
            closed_step: the last step the shard has closed (None: none yet).
            pending_steps: how many steps the shard holds open, waiting for a partition.
            backlog_steps: how many steps every partition has passed that the shard has not
                closed yet (a backlog it closes in chunks).

        ``dpstream_closed_step`` becomes the smallest closed step over the shards that
        reported (absent while one of them has closed nothing),
        ``dpstream_steps_pending`` the largest number of pending steps and
        ``dpstream_backlog_steps`` the sum of the backlogs.
        """
        with self._lock:
            self._shard_closed[shard] = closed_step
            self._shard_pending[shard] = pending_steps
            self._shard_backlog[shard] = backlog_steps
            self.backlog_steps.labels(self.flow).set(sum(self._shard_backlog.values()))
            known = [c for c in self._shard_closed.values() if c is not None]
            closed = min(known) if len(known) == len(self._shard_closed) else None
            pending = max(self._shard_pending.values())
            if closed is None:
                if self._closed is not None:
                    self.closed_step.remove(self.flow)
            else:
                self.closed_step.labels(self.flow).set(closed)
            self._closed = closed
            self.steps_pending.labels(self.flow).set(pending)

    def observe_input_lag(self, partition: int, records: int) -> None:
        """Publish how many records of an input partition are on the broker and not yet read.

        An exact count: recorded only with ``exact_counts``.
        """
        if self.exact_counts:
            self.input_lag.labels(self.flow, self.partition_name(partition)).set(records)

    def observe_delivery(self, pending: int, delivered: dict[str, int], retried: int) -> None:
        """Publish the Kafka sink's state.

        Args:
            pending: records handed to the producer and not yet confirmed (a level).
            delivered: records confirmed since the last call, by role (``releases``,
                ``alerts``, ``dead_letters``); dead letters are dropped without
                ``exact_counts``.
            retried: records sent again since the last call after a failed delivery.

        Raises:
            ValueError: an unknown role, or a negative amount.
        """
        for role, amount in delivered.items():
            if role not in OUTPUT_ROLES:
                raise ValueError(f"delivered role must be one of {', '.join(OUTPUT_ROLES)}, "
                                 f"got {role!r}")
            if amount < 0:
                raise ValueError(f"delivered[{role!r}] must be >= 0, got {amount}")
        if retried < 0:
            raise ValueError(f"retried must be >= 0, got {retried}")
        self.output_pending.labels(self.flow).set(pending)
        for role, amount in delivered.items():
            child = self._delivered.get(role)
            if child is not None and amount:
                child.inc(amount)
        if retried:
            self._retries.inc(retried)

    def observe_kafka_error(self, client: str) -> None:
        """Count one error-level librdkafka log line or error callback of ``client``.

        Raises:
            ValueError: ``client`` is not one of consumer, producer, admin.
        """
        counter = self._kafka_errors.get(client)
        if counter is None:
            raise ValueError(f"client must be one of {', '.join(KAFKA_CLIENTS)}, got {client!r}")
        counter.inc()

    def step_lag_seconds(self) -> float | None:
        """Now minus the end of the closed step, or None until both clock and step are known."""
        with self._lock:
            origin, step, closed = self._origin_seconds, self._step_seconds, self._closed
        if origin is None or step is None or closed is None:
            return None
        return self._clock() - (origin + (closed + 1) * step)


class _StepLagCollector:
    """Yields ``dpstream_step_lag_seconds``, computed when Prometheus scrapes."""

    NAME: Final = "dpstream_step_lag_seconds"
    HELP: Final = ("Wall-clock now minus the end time of dpstream_closed_step "
                   "(origin + (closed_step + 1) * step).")

    def __init__(self, metrics: FlowMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.HELP, labels=["flow"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["flow"])
        lag = self._metrics.step_lag_seconds()
        if lag is not None:
            family.add_metric([self._metrics.flow], lag)
        yield family
