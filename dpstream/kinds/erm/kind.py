"""The ERM flow kind: private classifiers released continually from a stream of labelled events.

Events (JSON objects with a feature vector, a label and an event time) are placed in steps by
the shared step clock. **One step is one block** of the paper's algorithms (Watson et al.,
:mod:`dpstream.core.erm.schedules`): a block holds whatever events fall in its step, and every
objective is normalised by the *public, nominal* block size ``b0`` (``release.block_size``)
times the number of blocks it spans — never by the private number of events, so one event
more or less changes exactly one block and moves each minimiser by at most ``L/(λ n̄)``
(:mod:`dpstream.core.erm.spec`). Cutting blocks by counts (the paper's "dynamic time
steps") would let one event shift every later block, so it is not offered.

Each configured **model stream** (``model.streams``; events name theirs in
``model.stream_field``) runs its own release schedule from step 0 (the origin): the set of
streams and their start are public, so no stream's existence or start reveals an event.
Streams are spread over shards by name. When a step closes, each stream's block (its events
sorted by input partition and offset, so a replay trains on the very same rows in the very
same order) goes to its schedule, and every model the schedule releases is published on the
models topic (``dpstream.model/1``): weights and intercept for raw (clipped) features, the
classes, the data window it depends on, its privacy cost and the per-event budget. A model
may be scored on a **public holdout** (``holdout.path``) — never on the private stream.

Algorithms (``release.algorithm``): ``continual`` (Algorithm 4 with Algorithm 2's bases: 2ε
per event, Theorem 4's remark), ``multi-resolution`` (Algorithm 2), ``sliding-window``
(Algorithm 5), ``independent`` (each block alone: the baseline), each with ``sampling``
(Algorithms 6–8) under pure ε; ``ermg`` (paper 003, Theorem 31: BBImprover over output
perturbation, (ε, δ)).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import bytewax.operators as op
from bytewax.dataflow import Stream

from dpstream.kind import ClockFactory, FlowKind, FlowParts
from dpstream.kinds.erm.config import TOPICS, ErmConfig, parse_config
from dpstream.kinds.erm.events import ErmClock
from dpstream.kinds.erm.metrics import register_metrics
from dpstream.kinds.erm.records import ModelEncoder
from dpstream.kinds.erm.shard import ErmShard
from dpstream.messages import Encoded
from dpstream.stream.clock import ShardUpdate
from dpstream.stream.operators import stepped_shards

__all__ = ["KIND", "ErmKind"]


class ErmKind:
    """The ERM flow kind (see the module docstring)."""

    name: Final[str] = "erm"
    inputs: Final[tuple[str, ...]] = ("input_topic",)
    outputs: Final[Mapping[str, str]] = {"models": "models_topic",
                                         "dead_letters": "dead_letter_topic"}
    topics: Final[Mapping[str, str]] = TOPICS

    def parse_config(self, raw: dict[str, Any], source: str) -> ErmConfig:
        """Validate an ERM configuration."""
        return parse_config(raw, source)

    def binding(self, config: ErmConfig) -> ErmConfig:
        """What a flow instance binds (the model, schedule and streams digest)."""
        return config

    def clock(self, config: ErmConfig, bases: Mapping[str, int]) -> ClockFactory:
        """The clock factory."""
        return lambda state: ErmClock(config, state)

    def wire(self, parts: FlowParts[ErmConfig], updates: Stream[tuple[str, ShardUpdate]]
             ) -> Stream[Encoded]:
        """Model-stream shards releasing models step by step, encoded as model records.

        ``parts.options["train"]`` replaces the private trainer: only ``bench/``'s
        non-private baseline uses it. ``parts.options["recovery_dir"]``: the run's recovery
        directory, under which each model stream keeps its block history (a private
        temporary directory without it: :mod:`dpstream.kinds.erm.shard`).
        """
        config = parts.config
        metrics = parts.metrics
        if metrics is not None:
            metrics.set_kind("erm")
            unit = "epsilon" if config.algorithm == "ermg" or config.accounting == "pure" \
                else "rho"
            for stream in config.streams:
                metrics.set_budget(config.algorithm, unit, config.budget, stream)
        models = stepped_shards(
            "models", updates,
            lambda state: ErmShard(config, parts.noise, parts.instance, parts.partitions,
                                   state, parts.options.get("train"),
                                   parts.options.get("recovery_dir")),
            metrics, register_metrics(metrics).observe_models if metrics is not None else None)
        return op.map("encode", models, ModelEncoder(config, parts.instance).encode)


KIND: Final[FlowKind[ErmConfig, ErmConfig, Encoded]] = ErmKind()
