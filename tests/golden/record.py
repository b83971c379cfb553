"""Record the golden runs and the recovery stores with the code checked out now.

    python tests/golden/record.py [--commit ID]

writes, under ``tests/golden/``:

* ``<run>.jsonl``: every record each golden run (``tests/support/golden.py``) published;
* ``stores/<kind>/``: a recovery store (Bytewax partition and instance manifest) left by a
  crash after the first part of the input, ``stores/<kind>/before.jsonl`` what was published
  before the crash, ``stores/<kind>/resume.jsonl`` what the recorded version published on
  resuming it with the rest of the input (``resume-<name>.jsonl`` under another
  configuration), and ``stores/<kind>/pickled.txt``, every global the snapshots pickle.

Each run is recorded twice and the recordings compared (determinism); the script stops if
they differ. Record only with the version the files are meant to pin (``--commit`` names it in
``tests/golden/RECORDED``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pickle
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

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
    resumed_under,
    run_flow,
    status_records,
)


def pickled_globals(store: Path) -> list[str]:
    """Every Bytewax step with a snapshot in ``store``, and every ``module.name`` one pickles.

    Lines ``step <step id> <state keys>``, then ``global <module>.<name>`` (sorted): each
    snapshot is unpickled with an unpickler that records every class or function it loads.
    """
    found: set[str] = set()
    steps: dict[str, set[str]] = {}

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.add(f"{module}.{name}")
            return super().find_class(module, name)

    for part in sorted(store.glob("part-*.sqlite3")):
        with contextlib.closing(sqlite3.connect(part)) as db:
            for step, key, blob in db.execute("SELECT step_id, state_key, ser_change FROM snaps"):
                steps.setdefault(step, set()).add(key)
                if blob is not None:
                    Recording(io.BytesIO(blob)).load()
    return ([f"step {step} {' '.join(sorted(keys))}" for step, keys in sorted(steps.items())]
            + [f"global {name}" for name in sorted(found)])


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
    for kind in STORE_RUNS:
        record_store(kind, GOLDEN_DIR / "stores" / kind)
    (GOLDEN_DIR / "RECORDED").write_text(f"recorded at {args.commit}\n")


if __name__ == "__main__":
    main()
