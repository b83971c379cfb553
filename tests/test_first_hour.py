"""Issue 22 items 5 and 9: the first hour on the trial broker works as written.

* every shipped example passes its own ``check-config`` (no ``[VIOLATED]``);
* ``dpstream topics`` reports the timestamp type the broker actually gave the input topic;
* ``dpstream run`` with ``flow.clock = "broker"`` on a broker that ignores LogAppendTime stops at
  start-up with one line that names the fix (before: every event became a dead letter);
* docs/running.md's "Running it", followed command by command against the embedded broker,
  publishes releases;
* every configuration of the README's tour passes its own ``check-config``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.configs import counters, write

from dpstream.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "deploy").glob("*.example.toml"))
KEY = "5a1f0e9a1c5d4e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_passes_its_own_check_config(example, capsys):
    assert len(EXAMPLES) >= 3
    assert main(["check-config", str(example)]) == 0
    printed = capsys.readouterr().out
    assert "VIOLATED" not in printed, printed
    assert "not guaranteed" not in printed, printed


def _config(path: Path, bootstrap: str, topics: dict[str, str], clock: str) -> Path:
    return write(path, counters(bootstrap, topics, name="first-hour", origin=time.time() - 5,
                                flow={"clock": clock}))


def _names(tag: str) -> dict[str, str]:
    stamp = f"{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    return {role: f"fh-{role}-{stamp}" for role in ("events", "releases", "alerts", "dead")}


@pytest.mark.integration
def test_topics_reports_the_timestamp_type_the_broker_gave(broker, tmp_path, capsys):
    names = _names("topics")
    config = _config(tmp_path / "c.toml", broker.bootstrap, names, "broker")
    assert main(["topics", "--config", str(config)]) == 0
    captured = capsys.readouterr()
    [line] = [line for line in captured.out.splitlines() if names["events"] in line]
    # the trial broker accepts LogAppendTime and ignores it: the report says so
    assert "asked for LogAppendTime" in line and "timestamp type CreateTime" in line, line
    assert "would dead-letter every event" in captured.err
    assert "DPSTREAM_FLOW_CLOCK=producer" in captured.err
    assert "LogAppendTime" not in "".join(
        line for line in captured.out.splitlines() if names["releases"] in line)


@pytest.mark.integration
def test_run_with_the_broker_clock_on_the_trial_broker_stops_and_names_the_fix(broker,
                                                                             tmp_path):
    from dpstream.io.topics import ensure_topics

    names = _names("run")
    ensure_topics(broker.bootstrap, {name: 1 for name in names.values()})
    config = _config(tmp_path / "c.toml", broker.bootstrap, names, "broker")
    env = dict(os.environ, DPSTREAM_NOISE_KEY=KEY, PYTHONUNBUFFERED="1")
    env.pop("DPSTREAM_FLOW_CLOCK", None)
    done = subprocess.run([sys.executable, "-m", "dpstream.cli", "run", "--config", str(config),
                           "--ephemeral"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    [error] = [line for line in done.stderr.splitlines() if line.startswith("dpstream: error:")]
    assert names["events"] in error and "CreateTime" in error
    assert "message.timestamp.type=LogAppendTime" in error and 'flow.clock = "producer"' in error
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("kind", ["counters", "pmwg", "erm"])
def test_every_configuration_of_the_readme_tour_passes_check_config(kind, tmp_path, capsys):
    text = (ROOT / "README.md").read_text()
    tour = text[text.index("## A five-minute tour"):text.index("## The privacy claim")]
    blocks = [block.split("```", 1)[0] for block in tour.split("```toml\n")[1:]]
    assert len(blocks) == 3, tour
    kinds = [re.search(r'^kind = "(\w+)"', b, re.M) for b in blocks]
    [block] = [b for b, k in zip(blocks, kinds, strict=True)
               if (k.group(1) if k else "counters") == kind]
    config = tmp_path / f"{kind}.toml"
    config.write_text(block)
    assert main(["check-config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert "VIOLATED" not in printed and "not guaranteed" not in printed, printed
    if kind != "counters":
        assert f"({kind})" in printed.splitlines()[0], printed


def _readme_commands() -> list[str]:
    text = (ROOT / "docs" / "running.md").read_text()
    section = text[text.index("## Running it"):]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    commands = []
    for raw in block.strip().splitlines():
        command = raw.split("  #", 1)[0].strip()  # the comments are two spaces away
        if command:
            commands.append(command)
    return commands


@pytest.mark.integration
@pytest.mark.slow
def test_docs_running_it_followed_literally_publishes_releases(tmp_path):
    """Every command of docs/running.md "Running it", in order, against the embedded broker.

    Two substitutions only, for a shared test machine: a free port for 9092 (with
    DPSTREAM_BROKERS pointing the example at it) and a temporary directory for /secret; and the
    metrics on a free port. The events are written as a user's producer would: JSON objects with
    the producer's timestamps.
    """
    from dpstream.io.broker import free_port
    from dpstream.io.topics import produce, read_all

    commands = _readme_commands()
    assert [c.split()[:2] for c in commands] == [
        ["dpstream", "keygen"], ["export", "DPSTREAM_NOISE_KEY_FILE=/secret/noise.key"],
        ["dpstream", "broker"], ["export", "DPSTREAM_FLOW_CLOCK=producer"],
        ["dpstream", "topics"], ["dpstream", "check-config"], ["dpstream", "run"]], commands
    port = free_port()
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    script = ["set -e", f"cd {shlex.quote(str(ROOT))}",
              f"export DPSTREAM_BROKERS=127.0.0.1:{port}",
              f"export DPSTREAM_METRICS_PORT={free_port()}"]
    pids = tmp_path / "pids"
    for command in commands:
        command = command.replace("/secret", str(secret)).replace("9092", str(port))
        if command.startswith("dpstream broker"):
            command = command.rstrip("&").strip()
            script += [f"{command} > {tmp_path}/broker.log 2>&1 &", f"echo $! >> {pids}",
                       f"for i in $(seq 100); do grep -q bootstrap {tmp_path}/broker.log "
                       "&& break; sleep 0.1; done"]
        elif command.startswith("dpstream run"):
            script += [f"{command} > {tmp_path}/run.log 2>&1 &", f"echo $! >> {pids}", "wait $!"]
        else:
            script.append(command)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPSTREAM_")}
    env.update(PYTHONUNBUFFERED="1", DPSTREAM_PROGRESS_SECONDS="5")
    shell = subprocess.Popen(["bash", "-c", "\n".join(script)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    bootstrap = f"127.0.0.1:{port}"
    run_log = tmp_path / "run.log"
    try:
        deadline = time.monotonic() + 120
        while not (run_log.exists() and "reading events" in run_log.read_text()):
            assert shell.poll() is None, (shell.communicate()[0][-3000:],
                                          run_log.read_text()[-3000:] if run_log.exists() else "")
            assert time.monotonic() < deadline, run_log.read_text()[-3000:]
            time.sleep(0.3)
        # a user's producer: one popular key, 50 events a second stamped now (the example's
        # monitor threshold is about 1,000 events; its steps are one minute long)
        deadline = time.monotonic() + 240
        releases: list = []
        while not releases and time.monotonic() < deadline:
            assert shell.poll() is None, shell.communicate()[0][-3000:] + run_log.read_text()
            now = time.time()
            produce(bootstrap, "events",
                    [(b"video-17", json.dumps({"key": "video-17", "ts": now}).encode(),
                      int(now * 1000))] * 50)
            releases = [json.loads(r.value) for r in read_all(bootstrap, "releases", idle=0.5)]
            time.sleep(max(0.0, now + 1 - time.time()))
        assert releases, run_log.read_text()[-3000:]
        assert {r["key"] for r in releases} == {"video-17"}
        dead = read_all(bootstrap, "dead-letters", idle=1)
        assert len(dead) == 0, [json.loads(d.value)["reason"] for d in dead[:3]]
    finally:
        for pid in (pids.read_text().split() if pids.exists() else [])[::-1]:
            try:
                os.kill(int(pid), signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            out = shell.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            shell.kill()
            out = shell.communicate()[0]
    assert "Traceback" not in out, out[-3000:]
    log = run_log.read_text()
    assert "Traceback" not in log and "panicked" not in log, log[-3000:]


# --- item 9: partitions are named topic[partition] ------------------------------------------

def test_partitions_are_named_by_topic_and_partition_in_metrics_and_the_stall_line(
        monkeypatch, caplog):
    from prometheus_client import CollectorRegistry

    from dpstream.metrics import FlowMetrics
    from dpstream.platform import partition_names
    from dpstream.stream import operators
    from dpstream.stream.barrier import StepBarrier

    names = partition_names(["events", "queries"], [2, 2])
    assert names == ["events[0]", "events[1]", "queries[0]", "queries[1]"]
    metrics = FlowMetrics("pm", CollectorRegistry(), exact_counts=True)
    metrics.set_partition_names(names)
    metrics.observe_partition(3, 7, 1_700_000_000.0)
    metrics.observe_input_lag(2, 5)
    labels = {s.labels.get("partition") for family in metrics.registry.collect()
              for s in family.samples if "partition" in s.labels}
    assert labels == {"queries[1]", "queries[0]"}

    # the stall line: flow partition 3 is the queries topic's partition 1, not "partition 3"
    monkeypatch.setattr(operators, "STALL_REPORT_SECONDS", 0.0)
    operators._last_stall_report[0] = 0.0
    barrier = StepBarrier(4, first_step=0)
    barrier.bind(0)
    barrier.frontiers = {0: 9, 1: 9, 2: 9, 3: 0}
    barrier.to_state = lambda: {}  # type: ignore[method-assign]
    logic = operators._ShardLogic(barrier, metrics, lambda _out: None)
    with caplog.at_level("WARNING", logger="dpstream"):
        logic._observe([])
    [line] = [r.getMessage() for r in caplog.records if "wait for" in r.getMessage()]
    assert "input partition(s) queries[1] (at step 0)" in line, line
