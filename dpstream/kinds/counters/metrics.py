"""The counters kind's metric series: releases, alerts and refusals of its shards' outputs.

The series themselves (``dpstream_releases_total``, ``dpstream_alerts_total``,
``dpstream_refused_releases_total`` and the spend gauges) are the shared ones of
:class:`~dpstream.metrics.FlowMetrics`; what is the counters' own is how their outputs
(releases, alerts, budget statuses, or whole closed steps) move them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dpstream.core.counting.outputs import Alert, BudgetExhausted, Release
from dpstream.metrics import FlowMetrics

__all__ = ["CountersMetrics", "register_metrics"]


class CountersMetrics:
    """What the counters' outputs do to a flow's metrics (see the module docstring)."""

    def __init__(self, metrics: FlowMetrics) -> None:
        self.metrics = metrics

    def observe_outputs(self, outputs: Iterable[Any], mechanism: str) -> None:
        """Count releases, alerts and refusals and update the spend gauges.

        ``outputs`` holds outputs, or whole closed steps (``StepOutputs``, counted through
        ``count()`` and their release columns, without one object per release).
        """
        m = self.metrics
        releases = alerts = refused = 0
        for item in outputs:
            if isinstance(item, Release):
                releases += 1
                m.track_spend(item.mechanism, item.unit, item.spent, item.budget)
            elif isinstance(item, Alert):
                alerts += 1
            elif isinstance(item, BudgetExhausted):
                refused += 1
                m.track_spend(mechanism, item.unit, item.spent, item.budget)
            else:  # a closed step's outputs
                r, a, s = item.count()
                releases, alerts, refused = releases + r, alerts + a, refused + s
                for column in item.releases:
                    if len(column.keys):
                        m.track_spend(column.mechanism, column.unit, column.spent, column.budget)
                for status in item.statuses:
                    m.track_spend(mechanism, status.unit, status.spent, status.budget)
        if releases:
            m.releases.labels(m.flow, mechanism).inc(releases)
        if alerts:
            m.alerts.labels(m.flow).inc(alerts)
        if refused:
            m.refused.labels(m.flow, mechanism).inc(refused)
            m.mark_exhausted(mechanism)


def register_metrics(flow_metrics: FlowMetrics) -> CountersMetrics:
    """The counters kind's series of ``flow_metrics`` (registers nothing of its own)."""
    return flow_metrics.kind_series("counters", CountersMetrics)
