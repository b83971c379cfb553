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

The budget may change on resume (see :class:`~dpstream.core.key_statistics.KeyStatistics`).

The recovery store holds true counts, so it is kept private to the user that runs the flow: a
missing recovery directory is created with mode 0700, the manifest is written with mode 0600,
and a directory or manifest that its group or others may access (``mode & 0o077``) is refused
with the ``chmod`` that fixes it.

Without a recovery store every start is a new instance with a fresh random id: replays are
impossible (nothing is resumed) and each run's spend adds to every earlier run's over the same
data. That must be acknowledged explicitly (``dpstream run --ephemeral``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sqlite3
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol

from dpstream.config import FlowConfig
from dpstream.core.noise import NoiseKey
from dpstream.errors import ConfigError, RecoveryMismatchError

__all__ = ["MANIFEST_NAME", "FlowInstance", "bind_instance"]

MANIFEST_NAME: Final = "dpstream-instance.json"
MANIFEST_SCHEMA: Final = "dpstream.instance/1"
_PRIVATE_DIR_MODE: Final = 0o700
_PRIVATE_FILE_MODE: Final = 0o600
_SHARED_BITS: Final = 0o077
"""Permission bits of group and others: the recovery store and its manifest must have none."""

log = logging.getLogger("dpstream")


class Mechanisms(Protocol):
    """What a flow kind binds to an instance: the digest of its mechanisms' parameters."""

    @property
    def mechanisms_digest(self) -> str:
        """One digest of every mechanism's parameters."""


@dataclass(frozen=True)
class FlowInstance:
    """The id every noise coordinate starts with, and whether it survives a restart."""

    id: str
    durable: bool
    resumed: bool = False


def _fixed_settings(config: FlowConfig, spec: Mechanisms, noise: NoiseKey) -> dict[str, Any]:
    return {
        "flow.shards": config.shards,
        "flow.step": config.step_seconds,
        "flow.origin": config.origin.isoformat(),
        "noise key fingerprint": noise.fingerprint(),
        "mechanisms": spec.mechanisms_digest,
    }


def _write_durably(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` (mode 0600) atomically and flush it to disk."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _PRIVATE_FILE_MODE)
    with open(fd, "w") as handle:
        os.fchmod(fd, _PRIVATE_FILE_MODE)  # a stale .tmp from a crash keeps its old mode
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _refuse_if_shared(path: Path, what: str, private_mode: int) -> None:
    """Raise ConfigError if group or others may access ``path`` (``mode & 0o077``)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & _SHARED_BITS:
        raise ConfigError(
            f"the {what} {path} has mode {mode:04o}: its group or others can access it, and "
            "the recovery store holds true counts (whoever reads it sees the data the noise "
            f"protects). Restrict it with `chmod {private_mode:o} {path}` (and keep it owned "
            "by the user that runs the flow)")


def _private_directory(directory: Path) -> None:
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


def bind_instance(config: FlowConfig, spec: Mechanisms, noise: NoiseKey,
                  recovery_dir: str | os.PathLike[str] | None, *,
                  ephemeral: bool = False) -> FlowInstance:
    """Return the flow instance to run: resumed from, or recorded in, ``recovery_dir``.

    Args:
        config: the validated configuration.
        spec: the mechanisms it implies (the flow kind's binding; only their digest is used).
        noise: the secret noise key (only its fingerprint is recorded).
        recovery_dir: the Bytewax recovery directory, or None.
        ephemeral: acknowledge a run without a recovery store (a new instance every start).

    The recovery directory is created with mode 0700 if missing, and the manifest written
    with mode 0600.

    Raises:
        ConfigError: no recovery store and not acknowledged, or the recovery directory or its
            manifest is accessible to its group or others (``mode & 0o077``).
        RecoveryMismatchError: the store was made with other fixed settings, another noise
            key or other mechanisms, or holds Bytewax state but no dpstream manifest.
    """
    if recovery_dir is None:
        if not ephemeral:
            raise ConfigError(
                "no recovery store: without one a restart re-reads the input and publishes "
                "every release again under a new flow instance, whose spend adds to the "
                "earlier run's. Give a recovery directory (dpstream run --recovery-dir DIR; "
                "with bytewax.run set DPSTREAM_RECOVERY_DIR to its -r directory) or acknowledge "
                "with dpstream run --ephemeral (DPSTREAM_EPHEMERAL=1)")
        return FlowInstance(secrets.token_hex(16), durable=False)
    directory = Path(recovery_dir)
    _private_directory(directory)
    manifest = directory / MANIFEST_NAME
    fixed = _fixed_settings(config, spec, noise)
    if manifest.exists():
        _refuse_if_shared(manifest, "flow instance manifest", _PRIVATE_FILE_MODE)
        try:
            recorded = json.loads(manifest.read_text())
            instance, settings = recorded["instance"], recorded["fixed"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RecoveryMismatchError(
                f"cannot read the flow instance manifest {manifest}: {exc}") from None
        changed = [f"{name}: {settings.get(name)!r} in the store, {value!r} now"
                   for name, value in fixed.items() if settings.get(name) != value]
        if changed:
            raise RecoveryMismatchError(
                f"the recovery store {directory} belongs to flow instance {instance} made with "
                f"other settings ({'; '.join(changed)}). These cannot change under a running "
                "instance; restore them, or start a new instance with an empty recovery "
                "directory (its spend adds to this one's)")
        return FlowInstance(instance, durable=True, resumed=True)
    ours = {MANIFEST_NAME, manifest.with_suffix(".tmp").name}  # .tmp: a crash mid-write
    if any(p.name not in ours and not _empty_partition(p) for p in directory.iterdir()):
        raise RecoveryMismatchError(
            f"the recovery directory {directory} holds state but no {MANIFEST_NAME}: it was not "
            "made by this version of dpstream; use an empty directory (a new flow instance)")
    instance = secrets.token_hex(16)
    _write_durably(manifest, {
        "schema": MANIFEST_SCHEMA, "instance": instance, "flow": config.name,
        "input_topic": config.kafka.input_topic,
        "created": datetime.now(UTC).isoformat().replace("+00:00", "Z"), "fixed": fixed,
    })
    return FlowInstance(instance, durable=True)
