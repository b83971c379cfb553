"""Prepare one Bytewax process's recovery volume, noise key and flow instance before it starts.

Run as the init step of every process of a dpstream cluster (the Kubernetes StatefulSet's init
container, the compose stack's flow service), in the dpstream image, as the user that runs the
flow. It is idempotent: a restart checks what an earlier start made and changes nothing.

**Recovery partitions.** Bytewax keeps a flow's snapshots in a fixed number of SQLite
*recovery partitions* (``DPSTREAM_RECOVERY_PARTITIONS``, fixed for the life of a flow instance)
and resumes when the processes *together* hold every partition; one process may hold none. With
one volume per process, the first ``DPSTREAM_RECOVERY_OWNERS`` processes (ordinals
0 .. owners-1) each create, on their empty volume, the partitions ``j`` with
``j % owners == ordinal``; processes added later (scale-out) hold none. A layout file beside the
store (``dpstream-recovery-layout.json``) records partitions, owners and ordinal, and a start
with other values is refused: changing them would create a second, empty copy of partitions
another volume already holds. A volume that was lost and comes back empty is re-created empty;
Bytewax then refuses to resume (its partitions are "too old"): restore it from a backup.

The store is a subdirectory of the volume (``DPSTREAM_RECOVERY_DIR``, mode 0700): the volume's
root belongs to Kubernetes' ``fsGroup`` and is group-accessible, which dpstream refuses for a
store that holds true counts.

**Noise key.** ``DPSTREAM_NOISE_KEY_SOURCE`` (the Secret's file) is copied to
``DPSTREAM_NOISE_KEY_FILE`` with mode 0400, owned by this user: Kubernetes adds group read to
Secret files when the pod sets ``fsGroup`` (kubernetes/kubernetes#57923), and dpstream refuses a
key file its group can read. The copy is checked with dpstream's own loader; the key is never
printed.

**Flow instance.** Every process of one flow instance must record the same instance id (it
starts every noise coordinate). With ``DPSTREAM_INSTANCE_ID`` (32 hex digits, the same for every
process), a store without a manifest gets one made by :func:`dpstream.instance.bind_instance`
(which checks the configuration, the key and the mechanisms) carrying that id; a store whose
manifest carries another id is refused.

Exit status 0 when the process may start, 2 with one ``dpstream-cluster-init: error: ...`` line
otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

LAYOUT_NAME: Final = "dpstream-recovery-layout.json"
LAYOUT_SCHEMA: Final = "dpstream.recovery-layout/1"
INSTANCE_ID: Final = re.compile(r"[0-9a-f]{32}")
PARTITION_FILE: Final = re.compile(r"part-(\d+)\.sqlite3")


class InitError(Exception):
    """Something the operator must fix before this process may start."""


@dataclass(frozen=True)
class Layout:
    """How a flow instance's recovery partitions are spread over the processes' volumes."""

    partitions: int
    owners: int
    ordinal: int


def ordinal_of(pod_name: str, statefulset: str) -> int:
    """The ordinal of ``pod_name`` (``<statefulset>-<ordinal>``), the Bytewax process id."""
    prefix = f"{statefulset}-"
    suffix = pod_name[len(prefix):] if pod_name.startswith(prefix) else ""
    if not suffix.isdigit() or (len(suffix) > 1 and suffix.startswith("0")):
        raise InitError(f"pod name {pod_name!r} is not {statefulset!r} followed by -<ordinal>")
    return int(suffix)


def owned_partitions(layout: Layout) -> list[int]:
    """The recovery partitions this process creates on its empty volume."""
    if layout.ordinal >= layout.owners:
        return []
    return [j for j in range(layout.partitions) if j % layout.owners == layout.ordinal]


def _env_int(env: Mapping[str, str], name: str, lowest: int) -> int:
    text = env.get(name, "")
    if not text.isdigit() or int(text) < lowest:
        raise InitError(f"{name} must be an integer >= {lowest}, got {text!r}")
    return int(text)


def _partition_count(path: Path) -> int:
    """The partition count recorded inside a Bytewax recovery partition file."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT part_count FROM parts").fetchone()
    except sqlite3.Error as exc:
        raise InitError(f"{path} is not a Bytewax recovery partition: {exc}") from None
    if row is None:
        raise InitError(f"{path} records no partition count")
    return int(row[0])


def check_partitions(store: Path, partitions: int) -> list[int]:
    """The partition indexes in ``store``, each checked to belong to a set of ``partitions``."""
    found = []
    for path in sorted(store.glob("part-*.sqlite3")):
        match = PARTITION_FILE.fullmatch(path.name)
        if match is None:
            continue
        count = _partition_count(path)
        if count != partitions or int(match.group(1)) >= partitions:
            raise InitError(f"{path} belongs to a set of {count} recovery partitions, but "
                            f"DPSTREAM_RECOVERY_PARTITIONS is {partitions}: the partition count "
                            "cannot change under a flow instance")
        found.append(int(match.group(1)))
    return found


def _create_partitions(store: Path, layout: Layout) -> list[int]:
    """Create this process's partitions in ``store`` (via a scratch directory beside it)."""
    from bytewax.recovery import init_db_dir

    owned = owned_partitions(layout)
    if owned:
        with tempfile.TemporaryDirectory(prefix=".init-", dir=store.parent) as scratch:
            init_db_dir(Path(scratch), layout.partitions)  # type: ignore[no-untyped-call]
            for j in owned:
                os.replace(Path(scratch, f"part-{j}.sqlite3"), store / f"part-{j}.sqlite3")
    return owned


def _write_private_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically, mode 0600, flushed to disk."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as handle:
        os.fchmod(fd, 0o600)
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def prepare_store(store: Path, layout: Layout) -> str:
    """Create or check the recovery store and its layout; say what was done."""
    if not store.parent.is_dir():
        raise InitError(f"the recovery volume {store.parent} is not mounted")
    if not store.exists():
        store.mkdir(mode=0o700)
    os.chmod(store, 0o700)
    marker = store.parent / LAYOUT_NAME
    present = check_partitions(store, layout.partitions)
    if marker.exists():
        recorded = json.loads(marker.read_text())
        wanted = asdict(layout)
        changed = [f"{k} {recorded.get(k)!r} recorded, {v!r} now" for k, v in wanted.items()
                   if recorded.get(k) != v]
        if changed:
            raise InitError(f"the recovery volume {store.parent} was laid out with other "
                            f"settings ({'; '.join(changed)}): keep DPSTREAM_RECOVERY_PARTITIONS "
                            "and DPSTREAM_RECOVERY_OWNERS for the life of the flow instance")
        return f"recovery store {store}: partitions {present or 'none'} (resumed layout)"
    if present:
        raise InitError(f"{store} holds recovery partitions {present} but no {LAYOUT_NAME}: "
                        "it was not laid out by this init step; move the partitions away or "
                        "write the layout file by hand (docs/deploy.md)")
    created = _create_partitions(store, layout)
    _write_private_json(marker, {"schema": LAYOUT_SCHEMA, **asdict(layout)})
    return f"recovery store {store}: created partitions {created or 'none'} of {layout.partitions}"


def copy_noise_key(source: Path, target: Path) -> str:
    """Copy the Secret's key file to ``target`` (mode 0400) and check it with dpstream."""
    from dpstream.core.noise.keys import NoiseKey

    try:
        data = source.read_bytes()
    except OSError as exc:
        raise InitError(f"cannot read the noise key {source}: {exc.strerror}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    try:
        os.fchmod(fd, 0o400)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    key = NoiseKey.from_file(target)
    return f"noise key copied to {target} (fingerprint {key.fingerprint()})"


def pin_instance(store: Path, instance_id: str) -> str:
    """Make sure the store's flow-instance manifest carries ``instance_id``."""
    from dpstream.core.noise.keys import NoiseKey
    from dpstream.instance import MANIFEST_NAME, bind_instance
    from dpstream.platform import flow_kind, load_config

    if INSTANCE_ID.fullmatch(instance_id) is None:
        raise InitError("DPSTREAM_INSTANCE_ID must be 32 lowercase hex digits (make one with "
                        "python -c 'import secrets; print(secrets.token_hex(16))')")
    manifest = store / MANIFEST_NAME
    config = load_config()
    spec = flow_kind(config.kind).binding(config)
    if not manifest.exists():
        bind_instance(config, spec, NoiseKey.from_environment(), store)
        recorded = json.loads(manifest.read_text())
        recorded["instance"] = instance_id
        _write_private_json(manifest, recorded)
        return f"flow instance {instance_id} recorded in {manifest}"
    bind_instance(config, spec, NoiseKey.from_environment(), store)  # checks the fixed settings
    found = json.loads(manifest.read_text()).get("instance")
    if found != instance_id:
        raise InitError(f"{manifest} belongs to flow instance {found}, not DPSTREAM_INSTANCE_ID "
                        f"{instance_id}: every process of a flow instance must use one id; a "
                        "new instance needs new, empty recovery volumes")
    return f"flow instance {instance_id} resumed"


def main(env: Mapping[str, str] | None = None) -> int:
    """Run the init step with the settings in ``env`` (default: the environment)."""
    env = os.environ if env is None else env
    from dpstream.errors import DpstreamError

    try:
        layout = Layout(partitions=_env_int(env, "DPSTREAM_RECOVERY_PARTITIONS", 1),
                        owners=_env_int(env, "DPSTREAM_RECOVERY_OWNERS", 1),
                        ordinal=ordinal_of(env.get("POD_NAME", ""),
                                           env.get("DPSTREAM_STATEFULSET", "")))
        store = Path(env.get("DPSTREAM_RECOVERY_DIR", ""))
        if not store.is_absolute():
            raise InitError("DPSTREAM_RECOVERY_DIR must be an absolute path")
        done = [prepare_store(store, layout)]
        if env.get("DPSTREAM_NOISE_KEY_SOURCE"):
            target = Path(env.get("DPSTREAM_NOISE_KEY_FILE", ""))
            if not target.is_absolute():
                raise InitError("DPSTREAM_NOISE_KEY_FILE must be an absolute path (where the "
                                "flow reads the key copied from DPSTREAM_NOISE_KEY_SOURCE)")
            done.append(copy_noise_key(Path(env["DPSTREAM_NOISE_KEY_SOURCE"]), target))
        if env.get("DPSTREAM_INSTANCE_ID"):
            done.append(pin_instance(store, env["DPSTREAM_INSTANCE_ID"]))
    except (InitError, DpstreamError, OSError, ValueError) as exc:
        print(f"dpstream-cluster-init: error: {exc}", file=sys.stderr)
        return 2
    for line in done:
        print(f"dpstream-cluster-init: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
