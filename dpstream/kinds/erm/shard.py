"""One shard of the ERM kind's model streams: each closed step is one block of each stream.

Model streams are spread over shards by name. When a step closes, each stream's block (its
events sorted by input partition and offset, so a replay trains on the very same rows in the
very same order) goes to its release schedule, and every model the schedule releases comes out
as a :class:`ModelRecord` (encoded by :mod:`dpstream.kinds.erm.records`). A stream whose
budget is spent says so once and releases no further model.

After its models, every stream names at every step the model a consumer should use, a
:class:`ServingRecord`: :func:`~dpstream.core.erm.serving.serving_choice` over the public
metadata of the models it released (None before the first; after the budget is spent, the
last choice). A stream keeps, in its state, the candidates that cover its latest released block
(all a later choice can need: a candidate covering an older last block is never eligible
again), so a replay from a snapshot writes the same serving records. A snapshot of a dpstream
before serving records does not know what its stream released: resumed from one, a stream
writes no serving record until its next release (whose models end at the latest block, so
the choice is then complete again).

**History and memory.** Each stream's schedule keeps the blocks it may still train on in a
:class:`~dpstream.core.erm.history.FileBlockStore` of its own: append-only, checksummed segment
files under ``<recovery dir>/history/<instance>/<flow>/<stream>/<shard>`` when the run has a
recovery directory, else under a private temporary directory of the process (``0700``),
removed when the process exits normally, and, when it was killed, by the sweep of a later run
of the same user, once no process holds its owner lock (:func:`sweep_stale_histories`). The
shard's snapshot then holds each store's cursor,
never the rows: RAM and snapshot stay O(window + one block) with ``release.max_history``
(without it a cumulative schedule's files grow with the stream, about ``8·(d + 2)`` bytes per
event and a base step reads its whole range into RAM while it trains; the snapshot stays
flat). Every snapshot is taken after the store made its
blocks durable (:meth:`~dpstream.core.erm.history.FileBlockStore.state` fsyncs first); a resume
cuts off the blocks appended after the snapshot and the replay appends them again. Files
rather than re-reading the input topic: :mod:`dpstream.core.erm.history` says why. A shard
resumed where its history directory is missing (moved to another machine without it)
stops at once with a :class:`~dpstream.core.erm.history.HistoryError` that says so. Path
components that are not plain names (``[A-Za-z0-9_.-]``, no leading dot) are replaced by
``x-`` and a digest of the name.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpstream.core.erm.history import FileBlockStore
from dpstream.core.erm.model import PrivateModel, predict
from dpstream.core.erm.schedules.schedule import ReleaseSchedule
from dpstream.core.erm.serving import ServingCandidate, serving_choice, still_eligible
from dpstream.core.erm.spec import Block
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import BudgetExhaustedError
from dpstream.kinds.erm.config import ErmConfig
from dpstream.stream.barrier import MechanismShard

__all__ = ["ErmShard", "ModelRecord", "ServingRecord"]


@dataclass(frozen=True)
class ModelRecord:
    """One published model (before encoding)."""

    stream: str
    algorithm: str
    step: int
    role: str
    level: int | None
    first_step: int
    last_step: int
    depends_on: tuple[tuple[int, int], ...]
    model: PrivateModel | None
    cost: float
    spent: float
    budget: float
    accuracy: float | None
    reason: str | None = None


@dataclass(frozen=True)
class ServingRecord:
    """The model of ``stream`` to serve after ``step`` (``choice`` None: none released yet)."""

    stream: str
    algorithm: str
    step: int
    choice: ServingCandidate | None


def _candidate_state(c: ServingCandidate) -> list[Any]:
    return [c.step, c.role, c.level, c.first_step, c.last_step, c.blocks, c.noise_std]


def _candidate(stream: str, data: list[Any]) -> ServingCandidate:
    step, role, level, first, last, blocks, std = data
    return ServingCandidate(stream, int(step), str(role), None if level is None else int(level),
                            int(first), int(last), int(blocks), float(std))


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
_temporary_root: list[Path] = []  # this process's private history directory (no recovery)


def _path_part(name: object) -> str:
    """A name as one safe path component (itself if plain, else ``x-`` and a digest)."""
    text = str(name)
    if _PLAIN_NAME.fullmatch(text):
        return text
    return "x-" + hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


_TEMPORARY_PREFIX = "dpstream-erm-history-"
_TEMPORARY_NAME = re.compile(re.escape(_TEMPORARY_PREFIX) + r"held-[A-Za-z0-9_]+")
_OWNER_LOCK = ".owner.lock"
_temporary_lock: list[int] = []  # the descriptor whose lock marks this process's directory


def _lock_if_free(directory: Path) -> int | None:
    """Lock ``directory``'s owner lock without waiting; return the descriptor.

    None when the lock is held (its process, or a process it forked, still runs) or is not a
    file we can open.
    """
    try:
        fd = os.open(directory / _OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_stale_histories(directory: str | Path | None = None) -> list[Path]:
    """Remove the temporary histories whose process has ended; return what was removed.

    A process killed without a normal exit (``kill -9``, an OOM kill) cannot remove its private
    temporary history, and those files hold raw rows. Each such directory holds an owner lock
    (``flock``) for its process's whole life, shared by any process it forks; the lock goes
    when the last of them ends, however it ends. A later run removes the directories of this
    user whose lock it can take (never another user's, a symbolic link, or one whose lock is
    held: no process ids, hosts or namespaces are guessed at). A directory is renamed to its
    swept name only once its lock is held.
    """
    base = Path(tempfile.gettempdir() if directory is None else directory)
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if _TEMPORARY_NAME.fullmatch(entry.name) is None or entry in _temporary_root:
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        fd = _lock_if_free(entry)
        if fd is None:
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
        finally:
            os.close(fd)
        if not entry.exists():
            removed.append(entry)
    return removed


def _temporary_history() -> Path:
    """The process's private temporary history directory, removed when the process exits.

    A later run's :func:`sweep_stale_histories` removes it when the process did not exit
    normally. It is made under a staging name (never swept), its owner lock taken, and then
    renamed to the name a sweep looks for.
    """
    if not _temporary_root:
        sweep_stale_histories()
        staging = Path(tempfile.mkdtemp(prefix=f"{_TEMPORARY_PREFIX}new-"))  # mode 0700
        fd = os.open(staging / _OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                     0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        root = staging.with_name(staging.name.replace("-new-", "-held-", 1))
        os.rename(staging, root)
        _temporary_lock.append(fd)
        _temporary_root.append(root)
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    return _temporary_root[0]


def history_directory(recovery_dir: str | Path | None, instance: str, flow: str,
                      stream: str, shard: int) -> Path:
    """Where a model stream's block history lives (see the module docstring)."""
    root = (_temporary_history() if recovery_dir is None
            else Path(recovery_dir) / "history")
    return root.joinpath(*map(_path_part, (instance, flow, stream, shard)))


def _make_schedule(config: ErmConfig, noise: NoiseKey, coords: tuple[Any, ...],
                   state: dict[str, Any] | None, train: Any = None,
                   store: FileBlockStore | None = None) -> Any:
    if config.algorithm == "ermg":
        from dpstream.core.erm.ermg import Ermg  # noqa: PLC0415

        if state is None:
            return Ermg(config.schedule, config.model, noise, coords)
        return Ermg.from_state(state, config.schedule, config.model, noise, coords)
    if state is None:
        return ReleaseSchedule(config.schedule, config.model, noise, coords, train=train,
                               store=store)
    return ReleaseSchedule.from_state(state, config.schedule, config.model, noise, coords,
                                      train=train, store=store)


class _Stream:
    """One model stream: its schedule, fed one block per step."""

    def __init__(self, config: ErmConfig, name: str, noise: NoiseKey, coords: tuple[Any, ...],
                 state: dict[str, Any] | None, train: Any = None,
                 store: FileBlockStore | None = None) -> None:
        self.config, self.name = config, name
        self.exhausted: bool = bool(state and state.get("exhausted"))
        kept = {} if state is None else state.get("serving")  # None: an older snapshot
        self.candidates: list[ServingCandidate] | None = None if kept is None else [
            _candidate(name, c) for c in kept]
        self.schedule = _make_schedule(config, noise, coords,
                                       None if state is None else state["schedule"], train,
                                       store)

    def to_state(self) -> dict[str, Any]:
        return {"schedule": self.schedule.to_state(), "exhausted": self.exhausted,
                "serving": None if self.candidates is None
                else [_candidate_state(c) for c in self.candidates]}

    def step(self, step: int, block: Block) -> list[ModelRecord | ServingRecord]:
        """The step's models (or the exhaustion notice), then the step's serving record."""
        out: list[ModelRecord | ServingRecord] = []
        if not self.exhausted:
            out.extend(self._models(step, block))
        fresh = [ServingCandidate.of(m.stream, m.step, m.role, m.level, m.depends_on,
                                     m.model.noise_std) for m in out
                 if isinstance(m, ModelRecord) and m.model is not None]
        if fresh:  # keep only the candidates that cover the latest released block
            self.candidates = still_eligible((self.candidates or []) + fresh)
        if self.candidates is not None:
            out.append(ServingRecord(self.name, self.config.algorithm, step,
                                     serving_choice(self.candidates)))
        return out

    def _models(self, step: int, block: Block) -> list[ModelRecord]:
        config = self.config
        try:
            releases = self.schedule.add_block(step, block)
        except BudgetExhaustedError:
            self.exhausted = True
            return [ModelRecord(self.name, config.algorithm, step, "exhausted", None, step, step,
                                (), None, 0.0, float(self.schedule.max_block_spend()),
                                config.budget, None,
                                "the privacy budget of this model stream is spent: no "
                                "further models")]
        spent = float(self.schedule.max_block_spend())
        out = []
        for r in releases:
            accuracy = None
            if config.holdout is not None:
                guess = predict(config.model, r.model.params, config.holdout.z)
                accuracy = float(np.mean(guess == config.holdout.y))
            out.append(ModelRecord(self.name, config.algorithm, step, r.role, r.level,
                                   r.first_step, r.last_step, tuple(r.depends_on), r.model,
                                   float(r.cost), spent, config.budget, accuracy))
        return out


class ErmShard(MechanismShard):
    """The model streams of one shard: each closed step is one block of each stream."""

    members_key = "streams"
    mechanism = "erm"

    def __init__(self, config: ErmConfig, noise: NoiseKey, instance: str, partitions: int,
                 state: dict[str, Any] | None = None, train: Any = None,
                 recovery_dir: str | Path | None = None) -> None:
        self.train = train  # None: private training (another trainer only for bench/)
        self.recovery_dir = recovery_dir  # None: histories in a temporary directory
        super().__init__(config, noise, instance, partitions, state)

    def names(self) -> list[str]:
        """The configured model streams."""
        return list(self.config.streams)

    def build(self, name: str, coordinates: tuple[Any, ...],
              state: dict[str, Any] | None) -> _Stream:
        """A model stream and its schedule (new, or from its snapshot) and its history."""
        store = None
        if self.config.algorithm != "ermg" and self.shard is not None:
            directory = history_directory(self.recovery_dir, self.instance, self.config.name,
                                          name, self.shard)
            bound = getattr(self.config.schedule, "max_history", None)
            store = FileBlockStore(  # segments no longer than the bound: disk O(window) too
                directory, self.config.model.columns,
                blocks_per_segment=64 if bound is None else max(1, min(64, int(bound))),
                durable=self.recovery_dir is not None)
        return _Stream(self.config, name, self.noise, coordinates, state, self.train, store)

    def merge(self, step: int, bucket: dict[str, Any]) -> None:
        """Add one partition's rows for ``step``."""
        pending = self.pending.setdefault(step, {})
        for name, parts in bucket.items():
            pending.setdefault(name, []).extend(parts)

    def close(self, step: int, bucket: dict[str, Any] | None
              ) -> list[ModelRecord | ServingRecord]:
        """Give every stream of this shard its block (rows in partition, offset order)."""
        bucket = bucket or {}
        columns = self.config.model.columns
        out: list[ModelRecord | ServingRecord] = []
        for name in sorted(self.members):
            parts = bucket.get(name)
            if parts:
                z = np.concatenate([p[0] for p in parts])
                y = np.concatenate([p[1] for p in parts])
                where = np.concatenate([p[2] for p in parts])
                order = np.lexsort((where[:, 1], where[:, 0]))
                block = Block(z[order], y[order])
            else:
                block = Block(np.empty((0, columns)), np.empty(0, dtype=np.int64))
            out.extend(self.members[name].step(step, block))
        return out
