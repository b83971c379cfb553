"""Sources hand the step clock whole batches as columns (:class:`RawBatch`).

Nothing may depend on the form: a batch of columns must be placed, counted and dead-lettered
exactly as the same records given one tuple at a time.
"""

import random

import numpy as np
import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from support.messages import message, raw

from dpstream.core.noise.keys import NoiseKey
from dpstream.io.memory import MemorySource
from dpstream.kinds.counters.events import PartitionClock
from dpstream.kinds.counters.kind import event_rules
from dpstream.messages import TICK, TIMESTAMP_CREATE_TIME, TIMESTAMP_NONE, RawBatch
from dpstream.platform import build_flow, parse_config

ORIGIN = 1_790_000_000


def config(mode: str, shards: int = 3):
    admission = ({"mode": "declared", "keys": ["a", "b", "c", "d"]} if mode == "declared"
                 else {"mode": "open"})
    return parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s",
                                  "shards": shards, "lateness": "2s"},
                         "admission": admission, "metrics": {"port": 0}})


def mixed_records(seed: int, partition: int, n: int):
    """One partition's records: events, undeclared keys, bad JSON, untrusted and late
    timestamps, heartbeats, out-of-order event times."""
    rng = random.Random(seed)
    out, broker = [], ORIGIN + 0.2
    for offset in range(n):
        broker += rng.random() * 0.4
        if rng.random() < 0.05:
            broker -= 3  # the broker's clock went backwards: later records may be late
        kind = rng.choice([0] * 8 + [1, 2])
        if kind == 1:
            out.append(raw(partition, rng.choice([b"{", b"[]", b'{"key":""}', TICK]), offset,
                           broker))
        elif kind == 2:
            out.append(message(partition, "a", broker, offset, broker=broker,
                               kind=rng.choice([TIMESTAMP_CREATE_TIME, TIMESTAMP_NONE])))
        else:
            key = rng.choice("abcde")  # "e" is not declared
            out.append(message(partition, key, broker - rng.random() * 4, offset, broker=broker))
    return out


def test_a_batch_holds_one_partition_and_whole_columns():
    with pytest.raises(ValueError, match="one input partition"):
        RawBatch.of([raw(0, b"x", 0, ORIGIN), raw(1, b"x", 0, ORIGIN)])
    with pytest.raises(ValueError, match="at least one record"):
        RawBatch.of([])
    with pytest.raises(ValueError, match="one entry per record"):
        RawBatch(0, [b"x"], [0, 1], ["t"], np.zeros(1), np.zeros(1, np.int64))
    records = [raw(2, b"x", 7, ORIGIN + 1.5), (2, None, 8, "t", 10**19, 1)]
    batch = RawBatch.of(records)
    assert list(batch) == records and batch[1] == records[1] and len(batch) == 2
    assert list(batch.keep(np.array([False, True]))) == records[1:]


@pytest.mark.parametrize("mode", ["declared", "open"])
@pytest.mark.parametrize("seed", range(6))
def test_the_clock_treats_columns_and_tuples_alike(mode, seed):
    cfg = config(mode)
    records = mixed_records(seed, 1, 300)
    rng = random.Random(seed)
    tuples, columns = PartitionClock(event_rules(cfg)), PartitionClock(event_rules(cfg))
    start = 0
    while start < len(records):
        size = rng.choice([1, 2, 17, 80])
        chunk = records[start:start + size]
        start += size
        a_updates, a_dead = tuples.process(1, chunk)
        b_updates, b_dead = columns.process(1, RawBatch.of(chunk))
        assert a_dead == b_dead
        assert [(u.shard, u.frontier, u.increments) for u in a_updates] == \
            [(u.shard, u.frontier, u.increments) for u in b_updates]
    assert tuples.to_state() == columns.to_state()
    assert (tuples.events, tuples.dead_letters, tuples.ticks) == \
        (columns.events, columns.dead_letters, columns.ticks)
    assert tuples.dead_letters > 0 and tuples.ticks > 0 and tuples.events > 0


@pytest.mark.flow
@pytest.mark.parametrize("mode", ["declared", "open"])
def test_a_flow_publishes_the_same_records_from_columns_as_from_tuples(mode):
    cfg = config(mode, shards=2)
    per_partition = [mixed_records(10 + p, p, 400) for p in range(3)]
    loose = [m for records in per_partition for m in records]
    random.Random(3).shuffle(loose)  # partitions interleaved, each in offset order
    loose.sort(key=lambda m: (m[2], m[0]))
    batches = [RawBatch.of(records[i:i + 64]) for records in per_partition
               for i in range(0, len(records), 64)]
    random.Random(4).shuffle(batches)
    batches.sort(key=lambda b: (b.offsets[0], b.partition))  # each partition in order
    outputs = []
    for source in (TestingSource(loose, 50), MemorySource(batches)):
        sink: list = []
        run_main(build_flow(cfg, NoiseKey.for_tests(3), instance="rb", partitions=3,
                            source=source, sink=TestingSink(sink)))
        outputs.append(sink)
    assert sorted(outputs[0]) == sorted(outputs[1])  # interleaving depends on batching
    roles = {role for role, _, _ in outputs[0]}
    assert roles == ({"releases", "dead_letters"} if mode == "declared" else {"dead_letters"})
