"""A soak of issue 22's anomalies: a poison record, a record an hour ahead under the producer
clock, a second process on the store in use, and a topic re-created with another partition count.

One run of about 2-3 minutes on its own embedded broker (input topic ``events``, 2 partitions),
with the counters flow of ``tests/test_soak.py`` (its config, process wrapper and producer
thread are reused: ``flow.clock = "producer"``, heartbeat ticks every 500 ms, exact counts on).
A real Prometheus with the shipped config and rules (``deploy/prometheus``) scrapes both runs
and the refused second process's port.

* the producer thread writes good events at 200/s to both partitions, stamped with the event
  time, and records every acknowledged event's ``(partition, offset)``, key and step;
* **poison record** (t = 10 s): ``{"key":"k","ts":…,"x":[[[…1,000 levels…]]]}``. It must be
  exactly one dead letter ``undecodable record (RecursionError)`` (copies de-duplicated by
  source offset) and the flow keeps running. Log line: one WARNING ``input events[p] offset o:
  undecodable record (RecursionError) -> dead letter (… --skip-record)`` naming the record's
  partition and offset and no value of it (plus the progress line's dead-letter count).
  Metric: ``dpstream_dead_letters_total{reason="undecodable record (RecursionError)"}`` on the
  flow's endpoint and in Prometheus. Alert: ``DpstreamUndecodableRecords`` (no ``for:``)
  *firing* in Prometheus' ``ALERTS`` while run 1 exports the series. ``DpstreamDeadLetters``
  (> 1 % for 10 minutes) must stay quiet: checked in Prometheus and with promtool, fed the
  soak's real counts (the dead-letter count and the event rate the flow measured);
* **a record stamped an hour ahead**, one in each run (t = 16 s and 75 s; its ``ts`` and its
  producer timestamp both now + 1 h): it is not a dead letter, closes no step (no release and no
  ``dpstream_closed_step`` past the wall clock; ``dpstream_step_lag_seconds`` never negative,
  checked on every sample Prometheus took), and no good event is a ``late`` dead letter. It is
  clamped ``flow.max_skew`` ahead of the ticks. The config sets ``max_skew = "5m"`` (asserted):
  a record is clamped, and so counted, only if it lies more than ``max_skew`` ahead, and the
  default (1 d) would place an hour-ahead record at its own time without a signal. Log line:
  one WARNING per run ``input events[p] offset o: record stamped more than flow.max_skew ahead
  of its partition's clock (heartbeat ticks): counted at the limit`` (never its timestamp).
  Metric: ``dpstream_clamped_records_total{topic="events",bound="ahead"}`` ≥ 1 on both runs'
  endpoints and in Prometheus. Alert: ``DpstreamClockSkew`` *firing* in ``ALERTS`` (the series
  starts at 0, so ``increase()`` sees the first one);
* **a second ``dpstream run`` on the same recovery store** (t = 24 s): exits 2 within 60 s with
  one ``dpstream: error:`` line naming the first process's pid and host; the first flow keeps
  running and closing steps. The refused process stops before it serves metrics, so it can
  have no metric of its own: its ``metrics.port`` is a scrape target of the same Prometheus
  (job ``dpstream``, as in the shipped config), which records ``up == 0`` for it (and never 1)
  and ``DpstreamDown`` *pending or firing* for that target. Pending proves the rule matched;
  firing needs its ``for: 2m`` to pass, which the soak may or may not reach (the target is down
  from Prometheus' start: Prometheus cannot tell a refused process from one never started; the
  state at the end is printed);
* **kill -9 and restart** on the same store (t = 50 s / 55 s) while the producer goes on (the
  first run snapshots every 5 s, so its replay usually re-publishes a few steps: every copy is
  compared; how many there were is printed, not asserted, as it depends on where in the
  snapshot cycle the kill falls); the producer stops at t = 110 s and the second run is stopped
  (SIGTERM) once its releases cover every step to the producer's end;
* **the topic re-created with 3 partitions** while no flow runs, then a third run on the same
  store: it exits 2 with one ``dpstream: error:`` line naming ``events``, both partition
  counts and ``events[2]`` as new. The process stops right after it serves metrics, before a
  scrape can be relied on, so the metric is checked the way tests/test_topology.py does: the
  same ``check_input_topology`` in this process, on the same store and topic, counting
  ``dpstream_topology_anomalies_total{topic="events",reason="partition_count_changed"}`` = 1
  into a registry served over HTTP to the same Prometheus, where the shipped
  ``DpstreamTopologyChanged`` alert (no ``for:``) must be *firing* in ``ALERTS``.

Final checks: the second run exits 0 (the first was killed); the only dead letter is the poison
record's (so no good event was late or otherwise dropped), the consumer group's committed
positions are past every acknowledged event (every event was read), and each key's last covered
release is within 6 std of its true count; every copy of a release coordinate ``(instance, key,
step)`` is byte-identical, one flow instance published them all, and
``dpstream.client.LatestValues`` counts no conflict.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.prometheus import find_promtool
from test_observability import PROMETHEUS_DIR, start_prometheus
from test_soak import (
    ENV,
    FLOW,
    KEYS,
    FlowRun,
    Traffic,
    metric,
    sleep_until,
    wait_until,
    write_config,
)
from test_topology import _recreate

from dpstream.io.broker import EmbeddedBroker, free_port
from dpstream.io.topics import ensure_topics, read_all

pytestmark = [pytest.mark.soak, pytest.mark.slow]

NESTED_TAIL = b"[" * 1000 + b"]" * 1000
POISON_REASON = "undecodable record (RecursionError)"
HOUR_MS = 3_600_000
SKEW_LINE = ("stamped more than flow.max_skew ahead of its partition's clock (heartbeat ticks): "
             "counted at the limit")
CLAMPED_AHEAD = 'dpstream_clamped_records_total{bound="ahead",flow="%s",topic="events"}'

# the timeline, in seconds after the producer started
POISON_AT = 10.0
AHEAD_AT = (16.0, 75.0)  # one per run: the first one is pending in the store across the restart
SECOND_PROCESS_AT = 24.0
FIRST_STOP_AT = 50.0
RESTART_AT = 55.0
PRODUCE_SECONDS = 110.0


class SlowSnapshotRun(FlowRun):
    """A `FlowRun` snapshotting every 5 s: a kill -9 leaves seconds of output to replay."""

    def __init__(self, config: Path, recovery: Path, log: Path, port: int) -> None:
        self.log, self.port = log, port
        self._handle = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dpstream.cli", "run", "--config", str(config),
             "--recovery-dir", str(recovery), "--snapshot-interval", "5"],
            env=ENV, stdout=self._handle, stderr=subprocess.STDOUT, text=True)
        self.started = time.monotonic()
        self.stopped: float | None = None


class AnomalyTraffic(Traffic):
    """`test_soak.Traffic` whose scheduled records are the poison one and the hour-ahead one."""

    def send_bad(self, producer, kind: str, partition: int) -> None:
        now_ms = int(time.time() * 1000)
        if kind == "poison":
            stamp = now_ms
            value = b'{"key":"k0","ts":%.3f,"x":%s}' % (now_ms / 1000, NESTED_TAIL)
        elif kind == "ahead":  # its own time and its producer timestamp: an hour ahead
            stamp = now_ms + HOUR_MS
            value = json.dumps({"key": "k0", "ts": stamp / 1000, "seq": -1}).encode()
        else:
            raise AssertionError(kind)
        producer.produce("events", value, partition=partition, timestamp=stamp,
                         on_delivery=self.report(("bad", kind, value)))


def promtool_dead_letter_alert(tmp_path: Path, events_per_minute: float,
                               dead_letters: float) -> subprocess.CompletedProcess[str]:
    """The shipped DpstreamDeadLetters rule fed the soak's real figures (15 minutes of them)."""
    labels = f'job="dpstream",instance="127.0.0.1:1",flow="{FLOW}"'
    test = {
        "rule_files": [str(PROMETHEUS_DIR / "dpstream-alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f"dpstream_events_total{{{labels}}}",
                 "values": f"0+{events_per_minute:.0f}x15"},
                {"series": f'dpstream_dead_letters_total{{{labels},reason="{POISON_REASON}"}}',
                 "values": f"{dead_letters:.0f}x15"},
            ],
            "alert_rule_test": [{"eval_time": t, "alertname": "DpstreamDeadLetters",
                                 "exp_alerts": []} for t in ("5m", "11m", "15m")],
        }],
    }
    path = tmp_path / "dead-letters.test.yml"
    path.write_text(json.dumps(test, indent=1))  # JSON is YAML
    return subprocess.run([find_promtool(), "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=120)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("dpstream: error:")]


def test_soak_poison_future_record_second_process_and_recreated_topic(tmp_path):
    from confluent_kafka import Consumer, TopicPartition
    from prometheus_client import CollectorRegistry, start_http_server

    from dpstream.client import LatestValues, Release, decode
    from dpstream.errors import ConfigError
    from dpstream.metrics import FlowMetrics
    from dpstream.platform import check_input_topology, kafka_clients, load_config

    began = time.monotonic()
    recovery = tmp_path / "recovery"
    port1, port2, port_topology = free_port(), free_port(), free_port()
    port_refused = free_port()  # the second process's metrics port: it never serves it
    figures: dict[str, Any] = {}
    with EmbeddedBroker() as broker:
        ensure_topics(broker.bootstrap, {"events": 2, "releases": 1, "alerts": 1, "dead": 1,
                                         "warmup": 1})
        origin = int(time.time()) - 4
        traffic = AnomalyTraffic(broker.bootstrap, origin,
                                 [(POISON_AT, "poison"), *((t, "ahead") for t in AHEAD_AT)])
        runs: list[FlowRun] = []
        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        prom = start_prometheus(prom_dir, [f"127.0.0.1:{p}" for p in (port1, port2,
                                                                      port_topology,
                                                                      port_refused)])
        topology_server = None
        try:
            traffic.start()
            wait_until(lambda: traffic.started_at is not None, 30, "the producer")
            t0 = traffic.started_at
            assert t0 is not None

            # run 1
            config1 = write_config(tmp_path / "run1.toml", broker.bootstrap, origin, port1)
            # an hour ahead is clamped (and counted) only past flow.max_skew: keep it below 1 h
            assert 'max_skew = "5m"' in config1.read_text()
            first = SlowSnapshotRun(config1, recovery, tmp_path / "run1.log", port1)
            runs.append(first)
            wait_until(lambda: metric(first.scrape(), "dpstream_releases_total")
                       >= 3 * len(KEYS), 90, "the first releases", first)
            figures["first releases after"] = time.monotonic() - first.started

            # the poison record: a dead letter on the flow's endpoint, the flow goes on
            poison_series = f'dpstream_dead_letters_total{{flow="{FLOW}",' \
                            f'reason="{POISON_REASON}"}}'
            sleep_until(t0 + POISON_AT)
            wait_until(lambda: first.scrape().get(poison_series), 60,
                       "the poison record's dead letter", first)
            poison_count_1 = first.scrape()[poison_series]
            # ... and the alert, in Prometheus (no `for`), while run 1 still exports the series
            undecodable_alert = prom.wait_for(
                'ALERTS{alertname="DpstreamUndecodableRecords",alertstate="firing"}',
                timeout=30)

            # the hour-ahead record: read, and nothing closed past the wall clock
            sleep_until(t0 + AHEAD_AT[0] + 3)
            with traffic.lock:
                assert any(kind == "ahead" for kind, _ in traffic.bad.values()), \
                    "the hour-ahead record was not acknowledged"
            clamped_1 = wait_until(lambda: first.scrape().get(CLAMPED_AHEAD % FLOW), 30,
                                   "the hour-ahead record counted as clamped", first)
            skew_alert = prom.wait_for(
                'ALERTS{alertname="DpstreamClockSkew",alertstate="firing"}', timeout=30)

            # a second process on the store in use
            sleep_until(t0 + SECOND_PROCESS_AT)
            closed_before = metric(first.scrape(), "dpstream_closed_step")
            config_x = write_config(tmp_path / "second.toml", broker.bootstrap, origin,
                                    port_refused)
            refused_began = time.monotonic()
            second_process = subprocess.run(
                [sys.executable, "-m", "dpstream.cli", "run", "--config", str(config_x),
                 "--recovery-dir", str(recovery)], env=ENV, capture_output=True, text=True,
                timeout=60)
            figures["second process refused after"] = time.monotonic() - refused_began
            # Prometheus' signal: the refused process's target is down, DpstreamDown matches it
            refused_target = f"127.0.0.1:{port_refused}"
            refused_up = prom.wait_for(f'up{{instance="{refused_target}"}}', timeout=30)
            refused_ever_up = prom.query(f'max_over_time(up{{instance="{refused_target}"}}[10m])')
            down_alert = prom.wait_for(
                f'ALERTS{{alertname="DpstreamDown",instance="{refused_target}",'
                f'alertstate=~"pending|firing"}}', timeout=30)
            assert first.alive(), first.output[-3000:]
            wait_until(lambda: metric(first.scrape(), "dpstream_closed_step")
                       >= closed_before + 5, 60, "steps closing after the refusal", first)

            sleep_until(t0 + FIRST_STOP_AT)
            last_scrape_1 = first.scrape()
            first.kill()  # kill -9: the restart replays from the last snapshot
            first.stopped = time.monotonic()
            out1 = first.output

            # run 2: the same store, the producer never stopped
            sleep_until(t0 + RESTART_AT)
            config2 = write_config(tmp_path / "run2.toml", broker.bootstrap, origin, port2)
            second = FlowRun(config2, recovery, tmp_path / "run2.log", port2)
            runs.append(second)
            sleep_until(t0 + PRODUCE_SECONDS)
            traffic.halt.set()
            traffic.join(90)
            assert not traffic.is_alive(), "the producer did not finish"
            assert traffic.done_at is not None
            target = math.floor(traffic.done_at - origin) + 1
            clamped_2 = metric(second.scrape(), CLAMPED_AHEAD % FLOW)
            wait_until(lambda: metric(second.scrape(), "dpstream_closed_step") >= target, 120,
                       f"releases through step {target}", second)
            last_scrape_2 = second.scrape()
            out2 = second.stop()
            stopped_at = time.time()

            # every acknowledged event was read: the group's positions are past them all
            consumer = Consumer({"bootstrap.servers": broker.bootstrap,
                                 "group.id": f"dpstream.{FLOW}"})
            try:
                committed = {tp.partition: tp.offset for tp in consumer.committed(
                    [TopicPartition("events", p) for p in (0, 1)], timeout=30)}
            finally:
                consumer.close()

            # Prometheus saw the poison record's series and never a negative lag
            seen_poison = prom.wait_for(
                f'max_over_time(dpstream_dead_letters_total{{reason="{POISON_REASON}"}}[10m])',
                timeout=30)
            min_lag = prom.query("min(min_over_time(dpstream_step_lag_seconds[10m]))")
            clamped_seen = prom.query(f'max_over_time({CLAMPED_AHEAD % FLOW}[10m])')
            down_late = prom.query(f'ALERTS{{alertname="DpstreamDown",'
                                   f'instance="{refused_target}"}}')

            # the topic re-created with another partition count, then run 3 on the same store
            _recreate(broker.bootstrap, "events", 3)
            config3 = write_config(tmp_path / "run3.toml", broker.bootstrap, origin,
                                   free_port())
            third = FlowRun(config3, recovery, tmp_path / "run3.log", 0)
            runs.append(third)
            try:
                third.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"run 3 did not stop on the re-created topic:\n"
                            f"{third.output[-3000:]}")
            out3 = third.output

            # the metric, counted by the same check in this process, fed to Prometheus
            cfg = load_config(config3, environ={})
            registry = CollectorRegistry()
            topo_metrics = FlowMetrics(FLOW, registry)
            with pytest.raises(ConfigError, match="re-created or re-partitioned") as refused:
                check_input_topology(cfg, kafka_clients(cfg), {"events": 3}, str(recovery),
                                     topo_metrics)
            topology_value = registry.get_sample_value(
                "dpstream_topology_anomalies_total",
                {"flow": FLOW, "topic": "events", "reason": "partition_count_changed"})
            topology_server, _ = start_http_server(port_topology, addr="127.0.0.1",
                                                   registry=registry)
            fired = prom.wait_for('ALERTS{alertname="DpstreamTopologyChanged",'
                                  'alertstate="firing"}', timeout=60)
            dead_letter_alerts = prom.query('ALERTS{alertname="DpstreamDeadLetters"}')
        finally:
            traffic.halt.set()
            for run in runs:
                run.kill()
            traffic.join(90)
            if topology_server is not None:
                topology_server.shutdown()
            prom.stop()

        releases = [r.value for r in read_all(broker.bootstrap, "releases", timeout=60, idle=2)]
        dead = [json.loads(r.value) for r in read_all(broker.bootstrap, "dead", timeout=60,
                                                      idle=2)]

    assert not traffic.errors, traffic.errors[:10]

    # --- runs 1 and 2: killed (-9) and a clean exit ------------------------------------------
    assert first.proc.returncode == -9, f"run 1 exited {first.proc.returncode}:\n{out1[-3000:]}"
    assert second.proc.returncode == 0, f"run 2 exited {second.proc.returncode}:\n{out2[-3000:]}"
    assert "stopping (SIGTERM)" in out2, out2[-3000:]
    for name, out in (("run 1", out1), ("run 2", out2)):
        assert "Traceback" not in out and "panicked" not in out, f"{name}:\n{out[-3000:]}"
    assert "flow instance" in out2 and "resumed" in out2, out2[-3000:]

    # --- the poison record: one dead letter; log line, metric; the alert rule via promtool --
    poison = [s for s, (kind, _) in traffic.bad.items() if kind == "poison"]
    assert len(poison) == 1, traffic.bad.keys()
    letters: dict[tuple[int, int], set[str]] = {}
    for body in dead:
        assert body["schema"] == "dpstream.dead_letter/1" and body["flow"] == FLOW, body
        source = (body["source"]["partition"], body["source"]["offset"])
        letters.setdefault(source, set()).add(json.dumps(body, sort_keys=True))
    assert set(letters) == set(poison), {s: [json.loads(c)["reason"] for c in v]
                                         for s, v in letters.items()}
    [copy] = letters[poison[0]]  # at-least-once copies are byte-identical: one left
    assert json.loads(copy)["reason"] == POISON_REASON
    assert poison_count_1 == 1
    assert re.search(r"progress: .*, 1 dead letters", out1), out1[-3000:]
    [(poison_partition, poison_offset)] = poison
    poison_lines = [line for line in out1.splitlines() if "-> dead letter" in line]
    assert len(poison_lines) == 1, poison_lines
    assert (f"WARNING dpstream: input events[{poison_partition}] offset {poison_offset}: "
            f"{POISON_REASON} -> dead letter (if a record still crashes the flow, quarantine "
            "it with dpstream run --skip-record)") in poison_lines[0], poison_lines
    assert '"k0"' not in poison_lines[0] and "[[" not in poison_lines[0]  # no value of it
    assert any(labels.get("reason") == POISON_REASON and labels.get("severity") == "warning"
               and labels.get("instance") == f"127.0.0.1:{port1}"
               for labels, _ in undecodable_alert), undecodable_alert
    assert seen_poison and all(v >= 1 for _, v in seen_poison), seen_poison
    events_1 = metric(last_scrape_1, "dpstream_events_total")
    run1_seconds = first.stopped - first.started  # type: ignore[operator]
    figures["events/min (run 1)"] = events_1 / run1_seconds * 60
    promtool = promtool_dead_letter_alert(tmp_path, events_1 / run1_seconds * 60,
                                          poison_count_1)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr
    assert not dead_letter_alerts, dead_letter_alerts

    # --- the hour-ahead records: not dead, closed nothing ahead, made nothing late ---------
    ahead = [s for s, (kind, _) in traffic.bad.items() if kind == "ahead"]
    assert len(ahead) == len(AHEAD_AT), traffic.bad.keys()
    assert not set(ahead) & set(letters)
    assert all(not body["reason"].startswith("late") for body in dead)
    # its signals: a warning line per run, the counter, DpstreamClockSkew
    named = set()
    for out in (out1, out2):  # one line each, naming its record; together both records
        lines = [line for line in out.splitlines() if "flow.max_skew" in line]
        assert len(lines) == 1, lines
        found = re.search(r"WARNING dpstream: input events\[(\d)\] offset (\d+): record "
                          + re.escape(SKEW_LINE) + "$", lines[0])
        assert found, lines
        named.add((int(found[1]), int(found[2])))
        stamps = [str(json.loads(value)["ts"]) for kind, value in traffic.bad.values()
                  if kind == "ahead"]
        assert not any(stamp[:8] in lines[0] for stamp in stamps), lines  # not its time
    assert named == set(ahead), (named, ahead)
    assert clamped_1 >= 1 and clamped_2 >= 1, (clamped_1, clamped_2)
    assert clamped_seen and max(v for _, v in clamped_seen) >= 1, clamped_seen
    assert any(labels.get("topic") == "events" and labels.get("bound") == "ahead"
               and labels.get("severity") == "warning" for labels, _ in skew_alert), skew_alert
    for name, out in (("run 1", out1), ("run 2", out2)):
        assert not re.search(r"-\d+ s behind the clock", out), f"{name}:\n{out[-3000:]}"
        assert "after this host's clock" not in out, f"{name}:\n{out[-3000:]}"
    now_step = math.floor(stopped_at - origin)
    for values in (last_scrape_1, last_scrape_2):
        assert metric(values, "dpstream_closed_step") <= now_step
    assert min_lag and min_lag[0][1] >= 0, min_lag

    # --- the second process: refused with one line; the first one went on ------------------
    text = second_process.stdout + second_process.stderr
    assert second_process.returncode == 2, text
    assert "Traceback" not in text and "panicked" not in text, text
    [refusal] = error_lines(text)
    assert f"pid {first.proc.pid}" in refusal and repr(socket.gethostname()) in refusal, refusal
    assert "in use" in refusal, refusal
    assert f"locked by this process (pid {first.proc.pid})" in out1, out1[-3000:]
    assert refused_up and all(v == 0 for _, v in refused_up), refused_up
    assert refused_ever_up and all(v == 0 for _, v in refused_ever_up), refused_ever_up
    assert any(labels.get("severity") == "critical" for labels, _ in down_alert), down_alert
    down_states = sorted({labels["alertstate"] for labels, _ in down_late})

    # --- the re-created topic: one line, the metric, the alert -----------------------------
    assert third.proc.returncode == 2, out3[-3000:]
    assert "Traceback" not in out3 and "panicked" not in out3, out3[-3000:]
    [error] = error_lines(out3)
    assert "input topic 'events' has 3 partition(s) but the recovery store read 2" in error, error
    assert "events[0] at offset" in error and "events[1] at offset" in error, error
    assert "events[2]..events[2] are new" in error, error
    assert str(refused.value) in error, (str(refused.value), error)
    assert topology_value == 1
    assert any(labels.get("topic") == "events"
               and labels.get("reason") == "partition_count_changed"
               and labels.get("severity") == "critical" for labels, _ in fired), fired

    # --- nothing lost: every acknowledged event read, none dead, the counts reflected -------
    good = dict(traffic.good)
    for partition in (0, 1):
        last = max(o for p, o in [*good, *traffic.bad] if p == partition)
        assert committed[partition] > last, (partition, committed, last)
    true_steps: dict[str, Counter[int]] = {key: Counter() for key in KEYS}
    for key, step in good.values():
        true_steps[key][step] += 1

    # --- nothing published twice with different values --------------------------------------
    copies: dict[tuple[str, str, int], set[bytes]] = {}
    latest = LatestValues(history=10**6)
    for raw in releases:
        body = json.loads(raw)
        assert body["schema"] == "dpstream.release/1", body
        copies.setdefault((body["instance"], body["key"], body["step"]), set()).add(raw)
        record = decode(raw)
        assert isinstance(record, Release)
        latest.add(record)
    differing = {c: v for c, v in copies.items() if len(v) > 1}
    assert not differing, list(differing.items())[:3]
    assert latest.counts.conflicts == 0, latest.counts
    instances = {instance for instance, _, _ in copies}
    assert len(instances) == 1, instances
    assert {key for _, key, _ in copies} == set(KEYS)
    assert max(step for _, _, step in copies) <= now_step  # nothing released ahead
    zs = []
    for key in KEYS:
        last = -1
        while (*instances, key, last + 1) in copies:
            last += 1
        assert last >= target, (key, last, target)
        release = json.loads(next(iter(copies[(*instances, key, last)])))
        truth = sum(n for step, n in true_steps[key].items() if step <= last)
        z = (release["value"] - truth) / release["std"]
        zs.append(z)
        assert abs(z) <= 6, (key, last, release["value"], truth, release["std"])

    total = time.monotonic() - began
    print(f"\nanomaly soak summary ({total:.0f} s in all):")
    print(f"  good events acknowledged: {len(good)}; dead letters {len(dead)} "
          f"({len(dead) - len(letters)} duplicates), all of the poison record")
    print(f"  releases: {len(releases)} records, {len(copies)} coordinates, conflicts "
          f"{latest.counts.conflicts}, duplicates {latest.counts.duplicates}; target {target}")
    print("  z at the last covered step: "
          + ", ".join(f"{k}={z:+.2f}" for k, z in zip(KEYS, zs, strict=True)))
    print(f"  second process: rc {second_process.returncode}: {refusal}; DpstreamDown for its "
          f"target {', '.join(down_states) or 'gone'} at the end")
    print(f"  hour-ahead records clamped: run 1 {clamped_1:.0f}, run 2 {clamped_2:.0f}")
    print(f"  re-created topic: rc {third.proc.returncode}: {error}")
    print(f"  min step lag seen by Prometheus: {min_lag[0][1]:.1f} s")
    for name, value in figures.items():
        print(f"  {name}: {value:.1f}" if isinstance(value, float) else f"  {name}: {value}")
