"""The small operator points of issue 22, item 11: each one a regression test.

The recovery store made and kept private by `dpstream run`, a one-line error instead of
Bytewax's NoPartitionsError, Ctrl-C's exit status, a closed stdout pipe, `tail --timeout`,
plain `--help`, refused nonsensical demo arguments, the "new flow instance" line only for a new
instance, kafka-python's "blocking the event loop" diagnostic kept out of the output, and the
Python range Bytewax installs on.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import time
import tomllib
from importlib.metadata import metadata
from pathlib import Path

import pytest

from dpstream.cli import main

ROOT = Path(__file__).parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


# --- requires-python -------------------------------------------------------------------------

def test_requires_python_stops_where_bytewax_wheels_stop():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bound = project["requires-python"]
    versions = [tuple(map(int, c.rsplit(" ", 1)[1].split("."))) for c in
                metadata("bytewax").get_all("Classifier") or ()
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    newest = max(versions)  # 0.21.1: (3, 12); it has no wheels (and no sdist build) past it
    assert bound == f">=3.11,<{newest[0]}.{newest[1] + 1}", bound


# --- a closed stdout pipe --------------------------------------------------------------------

@pytest.mark.flow
@pytest.mark.parametrize("argv", [["check-config", "deploy/counters.example.toml"],
                                  ["check-config", "deploy/pmwg.example.toml"],
                                  ["--version"]])
def test_a_reader_that_left_gets_no_broken_pipe_traceback(argv):
    """`dpstream check-config FILE | head -1`: the pipe's reader is gone before the output."""
    read, write = os.pipe()
    os.close(read)  # as `head -1` after its line, deterministically: every write gets EPIPE
    try:
        out = subprocess.run([sys.executable, "-m", "dpstream.cli", *argv], cwd=ROOT, env=ENV,
                             stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
    assert out.stderr == ""
    if argv[0] != "--version":
        assert out.returncode == 141  # 128 + SIGPIPE, as for a C tool killed by the pipe


# --- --help ----------------------------------------------------------------------------------

def command_parsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    """The `dpstream` parser and every subcommand's, as main() builds them."""
    built = []

    def capture(self, *_args, **_kwargs):
        built.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        main(["--help"])
    top = built[0]
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"dpstream": top, **sub.choices}


def test_every_option_of_every_command_has_a_help_text(monkeypatch):
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, parser in command_parsers(monkeypatch).items()
               for action in parser._actions if not action.help]
    assert missing == []


def test_help_is_plain_text_without_markup(monkeypatch, capsys):
    for name in command_parsers(monkeypatch):
        capsys.readouterr()
        monkeypatch.undo()
        with pytest.raises(SystemExit):
            main(["--help"] if name == "dpstream" else [name, "--help"])
        text = capsys.readouterr().out
        assert "usage: dpstream" in text
        for markup in ("`", "**", ":func:", ":class:", ".. "):
            assert markup not in text, (name, markup, text)


# --- nonsensical numbers ---------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "--rate", "-5"], "argument --rate: must be an integer >= 1, got -5"),
    (["demo", "--rate", "0"], "argument --rate: must be an integer >= 1, got 0"),
    (["demo", "--rate", "fast"], "argument --rate: must be an integer >= 1, got 'fast'"),
    (["demo", "--duration", "-1"], "argument --duration: must be a number of seconds >= 0, "
                                   "got '-1'"),
    (["demo", "--duration", "nan"], "argument --duration: must be a number of seconds >= 0"),
    (["demo", "-w", "0"], "argument -w/--workers: must be an integer >= 1, got 0"),
    (["demo", "--web-port", "70000"], "argument --web-port: must be a TCP port 1..65535, or 0 "
                                      "for none, got 70000"),
    (["run", "--workers", "-2"], "argument -w/--workers: must be an integer >= 1, got -2"),
    (["run", "--recovery-partitions", "0"], "argument --recovery-partitions: must be an "
                                            "integer >= 1, got 0"),
    (["run", "--snapshot-interval", "0"], "argument --snapshot-interval: must be a number of "
                                          "seconds > 0, got '0'"),
])
def test_nonsensical_numbers_are_refused_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rate": -5}, "the demo's rate must be an integer >= 1 event per second, got -5"),
    ({"duration": -1.0}, "the demo's duration must be a number of seconds >= 0"),
    ({"workers": 0}, "the demo's workers must be an integer >= 1, got 0"),
])
def test_run_demo_refuses_nonsensical_numbers(kwargs, message):
    from dpstream.demo import run_demo
    from dpstream.errors import DpstreamError

    with pytest.raises(DpstreamError, match=re.escape(message)):
        run_demo(web_port=0, **kwargs)


# --- the recovery store, Ctrl-C and the "new flow instance" line (a real broker) -------------

NEW_INSTANCE = "reprocessing an input topic is a new flow instance"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def flow_env() -> dict[str, str]:
    from test_flow_kafka import ENV as FLOW_ENV

    return dict(FLOW_ENV, PYTHONPATH=str(ROOT))


def bounded_flow(broker, topic_factory, tmp_path, steps: int = 3, tail: bool = False) -> Path:
    from test_flow_kafka import make_topics, produce_events, write_config

    topics = make_topics(topic_factory)
    produce_events(broker, topics["events"], steps)
    return write_config(tmp_path / "flow.toml", broker, topics, steps=steps, tail=tail)


def ran(out: subprocess.CompletedProcess) -> str:
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "Traceback" not in text and "panicked" not in text, text[-3000:]
    return text


@pytest.mark.integration
def test_run_makes_the_recovery_store_private_and_says_new_instance_only_when_new(
        broker, topic_factory, tmp_path):
    config = bounded_flow(broker, topic_factory, tmp_path)
    store = tmp_path / "missing" / "recovery"  # neither it nor its parent exists

    def run() -> str:
        return ran(subprocess.run(
            [sys.executable, "-m", "dpstream.cli", "run", "--config", str(config),
             "--recovery-dir", str(store), "--recovery-partitions", "2"],
            cwd=ROOT, env=flow_env(), capture_output=True, text=True, timeout=180))

    old = os.umask(0o022)  # the usual umask: Bytewax's files would be 0644 under it
    try:
        first = run()
        assert "initialised 2 recovery partitions" in first
        assert first.count(NEW_INSTANCE) == 1
        files = sorted(p.name for p in store.glob("part-*.sqlite3"))
        assert files == ["part-0.sqlite3", "part-1.sqlite3"]
        assert mode(store) == 0o700
        assert {p.name: mode(p) for p in store.iterdir()} == {
            p.name: 0o600 for p in store.iterdir()}  # the partitions, side files, manifest

        second = run()  # resumes the same instance: nothing new to say about reprocessing
        assert "(resumed, kept in" in second
        assert NEW_INSTANCE not in second
        assert {p.name: mode(p) for p in store.iterdir()} == {
            p.name: 0o600 for p in store.iterdir()}
    finally:
        os.umask(old)


@pytest.mark.integration
def test_bytewax_run_on_an_uninitialised_store_is_one_line_and_the_readme_steps_work(
        broker, topic_factory, tmp_path):
    config = bounded_flow(broker, topic_factory, tmp_path)
    store = tmp_path / "secret" / "recovery"
    env = dict(flow_env(), DPSTREAM_CONFIG=str(config), DPSTREAM_RECOVERY_DIR=str(store))
    bytewax_run = [sys.executable, "-m", "bytewax.run", "dpstream.flows.counters:flow",
                   "-w", "1", "-r", str(store), "-s", "5", "-b", "0"]
    out = subprocess.run(bytewax_run, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "NoPartitionsError" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"dpstream: error: the recovery directory {store} holds no Bytewax recovery partitions; "
        f"initialise it once: mkdir -p {store} && chmod 700 {store} && python -m "
        f"bytewax.recovery {store} N (N partitions, at least 1; dpstream run --recovery-dir "
        f"{store} does this itself)"]

    # docs/running.md's "once" step, literally (the parent directory does not exist either)
    running = (ROOT / "docs" / "running.md").read_text()
    step = re.search(r"^(mkdir -p /secret/recovery .*?)\s+# once$", running, re.M)
    assert step, "docs/running.md's initialisation step"
    old = os.umask(0o022)
    try:
        subprocess.run(["bash", "-ec", step.group(1).replace("/secret/recovery", str(store))],
                       cwd=ROOT, env=env, check=True, timeout=60)
        assert mode(store / "part-0.sqlite3") == 0o644  # as Bytewax makes it
        ran(subprocess.run(bytewax_run, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=180))
    finally:
        os.umask(old)
    assert {p.name: mode(p) for p in store.iterdir()} == {
        p.name: 0o600 for p in store.iterdir()}


@pytest.mark.integration
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)],
                         ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_exits_130_and_sigterm_0_after_a_clean_stop(broker, topic_factory, tmp_path,
                                                           signum, code):
    from test_flow_kafka import KEYS

    from dpstream.io.topics import read_all

    config = bounded_flow(broker, topic_factory, tmp_path, steps=5, tail=True)
    releases = re.search(r'releases_topic = "([^"]+)"', config.read_text()).group(1)
    proc = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "run", "--config",
                             str(config), "--recovery-dir", str(tmp_path / "recovery")],
                            cwd=ROOT, env=flow_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        read_all(broker.bootstrap, releases, expect=4 * len(KEYS), timeout=90)
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, out[-3000:]
    assert "stopped; a restart resumes from the recovery store" in out, out[-3000:]
    assert "Traceback" not in out and "panicked" not in out, out[-3000:]


# --- tail --timeout ---------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("reachable", [True, False], ids=["broker", "no-broker"])
def test_tail_timeout_bounds_the_whole_command(broker, topic_factory, reachable):
    """--timeout 3 returns after about 3 s, connecting included (it took 10 s without a broker:
    kafka-python's bootstrap wait came on top of the timeout)."""
    from dpstream.io.broker import free_port

    topic = topic_factory(2, "releases")
    brokers = broker.bootstrap if reachable else f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dpstream.cli", "tail", "--brokers", brokers,
                          "--topic", topic, "--timeout", "3"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert out.returncode == (0 if reachable else 2), out.stderr
    if reachable:
        assert elapsed >= 3 and "dpstream tail: read 0 records" in out.stderr
    else:
        assert out.stderr.startswith(f"dpstream: error: cannot reach a Kafka broker at {brokers}")
    # 3 s, plus the interpreter's start and imports (~0.5 s here) with a wide margin for a
    # loaded machine: a functional bound, not a benchmark
    assert elapsed < 6.0, (elapsed, out.stderr)


def test_tail_refuses_a_timeout_that_is_not_positive(capsys):
    with pytest.raises(SystemExit):
        main(["tail", "--brokers", "127.0.0.1:1", "--topic", "t", "--timeout", "0"])
    assert "argument --timeout: must be a number of seconds > 0, got '0'" in capsys.readouterr().err


# --- kafka-python's "blocking the event loop" ------------------------------------------------

def slow_kafka_python_step() -> None:
    """Make kafka-python's own I/O loop log its warning: one step that takes 0.15 s (what a
    step waiting for the GIL behind the demo's producer thread looks like to it)."""
    from kafka.net.selector import NetworkSelector

    async def slow() -> None:
        time.sleep(0.15)

    net = NetworkSelector()
    try:
        net.run(slow)
    finally:
        net.close()


@pytest.fixture
def restore_logging():
    names = ["", "dpstream", "kafka", "kafka.net.selector"]
    saved = [(logging.getLogger(n), logging.getLogger(n).level,
              list(logging.getLogger(n).filters)) for n in names]
    yield
    for logger, level, filters in saved:
        logger.setLevel(level)
        logger.filters[:] = filters


@pytest.mark.parametrize(("level", "shown"), [("info", False), ("warning", False),
                                              ("debug", True)])
def test_kafka_pythons_event_loop_warning_stays_out_unless_debugging(level, shown, caplog,
                                                                       restore_logging):
    from dpstream.cli import _configure_logging

    _configure_logging(level)  # what every dpstream command does first (demo, tail, query...)
    caplog.set_level(logging.DEBUG if shown else logging.WARNING, logger="kafka")
    slow_kafka_python_step()
    assert ("blocking the event loop" in caplog.text) is shown, caplog.text
    logging.getLogger("kafka.net.selector").warning("another warning of kafka-python")
    assert "another warning of kafka-python" in caplog.text  # only that one diagnostic goes


def test_a_cluster_process_may_hold_no_recovery_partitions(tmp_path, restore_umask):
    """More processes than partitions (deploy/container/cluster_init.py): not refused."""
    from dpstream.errors import ConfigError
    from dpstream.runner import _bytewax_cluster, _check_recovery_partitions

    empty = tmp_path / "store"
    empty.mkdir(mode=0o700)
    assert _bytewax_cluster(["run.py", "m:flow", "-i", "1", "-a", "h0:2101;h1:2101"], {})
    assert _bytewax_cluster(["run.py", "m:flow"], {"BYTEWAX_POD_NAME": "dpstream-1"})
    assert not _bytewax_cluster(["run.py", "m:flow", "-r", str(empty)], {})
    _check_recovery_partitions(str(empty), cluster=True)
    with pytest.raises(ConfigError, match="holds no Bytewax recovery partitions"):
        _check_recovery_partitions(str(empty), cluster=False)


@pytest.fixture
def restore_umask():
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


@pytest.mark.integration
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)],
                         ids=["SIGINT", "SIGTERM"])
def test_tail_exits_130_after_ctrl_c_and_0_after_sigterm(broker, topic_factory, signum, code):
    topic = topic_factory(1, "releases")
    proc = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "tail", "--brokers",
                             broker.bootstrap, "--topic", topic, "--json", "--web", "0"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None
        ready = proc.stderr.readline()  # after the consumer has its partitions
        assert "dpstream tail: live view at" in ready, ready + proc.stderr.read()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert "Traceback" not in err and "dpstream tail: read 0 records" in err, err
