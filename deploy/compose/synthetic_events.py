"""Synthetic page views for the local compose stack: JSON events on the ``events`` topic.

``{"key": "page-007", "ts": <now>}`` at ``EVENTS_PER_SECOND`` (default 200), keys drawn from a
Zipf-like law over ``PAGES`` pages (default 50) so a few pages pass the admission threshold
quickly and the rare ones stay hidden. Runs until stopped (SIGTERM from ``docker compose
stop``). Trial data only: nothing about it is private.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from types import FrameType

from kafka import KafkaProducer
from kafka.errors import KafkaError

_running = True


def _stop(_signum: int, _frame: FrameType | None) -> None:
    global _running
    _running = False


def _producer(bootstrap: list[str], timeout: float) -> KafkaProducer:
    """A producer, once the brokers answer (they may still be starting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return KafkaProducer(bootstrap_servers=bootstrap, linger_ms=50)
        except KafkaError:  # no broker answers yet
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def main() -> int:
    """Produce events until SIGTERM or SIGINT."""
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    bootstrap = os.environ.get("DPSTREAM_BROKERS", "kafka:9092").split(",")
    topic = os.environ.get("DPSTREAM_INPUT_TOPIC", "events")
    rate = int(os.environ.get("EVENTS_PER_SECOND", "200"))
    pages = [f"page-{i:03d}" for i in range(int(os.environ.get("PAGES", "50")))]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(len(pages))]
    producer = _producer(bootstrap, timeout=120.0)
    rng = random.Random()
    tick = 0.1
    sent = 0
    while _running:
        started = time.monotonic()
        now = time.time()
        for page in rng.choices(pages, weights, k=max(1, int(rate * tick))):
            producer.send(topic, json.dumps({"key": page, "ts": now}).encode())
            sent += 1
        time.sleep(max(0.0, tick - (time.monotonic() - started)))
    producer.flush(10)
    producer.close(5)
    print(f"synthetic_events: sent {sent} events", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
