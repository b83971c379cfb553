"""The flow instance: an id made once and kept with the recovery store, and what it binds.

Every noise coordinate starts with the flow instance's id, so noise is never shared between
two deployments with the same ``flow.name`` and noise key, nor between a flow and a
reprocessing of the same topic (pitfall 13). The id lives in a small manifest,
``dpstream-instance.json``, written (and flushed to disk) into the Bytewax recovery directory
*before* the dataflow starts, beside the settings a resume must not change:

* ``flow.shards``, ``flow.step``, ``flow.origin``: keys would move to other shards and events
  to other steps;
* the noise key's fingerprint: replayed releases would be published again with fresh noise;
* the digest of every mechanism's parameters: a changed mechanism needs new noise and new
  charges, and a crash before the next snapshot would lose them (a charge must be persisted
  before anything it pays for is emitted; Bytewax snapshots only at epoch ends).

The manifest also keeps the records the operator quarantined (``skipped_records``;
:mod:`dpstream.stream.quarantine`), append-only: a record skipped once in an instance is skipped
on every later run of it, whether or not the operator names it again, so every replay of the
instance counts exactly the same records. A skip is written (and flushed to disk) before the
flow starts, under a lock (``dpstream-instance.lock``) so that processes sharing the directory
do not lose each other's additions.

The budget may change on resume (see :class:`~dpstream.core.counting.key_table.KeyTable`).

The recovery store holds true counts, so it is kept private to the user that runs the flow: a
missing recovery directory is created with mode 0700, the manifest is written with mode 0600,
and a directory or manifest that its group or others may access (``mode & 0o077``) is refused
with the ``chmod`` that fixes it.

Without a recovery store every start is a new instance with a fresh random id: replays are
impossible (nothing is resumed) and each run's spend adds to every earlier run's over the same
data. That must be acknowledged explicitly (``dpstream run --ephemeral``).

**Several processes** (a Bytewax cluster, ``-i``/``-a``) must all bind the *same* instance: a
shard may run on any process (and moves on a rescale), so a process with its own id would
re-noise the releases it replays or continues. Each process binds its own ``-r`` directory:

* a directory shared by the processes: process 0 makes the instance; the others wait for its
  manifest (``wait_seconds``) and never make one of their own. The manifest is created with
  ``link()``, so two processes cannot both make one (the second reads the first's);
* a directory per process (a volume per pod): every process, process 0 included, is given the
  same new id (``instance_id``, ``$DPSTREAM_INSTANCE_ID``), recorded in each manifest; a
  manifest with another id is refused. A process other than 0 without the id and without a
  manifest stops with the instructions after ``wait_seconds``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import sqlite3
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol

from dpstream.config import FlowConfig
from dpstream.core._files import fsync_directory
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError, RecoveryMismatchError
from dpstream.store_lock import LOCK_PATTERN
from dpstream.stream.quarantine import SkippedRecord

__all__ = ["MANIFEST_NAME", "FlowInstance", "bind_instance", "private_directory"]

MANIFEST_NAME: Final = "dpstream-instance.json"
MANIFEST_SCHEMA: Final = "dpstream.instance/1"
MANIFEST_LOCK_NAME: Final = "dpstream-instance.lock"
"""Held while the manifest's list of skipped records is read and rewritten."""
_PRIVATE_DIR_MODE: Final = 0o700
_PRIVATE_FILE_MODE: Final = 0o600
_SHARED_BITS: Final = 0o077
"""Permission bits of group and others: the recovery store and its manifest must have none."""
_INSTANCE_ID: Final = re.compile(r"[0-9a-f]{32}")
"""A flow instance id: 128 random bits in lowercase hex (``secrets.token_hex(16)``)."""
_NEW_ID_HINT: Final = "python -c 'import secrets; print(secrets.token_hex(16))'"
_WAIT_POLL_SECONDS: Final = 0.1

log = logging.getLogger("dpstream")


class Mechanisms(Protocol):
    """What a flow kind binds to an instance: the digest of its mechanisms' parameters."""

    @property
    def mechanisms_digest(self) -> str:
        """One digest of every mechanism's parameters."""

    def mechanisms_hint(self, recorded: object) -> str:
        """A hint appended when a store's digest ``recorded`` is not ours ("" if none)."""


@dataclass(frozen=True)
class FlowInstance:
    """The id every noise coordinate starts with, and whether it survives a restart."""

    id: str
    durable: bool
    resumed: bool = False
    skipped: tuple[SkippedRecord, ...] = ()
    """Every record quarantined in this instance (recorded earlier, or now)."""
    newly_skipped: tuple[SkippedRecord, ...] = ()
    """Of those, the ones this start added to the manifest."""


_RECORDED_SINCE_ISSUE_22: Final = frozenset({"flow.clock"})
"""Fixed settings older manifests do not record: not compared when absent.

``flow.clock`` is fixed because it decides which records' times are trusted: a resume under
the other clock (e.g. from a shell that still exports ``DPSTREAM_FLOW_CLOCK=producer``) would
change the trust model of a running instance, and the placement of replayed records."""


def _fixed_settings(config: FlowConfig, spec: Mechanisms, noise: NoiseKey) -> dict[str, Any]:
    return {
        "flow.shards": config.shards,
        "flow.step": config.step_seconds,
        "flow.origin": config.origin.isoformat(),
        "flow.clock": config.clock,
        "noise key fingerprint": noise.fingerprint(),
        "mechanisms": spec.mechanisms_digest,
    }


def _create_durably(path: Path, data: dict[str, Any]) -> bool:
    """Create ``path`` (mode 0600) holding ``data`` as JSON, flushed to disk; False if it exists.

    The content is written to a temporary file of its own and hard-linked to ``path``: the
    link fails if ``path`` exists, so of several processes creating one manifest at once
    exactly one succeeds, and nobody ever reads a half-written manifest.
    """
    tmp = path.with_name(f"{path.stem}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _PRIVATE_FILE_MODE)
    try:
        with open(fd, "w") as handle:
            os.fchmod(fd, _PRIVATE_FILE_MODE)  # whatever the umask
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            raise ConfigError(f"cannot record the flow instance in {path.parent}: "
                              f"{exc.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_directory(path.parent)
    return True


def _refuse_if_shared(path: Path, what: str, private_mode: int) -> None:
    """Raise ConfigError if group or others may access ``path`` (``mode & 0o077``)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & _SHARED_BITS:
        raise ConfigError(
            f"the {what} {path} has mode {mode:04o}: its group or others can access it, and "
            "the recovery store holds true counts (whoever reads it sees the data the noise "
            f"protects). Restrict it with `chmod {private_mode:o} {path}` (and keep it owned "
            "by the user that runs the flow)")


def private_directory(directory: Path) -> None:
    """Create ``directory`` with mode 0700 if it is missing; refuse it if it is shared."""
    if not directory.exists():
        try:
            directory.mkdir(mode=_PRIVATE_DIR_MODE, parents=True)
        except FileExistsError:
            pass  # made concurrently (another worker process): checked below like any other
        except OSError as exc:
            raise ConfigError(
                f"cannot create the recovery directory {directory}: {exc.strerror}") from None
        else:
            os.chmod(directory, _PRIVATE_DIR_MODE)  # whatever the umask
    if not directory.is_dir():
        raise ConfigError(f"the recovery directory {directory} is not a directory")
    _refuse_if_shared(directory, "recovery directory", _PRIVATE_DIR_MODE)


def _empty_partition(path: Path) -> bool:
    """Whether ``path`` is a Bytewax recovery partition that holds no snapshot yet.

    ``python -m bytewax.recovery DIR N`` initialises such partitions before a first run.
    """
    if not (path.name.startswith("part-") and path.suffix == ".sqlite3"):
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            return not any(db.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone()
                           for table in ("snaps", "commits", "fronts", "exs"))
    except sqlite3.Error:
        return False


def _check_instance_id(instance_id: str) -> None:
    if _INSTANCE_ID.fullmatch(instance_id) is None:
        raise ConfigError(
            "the flow instance id (DPSTREAM_INSTANCE_ID) must be 32 lowercase hex digits, a new "
            f"random one for each new flow instance ({_NEW_ID_HINT}); got "
            f"{len(instance_id)} characters")


def _resume(directory: Path, manifest: Path, fixed: dict[str, Any],
            instance_id: str | None,
            hint: Callable[[object], str] | None = None) -> FlowInstance:
    """The instance recorded in ``manifest``, if its fixed settings (and id) are ours.

    ``hint`` (the binding's ``mechanisms_hint``) explains a recorded mechanisms
    digest that differs from ours, when it can (e.g. the other ERM learner).
    """
    _refuse_if_shared(manifest, "flow instance manifest", _PRIVATE_FILE_MODE)
    try:
        recorded = json.loads(manifest.read_text())
        instance, settings = recorded["instance"], recorded["fixed"]
        if not isinstance(settings, dict):
            raise TypeError(f"'fixed' is a {type(settings).__name__}, not a table")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RecoveryMismatchError(
            f"cannot read the flow instance manifest {manifest}: {exc}") from None
    if recorded.get("schema") != MANIFEST_SCHEMA:
        raise RecoveryMismatchError(
            f"the flow instance manifest {manifest} has format {recorded.get('schema')!r}; "
            f"this dpstream reads {MANIFEST_SCHEMA!r} only: resume the instance with the "
            "dpstream that made it, or start a new instance with an empty recovery directory")
    if instance_id is not None and instance != instance_id:
        raise RecoveryMismatchError(
            f"the recovery store {directory} belongs to flow instance {instance}, not to "
            f"{instance_id} (DPSTREAM_INSTANCE_ID): every process of a flow instance must use "
            "one id; a new instance needs new, empty recovery directories")
    changed = [f"{name}: {settings.get(name)!r} in the store, {value!r} now"
               + (hint(settings.get(name)) if name == "mechanisms" and hint else "")
               for name, value in fixed.items() if settings.get(name) != value
               and (name in settings or name not in _RECORDED_SINCE_ISSUE_22)]
    if changed:
        raise RecoveryMismatchError(
            f"the recovery store {directory} belongs to flow instance {instance} made with "
            f"other settings ({'; '.join(changed)}). These cannot change under a running "
            "instance; restore them, or start a new instance with an empty recovery "
            "directory (its spend adds to this one's)")
    return FlowInstance(instance, durable=True, resumed=True)


def _await_manifest(directory: Path, manifest: Path, process: int, wait_seconds: float) -> None:
    """Wait for process 0 to make the instance in a shared directory; explain if it never does."""
    deadline = time.monotonic() + wait_seconds
    while not manifest.exists():
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"process {process} of the cluster found no flow instance manifest in "
                f"{directory} after {wait_seconds:g} s. Only process 0 makes a new flow "
                "instance; the other processes share its recovery directory or are given its "
                "id. With a recovery directory per process (a volume per pod), set "
                "DPSTREAM_INSTANCE_ID to the same new id on every process, process 0 included "
                f"({_NEW_ID_HINT})")
        time.sleep(_WAIT_POLL_SECONDS)


def _temporary_manifest(name: str) -> bool:
    """A manifest being (or left half-) written: ``dpstream-instance[.<tag>].tmp``."""
    stem = Path(MANIFEST_NAME).stem
    return name.startswith(stem + ".") and name.endswith(".tmp")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _skip_entries(skipped: Sequence[SkippedRecord]) -> list[dict[str, Any]]:
    since = _now()
    return [{"topic": r.topic, "partition": r.partition, "offset": r.offset, "since": since}
            for r in skipped]


def _replace_durably(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` by ``data`` as JSON (mode 0600), atomically and flushed to disk."""
    tmp = path.with_name(f"{path.stem}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _PRIVATE_FILE_MODE)
    try:
        with open(fd, "w") as handle:
            os.fchmod(fd, _PRIVATE_FILE_MODE)
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_directory(path.parent)


def _read_skips(manifest: Path) -> tuple[dict[str, Any], list[Any], set[SkippedRecord]]:
    """The manifest, its ``skipped_records`` entries, and those records."""
    try:
        recorded = json.loads(manifest.read_text())
        entries = list(recorded.get("skipped_records", []))
        known = {SkippedRecord(str(e["topic"]), int(e["partition"]), int(e["offset"]))
                 for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RecoveryMismatchError(
            f"cannot read the skipped records of the flow instance manifest {manifest}: "
            f"{type(exc).__name__}") from None
    return recorded, entries, known


def _record_skips(manifest: Path, requested: list[SkippedRecord]
                  ) -> tuple[tuple[SkippedRecord, ...], tuple[SkippedRecord, ...]]:
    """Add ``requested`` to the manifest's skipped records; (all of them, the new ones)."""
    if not requested:  # only read (a rewrite replaces the file atomically)
        return tuple(sorted(_read_skips(manifest)[2])), ()
    fd = os.open(manifest.with_name(MANIFEST_LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 _PRIVATE_FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        recorded, entries, known = _read_skips(manifest)
        new = sorted(set(requested) - known)
        if new:
            recorded["skipped_records"] = entries + _skip_entries(new)
            _replace_durably(manifest, recorded)
        return tuple(sorted(known | set(new))), tuple(new)
    finally:
        os.close(fd)


def bind_instance(config: FlowConfig, spec: Mechanisms, noise: NoiseKey,
                  recovery_dir: str | os.PathLike[str] | None, *,
                  ephemeral: bool = False, instance_id: str | None = None, process: int = 0,
                  wait_seconds: float = 0.0,
                  skip_records: Iterable[SkippedRecord] = ()) -> FlowInstance:
    """Return the flow instance to run: resumed from, or recorded in, ``recovery_dir``.

    Args:
        config: the validated configuration.
        spec: the mechanisms it implies (the flow kind's binding; only their digest is used).
        noise: the secret noise key (only its fingerprint is recorded).
        recovery_dir: the Bytewax recovery directory, or None.
        ephemeral: acknowledge a run without a recovery store (a new instance every start).
        instance_id: the id a new instance must get, and a resumed one must have (32 hex
            digits, the same for every process of a cluster); a random id if None.
        process: this process's id in a Bytewax cluster (``-i``); only process 0 makes a new
            instance without ``instance_id``.
        wait_seconds: how long a process other than 0 waits for process 0's manifest.
        skip_records: records the operator quarantines from now on in this instance; they
            are added to the manifest's ``skipped_records`` (append-only), and the
            instance's :attr:`FlowInstance.skipped` holds every one recorded.

    The recovery directory is created with mode 0700 if missing, and the manifest written
    with mode 0600.

    Raises:
        ConfigError: no recovery store and not acknowledged, ``instance_id`` malformed or
            given to an ephemeral run, the recovery directory or its manifest is accessible
            to its group or others (``mode & 0o077``), or a process other than 0 found no
            manifest within ``wait_seconds`` and was given no ``instance_id``.
        RecoveryMismatchError: the store was made with other fixed settings, another noise
            key, other mechanisms or another instance id, or holds Bytewax state but no
            dpstream manifest.
    """
    requested = [SkippedRecord(*record) for record in skip_records]
    if instance_id is not None:
        _check_instance_id(instance_id)
    if recovery_dir is None:
        if instance_id is not None:
            raise ConfigError(
                "DPSTREAM_INSTANCE_ID names a durable flow instance, kept in a recovery store; "
                "a run without one is a new instance at every start: give a recovery directory "
                "or unset DPSTREAM_INSTANCE_ID")
        if not ephemeral:
            raise ConfigError(
                "no recovery store: without one a restart re-reads the input and publishes "
                "every release again under a new flow instance, whose spend adds to the "
                "earlier run's. Give a recovery directory (dpstream run --recovery-dir DIR; "
                "with bytewax.run set DPSTREAM_RECOVERY_DIR to its -r directory) or acknowledge "
                "with dpstream run --ephemeral (DPSTREAM_EPHEMERAL=1)")
        skipped = tuple(sorted(set(requested)))
        return FlowInstance(secrets.token_hex(16), durable=False, skipped=skipped,
                            newly_skipped=skipped)
    directory = Path(recovery_dir)
    private_directory(directory)
    manifest = directory / MANIFEST_NAME
    fixed = _fixed_settings(config, spec, noise)
    hint = spec.mechanisms_hint
    if instance_id is None and process > 0 and not manifest.exists():
        _await_manifest(directory, manifest, process, wait_seconds)
    if manifest.exists():
        return _with_skips(_resume(directory, manifest, fixed, instance_id, hint), manifest,
                           requested)
    if any(p.name != MANIFEST_NAME and not _temporary_manifest(p.name)
           and not LOCK_PATTERN.fullmatch(p.name) and p.name != MANIFEST_LOCK_NAME
           and not _empty_partition(p)
           for p in directory.iterdir()):
        raise RecoveryMismatchError(
            f"the recovery directory {directory} holds state but no {MANIFEST_NAME}: it was not "
            "made by this version of dpstream; use an empty directory (a new flow instance)")
    instance = instance_id or secrets.token_hex(16)
    skipped = tuple(sorted(set(requested)))
    made = _create_durably(manifest, {
        "schema": MANIFEST_SCHEMA, "instance": instance, "flow": config.name,
        "input_topic": config.kafka.input_topic, "created": _now(), "fixed": fixed,
        "skipped_records": _skip_entries(skipped),
    })
    if not made:  # another process sharing the directory made it first: bind to that one
        return _with_skips(_resume(directory, manifest, fixed, instance_id, hint), manifest,
                           requested)
    return FlowInstance(instance, durable=True, skipped=tuple(skipped),
                        newly_skipped=tuple(skipped))


def _with_skips(instance: FlowInstance, manifest: Path,
                requested: list[SkippedRecord]) -> FlowInstance:
    """``instance`` with every record skipped in it (``requested`` recorded first)."""
    skipped, new = _record_skips(manifest, requested)
    return FlowInstance(instance.id, instance.durable, instance.resumed, skipped, new)


RECOVERY_PARTITION_GLOB: Final = "part-*.sqlite3"
"""The files of a Bytewax recovery store (``python -m bytewax.recovery DIR N`` makes them)."""


def private_recovery_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Make the recovery partitions in ``directory`` private; return them (sorted).

    The partitions hold true counts, as the manifest does: Bytewax creates them (and SQLite
    its ``-wal``/``-shm``/``-journal`` files) with the umask's mode, often 0644. Each is set to
    0600 here, and the process's umask is narrowed to keep group and others out of every file
    made later (SQLite makes and removes its side files during the run).
    """
    os.umask(os.umask(0) | _SHARED_BITS)
    found = sorted(Path(directory).glob(RECOVERY_PARTITION_GLOB))
    for path in found:
        for part in (path, *(path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal"))):
            try:
                if stat.S_IMODE(part.stat().st_mode) & _SHARED_BITS:
                    os.chmod(part, _PRIVATE_FILE_MODE)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise ConfigError(f"cannot make the recovery partition {part} private: "
                                  f"{exc.strerror}; `chmod 600` it (it holds true counts) as "
                                  "its owner") from None
    return found
