"""The platform every flow kind runs on: Kafka in and out, the step clock, dead letters.

:func:`build_flow` wires any flow kind (:mod:`dpstream.kinds`)::

    input topics (KafkaInput per topic, or an in-memory source)
      -> assign_steps      the kind's StepClock: records -> steps, dead letters
      -> kind.wire         the kind's shards (StepBarrier) -> encoded outputs (records, or
                           an EncodedBatch sequence of records: a closed step's, whole)
      -> merge with the encoded dead letters -> KafkaOutput (or an in-memory sink, which
                           gets one record per item unless ``sink_batches``)

Input partitions are numbered across a kind's input topics in order (a second topic's
partitions follow the first's), so one step barrier waits for every partition of every input.
Tests and benchmarks pass an in-memory ``source``/``sink``; everything between is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import bytewax.operators as op
from bytewax.dataflow import Dataflow, Stream
from bytewax.inputs import Source
from bytewax.outputs import Sink

from dpstream.config import FlowConfig
from dpstream.core.noise import NoiseKey
from dpstream.io.kafka import KafkaClients, KafkaInput, KafkaOutput, wait_for_topics
from dpstream.io.records import encode_dead_letter, flatten
from dpstream.kinds import flow_kind
from dpstream.messages import RawBatch, RawMessage
from dpstream.metrics import FlowMetrics
from dpstream.stream.operators import assign_steps

__all__ = ["FlowParts", "build_flow", "input_partitions", "kafka_clients", "output_topics"]

log = logging.getLogger("dpstream")


@dataclass(frozen=True)
class FlowParts:
    """What a flow kind's wiring gets from the platform."""

    config: Any
    noise: NoiseKey
    instance: str
    partitions: int
    """Input partitions over every input topic (the step barrier waits for all)."""
    metrics: FlowMetrics | None
    options: Mapping[str, Any] = field(default_factory=dict)


def kafka_clients(config: FlowConfig, metrics: FlowMetrics | None = None) -> KafkaClients:
    """The one Kafka client configuration of a flow (credentials from the environment)."""
    on_error = metrics.observe_kafka_error if metrics is not None else (lambda _c: None)
    return KafkaClients(config.kafka.brokers, config.kafka.add_config, on_error=on_error)


def output_topics(config: FlowConfig) -> dict[str, str]:
    """The topic of each output role of the flow's kind."""
    kind = flow_kind(config.kind)
    return {role: config.kafka.topic(setting) for role, setting in kind.outputs.items()}


def input_topics(config: FlowConfig) -> list[str]:
    """The flow's input topics, in partition-numbering order."""
    return [config.kafka.topic(setting) for setting in flow_kind(config.kind).inputs]


def input_partitions(config: FlowConfig, clients: KafkaClients) -> dict[str, int]:
    """Wait for the cluster and every topic; the partition count of each input topic."""
    outputs = list(output_topics(config).values())
    return {topic: wait_for_topics(clients, topic, outputs if i == 0 else (),
                                   config.kafka.startup_timeout_seconds)
            for i, topic in enumerate(input_topics(config))}


def build_flow(
    config: FlowConfig,
    noise: NoiseKey,
    *,
    instance: str,
    partitions: int | Mapping[str, int] | None = None,
    source: Source[RawBatch | RawMessage] | None = None,
    sink: Sink[Any] | None = None,
    metrics: FlowMetrics | None = None,
    sink_batches: bool = False,
    **options: Any,
) -> Dataflow:
    """Build the dataflow of ``config``'s flow kind.

    Args:
        config: the validated configuration (its ``kind`` picks the flow kind).
        noise: the secret noise key.
        instance: the flow instance's id (see :mod:`dpstream.instance`); every noise
            coordinate starts with it.
        partitions: input partitions per input topic (or their total with an in-memory
            source); looked up from the broker (waiting for it) when None and reading Kafka.
        source: in-memory input (:class:`~dpstream.messages.RawBatch` items, or
            :data:`~dpstream.messages.RawMessage` tuples); Kafka if None.
        sink: in-memory output of ``(topic_role, key, value)``; Kafka if None.
        metrics: where to count; nothing is counted if None.
        sink_batches: give the in-memory ``sink`` the kind's encoded items as they are
            (a kind may emit a closed step's records as one
            :class:`~dpstream.io.records.EncodedBatch`) instead of one triple per record
            (``bench/``). The Kafka sink always takes both.
        options: passed to the kind's wiring (e.g. the counters' ``shard_class`` for
            ``bench/``'s non-private baseline).
    """
    kind = flow_kind(config.kind)
    flow = Dataflow(config.name)
    kafka = config.kafka
    clients = kafka_clients(config, metrics)
    topics = input_topics(config)
    if source is None:
        if partitions is None:
            partitions = input_partitions(config, clients)
        if isinstance(partitions, int):
            partitions = {topics[0]: partitions}
        counts = [partitions[topic] for topic in topics]
        observe_lag = metrics.observe_input_lag if metrics is not None else None
        streams: list[Stream[RawBatch]] = []
        first = 0
        for i, (topic, count) in enumerate(zip(topics, counts, strict=True)):
            reader = KafkaInput(clients, topic, count, group_id=kafka.group_id,
                                start_offset=kafka.start_offset, batch_size=kafka.batch_size,
                                tail=kafka.tail, observe_lag=observe_lag, first_partition=first)
            streams.append(op.input("kafka_in" if i == 0 else f"kafka_in_{i}", flow, reader))
            first += count
        raw = streams[0] if len(streams) == 1 else op.merge("inputs", *streams)
    else:
        if partitions is None:
            raise ValueError("partitions must be given with an in-memory source")
        if isinstance(partitions, int) and len(topics) > 1:
            raise ValueError(f"give the partitions of each input topic ({', '.join(topics)})")
        counts = ([partitions] if isinstance(partitions, int)
                  else [partitions[topic] for topic in topics])
        raw = op.input("memory_in", flow, source)
    bases = dict(zip(topics, [sum(counts[:i]) for i in range(len(counts))], strict=True))
    total = sum(counts)
    if metrics is not None:
        metrics.set_clock(config.origin.timestamp(), config.step_seconds)
        metrics.set_instance(instance)
    assigned = assign_steps("assign_steps", raw, kind.clock(config, bases), metrics)
    parts = FlowParts(config, noise, instance, total, metrics, options)
    encoded = op.merge("encoded", kind.wire(parts, assigned.updates),
                       op.map("encode_dead", assigned.dead_letters,
                              partial(encode_dead_letter, config.name,
                                      instance=instance)))
    if sink is None:
        observe = metrics.observe_delivery if metrics is not None else None
        op.output("kafka_out", encoded, KafkaOutput(clients, output_topics(config), observe))
    else:
        if not sink_batches:
            encoded = op.flat_map("flatten", encoded, flatten)
        op.output("memory_out", encoded, sink)
    return flow
