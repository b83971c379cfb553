"""``dpstream demo``: the whole system on one machine, no Kafka of your own needed.

It starts the embedded Kafka-protocol broker, creates the topics, produces a
synthetic stream (page views of 300 pages with Zipf-like popularity, plus a few
malformed records that end up on the dead-letter topic), runs the counters
flow in a child process (``dpstream run``) and prints the releases and alerts
as they arrive. The noise key is generated for this run only.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["run_demo"]

DEMO_CONFIG = """\
# Written by `dpstream demo`.
[flow]
name = "demo"
step = "1s"
origin = "{origin}"
lateness = "1s"
shards = 8
# Tansu, the embedded broker, ignores message.timestamp.type=LogAppendTime; the demo's own
# producer is the only one, so its record timestamps are trusted.
clock = "producer"

[kafka]
brokers = ["{bootstrap}"]
input_topic = "events"
releases_topic = "releases"
alerts_topic = "alerts"
dead_letter_topic = "dead-letters"
batch_size = 5000

[privacy]
accounting = "pure"
budget = 1.0
delta = 1e-6

[counter]
epsilon = 0.6
horizon = 65536

[monitor]
epsilon = 0.2
horizon = 3600

[admission]
mode = "open"
initial_epsilon = 0.2

[metrics]
port = {metrics_port}
"""


def _produce(bootstrap: str, rate: int, stop: threading.Event, sent: Counter[str]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20)
    rng = random.Random()
    pages = [f"page-{i:03d}" for i in range(300)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(300)]
    tick = 0.05
    while not stop.is_set():
        started = time.monotonic()
        now = time.time()
        batch = max(1, int(rate * tick))
        for page in rng.choices(pages, weights, k=batch):
            producer.send("events", json.dumps({"key": page, "ts": now}).encode())
        sent["events"] += batch
        if rng.random() < 0.05:  # a malformed record now and then
            producer.send("events", b'{"key": 42, "ts": "yesterday"}')
            sent["malformed"] += 1
        time.sleep(max(0.0, tick - (time.monotonic() - started)))
    producer.flush(10)
    producer.close(5)


def _view(bootstrap: str, stop: threading.Event, started: float) -> None:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             group_id=None, consumer_timeout_ms=500)
    parts = [TopicPartition(t, p) for t in ("releases", "alerts", "dead-letters")
             for p in consumer.partitions_for_topic(t) or {0}]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    latest: dict[str, dict[str, object]] = {}
    alerts = dead = statuses = 0
    first_release: float | None = None
    last_print = 0.0
    while not stop.is_set():
        for records in consumer.poll(timeout_ms=300).values():
            for record in records:
                body = json.loads(record.value)
                if record.topic == "alerts":
                    alerts += 1
                elif record.topic == "dead-letters":
                    dead += 1
                elif body["schema"].startswith("dpstream.release"):
                    latest[body["key"]] = body
                    if first_release is None:
                        first_release = time.monotonic() - started
                        print(f"first release after {first_release:.1f} s")
                else:
                    statuses += 1
        if time.monotonic() - last_print >= 2 and latest:
            last_print = time.monotonic()
            top = sorted(latest.values(), key=lambda b: -float(b["value"]))[:8]  # type: ignore[arg-type]
            step = max(int(b["step"]) for b in latest.values())  # type: ignore[call-overload]
            print(f"\n-- step {step}: {len(latest)} keys admitted, {alerts} alerts, "
                  f"{dead} dead letters, {statuses} status records")
            for body in top:
                print(f"   {body['key']:<10} {float(body['value']):>12.1f} ± "  # type: ignore[arg-type]
                      f"{float(body['std']):<8.1f} (step {body['step']}, "  # type: ignore[arg-type]
                      f"eps spent {body['privacy']['spent']:g})")  # type: ignore[index]
    consumer.close()


def run_demo(duration: float = 30.0, rate: int = 5_000, workers: int = 1) -> int:
    """Run the demo for ``duration`` seconds (0: until Ctrl-C); return an exit code."""
    from dpstream.io.broker import EmbeddedBroker
    from dpstream.io.topics import ensure_topics

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dpstream-demo-") as tmp, EmbeddedBroker() as broker:
        print(f"broker up at {broker.bootstrap} ({time.monotonic() - started:.1f} s)")
        ensure_topics(broker.bootstrap, {"events": 3, "releases": 3, "alerts": 1,
                                         "dead-letters": 1})
        origin = datetime.fromtimestamp(int(time.time()), tz=UTC).isoformat().replace(
            "+00:00", "Z")
        config = Path(tmp) / "demo.toml"
        metrics_port = int(os.environ.get("DPSTREAM_DEMO_METRICS_PORT", "9464"))
        config.write_text(DEMO_CONFIG.format(origin=origin, bootstrap=broker.bootstrap,
                                             metrics_port=metrics_port))
        env = dict(os.environ, DPSTREAM_NOISE_KEY=os.urandom(32).hex())
        print(f"configuration: {config} (metrics on http://127.0.0.1:{metrics_port}/metrics)")
        stop = threading.Event()
        sent: Counter[str] = Counter()
        producer = threading.Thread(target=_produce, args=(broker.bootstrap, rate, stop, sent),
                                    daemon=True)
        viewer = threading.Thread(target=_view, args=(broker.bootstrap, stop, started),
                                  daemon=True)
        flow = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "run", "--config",
                                 str(config), "--workers", str(workers),
                                 "--recovery-dir", str(Path(tmp) / "recovery")], env=env)
        producer.start()
        viewer.start()
        try:
            deadline = None if duration <= 0 else time.monotonic() + duration
            while deadline is None or time.monotonic() < deadline:
                if flow.poll() is not None:
                    print(f"the flow exited early with code {flow.returncode}")
                    return 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("\nstopping")
        finally:
            stop.set()
            flow.send_signal(signal.SIGINT)
            try:
                flow.wait(15)
            except subprocess.TimeoutExpired:
                flow.kill()
                flow.wait()
            producer.join(15)
            viewer.join(5)
        print(f"sent {sent['events']} events and {sent['malformed']} malformed records")
    return 0
