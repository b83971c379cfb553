"""Memory, snapshot size and resume of a long ERM run (issue 25): bounded history at d = 64.

The real dataflow (decode JSON -> steps -> model-stream shard -> continual release schedule
-> encode), one worker, fed in memory as ``bench/erm_throughput.py`` feeds it, **with a
recovery directory**, so that Bytewax snapshots the shard's state at every epoch
(``--snapshot-interval`` seconds, ``dpstream run``'s default 5 s). The events are synthetic:
d = 64 features (a pool of ``POOL`` rows of standard normals rounded to 4 digits, labelled by a
fixed hyperplane, picked by a seeded generator per batch), spread evenly over one-second steps
of ``b0`` events each (one step is one block), three input partitions. Nothing is held in
memory ahead of the flow: batch ``i`` is made when the source asks for it (``Batches``), so
the process's memory is the flow's own.

What is sampled, once per closed step (in the sink, when the step's models arrive; the
sampling itself reads two files and ``/proc``):

* events handed to the flow so far (the source's count) and the step;
* the worker process's resident set (``VmRSS`` of ``/proc/self/status``; one worker, so the
  process is the worker);
* the shard's **snapshot bytes**: the size of the newest serialised state of the model shards'
  stateful step in Bytewax's recovery partition (``snaps.ser_change``, SQLite), and the size of
  the recovery partition files;
* the disk use of the history store (files under the recovery directory other than Bytewax's
  partitions, e.g. a file block store's segments).

Modes::

    OPENBLAS_NUM_THREADS=1 python bench/erm_memory.py run --events 50000000 --block 50000 \\
        --window 8 --tag bounded                      # the long run (samples as JSON lines)
    OPENBLAS_NUM_THREADS=1 python bench/erm_memory.py run --events 2000000 --block 50000 \\
        --tag unbounded                                # the same without max_history
    OPENBLAS_NUM_THREADS=1 python bench/erm_memory.py resume --events 2000000 --block 50000 \\
        --window 8                                     # kill -9 mid-run, resume, compare
    python bench/erm_memory.py report                  # results/issue25-memory.{md,json,svg}

``run`` and ``resume`` start every flow in a child process (``--one``), as the other benches
do; a run's samples go to ``results/.issue25-memory-<tag>.jsonl`` line by line, so a long run
can be watched and a cut-short run still reports what it measured. ``resume`` runs the flow
once uninterrupted, then once more in a child it kills with SIGKILL after ``--kill-at`` of the
input (the child's sink appends every record to a file and fsyncs it), restarts it on the
same recovery directory, and compares the model records: every record of the killed and the
resumed run must be byte-identical to the uninterrupted run's record of the same (stream,
step, role, level), and together they must cover all of them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ORIGIN = 1_790_000_000
BATCH = 10_000
D = 64
POOL = 1 << 15
PARTITIONS = 3
OUT = "issue25-memory"


def _samples_path(tag: str) -> Path:
    return RESULTS / f".{OUT}-{tag}.jsonl"


class Batches(Sequence[Any]):
    """The input as a lazy sequence of :class:`~dpstream.messages.RawBatch`: batch ``i`` is
    made when asked for, from a seeded generator of its own (the same bytes on a replay)."""

    def __init__(self, events: int, block: int, seed: int = 0) -> None:
        import numpy as np

        self.block, self.seed = block, seed
        self.steps = events // block
        self.per_partition = block // PARTITIONS
        self.chunks = math.ceil(self.per_partition / BATCH)
        self.handed = 0  # events handed to the flow (read by the sampler)
        rng = np.random.default_rng(seed)
        w = rng.standard_normal(D)
        x = np.round(rng.standard_normal((POOL, D)), 4)
        labels = np.where(x @ w > 0, "yes", "no")
        self.prefix = [
            ('{"features":[' + ",".join(f"{v:.4f}" for v in row) + f'],"label":"{label}","ts":'
             ).encode() for row, label in zip(x.tolist(), labels.tolist(), strict=True)]

    def __len__(self) -> int:
        return self.steps * PARTITIONS * self.chunks

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        import numpy as np

        from dpstream.messages import TIMESTAMP_LOG_APPEND_TIME, RawBatch

        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not 0 <= i < len(self):
            raise IndexError(i)
        step, rest = divmod(i, PARTITIONS * self.chunks)
        partition, chunk = divmod(rest, self.chunks)
        first = chunk * BATCH
        n = min(BATCH, self.per_partition - first)
        pick = np.random.default_rng((self.seed, i)).integers(POOL, size=n).tolist()
        j = np.arange(first, first + n)
        ts = ORIGIN + step + j / self.per_partition
        prefix = self.prefix
        values: list[bytes | None] = [
            prefix[k] + f"{t:.6f}}}".encode() for k, t in zip(pick, ts.tolist(), strict=True)]
        offsets: list[int | None] = list(range(step * self.per_partition + first,
                                               step * self.per_partition + first + n))
        self.handed += n
        return RawBatch(partition, values, offsets, ["events"] * n,
                        np.floor(ts * 1000), np.full(n, TIMESTAMP_LOG_APPEND_TIME,
                                                     dtype=np.int64))


def config(block: int, window: int | None, learner: str | None) -> Any:
    """The ERM flow: continual release, pure ε = 1, d = 64 (``bench/erm_throughput.py``'s)."""
    from dpstream.platform import parse_config

    release: dict[str, Any] = {"algorithm": "continual", "block_size": block, "base_blocks": 4}
    if window:
        release["max_history"] = window
    model: dict[str, Any] = {"classes": ["no", "yes"], "dimension": D, "clip_norm": 12.0,
                             "regularization": 0.01}
    if learner:
        model["learner"] = learner
    return parse_config({
        "flow": {"kind": "erm", "name": "bench", "origin": "2026-09-21T14:13:20Z",
                 "step": "1s", "shards": 1},
        "privacy": {"accounting": "pure", "epsilon": 1.0},
        "model": model, "release": release, "metrics": {"port": 0},
    })


def rss_bytes() -> int:
    """This process's resident set (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def snapshot_bytes(recovery: Path) -> tuple[int, int, int] | None:
    """(epoch, size) of the newest snapshot of the model shards' state, and the recovery
    partitions' bytes on disk; None while there is none.

    Read from **another process** than the flow's: SQLite's POSIX locks are per process, and
    a second SQLite library closing the file in the flow's process would drop Bytewax's locks
    (it did: the flow died with SIGBUS). In WAL mode a reader in another process is safe.
    """
    best: tuple[int, int] | None = None
    for part in sorted(recovery.glob("part-*.sqlite3")):
        try:
            db = sqlite3.connect(f"file:{part}?mode=ro", uri=True, timeout=30)
            try:
                row = db.execute(
                    "SELECT snap_epoch, length(ser_change) FROM snaps "
                    "WHERE step_id LIKE '%.models.%' AND ser_change IS NOT NULL "
                    "ORDER BY snap_epoch DESC LIMIT 1").fetchone()
            finally:
                db.close()
        except sqlite3.OperationalError:  # not made yet, or the writer holds the lock
            continue
        if row is not None:
            best = (int(row[0]), int(row[1]) + (best[1] if best else 0))
    if best is None:
        return None
    files = sum(p.stat().st_size for p in recovery.glob("part-*.sqlite3*"))
    return best[0], best[1], files


def process_rss(pid: int) -> int | None:
    """Another process's resident set (``VmRSS``), None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def last_events(samples: Path) -> int | None:
    """The events count of the newest per-step sample of the flow (its last full line)."""
    with samples.open("rb") as f:
        f.seek(max(0, samples.stat().st_size - 4096))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            sample = json.loads(line)
        except ValueError:
            continue
        if "step" in sample:
            return int(sample["events"])
    return None


def history_bytes(recovery: Path) -> int:
    """Disk use of everything under the recovery directory but Bytewax's partitions."""
    total = 0
    for path in recovery.rglob("*"):
        if path.is_file() and not path.name.startswith("part-"):
            total += path.stat().st_size
    return total


def run_once(args: argparse.Namespace) -> None:
    """One flow in this process (a child): samples, or records for ``resume``."""
    import gc
    from datetime import timedelta

    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.testing import run_main

    from dpstream.core.noise.keys import NoiseKey
    from dpstream.io.memory import MemorySource
    from dpstream.platform import build_flow
    from dpstream.runner import keep_freed_memory

    keep_freed_memory()
    recovery = Path(args.recovery)
    if not any(recovery.glob("part-*.sqlite3")):
        recovery.mkdir(parents=True, exist_ok=True)
        init_db_dir(recovery, 1)  # type: ignore[no-untyped-call]
    cfg = config(args.block, args.window, args.learner)
    batches = Batches(args.events, args.block)
    out = open(args.output, "ab")  # noqa: SIM115  # the child's lifetime
    started, cpu0 = time.perf_counter(), time.process_time()
    last = [-1]
    records = args.mode == "records"

    class Sample(StatelessSinkPartition[Any]):
        def write_batch(self, items: list[Any]) -> None:
            if records:
                for item in items:
                    out.write(json.dumps({"value": item[2].decode()}).encode() + b"\n")
                out.flush()
                os.fsync(out.fileno())
                return
            steps = [json.loads(item[2])["step"] for item in items]
            step = max(steps)
            if step <= last[0]:
                return
            last[0] = step
            sample = {"step": step, "events": batches.handed, "models": len(items),
                      "rss": rss_bytes(), "seconds": time.perf_counter() - started,
                      "cpu_seconds": time.process_time() - cpu0}
            out.write(json.dumps(sample).encode() + b"\n")
            out.flush()

    class SampleSink(DynamicSink[Any]):
        def build(self, step_id: str, worker_index: int, worker_count: int) -> Sample:
            return Sample()

    gc.freeze()
    flow = build_flow(cfg, NoiseKey.for_tests(0), instance="bench", partitions=PARTITIONS,
                      source=MemorySource(batches), sink=SampleSink())
    run_main(flow, epoch_interval=timedelta(seconds=args.snapshot_interval),
             recovery_config=RecoveryConfig(recovery))  # type: ignore[no-untyped-call]
    out.close()


def child(args: argparse.Namespace, mode: str, recovery: Path, output: Path
          ) -> list[str]:
    cmd = [sys.executable, __file__, "one", "--mode", mode, "--events", str(args.events),
           "--block", str(args.block), "--window", str(args.window or 0),
           "--snapshot-interval", str(args.snapshot_interval), "--recovery", str(recovery),
           "--output", str(output)]
    if args.learner:
        cmd += ["--learner", args.learner]
    return cmd


def environment() -> dict[str, str]:
    return dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")


def scratch(name: str) -> Path:
    import shutil
    import tempfile

    path = Path(tempfile.gettempdir()) / f"dpstream-bench-{OUT}-{name}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)
    return path


def run(args: argparse.Namespace) -> None:
    """A sampled run (its samples: ``results/.issue25-memory-<tag>.jsonl``)."""
    work = scratch(args.tag)
    samples = _samples_path(args.tag)
    samples.unlink(missing_ok=True)
    meta = {"meta": {"tag": args.tag, "events": args.events, "block": args.block,
                     "window": args.window or None, "learner": args.learner,
                     "snapshot_interval": args.snapshot_interval, "d": D,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    samples.write_text(json.dumps(meta) + "\n")
    recovery = work / "recovery"
    errors = work / "stderr.txt"
    with errors.open("w") as err:
        proc = subprocess.Popen(child(args, "samples", recovery, samples), env=environment(),
                                stdout=subprocess.DEVNULL, stderr=err)
        started = time.perf_counter()
        seen = None
        while proc.poll() is None:
            time.sleep(args.monitor_interval)
            snap = snapshot_bytes(recovery)
            if snap is None or snap[:2] == seen:
                continue
            seen = snap[:2]
            sample = {"monitor": True, "epoch": snap[0], "snapshot": snap[1],
                      "recovery_files": snap[2], "history": history_bytes(recovery),
                      "rss": process_rss(proc.pid), "seconds": time.perf_counter() - started,
                      "events": last_events(samples)}
            with samples.open("a") as f:
                f.write(json.dumps(sample) + "\n")
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{errors.read_text()[-3000:]}")
    with samples.open("a") as f:
        f.write(json.dumps({"done": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")


def _keyed(path: Path) -> dict[tuple[Any, ...], list[str]]:
    out: dict[tuple[Any, ...], list[str]] = {}
    for line in path.read_text().splitlines():
        value = json.loads(line)["value"]
        body = json.loads(value)
        out.setdefault((body["stream"], body["step"], body["role"], str(body["level"])),
                       []).append(value)
    return out


def resume(args: argparse.Namespace) -> None:
    """Uninterrupted run, then a run killed with SIGKILL mid-way and resumed: compare."""
    work = scratch("resume")
    whole_out, cut_out = work / "whole.jsonl", work / "cut.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.run(child(args, "records", work / "whole", whole_out), env=environment(),
                          check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"uninterrupted run failed:\n{proc.stderr[-3000:]}")
    whole_seconds = time.perf_counter() - t0
    whole = _keyed(whole_out)
    kill_after = max(1, int(len(whole) * args.kill_at))
    # kill -9 once the cut run has written kill_after records (each fsynced as it is written)
    killed = subprocess.Popen(child(args, "records", work / "cut", cut_out), env=environment(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while killed.poll() is None:
        if cut_out.exists() and cut_out.read_bytes().count(b"\n") >= kill_after:
            os.kill(killed.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    killed.wait()
    before = cut_out.read_bytes().count(b"\n") if cut_out.exists() else 0
    history_at_kill = history_bytes(work / "cut")
    proc = subprocess.run(child(args, "records", work / "cut", cut_out), env=environment(),
                          check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"resumed run failed:\n{proc.stderr[-3000:]}")
    cut = _keyed(cut_out)
    mismatched = [k for k, vs in cut.items() if any(v not in whole.get(k, []) for v in vs)]
    missing = [k for k in whole if k not in cut]
    duplicates = sum(len(vs) - 1 for vs in cut.values())
    identical_copies = all(len(set(vs)) == 1 for vs in cut.values())
    result = {"events": args.events, "block": args.block, "window": args.window or None,
              "learner": args.learner, "models_uninterrupted": sum(map(len, whole.values())),
              "killed_with_sigkill": killed.returncode == -signal.SIGKILL,
              "records_before_kill": before, "history_bytes_at_kill": history_at_kill,
              "records_after_resume": sum(map(len, cut.values())) - before,
              "replayed_duplicates": duplicates, "duplicates_identical": identical_copies,
              "mismatched": len(mismatched), "missing": len(missing),
              "byte_identical": not mismatched and not missing and identical_copies,
              "digest": hashlib.sha256("".join(sorted(v[0] for v in whole.values()))
                                       .encode()).hexdigest()[:16],
              "seconds_uninterrupted": round(whole_seconds, 1)}
    (RESULTS / f".{OUT}-resume.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if not result["byte_identical"] or not result["killed_with_sigkill"]:
        raise SystemExit("kill -9 and resume: NOT byte-identical (see above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("run", "resume", "report", "one"))
    parser.add_argument("--events", type=int, default=50_000_000)
    parser.add_argument("--block", type=int, default=50_000, help="b0 (events per step)")
    parser.add_argument("--window", type=int, default=0, help="release.max_history (0: none)")
    parser.add_argument("--learner", default=None, help="model.learner (default: the config's)")
    parser.add_argument("--snapshot-interval", type=float, default=5.0)
    parser.add_argument("--monitor-interval", type=float, default=1.0)
    parser.add_argument("--tag", default="bounded")
    parser.add_argument("--kill-at", type=float, default=0.5)
    parser.add_argument("--mode", choices=("samples", "records"), help=argparse.SUPPRESS)
    parser.add_argument("--recovery", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.what == "one":
        run_once(args)
    elif args.what == "run":
        run(args)
    elif args.what == "resume":
        resume(args)
    else:
        report()


def report() -> None:
    raise NotImplementedError


if __name__ == "__main__":
    main()
