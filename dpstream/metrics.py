"""Prometheus metrics: privacy spend per mechanism and operational counters.

Every metric lives in the registry passed in (tests make a fresh
``CollectorRegistry``). No metric carries a key. Counters count work done by this
process; after a recovery, replayed work is counted again.

**Trust model.** Metrics, logs and dead letters are *operator data*. Two series are
exact, data-dependent counts of the input and move by one per event:
``dpstream_events_total`` and ``dpstream_dead_letters_total``. Every other series is a
function of what the flow publishes (releases, alerts and status records, which are
private) and of the configuration: ``dpstream_releases_total``, ``dpstream_alerts_total``,
``dpstream_refused_releases_total``, ``dpstream_privacy_spent``,
``dpstream_privacy_remaining`` (both read from published records) and
``dpstream_privacy_budget``. With ``metrics.exact_counts = false`` the two exact series are
never registered, for deployments whose dashboards are shown more widely than the input.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from dpstream.core.key_statistics import Alert, BudgetExhausted, Output, Release

__all__ = ["FlowMetrics"]


class FlowMetrics:
    """The metrics of one flow in one process.

    Args:
        flow: the flow's name (the ``flow`` label).
        registry: where to register; a fresh one if None.
        exact_counts: register the two exact input counts (events, dead letters).
    """

    def __init__(self, flow: str, registry: CollectorRegistry | None = None,
                 exact_counts: bool = True) -> None:
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

    def observe_outputs(self, outputs: Iterable[Output], mechanism: str) -> None:
        """Count releases, alerts and refusals and update the spend gauges."""
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
