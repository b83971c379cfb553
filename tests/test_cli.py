"""The command line's production hygiene: private key files, weak keys, a private recovery store,
--version and --log-level, and the ``topics`` and ``broker`` helpers for trials."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path

import pytest

import dpstream
from dpstream.cli import main
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError, NoiseKeyError
from dpstream.instance import MANIFEST_NAME, bind_instance
from dpstream.kinds.counters.kind import statistics_spec
from dpstream.platform import parse_config

ROOT = Path(__file__).parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_config(path: Path, brokers: str = "127.0.0.1:9092", **topics: str) -> Path:
    lines = "\n".join(f'{name} = "{topic}"' for name, topic in topics.items())
    path.write_text(f"""
[flow]
origin = "2026-09-21T14:13:20Z"
[kafka]
brokers = ["{brokers}"]
{lines}
[privacy]
budget = 1.0
[admission]
mode = "declared"
keys = ["a"]
[metrics]
port = 0
""")
    return path


# --- keygen ---------------------------------------------------------------------------------

def test_keygen_out_makes_a_private_file_and_prints_only_the_fingerprint(tmp_path, capsys):
    path = tmp_path / "noise.key"
    old = os.umask(0)  # the mode comes from os.open, not from a lenient umask
    try:
        assert main(["keygen", "--out", str(path)]) == 0
    finally:
        os.umask(old)
    assert mode(path) == 0o600
    key = NoiseKey.from_file(path)
    out, err = capsys.readouterr()
    assert out == key.fingerprint() + "\n"
    assert path.read_text().strip() not in out + err
    assert str(path) in err
    assert NoiseKey.from_environment({"DPSTREAM_NOISE_KEY_FILE": str(path)}).fingerprint() == (
        key.fingerprint())


def test_keygen_out_refuses_to_overwrite(tmp_path, capsys):
    path = tmp_path / "noise.key"
    assert main(["keygen", "--out", str(path)]) == 0
    before = path.read_text()
    capsys.readouterr()
    assert main(["keygen", "--out", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path} already exists: refusing to overwrite it" in err
    assert path.read_text() == before and mode(path) == 0o600


def test_keygen_out_does_not_follow_a_dangling_symlink(tmp_path, capsys):
    target, link = tmp_path / "elsewhere", tmp_path / "noise.key"
    link.symlink_to(target)
    assert main(["keygen", "--out", str(link)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert not target.exists()


def test_keygen_to_stdout_warns_on_stderr(capsys):
    assert main(["keygen"]) == 0
    out, err = capsys.readouterr()
    assert NoiseKey.parse(out, source="stdout")
    assert "secret" in err and "--out" in err and out.strip() not in err


# --- loading keys ---------------------------------------------------------------------------

def test_a_key_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "noise.key"
    assert main(["keygen", "--out", str(path)]) == 0
    path.chmod(0o644)
    with pytest.raises(NoiseKeyError) as info:
        NoiseKey.from_environment({"DPSTREAM_NOISE_KEY_FILE": str(path)})
    assert str(info.value).startswith(f"the noise key file {path} has mode 0644: it is readable "
                                      "or writable by its group or by others")
    assert f"`chmod 600 {path}`" in str(info.value)


@pytest.mark.parametrize(("text", "message"), [
    ("00" * 32, "all 32 bytes equal"),
    ("A" * 43 + "=", "all 32 bytes equal"),  # base64 of 32 zero bytes
    ("0102030405060708" * 2, "64 hex characters"),  # 16 bytes
    (bytes(range(31)).hex(), "64 hex characters"),
], ids=["all-zero-hex", "all-zero-base64", "16-bytes", "31-bytes"])
def test_weak_and_short_keys_are_refused(text, message):
    with pytest.raises(NoiseKeyError, match=message) as info:
        NoiseKey.from_environment({"DPSTREAM_NOISE_KEY": text})
    assert "$DPSTREAM_NOISE_KEY" in str(info.value) and text not in str(info.value)


def test_an_all_zero_key_file_is_refused(tmp_path):
    path = tmp_path / "zero.key"
    path.write_text("00" * 32)
    path.chmod(0o600)
    with pytest.raises(NoiseKeyError, match=f"the noise key in file {path} has all 32 bytes"):
        NoiseKey.from_file(path)


# --- the recovery store ---------------------------------------------------------------------

def flow_config():
    return parse_config({"flow": {"origin": "2026-09-21T14:13:20Z"}, "privacy": {"budget": 1.0},
                         "admission": {"mode": "declared", "keys": ["a"]},
                         "metrics": {"port": 0}})


def bind(directory: Path):
    config = flow_config()
    return bind_instance(config, statistics_spec(config), NoiseKey.for_tests(1), directory)


def test_a_world_readable_recovery_directory_is_refused(tmp_path):
    store = tmp_path / "recovery"
    store.mkdir()
    store.chmod(0o755)
    with pytest.raises(ConfigError) as info:
        bind(store)
    assert f"the recovery directory {store} has mode 0755" in str(info.value)
    assert f"`chmod 700 {store}`" in str(info.value)
    assert list(store.iterdir()) == []


def test_a_missing_recovery_directory_is_created_private(tmp_path):
    store = tmp_path / "recovery"
    assert bind(store).durable
    assert mode(store) == 0o700 and mode(store / MANIFEST_NAME) == 0o600


# --- --version and --log-level --------------------------------------------------------------

def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == (
        f"dpstream {dpstream.__version__} (bytewax {version('bytewax')})\n")


@pytest.fixture
def restore_logging():
    loggers = [logging.getLogger(), logging.getLogger("dpstream"), logging.getLogger("kafka")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


@pytest.mark.parametrize(("argv", "level"), [
    ([], logging.INFO),
    (["--log-level", "debug"], logging.DEBUG),
    (["--log-level", "warning"], logging.WARNING),
    (["--log-level", "error"], logging.ERROR),
    (["-v"], logging.DEBUG),
    (["--verbose"], logging.DEBUG),
])
def test_log_level(tmp_path, capsys, restore_logging, argv, level):
    config = write_config(tmp_path / "flow.toml")
    assert main([*argv, "check-config", str(config)]) == 0
    assert logging.getLogger("dpstream").level == level
    assert logging.getLogger().level == level
    # also accepted after the subcommand
    assert main(["check-config", str(config), *argv]) == 0
    assert logging.getLogger("dpstream").level == level
    assert "privacy" in capsys.readouterr().out.lower()


def test_an_unknown_log_level_is_a_usage_error(capsys, restore_logging):
    with pytest.raises(SystemExit) as info:
        main(["--log-level", "loud", "keygen"])
    assert info.value.code == 2
    assert "invalid choice: 'loud'" in capsys.readouterr().err


# --- topics and broker ----------------------------------------------------------------------

@pytest.mark.integration
def test_topics_creates_the_four_topics_and_is_idempotent(broker, tmp_path, capsys,
                                                          restore_logging):
    from dpstream.io.topics import topic_partitions

    tag = uuid.uuid4().hex[:8]
    names = {"input_topic": f"cli-in-{tag}", "releases_topic": f"cli-rel-{tag}",
             "alerts_topic": f"cli-al-{tag}", "dead_letter_topic": f"cli-dl-{tag}"}
    config = write_config(tmp_path / "flow.toml", broker.bootstrap, **names)
    assert main(["topics", "--config", str(config), "--partitions", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["created"] * 4
    assert {line.split()[2] for line in lines} == set(names.values())
    for name in names.values():
        assert topic_partitions(broker.bootstrap, name) == 2

    assert main(["topics", "--config", str(config)]) == 0  # a different --partitions: no error
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["exists"] * 4
    assert all("(2 partitions)" in line for line in lines)


def test_topics_names_an_unreachable_broker(tmp_path, capsys, restore_logging):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = write_config(tmp_path / "flow.toml", f"127.0.0.1:{port}")
    assert main(["topics", "--config", str(config), "--timeout", "1"]) == 2
    assert f"cannot reach a Kafka broker at 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.integration
def test_broker_runs_in_the_foreground_until_sigint(tmp_path):
    from dpstream.io.topics import ensure_topics, topic_partitions

    proc = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "broker"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # blocks until the broker answers (or the command fails)
        assert first.startswith("bootstrap: 127.0.0.1:"), first + proc.stderr.read()
        bootstrap = first.split()[1]
        hint = proc.stdout.readline()
        assert f'kafka.brokers = ["{bootstrap}"]' in hint and "dpstream topics" in hint
        ensure_topics(bootstrap, {"trial": 1})  # a working Kafka-protocol broker
        assert topic_partitions(bootstrap, "trial") == 1
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err  # 128 + SIGINT: Ctrl-C, as a shell expects
    assert "Traceback" not in err and "Traceback" not in out, err
    assert "broker stopped" in out
    host, port = bootstrap.split(":")
    deadline = time.monotonic() + 10
    while True:  # the broker process is gone with it
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "the broker still accepts connections"
        time.sleep(0.1)
