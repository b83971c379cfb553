"""One recovery store, one owner: an OS file lock per recovery partition, held for life.

Two processes resuming one recovery store would both replay and publish, and both write
snapshots into it: the second one's releases of a step may differ from the first's (they see
other records), which an observer can difference. So before the flow instance is bound, a
process takes an exclusive ``flock`` on a lock file beside each Bytewax recovery partition it
will write (``dpstream-part-N.lock`` beside ``part-N.sqlite3``), writes its pid and host into
it, and keeps the file open until it exits (the kernel drops the lock however the process ends,
``kill -9`` included: there is no stale lock to clean up). A second process that needs one of
those partitions stops at start-up with a one-line error naming the holder's pid and host.

**Which partitions a process locks.** Bytewax writes each recovery partition from one worker
(its "primary"), chosen among the processes that hold the file. A single process holds and
writes them all, so it locks them all. In a cluster (``-a "h0:p;h1:p"``, ``N`` processes):

* a recovery directory per process (a volume per pod) holds that process's partitions, and
  only its process knows them, so it writes them all: it locks all of them;
* one directory shared by the processes holds the whole set of partitions (their count is
  recorded in each): process ``i`` locks the partitions ``k`` with ``k % N == i`` (what
  Bytewax's balanced assignment gives it with one worker per process), so the processes of one
  cluster coexist, while a second copy of a process, or a single process started on the store
  of a running cluster, is refused.

A directory without partitions yet (``dpstream run`` initialises them after this lock) is
locked for the partitions about to be made. The lock is advisory: it stops dpstream
processes, not someone copying files. On NFS ``flock`` may be local to a host.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from dpstream.errors import RecoveryStoreInUseError

__all__ = ["LOCK_PATTERN", "lock_recovery_store", "partition_count", "partitions_in",
           "partitions_to_lock"]

LOCK_PATTERN: Final = re.compile(r"dpstream-part-(\d+)\.lock")
"""The name of a recovery partition's lock file (``dpstream-part-N.lock``)."""
_PART: Final = re.compile(r"part-(\d+)\.sqlite3")
_held: dict[Path, int] = {}
"""The lock files this process holds, with their open descriptors (never closed: a lock
lasts as long as the process)."""


def partitions_in(directory: Path) -> list[int]:
    """The indexes of the Bytewax recovery partitions (``part-N.sqlite3``) in ``directory``."""
    if not directory.is_dir():
        return []
    found = (_PART.fullmatch(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1)) for m in found if m is not None)


def partition_count(directory: Path, index: int) -> int | None:
    """How many partitions the set of ``part-<index>.sqlite3`` has (None: unreadable)."""
    path = directory / f"part-{index}.sqlite3"
    if not path.is_file():
        return None
    try:  # immutable: a read-only connection to a WAL database would leave -wal/-shm files
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro&immutable=1",
                                                uri=True)) as db:
            row = db.execute("SELECT part_count FROM parts").fetchone()
    except sqlite3.Error:
        return None
    return None if row is None else int(row[0])


def partitions_to_lock(present: list[int], process: int, processes: int,
                       expected: int = 1, count: int | None = None) -> list[int]:
    """The recovery partitions this process writes (see the module docstring).

    ``count``: how many partitions the store's set has (None: unknown). A directory holding
    the whole set while the cluster has several processes is shared by them.
    """
    if not present:
        return list(range(max(1, expected)))
    shared = processes > 1 and count is not None and present == list(range(count))
    if shared:
        return [k for k in present if k % processes == process]
    return list(present)


def _holder(fd: int) -> str:
    """Who holds a lock file, as its holder wrote it (pid and host)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(data['pid'])} on host {str(data['host'])!r}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet (it is starting)"


def lock_recovery_store(directory: str | os.PathLike[str], *, process: int = 0,
                        processes: int = 1, expected: int = 1) -> list[Path]:
    """Lock the recovery partitions of ``directory`` this process writes, for its lifetime.

    Args:
        directory: the Bytewax recovery directory (it must exist).
        process: this process's id in a Bytewax cluster (``-i``).
        processes: how many processes the cluster has (1 without ``-a``).
        expected: how many partitions a directory without any will get.

    Returns:
        The lock files held (already held ones included).

    Raises:
        RecoveryStoreInUseError: another process holds one of them; the message (one line)
            names its pid and host.
    """
    root = Path(directory)
    present = partitions_in(root)
    count = partition_count(root, present[0]) if present and processes > 1 else None
    wanted = partitions_to_lock(present, process, processes, expected, count)
    taken: list[Path] = []
    new: list[Path] = []
    for k in wanted:
        path = (root / f"dpstream-part-{k}.lock").resolve()
        if path in _held:  # this process locked it already (a flow built twice in-process)
            taken.append(path)
            continue
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            for mine in new:  # all or nothing
                os.close(_held.pop(mine))
            raise RecoveryStoreInUseError(
                f"the recovery store {root} is in use: partition {k} is locked by {holder} "
                f"({path.name}); one recovery store serves one running process (stop that "
                "one first, or give this one its own store: a new flow instance)") from None
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            "partition": k}).encode(), 0)
        os.fsync(fd)
        _held[path] = fd
        taken.append(path)
        new.append(path)
    return taken
