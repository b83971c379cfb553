"""Starting, watching and stopping flows in the tests: in memory, and as processes on a broker.

* :func:`run_in_memory` runs a flow kind's real dataflow (``build_flow``) in Bytewax in memory
  over raw records (``support.messages.raw``) and returns what it published, as
  ``(role, key, value)``;
* :func:`scrape` reads a running flow's metrics port;
* :class:`TopicWatch` counts the records of a one-partition output topic as they arrive.

Processes of ``dpstream run`` are started and finished with :mod:`support.cli_flows`.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from bytewax.testing import TestingSink, TestingSource, cluster_main, run_main

from dpstream.platform import build_flow


def run_in_memory(config: Any, items: Sequence[Any], noise: Any, *, instance: str,
                  partitions: int = 2, workers: int = 1, batch: int = 100,
                  metrics: Any = None) -> list[Any]:
    """Run ``config``'s flow over ``items`` (batches of ``batch``) with 1 worker, or
    ``workers`` in one process; returns the published ``(role, key, value)`` in order."""
    sink: list[Any] = []
    flow = build_flow(config, noise, instance=instance, partitions=partitions,
                      source=TestingSource(items, batch), sink=TestingSink(sink),
                      metrics=metrics)
    if workers == 1:
        run_main(flow)
    else:
        cluster_main(flow, [], 0, worker_count_per_proc=workers)
    return sink


def scrape(port: int) -> dict[str, float]:
    """The samples a flow's metrics port serves now (``{}`` while it is not serving yet)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                      timeout=5).read().decode()
    except OSError:  # not serving yet
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


class TopicWatch:
    """Counts the records of a one-partition topic as they arrive, with little delay (one
    consumer for the whole watch: a kill can follow an output within milliseconds)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                      enable_auto_commit=False, fetch_max_wait_ms=10)
        partition = TopicPartition(topic, 0)
        self.consumer.assign([partition])
        self.consumer.seek(partition, 0)
        self.seen = 0

    def count(self) -> int:
        """How many records arrived so far (waits up to 20 ms for more)."""
        self.seen += sum(map(len, self.consumer.poll(timeout_ms=20).values()))
        return self.seen

    def settled(self, quiet: float = 1.0) -> int:
        """The count once no record arrived for ``quiet`` seconds."""
        last, since = self.count(), time.monotonic()
        while time.monotonic() - since < quiet:
            if (now := self.count()) != last:
                last, since = now, time.monotonic()
        return last

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> TopicWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
