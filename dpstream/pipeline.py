"""Wire the counters flow: Kafka in -> steps -> keyed statistics -> Kafka out.

:func:`build_counters_flow` builds the Bytewax dataflow from a validated
:class:`~dpstream.config.FlowConfig`. Tests and benchmarks pass an in-memory
``source``/``sink`` instead of Kafka; everything between is the same.
"""

from __future__ import annotations

import logging
from typing import Any

import bytewax.operators as op
from bytewax.connectors.kafka import KafkaSinkMessage
from bytewax.connectors.kafka import operators as kop
from bytewax.dataflow import Dataflow
from bytewax.inputs import Source
from bytewax.outputs import Sink

from dpstream.config import FlowConfig
from dpstream.core.key_statistics import StatisticsSpec
from dpstream.core.noise import NoiseKey
from dpstream.io.records import DeadLetter, RecordEncoder
from dpstream.metrics import FlowMetrics
from dpstream.stream.events import EventRules
from dpstream.stream.operators import RawMessage, assign_steps, keyed_statistics
from dpstream.stream.shard import ShardState

__all__ = ["build_counters_flow", "statistics_spec"]

log = logging.getLogger("dpstream")

Encoded = tuple[str, bytes | None, bytes]  # topic role, key, value


def statistics_spec(config: FlowConfig, instance: str = "") -> StatisticsSpec:
    """The per-key specification a flow configuration implies, for flow instance ``instance``."""
    p = config.privacy
    return StatisticsSpec(
        flow=config.name, mode=config.admission.mode, accounting=p.accounting, budget=p.budget,
        delta_budget=p.delta, counter=p.counter, monitor=p.monitor,
        initial=config.admission.initial, admission_delta=config.admission.delta,
        instance=instance,
    )


def event_rules(config: FlowConfig) -> EventRules:
    """How the flow reads events."""
    declared = frozenset(config.admission.keys) if config.admission.mode == "declared" else None
    return EventRules(
        key_field=config.key_field, time_field=config.time_field, origin=config.origin,
        step_seconds=config.step_seconds, lateness_seconds=config.lateness_seconds,
        shards=config.shards, declared_keys=declared, clock=config.clock,
    )


def _raw_message(m: Any) -> RawMessage:
    """A Kafka message as the stream layer reads it (the broker timestamp included)."""
    kind, ms = m.timestamp if m.timestamp is not None else (0, 0)
    return (m.partition, m.value, m.offset, m.topic, ms, kind)


def build_counters_flow(
    config: FlowConfig,
    noise: NoiseKey,
    *,
    instance: str,
    partitions: int | None = None,
    source: Source[RawMessage] | None = None,
    sink: Sink[Encoded] | None = None,
    metrics: FlowMetrics | None = None,
    shard_class: type[ShardState] = ShardState,
) -> Dataflow:
    """Build the counters dataflow.

    Args:
        config: the validated configuration.
        noise: the secret noise key.
        instance: the flow instance's id (see :mod:`dpstream.instance`); every noise
            coordinate starts with it.
        partitions: how many input partitions there are (steps close when all have passed);
            looked up from the broker when None and reading Kafka.
        source: in-memory input of ``(partition, value, offset, topic)``; Kafka if None.
        sink: in-memory output of ``(topic_role, key, value)``; Kafka if None.
        metrics: where to count; nothing is counted if None.
        shard_class: the per-shard state; only ``bench/``'s non-private baseline changes it.
    """
    flow = Dataflow(config.name)
    kafka = config.kafka
    if source is None:
        if partitions is None:
            from dpstream.io.topics import topic_partitions

            partitions = topic_partitions(",".join(kafka.brokers), kafka.input_topic)
        kafka_in = kop.input("kafka_in", flow, brokers=list(kafka.brokers),
                             topics=[kafka.input_topic], tail=kafka.tail,
                             batch_size=kafka.batch_size, add_config=dict(kafka.add_config))
        raw = op.map("raw", kafka_in.oks, _raw_message)
        errors = op.map("kafka_errors", kafka_in.errs,
                        lambda e: DeadLetter(f"kafka error: {e.err}", e.msg.value or b"",
                                             e.msg.topic, e.msg.partition, e.msg.offset))
    else:
        if partitions is None:
            raise ValueError("partitions must be given with an in-memory source")
        raw = op.input("memory_in", flow, source)
        errors = None

    observe_input = metrics.observe_input if metrics else (lambda _n, _a: None)
    assigned = assign_steps("assign_steps", raw, event_rules(config), observe_input)
    spec = statistics_spec(config, instance)
    mechanism = spec.counter.mechanism
    if metrics is not None:
        ledger = config.privacy.new_ledger()
        metrics.set_budget(mechanism, ledger.unit, ledger.budget)
        observe_outputs = lambda outs: metrics.observe_outputs(outs, mechanism)  # noqa: E731
    else:
        observe_outputs = lambda outs: None  # noqa: E731
    declared = config.admission.keys if config.admission.mode == "declared" else None
    outputs = keyed_statistics("statistics", assigned.updates, spec, partitions, config.shards,
                               declared, noise, observe_outputs, shard_class)

    encoder = RecordEncoder(config.name, config.origin, config.step_seconds, config.privacy.delta)
    dead = assigned.dead_letters if errors is None else op.merge("all_dead", assigned.dead_letters,
                                                                 errors)
    encoded = op.merge("encoded",
                       op.map("encode", outputs, encoder.encode),
                       op.map("encode_dead", dead, encoder.encode_dead_letter))
    if sink is not None:
        op.output("memory_out", encoded, sink)
        return flow
    topics = {"releases": kafka.releases_topic, "alerts": kafka.alerts_topic,
              "dead_letters": kafka.dead_letter_topic}

    def to_message(item: Encoded) -> KafkaSinkMessage[Any, Any]:
        role, key, value = item
        return KafkaSinkMessage(key=key, value=value, topic=topics[role])

    kop.output("kafka_out", op.map("to_kafka", encoded, to_message),
               brokers=list(kafka.brokers), topic=kafka.releases_topic,
               add_config=dict(kafka.add_config))
    return flow
