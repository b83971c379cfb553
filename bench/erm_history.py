#!/usr/bin/env python
"""What bounding the ERM history costs in accuracy, and what it saves (issue 25).

Continual release (Algorithm 4 with Algorithm 2's bases, ε = 1 per component, every event
costs at most 2ε) on the Adult stream of ``erm_adult.py`` (compact encoding, 30,162 events in
30 blocks of b0 = 1024, B = 8 blocks), with ``release.max_history = H`` for H in {unbounded,
16, 8, 4} blocks, in one run and with the same noise seeds. Each run is a real
:class:`~dpstream.core.erm.schedules.schedule.ReleaseSchedule` keeping its blocks in a real
:class:`~dpstream.core.erm.history.FileBlockStore` (a temporary directory). Beside them, the
independent-block baseline (every block alone at ε, each event costs ε), the floor continual
release must stay above.

λ (bases 0.003, updates 0.3; independent 0.03) are the values ``erm_adult.py`` chose for these
settings on its public surrogate streams (``bench/results/issue8-erm-adult.json``); they are
not re-tuned per H, which would favour the bounded runs only slightly (a base trained on its
last H of 2^k·B blocks, normalised by all of them, weighs its data as a larger λ would).

On this 30-block stream every range of the schedule fits in 16 blocks, so ``H = 16`` trains on
exactly the rows of the unbounded run: the two differ only by their noise (``max_history`` is a
parameter of the schedule, bound into its noise coordinates, so its draws are other ones), which
shows how far two sets of seeds of the same computation lie apart.

Reported per H: the accuracy on the final test of the current released model (role ``base``
or ``update``), mean over the releases from step 15 (the second half), median and quartiles
over the seeds; the largest number of blocks the store held; the largest pickled schedule
state; the bytes on disk at the end (segments of 4 blocks here, so that deleting shows on a
stream of 30 blocks: a store keeps whole segments, at most ``H`` blocks plus one segment's);
the largest spend of any block.

Usage::

    python bench/erm_history.py             # 30 seeds, writes bench/results/issue25-erm-history.*
    python bench/erm_history.py --seeds 2   # a smoke run, writes nothing
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: multi-threaded BLAS is erratic here

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import pickle  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import erm_data as D  # noqa: E402

D._core()  # puts the repository root on sys.path
from dpstream.core.erm.history import FileBlockStore  # noqa: E402
from dpstream.core.erm.schedules.schedule import ReleaseSchedule  # noqa: E402
from dpstream.core.erm.schedules.spec import ScheduleSpec  # noqa: E402

STREAM_SEED = 8001  # erm_adult.py's stream order
B0 = 1024
BASE_BLOCKS = 8
EPSILON = 1.0
LAMBDA, UPDATE_LAMBDA, INDEPENDENT_LAMBDA = 0.003, 0.3, 0.03
HISTORIES: tuple[int | None, ...] = (None, 16, 8, 4)
FROM_STEP = 15
SEGMENT_BLOCKS = 4  # 30 blocks: with the default 64 a segment would never be deleted here
ROLES = {"continual": ("base", "update"), "independent": ("independent",)}


def run(algorithm: str, history: int | None, seed: int, stream: D.Split, dataset: Any,
        evaluator: D.Evaluator) -> dict[str, Any]:
    """One schedule over the stream, its blocks in files: accuracy and what it kept."""
    lam = INDEPENDENT_LAMBDA if algorithm == "independent" else LAMBDA
    spec = D.make_spec(dataset, lam, clip_norm=1.0, intercept=False)
    schedule_spec = ScheduleSpec(
        algorithm=algorithm, epsilon=EPSILON, block_size=B0, base_blocks=BASE_BLOCKS,  # type: ignore[arg-type]
        update_regularization=UPDATE_LAMBDA if algorithm == "continual" else None,
        max_history=history)
    accuracies, kept, state_bytes = [], 0, 0
    with tempfile.TemporaryDirectory(prefix="erm-history-bench-") as directory:
        store = FileBlockStore(directory, spec.columns, durable=False,
                               blocks_per_segment=SEGMENT_BLOCKS)
        schedule = ReleaseSchedule(schedule_spec, spec, D.noise_key(seed), ("bench-history",),
                                   store=store)
        for step, (x, y) in enumerate(D.blocks_of(stream, B0)):
            for r in schedule.add_block(step, spec.block(x, y)):
                if r.role in ROLES[algorithm] and step >= FROM_STEP:
                    accuracies.append(evaluator(spec, r.model.params))
            kept = max(kept, len(schedule.kept_steps))
            state_bytes = max(state_bytes, len(pickle.dumps(schedule.to_state())))
        disk = sum(p.stat().st_size for p in Path(directory).iterdir())
    return {"accuracy": float(np.mean(accuracies)), "kept_blocks": kept,
            "state_bytes": state_bytes, "disk_bytes": disk,
            "max_block_spend": float(schedule.max_block_spend())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=30)
    args = parser.parse_args()
    started = time.perf_counter()
    full = D.load_adult()
    compact = D.compact_adult(full)
    stream = D.shuffled(compact.train, STREAM_SEED)
    evaluator = D.Evaluator(compact.test)
    cells: list[tuple[str, int | None]] = [("continual", h) for h in HISTORIES]
    cells.append(("independent", None))
    rows = []
    for algorithm, history in cells:
        runs = [run(algorithm, history, seed, stream, compact, evaluator)
                for seed in range(args.seeds)]
        accs = [r["accuracy"] for r in runs]
        rows.append({
            "algorithm": algorithm, "max_history": history, "accuracies": accs,
            "median": D.median(accs), "quartiles": D.quartiles(accs),
            "kept_blocks": max(r["kept_blocks"] for r in runs),
            "state_bytes": max(r["state_bytes"] for r in runs),
            "disk_bytes": max(r["disk_bytes"] for r in runs),
            "max_block_spend": max(r["max_block_spend"] for r in runs),
        })
        print(f"{algorithm:12s} H={history!s:>9s} median {100 * rows[-1]['median']:.1f} "
              f"kept {rows[-1]['kept_blocks']} blocks, state {rows[-1]['state_bytes']} B, "
              f"disk {rows[-1]['disk_bytes']} B", flush=True)
    seconds = time.perf_counter() - started
    lines = [
        "# Bounded ERM history: accuracy and state (issue 25)", "",
        f"Adult (compact encoding), continual release, ε = {EPSILON:g} per component "
        f"(≤ {2 * EPSILON:g} per event), b0 = {B0}, B = {BASE_BLOCKS} blocks, "
        f"{stream.size:,} events in {-(-stream.size // B0)} blocks; {args.seeds} noise seeds; "
        f"accuracy on the final test of the current model, mean over the releases from step "
        f"{FROM_STEP} (median over seeds, quartiles). λ {LAMBDA:g}, updates "
        f"{UPDATE_LAMBDA:g} (independent {INDEPENDENT_LAMBDA:g}): erm_adult.py's public tuning.",
        "", "| schedule | max_history | median | quartiles | blocks kept (max) | "
        "state (pickled, max) | disk at the end | max block spend |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q1, q3 = r["quartiles"]
        lines.append(
            f"| {r['algorithm']} | {r['max_history'] or 'unbounded'} | "
            f"{100 * r['median']:.1f} | {100 * q1:.1f}–{100 * q3:.1f} | {r['kept_blocks']} | "
            f"{r['state_bytes']:,} B | {r['disk_bytes']:,} B | {r['max_block_spend']:.4g} |")
    lines += ["", "H = 16 trains on exactly the rows of the unbounded run here (every range of "
              "the 30-block stream fits): the two differ by their noise draws only.", "",
              f"{seconds:.0f} s on {D.machine().get('cpus', '?')} CPUs."]
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    if args.seeds >= 10:
        payload = {"generated": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                   "machine": D.machine(), "seeds": args.seeds, "rows": rows,
                   "seconds": seconds}
        D.write_results("issue25-erm-history", payload, markdown)


if __name__ == "__main__":
    main()
