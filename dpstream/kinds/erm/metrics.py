"""The ERM kind's metric series: released models by stream and role, spend, holdout accuracy.

``dpstream_models_released_total``, ``dpstream_model_privacy_spent`` / ``_budget`` and
``dpstream_model_holdout_accuracy`` are registered at the first model record. Model records
also move the shared series of :class:`~dpstream.metrics.FlowMetrics`: a model counts as a
release of its algorithm, an ``exhausted`` record as a refusal, and each stream's spend feeds
the flow-wide spend gauges.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter, Gauge

from dpstream.kinds.erm.shard import ServingRecord
from dpstream.metrics import FlowMetrics

__all__ = ["ErmMetrics", "register_metrics"]


class ErmMetrics:
    """The ERM series of one flow's metrics (see the module docstring)."""

    def __init__(self, metrics: FlowMetrics) -> None:
        self.metrics = metrics

    def _model_series(self) -> None:
        if hasattr(self, "models"):
            return
        r = self.metrics.registry
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
        """Count released models; publish each stream's spend and holdout accuracy.

        Also counts, per algorithm (the ``mechanism`` label), the models as releases and
        an ``exhausted`` record (no model) as a refusal that exhausts the mechanism.
        """
        self._model_series()
        flow = self.metrics.flow
        for m in models:
            if isinstance(m, ServingRecord):  # it names a model: nothing to count
                continue
            self.models.labels(flow, m.stream, m.role).inc()
            self.model_spent.labels(flow, m.stream).set(m.spent)
            self.model_budget.labels(flow, m.stream).set(m.budget)
            if m.accuracy is not None:
                self.model_accuracy.labels(flow, m.stream).set(m.accuracy)
            if m.model is None:  # the stream's last record: a step was refused
                self.metrics.refused.labels(flow, m.algorithm).inc()
                self.metrics.mark_exhausted(m.algorithm)
            else:
                self.metrics.releases.labels(flow, m.algorithm).inc()
            self.metrics.track_declared(m.algorithm, m.spent, m.budget, m.stream)


def register_metrics(flow_metrics: FlowMetrics) -> ErmMetrics:
    """The ERM series of ``flow_metrics``: one object per flow metrics.

    Its series are registered at the first model.
    """
    return flow_metrics.kind_series("erm", ErmMetrics)
