"""The PMWG flow's encoder: answers as their ``dpstream.answer/1`` records.

The record's fields, order and change rules are defined by :class:`dpstream.schemas.Answer`.
"""

from __future__ import annotations

from typing import Any

from dpstream import schemas
from dpstream.core.accounting.ledger import approx_dp
from dpstream.kinds.pmwg.config import PmwgConfig
from dpstream.kinds.pmwg.shard import AnswerRecord
from dpstream.messages import Encoded

__all__ = ["AnswerEncoder"]


class AnswerEncoder:
    """Encodes answers as ``dpstream.answer/1`` records (keyed by histogram)."""

    def __init__(self, config: PmwgConfig, instance: str = "") -> None:
        self.config, self.instance = config, instance
        self.unit = "event"
        self.person: schemas.PersonLevel | None = None
        contribution = config.contribution
        if contribution.user_level:  # every answer states the per-person terms (public)
            total = config.per_person()
            period = ("lifetime" if contribution.period_steps is None
                      else f"{contribution.period_steps} steps")
            self.unit = "user"
            self.person = schemas.PersonLevel(
                period=period, caps=contribution.caps, epsilon=total["epsilon"],
                delta=total["delta"], rho=total.get("rho"))

    def encode(self, a: AnswerRecord) -> Encoded:
        """One answer record on the answers topic."""
        config = self.config
        approx = None
        if config.accounting == "zcdp":
            epsilon, delta = approx_dp(a.spent, config.delta)  # as check-config prints
            approx = schemas.ApproxDp(epsilon=epsilon, delta=delta)
        record = schemas.Answer(
            flow=config.name, instance=self.instance, histogram=a.histogram,
            mechanism=a.mechanism, id=a.query_id, step=a.step,
            window=schemas.Window.of_steps(config.origin, config.step_seconds, a.step),
            t=a.t, kind=a.kind, value=_clamp(a.value), reason=a.reason,
            hard_queries=a.hard_queries,
            privacy=schemas.Privacy(unit=self.unit, accounting=config.accounting, spent=a.spent,
                                    budget=a.budget, approx_dp=approx, person=self.person),
            kinds=None if a.kinds is None else tuple(a.kinds))
        return "answers", a.histogram.encode(), schemas.encode(record)


def _clamp(value: Any) -> Any:
    """Answers are fractions: clamping into [0, 1] is post-processing (free, never worse)."""
    if isinstance(value, list):
        return tuple(_clamp(v) for v in value)
    return None if value is None else min(1.0, max(0.0, float(value)))
