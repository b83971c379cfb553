"""Wire the counters flow: Kafka in -> steps -> keyed statistics -> Kafka out.

:func:`build_counters_flow` builds the Bytewax dataflow from a validated
:class:`~dpstream.config.FlowConfig`. Tests and benchmarks pass an in-memory
``source``/``sink`` instead of Kafka; everything between is the same.
"""

from __future__ import annotations

import logging

import bytewax.operators as op
from bytewax.dataflow import Dataflow
from bytewax.inputs import Source
from bytewax.outputs import Sink

from dpstream.config import FlowConfig
from dpstream.core.key_statistics import StatisticsSpec
from dpstream.core.noise import NoiseKey
from dpstream.io.kafka import Encoded, KafkaClients, KafkaInput, KafkaOutput, wait_for_topics
from dpstream.io.records import RecordEncoder
from dpstream.metrics import FlowMetrics
from dpstream.stream.events import EventRules
from dpstream.stream.operators import RawMessage, assign_steps, keyed_statistics
from dpstream.stream.shard import ShardState

__all__ = ["build_counters_flow", "kafka_clients", "output_topics", "statistics_spec"]

log = logging.getLogger("dpstream")


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


def kafka_clients(config: FlowConfig, metrics: FlowMetrics | None = None) -> KafkaClients:
    """The one Kafka client configuration of a flow (credentials from the environment)."""
    on_error = metrics.observe_kafka_error if metrics is not None else (lambda _c: None)
    return KafkaClients(config.kafka.brokers, config.kafka.add_config, on_error=on_error)


def output_topics(config: FlowConfig) -> dict[str, str]:
    """The topic of each output role."""
    kafka = config.kafka
    return {"releases": kafka.releases_topic, "alerts": kafka.alerts_topic,
            "dead_letters": kafka.dead_letter_topic}


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
            looked up from the broker (waiting for it, see
            :func:`~dpstream.io.kafka.wait_for_topics`) when None and reading Kafka.
        source: in-memory input of :data:`~dpstream.stream.events.RawMessage`; Kafka if None.
        sink: in-memory output of ``(topic_role, key, value)``; Kafka if None.
        metrics: where to count; nothing is counted if None.
        shard_class: the per-shard state; only ``bench/``'s non-private baseline changes it.
    """
    flow = Dataflow(config.name)
    kafka = config.kafka
    clients = kafka_clients(config, metrics)
    if source is None:
        if partitions is None:
            partitions = wait_for_topics(clients, kafka.input_topic,
                                         output_topics(config).values(),
                                         kafka.startup_timeout_seconds)
        observe_lag = metrics.observe_input_lag if metrics is not None else None
        source = KafkaInput(clients, kafka.input_topic, partitions, group_id=kafka.group_id,
                            start_offset=kafka.start_offset, batch_size=kafka.batch_size,
                            tail=kafka.tail, observe_lag=observe_lag)
        raw = op.input("kafka_in", flow, source)
    else:
        if partitions is None:
            raise ValueError("partitions must be given with an in-memory source")
        raw = op.input("memory_in", flow, source)

    assigned = assign_steps("assign_steps", raw, event_rules(config), metrics)
    spec = statistics_spec(config, instance)
    if metrics is not None:
        ledger = config.privacy.new_ledger()
        metrics.set_budget(spec.counter.mechanism, ledger.unit, ledger.budget)
        metrics.set_clock(config.origin.timestamp(), config.step_seconds)
    declared = config.admission.keys if config.admission.mode == "declared" else None
    outputs = keyed_statistics("statistics", assigned.updates, spec, partitions, config.shards,
                               declared, noise, metrics, shard_class)

    encoder = RecordEncoder(config.name, config.origin, config.step_seconds, config.privacy.delta)
    encoded = op.merge("encoded",
                       op.map("encode", outputs, encoder.encode),
                       op.map("encode_dead", assigned.dead_letters, encoder.encode_dead_letter))
    if sink is None:
        observe = metrics.observe_delivery if metrics is not None else None
        sink = KafkaOutput(clients, output_topics(config), observe)
        op.output("kafka_out", encoded, sink)
    else:
        op.output("memory_out", encoded, sink)
    return flow
