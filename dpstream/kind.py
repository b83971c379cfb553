"""What a flow kind provides: the :class:`FlowKind` protocol, and what the platform gives it.

A flow kind (``dpstream/kinds/<name>/``) is one object, its module's ``KIND``; the platform
(:mod:`dpstream.platform`) owns the registry of them (``KINDS``) and runs any of them the same
way::

    raw TOML --kind.parse_config--> ConfigT (a FlowConfig)
    input topics (kind.inputs) --kind.clock(config, bases)--> StepClock per input partition
        -> (shard, ShardUpdate) --kind.wire(FlowParts, updates)--> RecordT
        -> the kind's output topics (kind.outputs), with the platform's dead letters

The protocol is generic over the kind's configuration (``ConfigT``), what it binds to a flow
instance (``BindingT``, see :mod:`dpstream.instance`) and the records its wiring emits
(``RecordT``: encoded ``(role, key, value)`` triples, or a kind's batch of them). Every kind
of the package conforms, checked by ``mypy --strict``::

    >>> from dpstream.platform import KINDS
    >>> sorted(KINDS)
    ['counters', 'erm', 'pmwg']
    >>> kind = KINDS["pmwg"]
    >>> kind.inputs
    ('input_topic', 'queries_topic')
    >>> dict(kind.outputs)["answers"]
    'answers_topic'

This module sits between the shared configuration (:mod:`dpstream.config`) and the kinds: it
imports neither a kind nor the platform.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from bytewax.dataflow import Stream

from dpstream.config import FlowConfig
from dpstream.core.noise.keys import NoiseKey
from dpstream.instance import Mechanisms
from dpstream.metrics import FlowMetrics
from dpstream.stream.clock import ShardUpdate, StepClock

__all__ = ["ClockFactory", "ClockState", "FlowKind", "FlowParts"]

ConfigT = TypeVar("ConfigT", bound=FlowConfig)
ConfigT_co = TypeVar("ConfigT_co", bound=FlowConfig, covariant=True)
BindingT_co = TypeVar("BindingT_co", bound=Mechanisms, covariant=True)
RecordT_co = TypeVar("RecordT_co", covariant=True)

ClockState = dict[str, Any]
"""A step clock's snapshot (:meth:`~dpstream.stream.clock.StepClock.to_state`): JSON-like."""

ClockFactory = Callable[[ClockState | None], StepClock]
"""Builds one input partition's step clock from its snapshot (None: a fresh partition)."""


@dataclass(frozen=True)
class FlowParts(Generic[ConfigT_co]):
    """What a flow kind's wiring gets from the platform.

    >>> from dpstream.core.noise.keys import NoiseKey
    >>> from dpstream.platform import parse_config
    >>> config = parse_config({"flow": {"kind": "counters"}})
    >>> parts = FlowParts(config, NoiseKey.generate(), "instance-1", 4, None)
    >>> parts.partitions, dict(parts.options)
    (4, {})
    """

    config: ConfigT_co
    noise: NoiseKey
    instance: str
    partitions: int
    """Input partitions over every input topic (the step barrier waits for all)."""
    metrics: FlowMetrics | None
    options: Mapping[str, Any] = field(default_factory=dict)
    """Options of the caller for the kind's wiring (e.g. ``bench/``'s baselines): a kind
    reads the ones it knows and ignores the rest."""


class FlowKind(Protocol[ConfigT, BindingT_co, RecordT_co]):
    """One flow kind: its configuration, topics, step clock and wiring.

    Type parameters: ``ConfigT``, the kind's :class:`~dpstream.config.FlowConfig` subclass;
    ``BindingT_co``, what :meth:`binding` returns (it has a ``mechanisms_digest`` and a
    ``mechanisms_hint``);
    ``RecordT_co``, what :meth:`wire`'s stream carries (encoded records).
    """

    @property
    def name(self) -> str:
        """The kind's name, the value of ``flow.kind`` that picks it (e.g. ``"counters"``).

        >>> from dpstream.platform import KINDS
        >>> all(kind.name == name for name, kind in KINDS.items())
        True
        """

    @property
    def inputs(self) -> tuple[str, ...]:
        """The ``[kafka]`` topic settings the flow reads, in partition-numbering order.

        The platform numbers the partitions of these topics one after the other (a second
        topic's partition 0 follows the first's last):

        >>> from dpstream.platform import KINDS
        >>> KINDS["counters"].inputs
        ('input_topic',)
        """

    @property
    def outputs(self) -> Mapping[str, str]:
        """Each output role the wiring emits, to its ``[kafka]`` topic setting.

        ``"dead_letters"`` is always one: the platform writes the step clock's dead letters.

        >>> from dpstream.platform import KINDS
        >>> KINDS["erm"].outputs["models"]
        'models_topic'
        """

    @property
    def topics(self) -> Mapping[str, str]:
        """Every ``[kafka]`` topic setting of the kind and its default topic.

        ``DPSTREAM_<SETTING>`` environment variables override them (:func:`~dpstream.platform.
        load_config`).

        >>> from dpstream.platform import KINDS
        >>> KINDS["counters"].topics["releases_topic"]
        'releases'
        """

    def parse_config(self, raw: dict[str, Any], source: str) -> ConfigT:
        """Validate a whole configuration mapping (as read from TOML) into the kind's type.

        The kind reads the shared tables with :func:`dpstream.config.parse_common` and its own
        with :class:`~dpstream.config.Section`; a bad setting raises
        :class:`~dpstream.errors.ConfigError` naming it.

        >>> from dpstream.platform import KINDS
        >>> KINDS["counters"].parse_config({"flow": {"name": "demo"}}, "<example>").name
        'demo'
        """

    def binding(self, config: ConfigT) -> BindingT_co:
        """What a flow instance binds to (:func:`dpstream.instance.bind_instance`).

        Its ``mechanisms_digest`` changes with any mechanism parameter, so a recovery store is
        never resumed under other mechanisms.

        >>> from dpstream.platform import KINDS
        >>> kind = KINDS["counters"]
        >>> len(kind.binding(kind.parse_config({}, "<example>")).mechanisms_digest) > 0
        True
        """

    def clock(self, config: ConfigT, bases: Mapping[str, int]) -> ClockFactory:
        """The factory of the step clock of each input partition.

        ``bases`` maps each input topic to the flow-wide number of its partition 0 (a kind
        with several inputs tells its records apart by it). The clock decodes records, places
        them in steps and shards, and turns unusable ones into dead letters.

        >>> from dpstream.platform import KINDS
        >>> kind = KINDS["counters"]
        >>> clock = kind.clock(kind.parse_config({}, "<example>"), {"events": 0})(None)
        >>> clock.frontier() is None
        True
        """

    def wire(self, parts: FlowParts[ConfigT], updates: Stream[tuple[str, ShardUpdate]]
             ) -> Stream[RecordT_co]:
        """Add the kind's shards to the dataflow: shard updates in, encoded records out.

        ``updates`` are keyed by shard (``str(shard)``); every shard is a
        :class:`~dpstream.stream.barrier.StepBarrier` that closes a step once every input
        partition has passed it. The records are ``(role, key, value)`` triples (or a kind's
        batch of them), ``role`` one of :attr:`outputs`. :func:`dpstream.platform.build_flow`
        calls it once per dataflow; here a bounded counters flow over an empty input closes
        the two steps before ``flow.end`` and releases its one declared key at each:

        >>> from bytewax.testing import TestingSink, TestingSource, run_main
        >>> from dpstream.core.noise.keys import NoiseKey
        >>> from dpstream.platform import build_flow, parse_config
        >>> config = parse_config({
        ...     "flow": {"origin": "2026-01-01T00:00:00Z", "end": "2026-01-01T00:02:00Z",
        ...              "step": "1m"},
        ...     "kafka": {"tail": False}, "metrics": {"port": 0},
        ...     "admission": {"mode": "declared", "keys": ["a"]}})
        >>> out = []
        >>> run_main(build_flow(config, NoiseKey.for_tests(1), instance="example",
        ...                     partitions=1, source=TestingSource([]), sink=TestingSink(out)))
        >>> [(role, key) for role, key, _value in out]
        [('releases', b'a'), ('releases', b'a')]
        """
