"""Record the golden runs and the recovery stores with the code checked out now.

    python tests/golden/record.py --commit ID [--stores]

writes, under ``tests/golden/``:

* ``<run>.jsonl``: every record each golden run (``tests/support/golden.py``) published;
* with ``--stores``, ``stores/<kind>/``: a recovery store (Bytewax partition and instance
  manifest) left by a crash after the first part of the input; ``before.jsonl``, what was
  published before the crash; ``resume.jsonl``, what the recorded version published on
  resuming it with the rest of the input (``resume-<name>.jsonl`` under another
  configuration); and ``pickled.txt``, every step and global the snapshots hold.

Each run is recorded twice and the recordings compared (determinism); the script stops if
they differ. Record only with the version the files are meant to pin (``--commit`` names it in
``tests/golden/RECORDED``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.golden import (  # noqa: E402
    GOLDEN_DIR,
    RUNS,
    STORE_RUNS,
    GoldenRun,
    Output,
    copy_store,
    encode_outputs,
    init_store,
    pickled_globals,
    resumed_under,
    run_flow,
    status_records,
)


def record_store(kind: str, target: Path) -> None:
    run = STORE_RUNS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        outputs: list[tuple[list[Output], dict[str, list[Output]], Path]] = []
        for attempt in ("a", "b"):  # twice, for determinism
            store = Path(tmp) / attempt
            init_store(store)
            before = run_flow(run, store, crash=True)
            resumed = {"": _resume(run, store, Path(tmp) / f"{attempt}-copy")}
            for name, _changes in run.resumes:
                resumed[name] = _resume(resumed_under(run, name), store,
                                        Path(tmp) / f"{attempt}-{name}")
            outputs.append((before, resumed, store))
        (before, resumed, store), (before_b, resumed_b, _) = outputs
        if (before, resumed) != (before_b, resumed_b):
            sys.exit(f"store {kind}: two recordings differ (not deterministic)")
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for path in sorted(store.iterdir()):
            if path.name.endswith(".sqlite3") or path.name.endswith(".json"):
                shutil.copy2(path, target / path.name)
        (target / "before.jsonl").write_text(encode_outputs(before))
        for name, out in resumed.items():
            (target / (f"resume-{name}.jsonl" if name else "resume.jsonl")).write_text(
                encode_outputs(out))
        (target / "pickled.txt").write_text("".join(g + "\n" for g in pickled_globals(store)))
        print(f"store {kind}: {len(before)} records before the crash, "
              + ", ".join(f"{len(o)} on resume{' ' + n if n else ''}"
                          for n, o in resumed.items()))


def _resume(run: GoldenRun, store: Path, copy: Path) -> list[Output]:
    """Resume a copy of ``store`` (the original stays as the crash left it)."""
    copy_store(store, copy)
    return run_flow(run, copy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True, help="the commit the recording pins")
    parser.add_argument("--stores", action="store_true",
                        help="also make the recovery stores anew (they stand for the version "
                             "that made them: remake them only with that version)")
    args = parser.parse_args()
    for run in RUNS:
        first, second = run_flow(run), run_flow(run)
        if first != second:
            sys.exit(f"{run.name}: two recordings differ (not deterministic)")
        (GOLDEN_DIR / f"{run.name}.jsonl").write_text(encode_outputs(first))
        print(f"{run.name}: {len(first)} records")
    statuses = status_records()
    if statuses != status_records():
        sys.exit("status records: two recordings differ (not deterministic)")
    (GOLDEN_DIR / "counters-status-records.jsonl").write_text(encode_outputs(statuses))
    for kind in STORE_RUNS if args.stores else ():
        record_store(kind, GOLDEN_DIR / "stores" / kind)
    (GOLDEN_DIR / "RECORDED").write_text(f"recorded at {args.commit}\n")


if __name__ == "__main__":
    main()
