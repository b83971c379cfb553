"""The PMWG kind's metric series: answers by histogram and kind, bottoms, hard queries, spend.

``dpstream_answers_total``, ``dpstream_bottom_answers_total``, ``dpstream_hard_queries`` and
``dpstream_histogram_privacy_spent`` / ``_budget`` are registered at the first answer (a flow
that has answered nothing shows none of them). Answers also move the shared series of
:class:`~dpstream.metrics.FlowMetrics`: those that carry a value count as releases, bottom
answers as refusals, and each histogram's spend feeds the flow-wide spend gauges.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from prometheus_client import Counter, Gauge

from dpstream.core.pmwg.mechanism import HARD_BUDGET_EXCEEDED, PRIVACY_BUDGET_EXHAUSTED
from dpstream.metrics import FlowMetrics

__all__ = ["BOTTOM_REASONS", "PmwgMetrics", "register_metrics"]

BOTTOM_REASONS: Final = {PRIVACY_BUDGET_EXHAUSTED: "privacy",
                         HARD_BUDGET_EXCEEDED: "hard_queries"}
"""PMWG's bottom reasons and the ``reason`` label of ``dpstream_bottom_answers_total``."""


class PmwgMetrics:
    """The PMWG series of one flow's metrics (see the module docstring)."""

    def __init__(self, metrics: FlowMetrics) -> None:
        self.metrics = metrics

    def _answer_series(self) -> None:
        if hasattr(self, "answers"):
            return
        r = self.metrics.registry
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
        self.bottoms = Counter(
            "dpstream_bottom_answers", "Answers that are bottom (or hold a bottom part), by "
            "histogram and the budget that ran out (privacy, hard_queries).",
            ["flow", "histogram", "reason"], registry=r)
        self._bottom_children: dict[str, dict[str, Any]] = {}

    def _bottoms_of(self, histogram: str) -> dict[str, Any]:
        """A histogram's bottom counters by reason, all at 0 from its first answer."""
        children = self._bottom_children.get(histogram)
        if children is None:
            children = {reason: self.bottoms.labels(self.metrics.flow, histogram, reason)
                        for reason in BOTTOM_REASONS.values()}
            self._bottom_children[histogram] = children
        return children

    def observe_answers(self, answers: Iterable[Any]) -> None:
        """Count answers by histogram and kind; publish each histogram's spend (no query).

        Also counts, per mechanism, the answers that carry a value as releases and the
        bottom answers as refusals (the mechanism is exhausted for good after one), and
        updates the flow-wide spend series of a mechanism declared by
        :meth:`~dpstream.metrics.FlowMetrics.set_budget`.
        """
        self._answer_series()
        flow = self.metrics.flow
        for a in answers:
            self.answers.labels(flow, a.histogram, a.kind).inc()
            self.hard_queries.labels(flow, a.histogram).set(a.hard_queries)
            self.histogram_spent.labels(flow, a.histogram, a.mechanism).set(a.spent)
            self.histogram_budget.labels(flow, a.histogram, a.mechanism).set(a.budget)
            parts = a.kinds if a.kinds is not None else [a.kind]
            bottoms = self._bottoms_of(a.histogram)
            if "bottom" in parts:
                reason = next((label for text, label in BOTTOM_REASONS.items()
                               if text in (a.reason or "")), "privacy")
                bottoms[reason].inc()
                self.metrics.refused.labels(flow, a.mechanism).inc()
                self.metrics.mark_exhausted(a.mechanism)
            if any(kind in ("easy", "hard") for kind in parts):
                self.metrics.releases.labels(flow, a.mechanism).inc()
            self.metrics.track_declared(a.mechanism, a.spent, a.budget, a.histogram)


def register_metrics(flow_metrics: FlowMetrics) -> PmwgMetrics:
    """The PMWG series of ``flow_metrics``: one object per flow metrics.

    Its series are registered at the first answer.
    """
    return flow_metrics.kind_series("pmwg", PmwgMetrics)
