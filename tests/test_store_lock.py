"""One recovery store, one owner (issue 22, item 2).

A process holding a recovery store (an OS file lock per recovery partition, held for its
lifetime) makes a second ``dpstream run`` on that store, or the ``bytewax.run`` entry point,
stop at start-up with a one-line error naming the holder's pid and host; the processes of one
cluster sharing a directory lock disjoint partitions and coexist. All with real processes;
no broker is needed, as the lock is taken before the flow looks for Kafka.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dpstream.store_lock import lock_recovery_store, partitions_to_lock

NOISE_KEY = "9a0c2e4f6b8d1a3c5e7f9b0d2c4e6a8f1b3d5c7e9a0b2d4f6c8e0a1b3c5d7e9f"
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("DPSTREAM_", "BYTEWAX_"))},
       "PYTHONUNBUFFERED": "1", "DPSTREAM_NOISE_KEY": NOISE_KEY,
       "DPSTREAM_PROGRESS_SECONDS": "0", "RUST_BACKTRACE": "0"}
CONFIG = """\
[flow]
name = "lock"
origin = "2026-09-21T14:13:20Z"
step = "1s"

[kafka]
brokers = ["127.0.0.1:9"]
input_topic = "events"
startup_timeout = "3s"

[admission]
mode = "declared"
keys = ["a"]

[privacy]
budget = 1.0

[metrics]
port = 0
"""


def hold(store: Path, process: int = 0, processes: int = 1) -> subprocess.Popen:
    """A process that locks ``store`` as process ``process`` of ``processes``, then sleeps."""
    code = textwrap.dedent(f"""
        import sys, time
        from dpstream.store_lock import lock_recovery_store
        held = lock_recovery_store({str(store)!r}, process={process}, processes={processes})
        print("held", *sorted(p.name for p in held), flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("held"), line + proc.stdout.read()  # type: ignore[union-attr]
    return proc


def store_with(tmp_path: Path, partitions: int) -> Path:
    from bytewax.recovery import init_db_dir

    store = tmp_path / "recovery"
    store.mkdir(mode=0o700)
    init_db_dir(store, partitions)
    return store


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "flow.toml"
    path.write_text(CONFIG)
    return path


def one_line_error(out: subprocess.CompletedProcess[str], holder: subprocess.Popen) -> str:
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "Traceback" not in text and "panicked" not in text, text
    errors = [line for line in text.splitlines() if "error" in line]
    assert len(errors) == 1, text
    line = errors[0]
    assert f"pid {holder.pid}" in line and repr(socket.gethostname()) in line, line
    assert "in use" in line, line
    return line


def running_flow(store: Path, config: Path) -> subprocess.Popen:
    """A real `dpstream run` on ``store``: bound to its instance, waiting for a broker."""
    slow = config.with_name("slow.toml")
    slow.write_text(CONFIG.replace('startup_timeout = "3s"', 'startup_timeout = "120s"'))
    proc = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "run", "--config",
                             str(slow), "--recovery-dir", str(store)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (store / "dpstream-instance.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the first flow died"
        time.sleep(0.05)
    time.sleep(0.5)
    return proc


def test_a_second_dpstream_run_on_a_store_in_use_stops_with_the_holders_pid_and_host(
        tmp_path, config):
    store = store_with(tmp_path, 1)
    holder = running_flow(store, config)
    try:
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "dpstream.cli", "run", "--config",
                              str(config), "--recovery-dir", str(store)], env=ENV,
                             capture_output=True, text=True, timeout=60)
        one_line_error(out, holder)
        assert time.monotonic() - start < 30  # refused at start-up, not after a Kafka wait
        assert out.returncode == 2
    finally:
        holder.kill()
        holder.wait()


def test_the_bytewax_entry_point_is_refused_too(tmp_path, config):
    store = store_with(tmp_path, 1)
    holder = running_flow(store, config)
    try:
        out = subprocess.run([sys.executable, "-m", "bytewax.run",
                              "dpstream.flows.counters:flow", "-r", str(store),
                              "-s", "5", "-b", "0"],
                             env={**ENV, "DPSTREAM_CONFIG": str(config),
                                  "DPSTREAM_RECOVERY_DIR": str(store)},
                             capture_output=True, text=True, timeout=60)
        one_line_error(out, holder)
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_dies_with_its_holder_even_on_kill_9(tmp_path):
    store = store_with(tmp_path, 1)
    holder = hold(store)
    holder.kill()
    holder.wait()
    assert [p.name for p in lock_recovery_store(store)] == ["dpstream-part-0.lock"]
    assert lock_recovery_store(store)  # the same process again: already held, no error


def test_cluster_processes_sharing_a_directory_coexist_and_a_duplicate_is_refused(tmp_path):
    store = store_with(tmp_path, 2)
    first = hold(store, 0, 2)
    second = hold(store, 1, 2)
    try:
        for process, processes in ((0, 2), (1, 2), (0, 1)):  # a copy of either, or a loner
            code = ("from dpstream.store_lock import lock_recovery_store\n"
                    f"lock_recovery_store({str(store)!r}, process={process}, "
                    f"processes={processes})")
            out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode != 0
            assert "RecoveryStoreInUseError" in out.stderr and "is in use" in out.stderr
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()


def test_which_partitions_a_process_locks():
    from dpstream.runner import process_count

    assert partitions_to_lock([0], 0, 1) == [0]
    assert partitions_to_lock([0, 1, 2], 0, 1, count=3) == [0, 1, 2]  # one process: all
    assert partitions_to_lock([0, 1], 1, 2, count=2) == [1]  # a shared directory
    assert partitions_to_lock([0, 1, 2, 3], 0, 2, count=4) == [0, 2]
    assert partitions_to_lock([1], 1, 2, count=2) == [1]  # a directory per process
    assert partitions_to_lock([1], 0, 2, count=2) == [1]  # ... whatever its partition's number
    assert partitions_to_lock([0, 2], 0, 2, count=4) == [0, 2]  # ... and however many
    assert partitions_to_lock([0, 1], 0, 2, count=4) == [0, 1]
    assert partitions_to_lock([0, 1], 1, 2, count=None) == [0, 1]  # unknown: all
    assert partitions_to_lock([], 0, 1, expected=3) == [0, 1, 2]  # about to be made
    assert process_count(["x", "-a", "h:1;h:2"], {}) == 2
    assert process_count(["x"], {"BYTEWAX_ADDRESSES": "h:1;h:2;h:3"}) == 3
    assert process_count(["x"], {}) == 1


def test_the_partition_count_is_read_from_the_store(tmp_path):
    from dpstream.store_lock import partition_count

    store = store_with(tmp_path, 3)
    before = sorted(p.name for p in store.iterdir())
    assert [partition_count(store, k) for k in range(3)] == [3, 3, 3]
    assert partition_count(store, 7) is None
    assert sorted(p.name for p in store.iterdir()) == before  # no -wal/-shm files left


def test_a_new_store_with_lock_files_is_still_a_new_store(tmp_path):
    from dpstream.core.noise.keys import NoiseKey
    from dpstream.instance import bind_instance
    from dpstream.kinds.counters.kind import statistics_spec
    from dpstream.platform import parse_config

    store = store_with(tmp_path, 1)
    lock_recovery_store(store)
    cfg = parse_config({"flow": {"name": "t", "origin": "2026-09-21T14:13:20Z", "step": "1s"},
                        "admission": {"mode": "declared", "keys": ["a"]},
                        "privacy": {"budget": 1.0}, "metrics": {"port": 0}})
    instance = bind_instance(cfg, statistics_spec(cfg), NoiseKey.for_tests(1), store)
    assert instance.durable and not instance.resumed
