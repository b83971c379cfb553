"""The counters' Bytewax operator: every key's monitor and counter, shard by shard.

:func:`keyed_statistics` runs the counters' :class:`~dpstream.kinds.counters.shard.ShardState`
shards on the shared :func:`~dpstream.stream.operators.stepped_shards` operator, under the
step id it is given (``"statistics"``): its steps are ``statistics.shards`` and
``statistics.unkey``, the ids the recovery stores are keyed by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bytewax.dataflow import Stream

from dpstream.core.counting.outputs import StepOutputs
from dpstream.core.counting.statistics_spec import StatisticsSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.kinds.counters.layout import DeclaredLayout
from dpstream.kinds.counters.shard import ShardState
from dpstream.stream.clock import ShardUpdate
from dpstream.stream.operators import FlowObserver, stepped_shards

__all__ = ["keyed_statistics"]


def keyed_statistics(step_id: str, up: Stream[tuple[str, ShardUpdate]], spec: StatisticsSpec,
                     partitions: int, declared: DeclaredLayout | None,
                     noise: NoiseKey, observer: FlowObserver | None = None,
                     observe_outputs: Callable[[list[Any]], None] | None = None,
                     shard_class: type[ShardState] = ShardState,
                     release_every: int = 1, end_step: int | None = None) -> Stream[StepOutputs]:
    """Run every key's monitor and counter, shard by shard; emit each closed step's outputs.

    One :class:`~dpstream.core.counting.outputs.StepOutputs` per closed step of a shard
    (releases, alerts, statuses; a step that publishes nothing emits nothing). ``declared``:
    the declared universe's keys by shard (None: the open universe). ``observe_outputs``:
    what counts the published steps (the counters' metrics). ``release_every``: see
    :class:`ShardState`. ``end_step``: the step of ``flow.end`` (see
    :attr:`~dpstream.stream.barrier.StepBarrier.end_step`). ``shard_class`` exists for the
    non-private baseline of ``bench/``; keep the default.
    """
    noise.prepare()  # the building thread's ciphers (run_main's worker): not at the first step

    def build(state: dict[str, Any] | None) -> ShardState:
        shard = shard_class(spec, partitions, declared, noise, state,
                            release_every=release_every)
        shard.end_step = end_step
        return shard

    return stepped_shards(step_id, up, build, observer, observe_outputs)
