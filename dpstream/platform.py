"""The platform every flow kind runs on: Kafka in and out, the step clock, dead letters.

It owns the registry of the flow kinds (:data:`KINDS`, each a
:class:`~dpstream.kind.FlowKind`) and turns a configuration into its kind's
(:func:`parse_config`, :func:`load_config`). :func:`build_flow` wires any flow kind::

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
import os
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any, Final

import bytewax.operators as op
from bytewax.dataflow import Dataflow, Stream
from bytewax.inputs import FixedPartitionedSource, Source, StatefulSourcePartition
from bytewax.outputs import Sink

from dpstream.config import FlowConfig, kind_name, read_config
from dpstream.core.contribution.people import PersonHasher
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError, DpstreamError
from dpstream.io.kafka import (
    KafkaClients,
    KafkaInput,
    KafkaOutput,
    broker_time_problem,
    probe_timestamp_type,
    wait_for_topics,
)
from dpstream.kind import FlowKind, FlowParts
from dpstream.kinds.counters.kind import KIND as COUNTERS
from dpstream.kinds.erm.kind import KIND as ERM
from dpstream.kinds.pmwg.kind import KIND as PMWG
from dpstream.messages import RawBatch, RawMessage
from dpstream.metrics import FlowMetrics
from dpstream.stream.bounding import BoundingShard, bound_contributions, person_clocks
from dpstream.stream.clock import ShardUpdate, StepClock
from dpstream.stream.encoded import encode_dead_letter, flatten
from dpstream.stream.operators import assign_steps
from dpstream.stream.quarantine import Quarantine, SkippedRecord

__all__ = ["KINDS", "build_flow", "check_broker_time", "flow_kind", "input_partitions",
           "kafka_clients", "load_config", "parse_config", "output_topics", "partition_names",
           "check_input_topology"]

log = logging.getLogger("dpstream")


KINDS: Final[Mapping[str, FlowKind[Any, Any, Any]]] = {
    COUNTERS.name: COUNTERS, PMWG.name: PMWG, ERM.name: ERM}
"""The flow kinds, by the name ``flow.kind`` picks them with."""


def flow_kind(name: object) -> FlowKind[Any, Any, Any]:
    """The flow kind called ``name`` (any value read from ``flow.kind``).

    Raises:
        ConfigError: no kind has that name (the message lists them).
    """
    if not isinstance(name, str) or name not in KINDS:
        raise ConfigError(f"flow.kind must be one of {', '.join(sorted(KINDS))}, got {name!r}")
    return KINDS[name]


def parse_config(raw: dict[str, Any], source: str = "<dict>") -> FlowConfig:
    """Validate a configuration mapping (as read from TOML) into its kind's configuration.

    Returns:
        The flow kind's :class:`~dpstream.config.FlowConfig` subclass (e.g.
        ``CountersConfig``; ``isinstance`` tells which).
    """
    config: FlowConfig = flow_kind(kind_name(raw)).parse_config(raw, source)
    return config


def load_config(path: str | os.PathLike[str] | None = None,
                environ: Mapping[str, str] | None = None) -> FlowConfig:
    """Load the TOML file at ``path`` (or ``$DPSTREAM_CONFIG``) into its kind's configuration.

    Environment overrides (:func:`dpstream.config.read_config`) include the kind's topic
    settings as ``DPSTREAM_<SETTING>`` (e.g. ``DPSTREAM_INPUT_TOPIC``,
    ``DPSTREAM_RELEASES_TOPIC``, ``DPSTREAM_ANSWERS_TOPIC``).
    """
    raw, source = read_config(path, environ, _topic_settings)
    return parse_config(raw, source)


def _topic_settings(name: object) -> Iterable[str]:
    """The topic settings of the kind called ``name`` (none if no kind is)."""
    return KINDS[name].topics if isinstance(name, str) and name in KINDS else ()


class _EveryShardPartition(StatefulSourcePartition[tuple[str, ShardUpdate], bool]):
    def __init__(self, shards: int, done: bool) -> None:
        self.shards, self.done = shards, done

    def next_batch(self) -> list[tuple[str, ShardUpdate]]:
        if self.done:
            raise StopIteration
        self.done = True
        return [(str(s), ShardUpdate(s, -1, None, {})) for s in range(self.shards)]

    def snapshot(self) -> bool:
        return self.done


class _EveryShard(FixedPartitionedSource[tuple[str, ShardUpdate], bool]):
    """One empty update to every shard, once (not again on a resume).

    Bytewax builds a shard's logic only when an item for it arrives. With ``flow.end`` a
    bounded run closes every step before ``flow.end``'s at the end of its input, whatever the
    input held (:attr:`~dpstream.stream.barrier.StepBarrier.end_step`): this makes sure that
    holds for a shard no record reached too, so that even an empty input and an input of
    one event publish the same steps. The update carries no frontier and no bucket.
    """

    def __init__(self, shards: int) -> None:
        self.shards = shards

    def list_parts(self) -> list[str]:
        """One partition."""
        return ["every_shard"]

    def build_part(self, step_id: str, for_part: str, resume_state: bool | None
                   ) -> _EveryShardPartition:
        """The partition, done if it was done before a resume."""
        return _EveryShardPartition(self.shards, bool(resume_state))


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


def check_input_topology(config: FlowConfig, clients: KafkaClients, partitions: Mapping[str, int],
                         recovery_dir: str | None, metrics: FlowMetrics | None
                         ) -> dict[str, dict[int, int]]:
    """Compare a resumed store's input partitions with the topics now (:mod:`dpstream.topology`).

    Returns:
        The partitions to read from their start (their recovery offset is past their end).

    Raises:
        ConfigError: a partition count differs from the store's (the message names the topic,
            both counts and the stored offsets).
    """
    from dpstream.io.kafka import offset_past_end
    from dpstream.topology import (
        check_topology,
        enforce,
        rewinds,
        store_is_complete,
        stored_offsets,
    )

    if not recovery_dir:
        return {}
    topics = input_topics(config)
    steps = {f"{config.name}.kafka_in" + ("" if i == 0 else f"_{i}"): topic
             for i, topic in enumerate(topics)}
    stored = stored_offsets(recovery_dir, steps)
    if not stored:
        return {}
    anomalies = check_topology(
        stored, partitions,
        lambda topic, partition, offset: offset_past_end(clients, topic, partition, offset),
        complete=store_is_complete(recovery_dir))
    enforce(anomalies, metrics.observe_topology if metrics is not None
            else (lambda _t, _r: None))
    return rewinds(anomalies)


def partition_names(topics: list[str], counts: list[int]) -> list[str]:
    """``topic[partition]`` of every flow input partition, in the flow's numbering.

    The flow numbers the partitions of its input topics one after the other (a second topic's
    partition 0 follows the first's last); logs and metrics name them by topic and partition.
    """
    return [f"{topic}[{p}]" for topic, count in zip(topics, counts, strict=True)
            for p in range(count)]


def check_broker_time(config: FlowConfig, clients: KafkaClients) -> None:
    """Stop at start-up if ``flow.clock = "broker"`` cannot work on the input topics.

    Probes partition 0 of every input topic (:func:`~dpstream.io.kafka.probe_timestamp_type`):
    when the flow writes heartbeat ticks anyway (``kafka.tail`` and ``flow.heartbeat`` on), it
    writes one tick and reads its timestamp type back; otherwise it reads the partition's newest
    record, if any, and writes nothing. A broker that ignores LogAppendTime (the embedded
    ``dpstream broker``) or a topic without it would turn every event into a dead letter.

    Raises:
        ConfigError: a probed record carries no broker time; the message names the fixes.
    """
    if config.clock != "broker":
        return
    write = config.kafka.tail and config.heartbeat_seconds > 0
    for topic in input_topics(config):
        try:
            kind = probe_timestamp_type(clients, topic, 0, write=write)
        except DpstreamError as exc:  # no write access, say: the heartbeat will say so too
            log.warning("%s; checking the newest record instead", exc)
            kind = probe_timestamp_type(clients, topic, 0, write=False)
        problem = broker_time_problem(topic, kind)
        if problem is not None:
            raise ConfigError(problem)
        if kind is None:
            log.info("input topic %s: no record to check its timestamp type on (an empty "
                     "topic and no heartbeat): records without broker time (LogAppendTime) "
                     "become dead letters", topic)
        else:
            log.info("input topic %s: records carry broker time (LogAppendTime)", topic)


def _bounding_shard(router: StepClock, config: FlowConfig, mechanisms: str, noise: NoiseKey,
                    instance: str, partitions: int, metrics: FlowMetrics | None,
                    state: dict[str, Any] | None) -> BoundingShard:
    """One person shard of the bounding stage (dropped events: an exact metric, if on)."""
    observe = metrics.observe_bounding if metrics is not None and metrics.exact_counts \
        else None
    return BoundingShard(router, config, mechanisms, noise, instance, partitions, state,
                         observe)


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
    skip_records: Iterable[SkippedRecord] = (),
    rewind: Mapping[str, Mapping[int, int]] | None = None,
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
            :class:`~dpstream.stream.encoded.EncodedBatch`) instead of one triple per record
            (``bench/``). The Kafka sink always takes both.
        skip_records: records the operator quarantined, as (topic, partition of that topic,
            offset): each becomes a dead letter (reason "quarantined by the operator")
            before anything reads it (:mod:`dpstream.stream.quarantine`).
        rewind: ``{topic: {partition: recovery offset}}`` of partitions whose recovery
            offset lies past their end (:mod:`dpstream.topology`): read from their start.
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
        observe_anomaly = metrics.observe_topology if metrics is not None else None
        rewind = rewind or {}
        streams: list[Stream[RawBatch]] = []
        first = 0
        for i, (topic, count) in enumerate(zip(topics, counts, strict=True)):
            reader = KafkaInput(clients, topic, count, group_id=kafka.group_id,
                                start_offset=kafka.start_offset, batch_size=kafka.batch_size,
                                tail=kafka.tail, observe_lag=observe_lag, first_partition=first,
                                rewind=rewind.get(topic), observe_anomaly=observe_anomaly)
            streams.append(op.input("kafka_in" if i == 0 else f"kafka_in_{i}", flow, reader))
            first += count
        raw: Stream[RawBatch | RawMessage] = (streams[0] if len(streams) == 1
                                              else op.merge("inputs", *streams))
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
        metrics.set_partition_names(partition_names(topics, counts))
        metrics.declare_input_topics(topics)
        metrics.set_instance(instance)
    skipped = frozenset(SkippedRecord(*record) for record in skip_records)
    make_clock = kind.clock(config, bases)
    user_level = config.contribution.user_level
    if user_level:  # people hashed at once, events routed to person shards (bounding.py)
        make_clock = person_clocks(make_clock, PersonHasher.for_flow(noise, instance, config.name),
                                   config.shards)
    assigned = assign_steps("assign_steps", raw, make_clock, metrics,
                            Quarantine(skipped, bases))
    parts = FlowParts(config, noise, instance, config.shards if user_level else total,
                      metrics, options)
    updates = assigned.updates
    if config.end is not None:  # every shard exists, so each closes through flow.end at EOF
        updates = op.merge("with_every_shard", updates,
                           op.input("every_shard", flow, _EveryShard(config.shards)))
    if user_level:  # the kind's shards hear from every person shard (its partitions)
        updates = bound_contributions("bounding", updates, partial(
            _bounding_shard, kind.clock(config, bases)(None), config,
            kind.binding(config).mechanisms_digest, noise, instance, total, metrics))
    encoded = op.merge("encoded", kind.wire(parts, updates),
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
