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

Without a recovery store every start is a new instance with a fresh random id: replays are
impossible (nothing is resumed) and each run's spend adds to every earlier run's over the same
data. That must be acknowledged explicitly (``dpstream run --ephemeral``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from dpstream.config import FlowConfig
from dpstream.core.key_statistics import StatisticsSpec
from dpstream.core.noise import NoiseKey
from dpstream.errors import ConfigError, RecoveryMismatchError

__all__ = ["MANIFEST_NAME", "FlowInstance", "bind_instance"]

MANIFEST_NAME: Final = "dpstream-instance.json"
MANIFEST_SCHEMA: Final = "dpstream.instance/1"

log = logging.getLogger("dpstream")


@dataclass(frozen=True)
class FlowInstance:
    """The id every noise coordinate starts with, and whether it survives a restart."""

    id: str
    durable: bool
    resumed: bool = False


def _fixed_settings(config: FlowConfig, spec: StatisticsSpec, noise: NoiseKey) -> dict[str, Any]:
    return {
        "flow.shards": config.shards,
        "flow.step": config.step_seconds,
        "flow.origin": config.origin.isoformat(),
        "noise key fingerprint": noise.fingerprint(),
        "mechanisms": spec.mechanisms_digest,
    }


def _write_durably(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def bind_instance(config: FlowConfig, spec: StatisticsSpec, noise: NoiseKey,
                  recovery_dir: str | os.PathLike[str] | None, *,
                  ephemeral: bool = False) -> FlowInstance:
    """Return the flow instance to run: resumed from, or recorded in, ``recovery_dir``.

    Args:
        config: the validated configuration.
        spec: the per-key statistics it implies (for the mechanisms' digest).
        noise: the secret noise key (only its fingerprint is recorded).
        recovery_dir: the Bytewax recovery directory, or None.
        ephemeral: acknowledge a run without a recovery store (a new instance every start).

    Raises:
        ConfigError: no recovery store and not acknowledged.
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
    manifest = directory / MANIFEST_NAME
    fixed = _fixed_settings(config, spec, noise)
    if manifest.exists():
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
    if directory.exists() and any(p.name != MANIFEST_NAME for p in directory.iterdir()):
        raise RecoveryMismatchError(
            f"the recovery directory {directory} holds state but no {MANIFEST_NAME}: it was not "
            "made by this version of dpstream; use an empty directory (a new flow instance)")
    directory.mkdir(parents=True, exist_ok=True)
    instance = secrets.token_hex(16)
    _write_durably(manifest, {
        "schema": MANIFEST_SCHEMA, "instance": instance, "flow": config.name,
        "input_topic": config.kafka.input_topic,
        "created": datetime.now(UTC).isoformat().replace("+00:00", "Z"), "fixed": fixed,
    })
    return FlowInstance(instance, durable=True)
