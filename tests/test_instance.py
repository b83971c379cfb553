"""The flow instance manifest: what a resume may not change, and the ephemeral acknowledgement."""

from __future__ import annotations

import json
import os
import stat

import pytest

from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import ConfigError, RecoveryMismatchError
from dpstream.instance import MANIFEST_NAME, bind_instance
from dpstream.kinds.counters.kind import statistics_spec
from dpstream.platform import parse_config

KEY = NoiseKey.for_tests(1)


def config(**flow):
    raw = {"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 4, **flow},
           "privacy": {"budget": 1.0}, "counter": {"epsilon": 0.7},
           "admission": {"mode": "declared", "keys": ["a"]}, "metrics": {"port": 0}}
    return parse_config(raw)


def bind(cfg, directory, key=KEY, **kwargs):
    return bind_instance(cfg, statistics_spec(cfg), key, directory, **kwargs)


def test_a_run_without_a_recovery_store_must_be_acknowledged():
    with pytest.raises(ConfigError, match="no recovery store"):
        bind(config(), None)
    first, second = bind(config(), None, ephemeral=True), bind(config(), None, ephemeral=True)
    assert not first.durable and first.id != second.id  # every start is a new instance


def test_the_instance_is_made_once_and_resumed(tmp_path):
    made = bind(config(), tmp_path / "store")
    assert made.durable and not made.resumed
    manifest = json.loads((tmp_path / "store" / MANIFEST_NAME).read_text())
    assert manifest["instance"] == made.id and manifest["fixed"]["flow.shards"] == 4
    assert KEY.fingerprint() in json.dumps(manifest) and KEY._key.hex() not in json.dumps(manifest)
    resumed = bind(config(), tmp_path / "store")
    assert resumed.id == made.id and resumed.resumed
    raised = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 4},
                           "privacy": {"budget": 2.0}, "counter": {"epsilon": 0.7},
                           "admission": {"mode": "declared", "keys": ["a"]},
                           "metrics": {"port": 0}})
    assert bind(raised, tmp_path / "store").id == made.id  # the budget may change


@pytest.mark.parametrize(("changed", "setting"), [
    (config(shards=8), "flow.shards"),
    (config(step="2s"), "flow.step"),
    (config(origin="2026-09-22T00:00:00Z"), "flow.origin"),
    (config(clock="producer"), "flow.clock"),
])
def test_fixed_settings_cannot_change_under_a_running_instance(tmp_path, changed, setting):
    bind(config(), tmp_path)
    with pytest.raises(RecoveryMismatchError, match=setting):
        bind(changed, tmp_path)


def test_a_manifest_from_before_the_clock_was_pinned_still_resumes(tmp_path):
    made = bind(config(), tmp_path)
    path = tmp_path / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    del manifest["fixed"]["flow.clock"]  # as an older dpstream wrote it
    path.write_text(json.dumps(manifest))
    assert bind(config(), tmp_path).id == made.id


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m.update(schema="dpstream.instance/0"), "has format 'dpstream.instance/0'"),
    (lambda m: m.pop("schema"), "has format None"),
    (lambda m: m.update(fixed=["flow.shards", 4]), "'fixed' is a list, not a table"),
])
def test_a_manifest_of_another_format_or_shape_is_refused(tmp_path, edit, message):
    bind(config(), tmp_path)
    path = tmp_path / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(RecoveryMismatchError, match=message.replace("(", r"\(")):
        bind(config(), tmp_path)


def test_another_noise_key_or_other_mechanisms_are_refused(tmp_path):
    bind(config(), tmp_path)
    with pytest.raises(RecoveryMismatchError, match="noise key fingerprint"):
        bind(config(), tmp_path, key=NoiseKey.for_tests(2))
    other = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 4},
                          "privacy": {"budget": 1.0}, "counter": {"epsilon": 0.6},
                          "admission": {"mode": "declared", "keys": ["a"]},
                          "metrics": {"port": 0}})
    with pytest.raises(RecoveryMismatchError, match="mechanisms"):
        bind(other, tmp_path)


def test_a_store_without_a_manifest_is_refused(tmp_path):
    (tmp_path / "part-0.sqlite3").write_bytes(b"")
    with pytest.raises(RecoveryMismatchError, match="holds state but no"):
        bind(config(), tmp_path)


# --- the recovery store holds true counts: private to its owner ------------------------------

def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_a_missing_recovery_directory_is_made_private(tmp_path):
    store = tmp_path / "deep" / "store"
    bind(config(), store)
    assert mode(store) == 0o700
    assert mode(store / MANIFEST_NAME) == 0o600
    assert not list(store.glob("*.tmp"))


def test_the_manifest_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        bind(config(), tmp_path / "store")
    finally:
        os.umask(old)
    assert mode(tmp_path / "store") == 0o700
    assert mode(tmp_path / "store" / MANIFEST_NAME) == 0o600


@pytest.mark.parametrize("shared", [0o755, 0o750, 0o705, 0o770, 0o701])
def test_a_recovery_directory_others_can_access_is_refused(tmp_path, shared):
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(shared)
    with pytest.raises(ConfigError) as info:
        bind(config(), store)
    message = str(info.value)
    assert f"recovery directory {store} has mode {shared:04o}" in message
    assert f"chmod 700 {store}" in message
    assert not (store / MANIFEST_NAME).exists()  # nothing written into it
    store.chmod(0o700)
    assert bind(config(), store).durable


def test_a_shared_manifest_is_refused(tmp_path):
    made = bind(config(), tmp_path / "store")
    manifest = tmp_path / "store" / MANIFEST_NAME
    manifest.chmod(0o644)
    with pytest.raises(ConfigError) as info:
        bind(config(), tmp_path / "store")
    assert f"manifest {manifest} has mode 0644" in str(info.value)
    assert f"chmod 600 {manifest}" in str(info.value)
    manifest.chmod(0o600)
    assert bind(config(), tmp_path / "store").id == made.id


def test_a_recovery_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        bind(config(), tmp_path / "file")


def test_a_leftover_temporary_manifest_is_not_foreign_state(tmp_path):
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    (store / "dpstream-instance.tmp").write_text("{")  # a crash between write and rename
    made = bind(config(), store)
    assert made.durable and not made.resumed
