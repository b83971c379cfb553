"""Golden runs: every output of every flow kind, byte for byte as the recorded version's.

The recordings under ``tests/golden/`` were made by ``tests/golden/record.py`` with the version
named in ``tests/golden/RECORDED``; the runs are defined in ``tests/support/golden.py``. A
failure shows the first differing record of each topic. Re-record only when an output is
meant to change (and say so in the commit).

The recovery stores under ``tests/golden/stores/`` were made by that version too: the current
code must resume each and publish what the recorded version published on resume, or refuse a
store it cannot resume with a message that says why.
"""

from __future__ import annotations

import json
import pickle
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from support.golden import (
    GOLDEN_DIR,
    RUNS,
    STORE_RUNS,
    STORES_DIR,
    GoldenRun,
    Output,
    bind_store,
    copy_store,
    decode_outputs,
    difference,
    pickled_globals,
    resumed_under,
    run_flow,
    status_records,
)

from dpstream.errors import RecoveryMismatchError

pytestmark = pytest.mark.flow


def _expect_same(recording: Path, actual: list[Output]) -> None:
    expected = decode_outputs(recording.read_text())
    assert expected, f"{recording.name} records nothing"
    problem = difference(expected, actual)
    if problem is not None:
        pytest.fail(f"{recording.name} differs from the recording "
                    f"({(GOLDEN_DIR / 'RECORDED').read_text().strip()}):\n{problem}",
                    pytrace=False)


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_a_golden_run_publishes_exactly_what_was_recorded(run: GoldenRun) -> None:
    _expect_same(GOLDEN_DIR / f"{run.name}.jsonl", run_flow(run))


def test_status_records_are_encoded_exactly_as_recorded() -> None:
    _expect_same(GOLDEN_DIR / "counters-status-records.jsonl", status_records())


def test_the_golden_runs_cover_every_output_record_kind() -> None:
    """What the recordings hold: every schema, mechanism, answer kind and model role."""
    seen: set[tuple[str, ...]] = set()
    for path in GOLDEN_DIR.glob("*.jsonl"):
        for topic, _key, value in decode_outputs(path.read_text()):
            body = json.loads(value)
            seen.add((topic, body["schema"]))
            for field in ("mechanism", "kind", "role", "status"):
                if field in body:
                    seen.add((body["schema"], field, str(body[field])))
    expected = {
        ("releases", "dpstream.release/1"), ("alerts", "dpstream.alert/1"),
        ("releases", "dpstream.status/1"), ("answers", "dpstream.answer/1"),
        ("models", "dpstream.model/1"), ("dead-letters", "dpstream.dead_letter/1"),
        ("models", "dpstream.serving/1"),
        ("dpstream.release/1", "mechanism", "tree-laplace"),
        ("dpstream.release/1", "mechanism", "blt-gaussian"),
        ("dpstream.answer/1", "mechanism", "pmwg"),
        ("dpstream.answer/1", "mechanism", "histogram"),
        *(("dpstream.answer/1", "kind", k)
          for k in ("easy", "hard", "marginal", "waiting", "bottom", "error")),
        *(("dpstream.model/1", "role", r)
          for r in ("base", "update", "multi-resolution", "window", "independent", "ermg")),
        ("dpstream.status/1", "status", "budget_exhausted"),
    }
    assert expected <= seen, sorted(expected - seen)


def _resume(kind: str, tmp_path: Path, run: GoldenRun | None = None) -> list[Output]:
    store = tmp_path / "store"
    copy_store(STORES_DIR / kind, store)
    return run_flow(run or STORE_RUNS[kind], store)


@pytest.mark.parametrize("kind", sorted(STORE_RUNS))
def test_a_store_of_the_recorded_version_resumes_to_the_same_outputs(kind: str,
                                                                      tmp_path: Path) -> None:
    _expect_same(STORES_DIR / kind / "resume.jsonl", _resume(kind, tmp_path))
    # the snapshots pickle no dpstream class (a module move would break resuming them), and
    # the steps that hold state keep their ids (Bytewax finds a step's state by its id)
    snapshots = pickled_globals(tmp_path / "store")
    assert not [g for g in snapshots if g.startswith("global dpstream")], snapshots
    recorded = (STORES_DIR / kind / "pickled.txt").read_text().splitlines()
    assert ([line for line in snapshots if line.startswith("step ")]
            == [line for line in recorded if line.startswith("step ")])


@pytest.mark.parametrize("kind, name", [(kind, name) for kind, run in sorted(STORE_RUNS.items())
                                        for name, _changes in run.resumes])
def test_a_store_of_the_recorded_version_resumes_under_a_changed_budget(
        kind: str, name: str, tmp_path: Path) -> None:
    run = resumed_under(STORE_RUNS[kind], name)
    _expect_same(STORES_DIR / kind / f"resume-{name}.jsonl", _resume(kind, tmp_path, run))


def test_a_store_is_refused_under_another_flow_kind(tmp_path: Path) -> None:
    store = tmp_path / "store"
    copy_store(STORES_DIR / "counters", store)
    with pytest.raises(RecoveryMismatchError, match=r"made with other settings \(.*mechanisms: "):
        bind_store(STORE_RUNS["pmwg"], store)


def test_a_store_is_refused_under_another_noise_key(tmp_path: Path) -> None:
    store = tmp_path / "store"
    copy_store(STORES_DIR / "erm", store)
    other = GoldenRun("other-key", STORE_RUNS["erm"].config, STORE_RUNS["erm"].messages,
                      noise_seed=99)
    with pytest.raises(RecoveryMismatchError, match="noise key fingerprint: "):
        run_flow(other, store)


def test_a_manifest_of_an_unknown_format_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    copy_store(STORES_DIR / "pmwg", store)
    manifest = store / "dpstream-instance.json"
    recorded = json.loads(manifest.read_text())
    recorded["schema"] = "dpstream.instance/2"  # as a later dpstream might write it
    manifest.write_text(json.dumps(recorded))
    with pytest.raises(RecoveryMismatchError,
                       match=r"has format 'dpstream.instance/2'; this dpstream reads "
                             r"'dpstream.instance/1' only"):
        run_flow(STORE_RUNS["pmwg"], store)


def test_a_store_without_its_manifest_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    copy_store(STORES_DIR / "counters", store)
    (store / "dpstream-instance.json").unlink()
    with pytest.raises(RecoveryMismatchError, match="holds state but no dpstream-instance.json"):
        run_flow(STORE_RUNS["counters"], store)


def _rewrite_shard_snapshots(store: Path, change: Callable[[dict[str, Any]], bool]) -> None:
    """Rewrite the shards' snapshots in ``store`` by ``change`` (which says if it changed one)."""
    changed = 0
    with closing(sqlite3.connect(store / "part-0.sqlite3")) as db, db:
        rows = db.execute("SELECT step_id, state_key, snap_epoch, ser_change FROM snaps "
                          "WHERE step_id LIKE '%.shards' AND ser_change IS NOT NULL").fetchall()
        for step, key, epoch, blob in rows:
            state = pickle.loads(blob)
            if change(state):
                changed += 1
                db.execute("UPDATE snaps SET ser_change = ? WHERE step_id = ? AND state_key = ? "
                           "AND snap_epoch = ?", (pickle.dumps(state), step, key, epoch))
    assert changed


def _older_noise_scheme(state: dict[str, Any]) -> bool:
    state["noise_scheme"] = "dpstream-noise/3"  # as a store made before noise scheme 4
    return True


def _later_key_table(state: dict[str, Any]) -> bool:
    if "table" not in state:
        return False
    state["table"]["version"] = 2  # as a later dpstream might write it
    return True


@pytest.mark.parametrize("change, message", [
    (_older_noise_scheme, "made with noise derivation 'dpstream-noise/3' (an older dpstream)"),
    (_later_key_table, "not a key table state of version 1"),
], ids=["older-noise-scheme", "later-key-table-version"])
def test_snapshots_of_another_format_are_refused_saying_why(
        change: Callable[[dict[str, Any]], bool], message: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    copy_store(STORES_DIR / "counters", store)
    _rewrite_shard_snapshots(store, change)
    with pytest.raises(Exception) as raised:
        run_flow(STORE_RUNS["counters"], store)
    text = "".join(str(e) for e in _chain(raised.value))
    assert message in text, text


def _chain(exc: BaseException | None) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out
