"""The ERM block history (dpstream.core.erm.history) and the bounded history of the schedules.

The stores: a round trip across segments, a torn append cut off at the snapshot's cursor,
corruption and missing segments refused saying where (never a value), whole segments deleted
once no state needs them, private permissions. The schedules: a file store gives the very
releases of the in-memory store (snapshots and restores included); ``max_history = H`` trains
every computation on the blocks of its range among the last ``H`` (checked against a reference
computed here), keeps the nominal normaliser and cost, and keeps the snapshot flat as the
stream grows. The flow: a Bytewax run with a recovery store, aborted and resumed, publishes the
models of an uninterrupted run, keeping its history under the recovery directory; a resume
without those files stops with a precise error.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sqlite3
from collections import defaultdict
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fakes import FakeTrain

from dpstream.core.erm.history import (
    RECORD_OVERHEAD,
    FileBlockStore,
    HistoryError,
    MemoryBlockStore,
)
from dpstream.core.erm.output_noise import private_erm
from dpstream.core.erm.schedules.schedule import ReleaseSchedule
from dpstream.core.erm.schedules.spec import ScheduleSpec
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import InvalidParameterError
from dpstream.stream.sharding import shard_of

KEY = NoiseKey.for_tests(25)
COORDS = ("instance-1", "flow", "erm", "a")
D = 3


def erm_spec() -> ErmSpec:
    return ErmSpec(classes=(0, 1), dimension=D, clip_norm=1.0, regularization=0.5)


def a_block(rows: int, seed: int) -> Block:
    spec = erm_spec()
    if rows == 0:
        return Block.empty(spec.columns)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, D))
    return Block(spec.features(x), (x[:, 0] + 0.3 * x[:, 1] > 0).astype(np.int64))


def rows_of(step: int) -> int:
    return (7 * step) % 11  # 0 to 10 rows: empty blocks included


def same(a: Block, b: Block) -> bool:
    return (a.z.shape == b.z.shape and a.z.tobytes() == b.z.tobytes()
            and a.y.tobytes() == b.y.tobytes())


def file_store(directory: Path, **options) -> FileBlockStore:
    store = FileBlockStore(directory, erm_spec().columns, blocks_per_segment=4, **options)
    store.restore(None, first=0)
    return store


def segment_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- the stores ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_store_reads_back_every_range_byte_for_byte(kind, tmp_path):
    columns = erm_spec().columns
    store = MemoryBlockStore(columns) if kind == "memory" else file_store(tmp_path / "h")
    blocks = [a_block(rows_of(s), s) for s in range(11)]  # three segments of 4 blocks
    for step, block in enumerate(blocks):
        store.append(step, block)
    assert (store.first, store.end) == (0, 11)
    for first in range(11):
        for last in range(first, 11):
            assert same(store.read(first, last), Block.concat(blocks[first:last + 1], columns))
    staged = a_block(5, 99)
    assert same(store.read(2, 10, staged), Block.concat([*blocks[2:], staged], columns))
    assert store.read(11, 10, staged) is staged  # no stored block: the staged one as it is
    assert store.read(3, 2).size == 0
    with pytest.raises(InvalidParameterError, match="not kept"):
        store.read(0, 11)
    with pytest.raises(InvalidParameterError, match="expected the block of step 11"):
        store.append(12, staged)
    if kind == "file":  # a new object on the same files, at the state's cursor
        again = FileBlockStore(tmp_path / "h", columns, blocks_per_segment=4)
        again.restore(store.state(), first=0)
        assert same(again.read(0, 10), Block.concat(blocks, columns))


def test_a_torn_append_after_the_snapshot_is_cut_off_and_replayed(tmp_path):
    directory = tmp_path / "h"
    store = file_store(directory)
    blocks = [a_block(rows_of(s) + 1, s) for s in range(10)]
    for step in range(6):
        store.append(step, blocks[step])
    state = store.state()  # the snapshot: 6 blocks; the next goes to segment 1
    assert state["segment"] == 1 and state["end"] == 6
    for step in range(6, 10):  # appended after the snapshot, into segments 1 and 2
        store.append(step, blocks[step])
    store.flush()
    with open(directory / "segment-0000000002.blocks", "ab") as f:
        f.write(b"DPHB\x01\x00half a record")  # then the process died mid-append
    size_at_snapshot = state["offset"]

    resumed = FileBlockStore(directory, erm_spec().columns, blocks_per_segment=4)
    resumed.restore(state, first=0)
    assert (resumed.first, resumed.end) == (0, 6)
    assert (directory / "segment-0000000001.blocks").stat().st_size == size_at_snapshot
    assert not (directory / "segment-0000000002.blocks").exists()
    for step in range(6, 10):  # the replay appends the same blocks again
        resumed.append(step, blocks[step])
    assert same(resumed.read(0, 9), Block.concat(blocks, erm_spec().columns))


def test_a_corrupt_record_is_refused_naming_where_never_what(tmp_path):
    directory = tmp_path / "h"
    store = file_store(directory)
    for step in range(6):
        store.append(step, a_block(8, step))
    state = store.state()
    path = directory / "segment-0000000000.blocks"
    data = bytearray(path.read_bytes())
    record = RECORD_OVERHEAD + 8 * 8 * (erm_spec().columns + 1)
    data[record + 40] ^= 0x01  # one bit of a feature of the block of step 1
    path.write_bytes(bytes(data))
    assert same(store.read(0, 0), a_block(8, 0))  # the others read as they were written
    with pytest.raises(HistoryError, match=r"segment-0000000000\.blocks fails its checksum at "
                                           r"the record of step 1") as raised:
        store.read(0, 3)
    z = a_block(8, 1).z
    assert not any(f"{v:.4f}" in str(raised.value) for v in z.ravel())  # no value named
    data[record + 40] ^= 0x01
    data[record: record + 4] = b"XXXX"  # a damaged header: refused at restore already
    path.write_bytes(bytes(data))
    with pytest.raises(HistoryError, match="has an invalid record"):
        FileBlockStore(directory, erm_spec().columns, blocks_per_segment=4).restore(state,
                                                                                   first=0)


def test_a_missing_or_short_history_is_refused_at_restore(tmp_path):
    directory = tmp_path / "h"
    store = file_store(directory)
    for step in range(10):
        store.append(step, a_block(3, step))
    state = store.state()
    (directory / "segment-0000000000.blocks").unlink()
    fresh = FileBlockStore(directory, erm_spec().columns, blocks_per_segment=4)
    with pytest.raises(HistoryError, match=r"segment-0000000000\.blocks is missing from .*"
                                           "must move with its recovery store"):
        fresh.restore(state, first=0)
    fresh.restore(state, first=4)  # a snapshot that no longer needs segment 0 resumes
    assert (fresh.first, fresh.end) == (4, 10)
    tail = directory / "segment-0000000002.blocks"
    tail.write_bytes(tail.read_bytes()[:-5])
    with pytest.raises(HistoryError, match=r"segment-0000000002\.blocks .* is shorter"):
        FileBlockStore(directory, erm_spec().columns, blocks_per_segment=4).restore(state,
                                                                                   first=4)
    with pytest.raises(InvalidParameterError, match="file store"):
        MemoryBlockStore(erm_spec().columns).restore(state, first=4)


def test_drop_before_deletes_whole_segments_once_no_state_needs_them(tmp_path):
    ephemeral = file_store(tmp_path / "e", durable=False)
    for step in range(10):
        ephemeral.append(step, a_block(2, step))
    ephemeral.drop_before(7)  # segment 0 (steps 0-3) only: segment 1 still holds 7
    assert segment_names(tmp_path / "e") == ["segment-0000000001.blocks",
                                             "segment-0000000002.blocks"]
    assert same(ephemeral.read(7, 9), Block.concat([a_block(2, s) for s in (7, 8, 9)],
                                                   erm_spec().columns))
    with pytest.raises(InvalidParameterError, match="not kept"):
        ephemeral.read(6, 9)

    durable = file_store(tmp_path / "d", keep_snapshots=2)
    for step in range(10):
        durable.append(step, a_block(2, step))
    durable.state()  # a snapshot that needs every block from 0
    durable.drop_before(9)
    assert len(segment_names(tmp_path / "d")) == 3  # kept for that snapshot
    durable.state()  # needs 9 on; the one before still needs 0
    assert len(segment_names(tmp_path / "d")) == 3
    durable.state()  # the last two states need 9 on: segments 0 and 1 go
    assert segment_names(tmp_path / "d") == ["segment-0000000002.blocks"]


def test_histories_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        directory = tmp_path / "a" / "b"
        store = file_store(directory)
        store.append(0, a_block(3, 0))
        store.flush()
    finally:
        os.umask(old)
    for path in (tmp_path / "a", directory):
        assert oct(path.stat().st_mode & 0o777) == oct(0o700)
    assert [oct(p.stat().st_mode & 0o777) for p in directory.iterdir()] == [oct(0o600)]


def test_a_new_history_deletes_what_the_directory_held(tmp_path):
    directory = tmp_path / "h"
    store = file_store(directory)
    for step in range(5):
        store.append(step, a_block(3, step))
    store.flush()
    again = file_store(directory)  # a new schedule in the same directory
    assert segment_names(directory) == [] and again.end == 0
    again.append(0, a_block(2, 50))
    assert same(again.read(0, 0), a_block(2, 50))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "append", "append", "snapshot", "drop",
                                           "crash", "tear"]),
                          st.integers(0, 6)), max_size=40))
def test_any_run_of_appends_drops_snapshots_and_crashes_reads_as_in_memory(tmp_path_factory,
                                                                          operations):
    """A file store driven like a schedule under crashes reads exactly what memory keeps.

    ``crash``: the process dies; a new store object resumes from the last snapshot (the
    reference rolls back to it too). ``tear``: the same after half a record was written.
    """
    directory = tmp_path_factory.mktemp("h")
    columns = erm_spec().columns
    files = FileBlockStore(directory, columns, blocks_per_segment=3, keep_snapshots=1)
    files.restore(None, first=0)
    memory = MemoryBlockStore(columns)
    snapshot = (None, [], 0)  # the files' state, the reference's blocks, first
    for op, n in operations:
        if op == "append":
            step = files.end
            block = a_block(n, step)
            files.append(step, block)
            memory.append(step, block)
        elif op == "drop":
            files.drop_before(files.first + n // 3)
            memory.drop_before(memory.first + n // 3)
        elif op == "snapshot":
            snapshot = (files.state(), memory.state(), files.first)
        else:
            if op == "tear":
                files.flush()
                tail = directory / f"segment-{files.end // 3:010d}.blocks"
                with open(tail, "ab") as f:
                    f.write(b"DPHB" + bytes(n))
            files = FileBlockStore(directory, columns, blocks_per_segment=3, keep_snapshots=1)
            state, blocks, first = snapshot
            files.restore(state, first=first)
            memory = MemoryBlockStore(columns)
            memory.restore(blocks or None, first=first)
        assert (files.first, files.end) == (memory.first, memory.end)
        if files.first < files.end:
            assert same(files.read(files.first, files.end - 1),
                        memory.read(memory.first, memory.end - 1))


# --- the schedules ---------------------------------------------------------------------------

def a_schedule(algorithm="continual", store=None, train=None, max_history=None, base=2,
               window=7):
    spec = ScheduleSpec(algorithm=algorithm, epsilon=1.0, block_size=8, base_blocks=base,
                        window_blocks=window, max_history=max_history)
    return ReleaseSchedule(spec, erm_spec(), KEY, COORDS, store=store,
                           train=private_erm if train is None else train)


def released(releases) -> list[tuple]:
    return [(r.step, r.role, r.level, r.first_step, r.last_step, r.depends_on,
             r.model.params.tobytes(), r.cost) for r in releases]


@pytest.mark.parametrize("algorithm, max_history", [
    ("continual", None), ("multi-resolution", None), ("sliding-window", None),
    ("continual", 5), ("independent", None)])
def test_a_file_store_gives_the_releases_of_the_memory_store(algorithm, max_history, tmp_path):
    """Byte-identical models over 70 steps, with a snapshot and a restore every 9 steps."""
    memory = a_schedule(algorithm, max_history=max_history)
    files = a_schedule(algorithm, max_history=max_history,
                       store=FileBlockStore(tmp_path / "h", erm_spec().columns,
                                            blocks_per_segment=4))
    count = 0
    for step in range(70):
        block = a_block(rows_of(step), step)
        want, got = released(memory.add_block(step, block)), released(files.add_block(step, block))
        assert got == want, step
        count += len(want)
        if step % 9 == 8:  # a snapshot, and a resume from it into a new store object
            state = files.to_state()
            assert "blocks" not in state and set(state["history"]) >= {"segment", "offset"}
            files = ReleaseSchedule.from_state(
                pickle.loads(pickle.dumps(state)), files.spec, files.erm, KEY, COORDS,
                train=private_erm, store=FileBlockStore(tmp_path / "h", erm_spec().columns,
                                                        blocks_per_segment=4))
        assert files.kept_steps == memory.kept_steps
        assert files.max_block_spend() == memory.max_block_spend()
    assert count > 50


def test_a_memory_snapshot_keeps_the_bytes_of_a_snapshot_made_before_stores():
    s = a_schedule(train=FakeTrain())
    for step in range(5):
        s.add_block(step, a_block(3, step))
    state = s.to_state()
    assert list(state) == ["version", "kind", "spec", "erm", "t", "first_kept", "blocks",
                           "first_live", "spend", "max_spend", "models"]
    assert "max_history" not in state["spec"]
    assert [b["z"].tobytes() for b in state["blocks"]] == [a_block(3, s).z.tobytes()
                                                          for s in range(5)]


def test_a_snapshot_that_holds_its_blocks_resumes_into_a_file_store(tmp_path):
    """How a store made before file histories resumes: its blocks are written to files."""
    memory = a_schedule()
    for step in range(12):
        memory.add_block(step, a_block(rows_of(step), step))
    files = ReleaseSchedule.from_state(
        memory.to_state(), memory.spec, memory.erm, KEY, COORDS, train=private_erm,
        store=FileBlockStore(tmp_path / "h", erm_spec().columns, blocks_per_segment=4))
    for step in range(12, 20):
        block = a_block(rows_of(step), step)
        assert released(files.add_block(step, block)) == released(memory.add_block(step, block))


class Recording(FakeTrain):
    """The fake trainer, also keeping the rows of every call."""

    def __init__(self):
        super().__init__()
        self.blocks: list[Block] = []

    def __call__(self, spec, block, **kwargs):
        self.blocks.append(block)
        return super().__call__(spec, block, **kwargs)


@pytest.mark.parametrize("algorithm, H", [("continual", 5), ("multi-resolution", 3),
                                          ("sliding-window", 4), ("continual", 1)])
def test_bounded_history_trains_on_the_last_h_blocks_of_each_range(algorithm, H, tmp_path):
    """Every computation's rows, normaliser and cost, against a reference computed here."""
    columns = erm_spec().columns
    train, full = Recording(), Recording()
    bounded = a_schedule(algorithm, train=train, max_history=H, store=FileBlockStore(
        tmp_path / "h", columns, blocks_per_segment=4, durable=False))
    unbounded = a_schedule(algorithm, train=full)
    blocks = []
    shortened = 0
    for step in range(40):
        blocks.append(a_block(rows_of(step) + 1, step))
        n = len(train.calls)
        bounded.add_block(step, blocks[-1])
        unbounded.add_block(step, blocks[-1])
        assert bounded.trained == unbounded.trained  # same plan, same charges and normalisers
        t = step + 1
        for c, call, rows in zip(bounded.trained, train.calls[n:], train.blocks[n:],
                                 strict=True):
            first = max(c.first_step, t - H)
            reference = Block.concat(blocks[first: c.last_step + 1], columns)
            assert same(rows, reference)
            assert call.normalizer == (c.last_step - c.first_step + 1) * 8  # nominal
            shortened += first > c.first_step
        assert len(bounded.kept_steps) <= H - 1  # at most H blocks while a step trains
        for s in range(max(0, t - H + 1), t):  # live blocks: spent as without the bound
            assert bounded.block_spend(s) == unbounded.block_spend(s)
        if t >= H:
            with pytest.raises(InvalidParameterError, match="retired"):
                bounded.block_spend(t - H)  # not read again: retired
        assert bounded.max_block_spend() <= unbounded.max_block_spend() <= bounded.spec.budget()
    assert shortened > 0  # the bound did cut ranges short (the check has power)


def test_the_snapshot_stays_flat_as_the_stream_grows(tmp_path):
    """200 steps of a continual schedule with H = 8 in files: the pickled state does not grow.

    The state holds the cursor, the live spends (at most H), the centres (two models) and a
    few integers; only their digits grow, by a few bytes. Without the bound and in memory the
    same state grows by every block (the power check).
    """
    store = FileBlockStore(tmp_path / "h", erm_spec().columns, durable=True, keep_snapshots=2)
    bounded = a_schedule(train=FakeTrain(), max_history=8, store=store)
    growing = a_schedule(train=FakeTrain())
    sizes, memory_sizes = [], []
    for step in range(200):
        block = a_block(10, step)
        bounded.add_block(step, block)
        growing.add_block(step, block)
        sizes.append(len(pickle.dumps(bounded.to_state())))
        memory_sizes.append(len(pickle.dumps(growing.to_state())))
        assert len(list((tmp_path / "h").iterdir())) <= 8 // 64 + 3  # segments on disk
    # after the first 16 steps: the same range of sizes in every later stretch (what varies is
    # whether one or two centres are kept and the digits of the spends), never a trend
    early, late = sizes[16:100], sizes[100:]
    assert max(late) <= max(early) + 16 and min(late) >= min(early) - 16, (early, late)
    # in memory and unbounded, the state grows by every block's rows (8 bytes a number)
    assert memory_sizes[-1] - memory_sizes[16] >= 183 * 10 * 8 * (erm_spec().columns + 1)
    assert sizes[-1] < memory_sizes[16]


def test_max_history_is_validated_and_bound_into_the_spec():
    with pytest.raises(InvalidParameterError, match="max_history must be an integer >= 1"):
        ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=8, max_history=0)
    spec = ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=8, max_history=16)
    assert spec.to_dict()["max_history"] == 16
    assert "last 16 blocks" in spec.describe()
    other = ScheduleSpec(algorithm="continual", epsilon=1.0, block_size=8)
    s = a_schedule(train=FakeTrain(), max_history=16)
    for step in range(3):
        s.add_block(step, a_block(2, step))
    with pytest.raises(InvalidParameterError, match="made with schedule"):
        ReleaseSchedule.from_state(s.to_state(), other, erm_spec(), KEY, COORDS)


# --- the flow --------------------------------------------------------------------------------

ORIGIN = 1_790_000_000


def flow_config(**release):
    from dpstream.platform import parse_config

    return parse_config({
        "flow": {"kind": "erm", "name": "m", "origin": "2026-09-21T14:13:20Z", "step": "1s",
                 "shards": 2},
        "privacy": {"accounting": "pure", "epsilon": 1.0},
        "metrics": {"port": 0},
        "model": {"classes": ["no", "yes"], "dimension": D, "clip_norm": 3.0,
                  "regularization": 0.05, "streams": ["a", "b"], "stream_field": "s"},
        "release": {"algorithm": "continual", "block_size": 100, "base_blocks": 2, **release},
    })


def flow_events(steps=14, rate=120, seed=3):
    import random

    from support.messages import raw

    rng = random.Random(seed)
    items, offsets = [], [0, 0]
    for step in range(steps):
        for _ in range(rate):
            p = rng.randrange(2)
            x = [rng.gauss(0, 1) for _ in range(D)]
            ts = ORIGIN + step + rng.random() * 0.9
            body = {"features": x, "label": "yes" if x[0] + 0.5 * x[1] > 0 else "no",
                    "s": rng.choice("ab"), "ts": ts}
            items.append(raw(p, json.dumps(body).encode(), offsets[p], ts))
            offsets[p] += 1
    items.sort(key=lambda m: m[4])
    return items


def run_flow(cfg, items, sink, recovery=None, history=None):
    from bytewax.recovery import RecoveryConfig
    from bytewax.testing import TestingSink, TestingSource, run_main

    from dpstream.platform import build_flow

    flow = build_flow(cfg, KEY, instance="m-1", partitions=2, source=TestingSource(items, 40),
                      sink=TestingSink(sink), recovery_dir=history)
    if recovery is None:
        run_main(flow)
    else:
        run_main(flow, epoch_interval=timedelta(0), recovery_config=RecoveryConfig(recovery))


def by_identity(sink) -> dict[tuple, set[bytes]]:
    copies = defaultdict(set)
    for role, _k, v in sink:
        if role == "models":
            m = json.loads(v)
            copies[(m["schema"], m["stream"], m["step"], m.get("role"), m.get("level"))].add(v)
    return copies


@pytest.mark.flow
def test_an_aborted_run_resumes_from_its_files_to_the_models_of_an_uninterrupted_run(tmp_path):
    from bytewax.recovery import init_db_dir
    from bytewax.testing import TestingSource

    cfg = flow_config(max_history=5)
    items = flow_events()
    whole: list = []
    run_flow(cfg, items, whole)
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    init_db_dir(store, 1)
    crashing = items[: len(items) // 2] + [TestingSource.ABORT()] + items[len(items) // 2:]
    sink: list = []
    run_flow(cfg, crashing, sink, recovery=store, history=store)  # stops at the abort
    first_run = len(by_identity(sink))
    histories = sorted(str(p.relative_to(store)) for p in (store / "history").glob("*/*/*/*"))
    assert histories == [f"history/m-1/m/{name}/{shard_of(name, 2)}" for name in "ab"]
    run_flow(cfg, crashing, sink, recovery=store, history=store)
    copies = by_identity(sink)
    assert 0 < first_run < len(copies)
    assert all(len(c) == 1 for c in copies.values())  # replays are byte-identical
    assert {k: next(iter(c)) for k, c in copies.items()} == {
        k: next(iter(c)) for k, c in by_identity(whole).items()}
    # the snapshots hold cursors, never rows: no array in any pickled shard state
    with closing(sqlite3.connect(store / "part-0.sqlite3")) as db:
        blobs = [b for (b,) in db.execute("SELECT ser_change FROM snaps WHERE step_id LIKE "
                                          "'%.shards' AND ser_change IS NOT NULL")]
    schedules = [m["schedule"] for blob in blobs for m in pickle.loads(blob)["streams"].values()]
    assert schedules and all("blocks" not in s and "history" in s for s in schedules)


@pytest.mark.flow
def test_a_resume_without_its_history_files_stops_saying_why(tmp_path):
    import shutil

    from bytewax.recovery import init_db_dir
    from bytewax.testing import TestingSource

    cfg = flow_config()
    items = flow_events(steps=8)
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    init_db_dir(store, 1)
    crashing = items[: len(items) // 2] + [TestingSource.ABORT()] + items[len(items) // 2:]
    run_flow(cfg, crashing, [], recovery=store, history=store)  # stops at the abort
    shutil.rmtree(store / "history")  # the store moved to a machine without the files
    with pytest.raises(Exception) as raised:
        run_flow(cfg, crashing, [], recovery=store, history=store)
    text = str(raised.value)
    assert "must move with its recovery store" in text, text


def test_release_max_history_is_a_setting_that_check_config_shows():
    from dpstream.errors import ConfigError

    bounded, unbounded = flow_config(max_history=64), flow_config()
    assert bounded.schedule.max_history == 64 and unbounded.schedule.max_history is None
    assert "history bounded to the last 64 blocks" in bounded.describe()
    assert "history bounded" not in unbounded.describe()
    assert bounded.mechanisms_digest != unbounded.mechanisms_digest  # a resume cannot change it
    for bad in (0, -3, 2.5, "64"):
        with pytest.raises(ConfigError, match=r"release\.max_history|\[release\].*max_history"):
            flow_config(max_history=bad)


@pytest.mark.flow
def test_without_a_recovery_directory_the_history_is_private_and_removed_at_exit(tmp_path):
    """A run without recovery keeps its histories in a private temporary directory (0700) of
    the process, removed when the process exits."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, "tests")
        from test_erm_history import flow_config, flow_events, run_flow
        import dpstream.kinds.erm.shard as shard
        run_flow(flow_config(max_history=4), flow_events(steps=6), [])
        root = shard._temporary_root[0]
        segments = sorted(str(p.relative_to(root)) for p in root.rglob("segment-*"))
        print(json.dumps([str(root), oct(root.stat().st_mode & 0o777), segments]))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    root, mode, segments = json.loads(out.stdout.strip().splitlines()[-1])
    assert mode == oct(0o700)
    assert segments and all(s.startswith("m-1/m/") for s in segments)
    assert not Path(root).exists()  # removed at exit


@pytest.mark.flow
def test_a_killed_runs_temporary_history_is_removed_by_the_next_run(tmp_path):
    """kill -9 leaves the rows of a run without recovery on disk; the next run removes the
    directories whose owner lock nobody holds (not while a process the run forked lives),
    and nothing else: a held lock, no lock, a symbolic link, another name."""
    import fcntl
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    temp = tmp_path / "tmp"
    temp.mkdir()
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TMPDIR=str(temp), PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parent), str(repo)]))
    killed = textwrap.dedent("""
        import os, signal, sys, time
        sys.path.insert(0, "tests")
        from test_erm_history import flow_config, flow_events, run_flow
        import dpstream.kinds.erm.shard as shard
        run_flow(flow_config(max_history=4), flow_events(steps=6), [])
        child = os.fork()
        if child == 0:  # inherits the owner lock, outlives its parent
            null = os.open(os.devnull, os.O_RDWR)
            for stream in (0, 1, 2):  # the test reads this process's pipes to their end
                os.dup2(null, stream)
            time.sleep(120)
            os._exit(0)
        print(shard._temporary_root[0], child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", killed], capture_output=True, text=True,
                         env=env, cwd=repo)
    assert out.returncode == -signal.SIGKILL
    path, child = out.stdout.strip().splitlines()[-1].split()
    stale = Path(path)
    assert stale.parent == temp and stale.name.startswith("dpstream-erm-history-held-")
    assert any(stale.rglob("segment-*"))  # the rows are still there
    later = textwrap.dedent("""
        import json
        import dpstream.kinds.erm.shard as shard
        print(json.dumps(str(shard._temporary_history())))
    """)

    def next_run() -> Path:
        done = subprocess.run([sys.executable, "-c", later], capture_output=True, text=True,
                              check=True, env=env, cwd=repo)
        return Path(json.loads(done.stdout.strip().splitlines()[-1]))

    try:
        next_run()
        assert any(stale.rglob("segment-*"))  # the forked child still holds the lock: kept
    finally:
        os.kill(int(child), signal.SIGKILL)
    live = temp / "dpstream-erm-history-held-live"  # its lock held (here): kept
    live.mkdir()
    fd = os.open(live / ".owner.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    unlocked = temp / "dpstream-erm-history-held-nolock"  # no owner lock: kept
    unlocked.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "rows").write_text("kept")
    (target / ".owner.lock").write_text("")
    link = temp / "dpstream-erm-history-held-link"  # a symbolic link: kept, target untouched
    link.symlink_to(target, target_is_directory=True)
    other = temp / "dpstream-erm-history-abc"  # another name: kept
    other.mkdir()
    for _ in range(100):  # the killed child's lock goes when the kernel reaps it
        try:
            os.kill(int(child), 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    try:
        new_root = next_run()
    finally:
        os.close(fd)
    assert not stale.exists()
    assert live.exists() and unlocked.exists() and other.exists()
    assert link.is_symlink() and (target / "rows").read_text() == "kept"
    assert not new_root.exists()  # the second run exited normally
    assert sorted(p.name for p in temp.iterdir()) == sorted(
        [live.name, unlocked.name, link.name, other.name])


@pytest.mark.flow
def test_a_bounded_history_keeps_its_disk_bounded_too(tmp_path):
    """With ``max_history = H`` the shard's segments hold at most H blocks each, so deleting
    whole segments keeps the files near H blocks a stream; with 64-block segments a 30-step
    run would keep every block it ever saw on disk."""
    from bytewax.recovery import init_db_dir

    items = flow_events(steps=30)
    sizes = {}
    for bound in (2, None):
        store = tmp_path / f"store-{bound}"
        store.mkdir(mode=0o700)
        init_db_dir(store, 1)
        release = {} if bound is None else {"max_history": bound}
        run_flow(flow_config(**release), items, [], recovery=store, history=store)
        files = [p for p in (store / "history").rglob("*") if p.is_file()]
        assert files
        sizes[bound] = sum(p.stat().st_size for p in files)
    # unbounded keeps all 30 blocks of each stream; H = 2 keeps about 2 + 2 + the 3 snapshots'
    # blocks, well under half of them
    assert sizes[2] < sizes[None] / 2, sizes


def test_a_second_crash_before_the_next_snapshot_resumes_from_the_same_snapshot(tmp_path):
    """A resume from snapshot S, a replay that retires blocks across a segment boundary, and
    a crash before any newer snapshot commits: the next resume is from S again and must find
    every segment S needs (deleting them would lose the instance on every restart)."""
    directory = tmp_path / "h"
    columns = erm_spec().columns
    store = FileBlockStore(directory, columns, blocks_per_segment=4)
    store.restore(None, first=0)
    for step in range(6):
        store.append(step, a_block(3, step))
    store.drop_before(2)
    snapshot = store.state()  # S: blocks 2..5 live, in segments 0 and 1
    store.close()
    for _attempt in range(2):  # resume from S, replay steps 6..9 retiring as H = 3, crash
        again = FileBlockStore(directory, columns, blocks_per_segment=4)
        again.restore(snapshot, first=2)
        assert same(again.read(2, 5), Block.concat([a_block(3, s) for s in range(2, 6)],
                                                   columns))
        for step in range(6, 10):
            again.append(step, a_block(3, step))
            again.drop_before(step + 1 - 3)
        again.close()


def test_history_errors_name_no_byte_offsets_or_sizes(tmp_path):
    """A record's length gives its rows (44 + 8 rows (columns + 1) bytes): an offset or a file
    size in a message would publish the events of each step (pitfall 5)."""
    directory = tmp_path / "h"
    columns = erm_spec().columns
    store = FileBlockStore(directory, columns, blocks_per_segment=64)
    store.restore(None, first=0)
    for step, rows in enumerate((17, 5)):
        store.append(step, a_block(rows, step))
    state = store.state()
    store.close()
    path = next(directory.iterdir())
    data = bytearray(path.read_bytes())
    messages = []
    for damaged in (bytes(data[:-20]) + bytes([data[-20] ^ 1]) + bytes(data[-19:]),
                    bytes(data[:100]), bytes(data[:RECORD_OVERHEAD + 30])):
        path.write_bytes(damaged)
        try:
            reader = FileBlockStore(directory, columns, blocks_per_segment=64)
            reader.restore(state, first=0)
            reader.read(0, 1)
        except HistoryError as exc:
            messages.append(str(exc))
    assert len(messages) == 3
    sizes = {str(n) for n in (len(data), 100, RECORD_OVERHEAD + 30,
                              RECORD_OVERHEAD + 8 * 17 * (columns + 1))}
    # The directory is named by design; pytest's own path holds digits ("pytest-574" contains
    # "74", which once failed CI), so it is cut out and sizes are matched as whole numbers.
    numbers = [set(re.findall(r"\d+", m.replace(str(directory), "<dir>"))) for m in messages]
    assert not any(sizes & found for found in numbers), messages
