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

What is sampled:

* once per closed step, in the flow's process (its sink, when the step's models arrive): the
  events handed to the flow so far (the source's count), the step, and the worker process's
  resident set (``VmRSS`` of ``/proc/self/status``; one worker, so the process is the worker);
* once per snapshot, by the parent process (polling every ``--monitor-interval`` seconds for
  a new epoch): the size of the newest serialised state of the model shards' stateful step in
  Bytewax's recovery partition (``snaps.ser_change``, SQLite), the size of the partition
  files, the disk use of the history store (every file under the recovery directory but
  Bytewax's partitions: the shard's segment files) and the child's ``VmRSS``. SQLite is read
  from another process on purpose: its POSIX locks are per process, and a second SQLite
  library closing the file inside the flow's process dropped Bytewax's locks (the flow died
  with SIGBUS).

Modes (the results were made with these)::

    OPENBLAS_NUM_THREADS=1 python bench/erm_memory.py run --events 50000000 --block 50000 \\
        --window 8 --learner objective --tag bounded  # the long run
    OPENBLAS_NUM_THREADS=1 python bench/erm_memory.py run --events 3000000 --block 50000 \\
        --learner objective --tag files-unbounded     # the same without max_history
    OPENBLAS_NUM_THREADS=1 python bench/erm_memory.py resume --events 2000000 --block 50000 \\
        --window 8 --learner objective                # kill -9 mid-run, resume, compare
    python bench/erm_memory.py report                 # results/issue25-memory.{md,json,svg}

``--tag unbounded`` is the run without ``max_history`` on the code before the bounded
history (every block in the shard's state, as in issue 8): the report shows it beside the
others when its samples are there.

``run`` and ``resume`` start every flow in a child process (``one``), as the other benches
do; a run's samples go to ``results/issue25-memory-<tag>.jsonl.tmp`` line by line, so a long
run can be watched and a cut-short run still reports what it measured. ``resume`` runs the
flow once uninterrupted, then once more in a child it kills with SIGKILL once that child has
published ``--kill-at`` (a fraction) of the uninterrupted run's records (its sink appends
every record to a file and fsyncs it), restarts it on the same recovery directory, and
compares the model records: every record of the killed and the resumed run must be
byte-identical to the uninterrupted run's record of the same (stream, step, role, level), the
replayed copies identical, and together they must cover all of them.
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
TAGS = ("bounded", "unbounded", "files-unbounded")
"""The runs the report shows: ``bounded`` (file history, ``max_history``), ``unbounded`` (the
in-memory history of issue 8, run on that code), ``files-unbounded`` (file history, no bound)."""


def _samples_path(tag: str) -> Path:
    return RESULTS / f"{OUT}-{tag}.jsonl.tmp"


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
                      source=MemorySource(batches), sink=SampleSink(),
                      recovery_dir=str(recovery))  # the shard's history files go under it
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


def _revision() -> str | None:
    """The checked-out commit of this repository (the code a run measures), if known."""
    out = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def run(args: argparse.Namespace) -> None:
    """A sampled run (its samples: ``results/issue25-memory-<tag>.jsonl.tmp``)."""
    work = scratch(args.tag)
    samples = _samples_path(args.tag)
    samples.unlink(missing_ok=True)
    meta = {"meta": {"tag": args.tag, "events": args.events, "block": args.block,
                     "window": args.window or None, "learner": args.learner,
                     "snapshot_interval": args.snapshot_interval, "d": D,
                     "code": _revision(),
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
    end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if proc.returncode != 0:  # recorded (the report says how the run ended), then raised
        lines = errors.read_text().strip().splitlines() or [f"exit status {proc.returncode}"]
        if proc.returncode == -signal.SIGTERM:
            lines = ["stopped with SIGTERM before its end (cut short)"]
        with samples.open("a") as f:
            f.write(json.dumps({"failed": lines[-1][-500:], "at": end}) + "\n")
        raise SystemExit(f"benchmark child failed:\n{errors.read_text()[-3000:]}")
    with samples.open("a") as f:
        f.write(json.dumps({"done": end}) + "\n")


def _keyed(path: Path) -> dict[tuple[Any, ...], list[str]]:
    out: dict[tuple[Any, ...], list[str]] = {}
    for line in path.read_text().splitlines():
        value = json.loads(line)["value"]
        body = json.loads(value)
        out.setdefault((body["stream"], body["step"], body["role"], str(body["level"])),
                       []).append(value)
    return out


def _compare(whole: dict[tuple[Any, ...], list[str]], cut: dict[tuple[Any, ...], list[str]]
             ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(records of ``cut`` that are not byte-identical to ``whole``'s, records it lacks)."""
    mismatched = [k for k, vs in cut.items() if any(v not in whole.get(k, []) for v in vs)]
    return mismatched, [k for k in whole if k not in cut]


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
    mismatched, missing = _compare(whole, cut)
    # power: the same comparison must see one digit of one weight changed, one record lost
    key = sorted(cut)[-1]
    value = cut[key][0]
    at = value.index('"coef":[[') + len('"coef":[[')
    at = next(i for i in range(at, len(value)) if value[i].isdigit())  # its first digit
    bent = {**cut, key: [value[:at] + str((int(value[at]) + 1) % 10) + value[at + 1:]]}
    lost = {k: v for k, v in cut.items() if k != key}
    power = _compare(whole, bent)[0] == [key] and _compare(whole, lost)[1] == [key]
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
              "comparison_power": power,
              "digest": hashlib.sha256("".join(sorted(v[0] for v in whole.values()))
                                       .encode()).hexdigest()[:16],
              "seconds_uninterrupted": round(whole_seconds, 1)}
    (RESULTS / f"{OUT}-resume.json.tmp").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if not (result["byte_identical"] and result["killed_with_sigkill"] and power):
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


def _load(tag: str) -> dict[str, Any] | None:
    path = _samples_path(tag)
    if not path.exists():
        return None
    meta: dict[str, Any] = {}
    steps, snaps, done, failed = [], [], None, None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        if "meta" in row:
            meta = row["meta"]
        elif "done" in row:
            done = row["done"]
        elif "failed" in row:
            failed = row
        elif row.get("monitor"):
            snaps.append(row)
        else:
            steps.append(row)
    return {"meta": meta, "steps": steps, "snapshots": snaps, "done": done, "failed": failed}


def _at(rows: list[dict[str, Any]], events: float, key: str) -> Any:
    """The value of ``key`` in the last row at or before ``events`` events."""
    best = None
    for row in rows:
        if row.get("events") is not None and row["events"] <= events and row.get(key) is not None:
            best = row[key]
    return best


def _slope(rows: list[dict[str, Any]], key: str, after: float) -> float | None:
    """Least-squares slope of ``key`` against events over the rows past ``after`` events
    (bytes per million events)."""
    pts = [(r["events"], r[key]) for r in rows
           if r.get("events") is not None and r["events"] > after and r.get(key) is not None]
    if len(pts) < 3:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return 1e6 * sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def _mib(v: float | None) -> str:
    return "–" if v is None else f"{v / 2**20:,.1f}"


def _size(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v / 2**20:,.1f} MiB" if v >= 2**20 else f"{v / 2**10:,.1f} KiB"


COLOURS = {"bounded": "#1f77b4", "unbounded": "#d62728", "files-unbounded": "#ff7f0e"}


def _ticks(top: float) -> float:
    """A round tick step for an axis from 0 to ``top``."""
    step = 10 ** math.floor(math.log10(max(top, 1e-9) / 2))
    return step * (5 if top / step > 25 else 2 if top / step > 10 else 1)


def _panel(out: list[str], box: tuple[float, float, float, float], xmax: float,
           series: list[tuple[str, list[tuple[float, float]]]], title: str, log: bool) -> None:
    """One plot: ``series`` of (events, value) points in ``box`` = (x, y, width, height)."""
    x0, y0, w, h = box
    values = [v for _, pts in series for _, v in pts if v > 0]
    if log:
        lo = math.floor(math.log10(min(values, default=1)))
        hi = max(lo + 1, math.ceil(math.log10(max(values, default=10))))

        def fy(v: float) -> float:
            return y0 + h - h * (math.log10(max(v, 10.0 ** lo)) - lo) / (hi - lo)
        yticks = [(fy(10.0 ** e), f"1e{e}") for e in range(lo, hi + 1)]
    else:
        top = max(values, default=1) * 1.1
        step = _ticks(top)
        top = step * math.ceil(top / step)

        def fy(v: float) -> float:
            return y0 + h - h * v / top
        yticks = [(fy(k * step), f"{k * step:g}") for k in range(round(top / step) + 1)]

    def fx(e: float) -> float:
        return x0 + w * e / xmax

    out.append(f'<text x="{x0}" y="{y0 - 10}" font-weight="bold">{title}</text>')
    for y, text in yticks:
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{text}</text>')
    step = _ticks(xmax)
    k = 0
    while k * step <= xmax * 1.0001:
        x = fx(k * step)
        out.append(f'<line x1="{x:.1f}" y1="{y0 + h}" x2="{x:.1f}" y2="{y0 + h + 4}" '
                   f'stroke="black"/><text x="{x:.1f}" y="{y0 + h + 17}" '
                   f'text-anchor="middle">{k * step / 1e6:g}</text>')
        k += 1
    out.append(f'<text x="{x0 + w / 2}" y="{y0 + h + 34}" text-anchor="middle">'
               'events processed (millions)</text>')
    out.append(f'<polyline points="{x0},{y0} {x0},{y0 + h} {x0 + w},{y0 + h}" fill="none" '
               'stroke="black"/>')
    for name, pts in series:
        shown = " ".join(f"{fx(e):.1f},{fy(v):.1f}" for e, v in pts if e <= xmax and v > 0)
        out.append(f'<polyline points="{shown}" fill="none" stroke="{COLOURS.get(name, "#555")}"'
                   ' stroke-width="1.5"/>')


def svg(runs: dict[str, dict[str, Any]]) -> str:
    """RSS (MiB), snapshot bytes (log scale) and history files (MiB) against events: the
    whole bounded run on the left, the first events of every run on the right (the unbounded
    runs are short). Snapshots taken after the flow ended (no open step) are left out."""
    rss = [(name, [(r["events"], r["rss"] / 2**20) for r in run["steps"]
                   if r.get("rss") and r.get("events")]) for name, run in runs.items()]
    live = {name: [r for r in run["snapshots"] if r.get("events") and r.get("rss")]
            for name, run in runs.items()}
    snap = [(name, [(r["events"], r["snapshot"]) for r in rows]) for name, rows in live.items()]
    hist = [(name, [(r["events"], r["history"] / 2**20) for r in rows])
            for name, rows in live.items()]
    full = max((e for _, pts in rss + snap for e, _ in pts), default=1)
    short = [max((e for e, _ in pts), default=full) for name, pts in rss if name != "bounded"]
    zoom = min(full, max(short, default=full) * 1.2)
    width, height = 1000, 960
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>']
    rows = [(rss, "RSS of the worker process (MiB)", False),
            (snap, "snapshot of the shard's state (bytes, log scale)", True),
            (hist, "history files on disk (MiB)", False)]
    for k, (series, title, log) in enumerate(rows):
        y = 50 + 290 * k
        _panel(out, (80, y, 370, 200), full, series, title, log)
        _panel(out, (590, y, 370, 200), zoom, series, title.replace(" (", ", first events ("),
               log)
    for k, (name, run) in enumerate(runs.items()):
        window = run["meta"].get("window")
        y = height - 60 + 16 * k
        out.append(f'<line x1="80" y1="{y}" x2="104" y2="{y}" '
                   f'stroke="{COLOURS.get(name, "#555")}" stroke-width="2"/>'
                   f'<text x="110" y="{y + 4}">{name}: release.max_history = '
                   f'{window or "none"}, b0 = {run["meta"]["block"]:,}'
                   f'{"; " + run["meta"]["note"] if run["meta"].get("note") else ""}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def report() -> None:
    """results/issue25-memory.{md,json,svg} from the runs' samples."""
    runs = {tag: run for tag in TAGS if (run := _load(tag)) is not None}
    if not runs:
        raise SystemExit("no samples: run `erm_memory.py run` first")
    resume_path = RESULTS / f"{OUT}-resume.json.tmp"
    resumed = json.loads(resume_path.read_text()) if resume_path.exists() else None
    lines = ["# ERM run in bounded memory (issue 25)", "",
             "`bench/erm_memory.py`: the real dataflow, one worker, in-memory input (synthetic "
             f"events, d = {D}, three partitions, made batch by batch as the source asks), "
             "continual release (Algorithm 4 + 2, B = 4), pure ε = 1, with a recovery "
             "directory (Bytewax snapshots every epoch). RSS is the worker process's VmRSS "
             "per closed step; the snapshot is the size of the newest serialised state of "
             "the model shard (Bytewax's recovery partition), read at every epoch from another "
             "process; history is the disk use of the history store's files.", ""]
    summary: dict[str, Any] = {}
    for tag, run in runs.items():
        meta, steps, every_snap = run["meta"], run["steps"], run["snapshots"]
        # the snapshots taken while the flow ran (the last one, after the end, has no open step)
        snaps = [r for r in every_snap if r.get("rss")]
        window = meta.get("window")
        first = (window or 0) * meta["block"]
        end = max((r["events"] for r in steps), default=0)
        last = steps[-1] if steps else {}
        rate = end / last["seconds"] if last.get("seconds") else None
        lines += [f"## {tag}: {end:,} events, b0 = {meta['block']:,}, "
                  f"max_history = {window or 'none'}, learner = "
                  f"{meta.get('learner') or 'the default'}", "",
                  *([f"Code: {meta['code']}" + (f" ({meta['note']})" if meta.get("note") else "")
                     + "."] if meta.get("code") or meta.get("note") else []),
                  f"Started {meta.get('started')}; "
                  + (f"finished {run['done']}" if run["done"] else
                     f"**did not finish**: {run['failed']['failed']} at {run['failed']['at']}"
                     " (the samples up to then are shown)"
                     if run["failed"] and "SIGTERM" in run["failed"]["failed"] else
                     f"**the flow failed** at {run['failed']['at']}: `{run['failed']['failed']}`"
                     " (the samples up to the failure are shown)" if run["failed"] else
                     "**did not finish** (cut short; the samples up to the cut are shown)")
                  + f"; {rate:,.0f} events/s over the whole run (snapshots included)."
                  if rate else "", "",
                  "| events | step | RSS MiB | snapshot | recovery files MiB | history MiB | "
                  "elapsed s |", "|---|---|---|---|---|---|---|"]
        every = 5_000_000 if end >= 20_000_000 else max(end // 10, 1)
        marks = list(range(every, end + 1, every))
        if not marks or marks[-1] != end:
            marks.append(end)
        for m in marks:
            step = _at(steps, m, "step")
            lines.append(f"| {m:,} | {'–' if step is None else step} | "
                         f"{_mib(_at(steps, m, 'rss'))} | "
                         f"{_size(_at(snaps, m, 'snapshot'))} | "
                         f"{_mib(_at(snaps, m, 'recovery_files'))} | "
                         f"{_mib(_at(snaps, m, 'history'))} | "
                         f"{_at(steps, m, 'seconds') or 0:,.0f} |")
        rss_slope = _slope(steps, "rss", max(first, 2 * meta["block"]))
        snap_slope = _slope(snaps, "snapshot", max(first, 2 * meta["block"]))
        hist_slope = _slope(snaps, "history", max(first, 2 * meta["block"]))
        peak = max((r["rss"] for r in steps), default=None)
        summary[tag] = {"meta": meta, "events": end, "events_per_second": rate,
                        "rss_slope_bytes_per_million_events": rss_slope,
                        "snapshot_slope_bytes_per_million_events": snap_slope,
                        "history_slope_bytes_per_million_events": hist_slope,
                        "peak_rss": peak, "finished": run["done"] is not None,
                        "samples": {"steps": steps, "snapshots": every_snap}}
        past = max(first, 2 * meta["block"])
        lines += ["", f"After {'the first window' if window else 'the first two blocks'} "
                  f"({past:,} events): RSS slope "
                  f"{'–' if rss_slope is None else f'{rss_slope / 2**20:+,.2f} MiB'} per million "
                  f"events, snapshot slope "
                  f"{'–' if snap_slope is None else f'{snap_slope:+,.0f} bytes'} per million "
                  f"events, history files "
                  f"{'–' if hist_slope is None else f'{hist_slope / 2**20:+,.2f} MiB'} per "
                  f"million events (least squares over every sample past it); peak RSS "
                  f"{_mib(peak)} MiB.", ""]
        if run["done"] and every_snap and not every_snap[-1].get("rss"):
            lines += [f"Last snapshot, taken once the input ended and every step was closed: "
                      f"{every_snap[-1]['snapshot']:,} bytes. During the run Bytewax snapshots "
                      "mid-step, so a snapshot also holds the rows of the open step(s) "
                      "(the shard's `pending`: up to one block and what the source read "
                      "ahead), which is the size plotted.", ""]
        if end > past:
            import statistics

            fifth = (end - past) / 5
            early = (past, past + fifth)
            late = (end - fifth, end)

            def med(rows: list[dict[str, Any]], key: str, span: tuple[float, float]) -> Any:
                got = [r[key] for r in rows if r.get(key) is not None
                       and r.get("events") is not None and span[0] < r["events"] <= span[1]]
                return statistics.median(got) if got else None
            lines += [f"Medians over the first and the last fifth past that point "
                      f"({early[0] / 1e6:.1f}–{early[1] / 1e6:.1f} M and "
                      f"{late[0] / 1e6:.1f}–{late[1] / 1e6:.1f} M events): RSS "
                      f"{_mib(med(steps, 'rss', early))} and {_mib(med(steps, 'rss', late))} "
                      f"MiB; snapshot {_size(med(snaps, 'snapshot', early))} and "
                      f"{_size(med(snaps, 'snapshot', late))}; history files "
                      f"{_mib(med(snaps, 'history', early))} and "
                      f"{_mib(med(snaps, 'history', late))} MiB (largest "
                      f"{_mib(max((r['history'] for r in snaps), default=None))} MiB).", ""]
        if tag == "bounded" and end >= 10_000_000:
            pairs = [(10_000_000, end)]
            for a, b in pairs:
                lines.append(f"RSS at {a / 1e6:g} M events {_mib(_at(steps, a, 'rss'))} MiB, at "
                             f"{b / 1e6:g} M {_mib(_at(steps, b, 'rss'))} MiB; snapshot "
                             f"{_size(_at(snaps, a, 'snapshot'))} and "
                             f"{_size(_at(snaps, b, 'snapshot'))}.")
            lines.append("")
    bounded = summary.get("bounded")
    if bounded is not None:
        meta, steps = bounded["meta"], bounded["samples"]["steps"]
        live = [r for r in bounded["samples"]["snapshots"] if r.get("rss")]
        at = min(10_000_000, bounded["events"])
        head = [f"**Headline.** {bounded['events']:,} events at d = {D}, b0 = {meta['block']:,}, "
                f"max_history = {meta['window']}, learner = {meta['learner']}: "
                f"{'finished' if bounded['finished'] else 'cut short'}; RSS "
                f"{_mib(_at(steps, at, 'rss'))} MiB at {at / 1e6:g} M events and "
                f"{_mib(steps[-1]['rss'] if steps else None)} MiB at the end (slope "
                f"{(bounded['rss_slope_bytes_per_million_events'] or 0) / 2**20:+.2f} MiB per "
                f"million events past the first window); the snapshot "
                f"{_size(_at(live, at, 'snapshot'))} at {at / 1e6:g} M and "
                f"{_size(live[-1]['snapshot'] if live else None)} at the last snapshot "
                f"before the end (slope "
                f"{(bounded['snapshot_slope_bytes_per_million_events'] or 0):+,.0f} bytes per "
                f"million events): flat."]
        if resumed is not None:
            head.append(f"kill -9 mid-run and resume ({resumed['events']:,} events): "
                        f"byte-identical = {resumed['byte_identical']}.")
        lines[2:2] = [" ".join(head), ""]
    if resumed is not None:
        lines += ["## kill -9 and resume", "",
                  f"{resumed['events']:,} events (b0 = {resumed['block']:,}, max_history = "
                  f"{resumed['window'] or 'none'}): one uninterrupted run "
                  f"({resumed['models_uninterrupted']} model records), then a run killed with "
                  f"SIGKILL after {resumed['records_before_kill']} records "
                  f"(killed by SIGKILL: {resumed['killed_with_sigkill']}) and resumed on the same "
                  f"recovery directory ({resumed['records_after_resume']} records after the "
                  f"restart, {resumed['replayed_duplicates']} of them replays of records "
                  f"published before the kill).", "",
                  f"**Byte-identical: {resumed['byte_identical']}** — mismatched records "
                  f"{resumed['mismatched']}, missing {resumed['missing']}, replayed copies "
                  f"identical: {resumed['duplicates_identical']}. Power of the comparison "
                  f"(one digit of one weight changed in one record, resp. one record "
                  f"dropped, must be found): {resumed.get('comparison_power', 'not run')}.",
                  ""]
        summary["resume"] = resumed
    lines += ["![RSS, snapshot size and history files against events processed]"
              "(issue25-memory.svg)", ""]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{OUT}.md").write_text("\n".join(lines))
    (RESULTS / f"{OUT}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (RESULTS / f"{OUT}.svg").write_text(svg(runs))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
