"""Prometheus metrics: privacy spend per mechanism and operational counters.

Every metric lives in the registry passed in (tests make a fresh
``CollectorRegistry``). No metric carries a key; the only labels are the flow, the
mechanism and ledger unit, the input partition, and small fixed sets (reason, role,
client). Counters count work done by this process; after a recovery, replayed work is
counted again.

**Trust model.** Metrics, logs and dead letters are *operator data*. The series fall in
three groups.

*Exact input counts* move by one with one input record. They are registered (or, for a
label value of a shared series, recorded) only with ``metrics.exact_counts = true``:
``dpstream_events_total``, ``dpstream_dead_letters_total``,
``dpstream_input_lag_records`` (records on the broker not yet read) and the
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
alerts and status records, which are private) and of the configuration:
``dpstream_releases_total``, ``dpstream_alerts_total``,
``dpstream_refused_releases_total``, ``dpstream_privacy_spent``,
``dpstream_privacy_remaining`` (both read from published records),
``dpstream_privacy_budget``, ``dpstream_output_delivered_total`` for
``role="releases"`` and ``role="alerts"``, and ``dpstream_up``. Also operational, but
counting *every* output record including dead letters (so a dead letter in flight moves
them while the broker is away): ``dpstream_output_pending_records`` and
``dpstream_output_retries_total``. ``dpstream_kafka_client_errors_total`` counts
librdkafka errors (broker and network state, not data).

With ``metrics.exact_counts = false`` the exact input counts are never registered or
recorded, for deployments whose dashboards are shown more widely than the input.

**Operational series** (all labelled ``flow``):

* ``dpstream_up`` -- 1 while the process serves metrics (count processes with ``sum``).
* ``dpstream_partition_frontier_step{partition}`` -- the first step the input partition
  has not closed; ``dpstream_partition_broker_time_seconds{partition}`` -- the latest
  trusted broker timestamp seen on it (Unix seconds).
* ``dpstream_closed_step`` -- the smallest step through which every shard of this
  process has closed (all releases up to it are out); absent while a shard that reported
  has closed nothing. ``dpstream_steps_pending`` -- the most steps a shard of this
  process holds open, waiting for a partition.
* ``dpstream_step_lag_seconds`` -- computed at scrape time: now minus the end of the
  closed step, ``origin + (closed_step + 1) * step``. A healthy flow stays between
  ``flow.lateness`` and ``flow.lateness + flow.step`` (plus the ingestion delay);
  absent until :meth:`FlowMetrics.set_clock` was called and a closed step is known.
* ``dpstream_output_pending_records`` -- records handed to the Kafka sink and not yet
  confirmed; ``dpstream_output_delivered_total{role}`` (role: releases, alerts,
  dead_letters); ``dpstream_output_retries_total`` -- records sent again after a failed
  delivery.
* ``dpstream_kafka_client_errors_total{client}`` (client: consumer, producer, admin) --
  error-level librdkafka log lines and error callbacks.
* ``dpstream_input_lag_records{partition}`` -- exact; see above.

Counters with a fixed set of label values (delivered, retries, client errors) start at 0,
so ``increase()`` sees their first increment.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from dpstream.core.key_statistics import Alert, BudgetExhausted, Release

__all__ = ["FlowMetrics"]

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
        if exact_counts:
            self.events = Counter("dpstream_events",
                                  "Events accepted into time steps (exact: operator data).",
                                  ["flow"], registry=r)
            self.dead_letters = Counter(
                "dpstream_dead_letters",
                "Records sent to the dead-letter topic, by reason (exact: operator data).",
                ["flow", "reason"], registry=r)
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
        self._lock = threading.Lock()
        self._max_spent: dict[tuple[str, str], float] = {}
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
        self._clock = clock
        self._origin_seconds: float | None = None
        self._step_seconds: float | None = None
        self._shard_closed: dict[int, int | None] = {}
        self._shard_pending: dict[int, int] = {}
        self._closed: int | None = None
        r.register(_StepLagCollector(self))

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose the registry over HTTP on ``port``."""
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

    def observe_outputs(self, outputs: Iterable[Any], mechanism: str) -> None:
        """Count releases, alerts and refusals and update the spend gauges.

        ``outputs`` holds outputs, or whole closed steps (``StepOutputs``, counted through
        ``count()`` and their release columns, without one object per release).
        """
        releases = alerts = refused = 0
        for item in outputs:
            if isinstance(item, Release):
                releases += 1
                self._track(item.mechanism, item.unit, item.spent, item.budget)
            elif isinstance(item, Alert):
                alerts += 1
            elif isinstance(item, BudgetExhausted):
                refused += 1
                self._track(mechanism, item.unit, item.spent, item.budget)
            else:  # a closed step's outputs
                r, a, s = item.count()
                releases, alerts, refused = releases + r, alerts + a, refused + s
                for column in item.releases:
                    if len(column.keys):
                        self._track(column.mechanism, column.unit, column.spent, column.budget)
                for status in item.statuses:
                    self._track(mechanism, status.unit, status.spent, status.budget)
        if releases:
            self.releases.labels(self.flow, mechanism).inc(releases)
        if alerts:
            self.alerts.labels(self.flow).inc(alerts)
        if refused:
            self.refused.labels(self.flow, mechanism).inc(refused)

    def set_budget(self, mechanism: str, unit: str, budget: float) -> None:
        """Publish the configured per-key budget."""
        self.budget.labels(self.flow, mechanism, unit).set(budget)
        with self._lock:
            if (mechanism, unit) not in self._max_spent:
                self.remaining.labels(self.flow, mechanism, unit).set(budget)
                self.spent.labels(self.flow, mechanism, unit).set(0.0)

    def _track(self, mechanism: str, unit: str, spent: float, budget: float) -> None:
        with self._lock:
            if spent > self._max_spent.get((mechanism, unit), -1.0):
                self._max_spent[(mechanism, unit)] = spent
                self.spent.labels(self.flow, mechanism, unit).set(spent)
                self.remaining.labels(self.flow, mechanism, unit).set(budget - spent)

    # -- query answers (the pmwg flow) -------------------------------------------------------

    def _answer_series(self) -> None:
        if hasattr(self, "answers"):
            return
        r = self.registry
        self.answers = Counter(
            "dpstream_answers", "Questions answered, by histogram and kind (easy, hard, "
            "bottom, error, waiting, marginal).", ["flow", "histogram", "kind"], registry=r)
        self.hard_queries = Gauge(
            "dpstream_hard_queries", "Hard queries a histogram's PMWG has answered.",
            ["flow", "histogram"], registry=r)
        self.histogram_spent = Gauge(
            "dpstream_histogram_privacy_spent",
            "Privacy a histogram has spent per event (size counter and mechanism), in the "
            "ledger unit.", ["flow", "histogram", "mechanism"], registry=r)
        self.histogram_budget = Gauge(
            "dpstream_histogram_privacy_budget",
            "Privacy a histogram may spend per event, in the ledger unit.",
            ["flow", "histogram", "mechanism"], registry=r)

    def observe_answers(self, answers: Iterable[Any]) -> None:
        """Count answers by histogram and kind; publish each histogram's spend (no query)."""
        self._answer_series()
        for a in answers:
            self.answers.labels(self.flow, a.histogram, a.kind).inc()
            self.hard_queries.labels(self.flow, a.histogram).set(a.hard_queries)
            self.histogram_spent.labels(self.flow, a.histogram, a.mechanism).set(a.spent)
            self.histogram_budget.labels(self.flow, a.histogram, a.mechanism).set(a.budget)

    # -- released models (the erm flow) ------------------------------------------------------

    def _model_series(self) -> None:
        if hasattr(self, "models"):
            return
        r = self.registry
        self.models = Counter(
            "dpstream_models_released", "Private models released, by model stream and role "
            "(base, update, window, multi-resolution, ...; 'exhausted' when a stream stops).",
            ["flow", "stream", "role"], registry=r)
        self.model_spent = Gauge(
            "dpstream_model_privacy_spent",
            "Largest privacy spend of any event in a model stream, in the ledger unit.",
            ["flow", "stream"], registry=r)
        self.model_budget = Gauge(
            "dpstream_model_privacy_budget",
            "Privacy one event may spend in a model stream (the theorems' bound).",
            ["flow", "stream"], registry=r)
        self.model_accuracy = Gauge(
            "dpstream_model_holdout_accuracy",
            "Accuracy of a stream's last released model on the public holdout.",
            ["flow", "stream"], registry=r)

    def observe_models(self, models: Iterable[Any]) -> None:
        """Count released models; publish each stream's spend and holdout accuracy."""
        self._model_series()
        for m in models:
            self.models.labels(self.flow, m.stream, m.role).inc()
            self.model_spent.labels(self.flow, m.stream).set(m.spent)
            self.model_budget.labels(self.flow, m.stream).set(m.budget)
            if m.accuracy is not None:
                self.model_accuracy.labels(self.flow, m.stream).set(m.accuracy)

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

    def observe_partition(self, partition: int, frontier_step: int | None,
                          broker_seconds: float | None) -> None:
        """Publish an input partition's frontier and latest broker time (None: unchanged)."""
        label = str(partition)
        if frontier_step is not None:
            self.partition_frontier.labels(self.flow, label).set(frontier_step)
        if broker_seconds is not None:
            self.partition_broker_time.labels(self.flow, label).set(broker_seconds)

    def observe_shard(self, shard: int, closed_step: int | None, pending_steps: int) -> None:
        """Record a shard's progress and publish the aggregate over this process's shards.

        Args:
            shard: the shard's index.
            closed_step: the last step the shard has closed (None: none yet).
            pending_steps: how many steps the shard holds open, waiting for a partition.

        ``dpstream_closed_step`` becomes the smallest closed step over the shards that
        reported (absent while one of them has closed nothing) and
        ``dpstream_steps_pending`` the largest number of pending steps.
        """
        with self._lock:
            self._shard_closed[shard] = closed_step
            self._shard_pending[shard] = pending_steps
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
            self.input_lag.labels(self.flow, str(partition)).set(records)

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
