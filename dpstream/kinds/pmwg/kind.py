"""The PMWG flow kind: adaptive linear queries answered privately over a growing database.

Two input topics feed the shared step clock: the **events** topic (the growing database:
JSON objects with the universe's attributes and an event time) and the **queries** topic (the
analyst: ``{"id": ..., "histogram": ..., "query": {dpstream.query/1}}``, placed at its broker
time). Each configured histogram (``[[histograms]]``) is one mechanism instance, on the shard
of its name (histograms are spread over workers like keys). When a step closes:

1. the step's events are added to the histogram's true counts;
2. the **public size** ``t`` is stepped: a continual counter (binary tree, or BLT under
   zCDP; ``size_epsilon`` / ``size_rho``) releases the number of events, and
   ``t = max(previous t, floor(estimate + 1e-9))``. The exact size would reveal whether one event is
   in the database (add/remove neighbours), so PMWG runs on this public, monotone size: the
   paper's proofs only need ``Δ_t = 1/t`` for the queries, which holds for
   ``f(D) = Σ w_i count_i / t`` with a public ``t``;
3. the step's queries are answered **in a fixed order** (input partition, then offset), each
   against the database of all steps up to this one — never against whatever Bytewax happened
   to interleave, so a replay reproduces every answer byte for byte (same noise coordinates).

Mechanisms: ``pmwg`` (:mod:`dpstream.core.pmwg.mechanism`, Algorithm 1 of the paper) and
``histogram`` (BBScheduler, Algorithm 4, over a noisy-histogram black box;
:mod:`dpstream.core.pmwg.bb_scheduler`): which to use is a matter of ``N`` against ``α·ε·t``
(docs/pmwg.md, "PMWG or a noisy histogram?").

Privacy: the unit is one event, or, with ``[contribution] unit = "user"``, one person's
rows (at most ``max_rows`` per period: the bounding stage keeps each person's first rows; the
questions, which are the analyst's, pass it unbounded). An event is in every histogram's
database, so the flow's cost per unit is the sum over histograms of each one's size counter
and mechanism cost, every noise scaled to the unit's sensitivity (derived in
:mod:`~dpstream.kinds.pmwg.config`); start-up refuses a configuration whose sum exceeds
``privacy.budget``.

The room: :mod:`~dpstream.kinds.pmwg.config` (the histograms and :func:`parse_config`),
:mod:`~dpstream.kinds.pmwg.events` (the clock's decoding of events and questions),
:mod:`~dpstream.kinds.pmwg.shard` (the histograms of one shard, stepped and answering),
:mod:`~dpstream.kinds.pmwg.records` (the answer encoder) and
:mod:`~dpstream.kinds.pmwg.metrics`; this module wires them as the kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import bytewax.operators as op
from bytewax.dataflow import Stream

from dpstream.core.pmwg.bb_scheduler import BBSchedulerSpec
from dpstream.core.pmwg.spec import PmwgSpec
from dpstream.kind import ClockFactory, FlowKind, FlowParts
from dpstream.kinds.pmwg.config import TOPICS, PmwgConfig, parse_config
from dpstream.kinds.pmwg.events import PmwgClock
from dpstream.kinds.pmwg.metrics import register_metrics
from dpstream.kinds.pmwg.records import AnswerEncoder
from dpstream.kinds.pmwg.shard import PmwgShard
from dpstream.messages import Encoded
from dpstream.metrics import FlowMetrics
from dpstream.stream.clock import ShardUpdate
from dpstream.stream.operators import stepped_shards

__all__ = ["KIND", "PmwgKind"]


def _declare_budgets(metrics: FlowMetrics, config: PmwgConfig) -> None:
    """Publish the flow's kind and each histogram's budget (size counter + mechanism)."""
    metrics.set_kind("pmwg")
    unit = "epsilon" if config.accounting == "pure" else "rho"
    for h in config.histograms:
        spec: PmwgSpec | BBSchedulerSpec | None = h.pmwg if h.pmwg is not None else h.scheduler
        assert spec is not None
        metrics.set_budget(h.mechanism, unit, h.size_cost + spec.new_ledger().budget, h.name)


class PmwgKind:
    """The PMWG flow kind (see the module docstring)."""

    name: Final[str] = "pmwg"
    inputs: Final[tuple[str, ...]] = ("input_topic", "queries_topic")
    outputs: Final[Mapping[str, str]] = {"answers": "answers_topic",
                                         "dead_letters": "dead_letter_topic"}
    topics: Final[Mapping[str, str]] = TOPICS

    def parse_config(self, raw: dict[str, Any], source: str) -> PmwgConfig:
        """Validate a PMWG configuration."""
        return parse_config(raw, source)

    def binding(self, config: PmwgConfig) -> PmwgConfig:
        """What a flow instance binds (the histograms' digest)."""
        return config

    def clock(self, config: PmwgConfig, bases: Mapping[str, int]) -> ClockFactory:
        """The clock factory: events and queries partitions, numbered by ``bases``."""
        return lambda state: PmwgClock(config, bases, state)

    def wire(self, parts: FlowParts[PmwgConfig], updates: Stream[tuple[str, ShardUpdate]]
             ) -> Stream[Encoded]:
        """Histogram shards answering questions step by step, encoded as answer records."""
        config = parts.config
        metrics = parts.metrics
        if metrics is not None:
            _declare_budgets(metrics, config)
        answers = stepped_shards(
            "histograms", updates,
            lambda state: PmwgShard(config, parts.noise, parts.instance, parts.partitions,
                                    state),
            metrics, register_metrics(metrics).observe_answers if metrics is not None else None)
        return op.map("encode", answers, AnswerEncoder(config, parts.instance).encode)


KIND: Final[FlowKind[PmwgConfig, PmwgConfig, Encoded]] = PmwgKind()
