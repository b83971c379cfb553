"""Render the Kubernetes manifests of one dpstream flow, run as a Bytewax cluster.

    python deploy/k8s/render.py deploy/k8s/counters.values.toml > counters.yaml
    kubectl apply -f counters.yaml

The values file (TOML, documented in ``counters.values.toml``) names the flow, its image, its
configuration file, the number of processes and workers, and the recovery volumes. The output
is one YAML stream of plain manifests (no Helm, no kustomize):

* a ConfigMap with the flow's TOML configuration;
* a headless Service whose DNS names (``<name>-<n>.<name>-cluster``) are the processes'
  cluster addresses;
* a StatefulSet: one pod per Bytewax process, ``python -m bytewax.run <flow> -w W -i <ordinal>
  -a <every process>`` through ``dpstream-cluster-start``; an init container that lays out the
  recovery partitions, copies the noise key from its Secret and pins the flow instance
  (``cluster_init.py``); one recovery volume per process (volumeClaimTemplates); Prometheus
  scrape annotations; resource requests and limits;
* a NetworkPolicy: Bytewax's traffic between processes is neither authenticated nor encrypted
  and carries raw events, so only the flow's own pods may reach the cluster port.

The noise key Secret (``<name>-noise-key``, key ``noise.key``) is made by hand, never
rendered: see docs/deploy.md. Needs PyYAML.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

IMAGE_USER: Final = 10001
"""The image's non-root user and group (deploy/container/Dockerfile)."""
RECOVERY_MOUNT: Final = "/var/lib/dpstream/recovery"
RECOVERY_STORE: Final = f"{RECOVERY_MOUNT}/store"
CONFIG_MOUNT: Final = "/etc/dpstream"
CONFIG_FILE: Final = "flow.toml"
SECRET_MOUNT: Final = "/etc/dpstream-secret"
NOISE_KEY_NAME: Final = "noise.key"
KEY_MOUNT: Final = "/run/dpstream"
INIT_SCRIPT: Final = "/usr/local/lib/dpstream/cluster_init.py"
START_COMMAND: Final = "dpstream-cluster-start"
NAME: Final = re.compile(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?")
INSTANCE_ID: Final = re.compile(r"[0-9a-f]{32}")


class ValuesError(Exception):
    """A values file that cannot be rendered; the message names the setting."""


@dataclass(frozen=True)
class Values:
    """Every knob of the rendered manifests (see counters.values.toml for their meaning)."""

    name: str
    namespace: str
    image: str
    flow_module: str
    config_text: str
    instance_id: str
    processes: int
    workers: int
    brokers: str = ""
    kafka_secret: str = ""
    partitions: int = 16
    owners: int = 2
    volume_size: str = "10Gi"
    storage_class: str = ""
    snapshot_seconds: int = 5
    backup_seconds: int = 0
    cluster_port: int = 2101
    metrics_port: int = 9464
    resources: dict[str, dict[str, str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def service(self) -> str:
        """The headless Service that gives every process a stable DNS name."""
        return f"{self.name}-cluster"

    @property
    def config_map(self) -> str:
        """The ConfigMap holding the flow's TOML configuration."""
        return f"{self.name}-config"

    @property
    def noise_key_secret(self) -> str:
        """The Secret holding the noise key (made by hand: docs/deploy.md)."""
        return f"{self.name}-noise-key"


def _int(table: dict[str, Any], key: str, default: int, lowest: int, where: str) -> int:
    value = table.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ValuesError(f"{where}{key} must be an integer >= {lowest}, got {value!r}")
    return value


def _str(table: dict[str, Any], key: str, default: str | None, where: str) -> str:
    value = table.get(key, default)
    if not isinstance(value, str):
        raise ValuesError(f"{where}{key} must be a string" +
                          (" (it is required)" if value is None else f", got {value!r}"))
    return value


def load_values(path: Path, instance_id: str | None = None) -> Values:
    """Read and check a values file; ``instance_id`` overrides its ``instance_id``."""
    raw = tomllib.loads(path.read_text())
    name = _str(raw, "name", None, "")
    if NAME.fullmatch(name) is None:
        raise ValuesError(f"name must be a DNS label of at most 42 characters, got {name!r}")
    config_path = (path.parent / _str(raw, "config", None, "")).resolve()
    try:
        config_text = config_path.read_text()
    except OSError as exc:
        raise ValuesError(f"config {config_path}: {exc.strerror}") from None
    chosen_id = instance_id if instance_id is not None else _str(raw, "instance_id", "", "")
    if INSTANCE_ID.fullmatch(chosen_id) is None:
        raise ValuesError("instance_id must be 32 lowercase hex digits, made once per flow "
                          "instance and kept: python -c 'import secrets; "
                          "print(secrets.token_hex(16))'")
    recovery = raw.get("recovery", {})
    ports = raw.get("ports", {})
    processes = _int(raw, "processes", 2, 1, "")
    values = Values(
        name=name, namespace=_str(raw, "namespace", "default", ""),
        image=_str(raw, "image", None, ""), flow_module=_str(raw, "flow_module", None, ""),
        config_text=config_text, instance_id=chosen_id, processes=processes,
        workers=_int(raw, "workers", 1, 1, ""), brokers=_str(raw, "brokers", "", ""),
        kafka_secret=_str(raw, "kafka_secret", "", ""),
        partitions=_int(recovery, "partitions", 16, 1, "recovery."),
        owners=_int(recovery, "owners", processes, 1, "recovery."),
        volume_size=_str(recovery, "size", "10Gi", "recovery."),
        storage_class=_str(recovery, "storage_class", "", "recovery."),
        snapshot_seconds=_int(recovery, "snapshot_seconds", 5, 1, "recovery."),
        backup_seconds=_int(recovery, "backup_seconds", 0, 0, "recovery."),
        cluster_port=_int(ports, "cluster", 2101, 1, "ports."),
        metrics_port=_int(ports, "metrics", 9464, 1, "ports."),
        resources={k: {kk: str(vv) for kk, vv in v.items()}
                   for k, v in raw.get("resources", {}).items()},
        env={k: str(v) for k, v in raw.get("env", {}).items()},
    )
    _check(values)
    return values


def _check(values: Values) -> None:
    if ":" not in values.flow_module:
        raise ValuesError(f"flow_module must be module:attribute, got {values.flow_module!r}")
    if values.owners > values.partitions:
        raise ValuesError(f"recovery.owners ({values.owners}) cannot exceed recovery.partitions "
                          f"({values.partitions})")
    if values.metrics_port <= values.processes or values.metrics_port > 65535:
        raise ValuesError(f"ports.metrics must be a port above processes, got "
                          f"{values.metrics_port}")
    if values.cluster_port > 65535 or values.cluster_port == values.metrics_port:
        raise ValuesError("ports.cluster must be a port other than ports.metrics")
    reserved = set(_flow_env(values, init=True)) & set(values.env)
    if reserved:
        raise ValuesError(f"env cannot set {', '.join(sorted(reserved))}: rendered from the "
                          "other settings")


def labels(values: Values) -> dict[str, str]:
    """The labels that select this flow's pods."""
    return {"app.kubernetes.io/name": "dpstream", "app.kubernetes.io/instance": values.name,
            "app.kubernetes.io/component": "flow"}


def _flow_env(values: Values, *, init: bool) -> dict[str, str]:
    """The environment of the flow container (and of the init step with ``init``)."""
    env = {
        "DPSTREAM_CONFIG": f"{CONFIG_MOUNT}/{CONFIG_FILE}",
        "DPSTREAM_FLOW_MODULE": values.flow_module,
        "DPSTREAM_STATEFULSET": values.name,
        "DPSTREAM_SERVICE": values.service,
        "DPSTREAM_PROCESSES": str(values.processes),
        "DPSTREAM_WORKERS": str(values.workers),
        "DPSTREAM_CLUSTER_PORT": str(values.cluster_port),
        "DPSTREAM_POD_METRICS_PORT": str(values.metrics_port),
        # the Service and Prometheus reach the pod's address: bind every interface
        "DPSTREAM_METRICS_HOST": "0.0.0.0",
        "DPSTREAM_RECOVERY_DIR": RECOVERY_STORE,
        "DPSTREAM_RECOVERY_PARTITIONS": str(values.partitions),
        "DPSTREAM_RECOVERY_OWNERS": str(values.owners),
        "DPSTREAM_SNAPSHOT_SECONDS": str(values.snapshot_seconds),
        "DPSTREAM_BACKUP_SECONDS": str(values.backup_seconds),
        "DPSTREAM_NOISE_KEY_FILE": f"{KEY_MOUNT}/{NOISE_KEY_NAME}",
        "DPSTREAM_INSTANCE_ID": values.instance_id,
    }
    if init:
        env["DPSTREAM_NOISE_KEY_SOURCE"] = f"{SECRET_MOUNT}/{NOISE_KEY_NAME}"
    if values.brokers:
        env["DPSTREAM_BROKERS"] = values.brokers
    return env


def _env_list(values: Values, *, init: bool) -> list[dict[str, Any]]:
    pod_name = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    env = {**_flow_env(values, init=init), **values.env}
    return [pod_name] + [{"name": k, "value": v} for k, v in env.items()]


def config_map(values: Values) -> dict[str, Any]:
    """The ConfigMap with the flow's configuration file."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": values.config_map, "namespace": values.namespace,
                         "labels": labels(values)},
            "data": {CONFIG_FILE: values.config_text}}


def headless_service(values: Values) -> dict[str, Any]:
    """The headless Service: one DNS name per process, published before the pod is ready."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": values.service, "namespace": values.namespace,
                         "labels": labels(values)},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": labels(values),
                     "ports": [{"name": "cluster", "port": values.cluster_port,
                                "targetPort": "cluster", "protocol": "TCP"}]}}


def network_policy(values: Values) -> dict[str, Any]:
    """Only the flow's own pods reach the cluster port; the metrics port is open to scrapers."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": values.name, "namespace": values.namespace,
                         "labels": labels(values)},
            "spec": {"podSelector": {"matchLabels": labels(values)},
                     "policyTypes": ["Ingress"],
                     "ingress": [
                         {"from": [{"podSelector": {"matchLabels": labels(values)}}],
                          "ports": [{"port": values.cluster_port, "protocol": "TCP"}]},
                         {"ports": [{"port": values.metrics_port, "protocol": "TCP"}]}]}}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def _volume_mounts(*, init: bool) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "recovery", "mountPath": RECOVERY_MOUNT},
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "noise-key", "mountPath": KEY_MOUNT, "readOnly": not init},
        {"name": "tmp", "mountPath": "/tmp"}]
    if init:
        mounts.append({"name": "noise-key-secret", "mountPath": SECRET_MOUNT, "readOnly": True})
    return mounts


def stateful_set(values: Values) -> dict[str, Any]:
    """The StatefulSet: one pod per Bytewax process, each with its recovery volume."""
    config_digest = hashlib.sha256(values.config_text.encode()).hexdigest()
    init = {"name": "recovery-init", "image": values.image,
            "command": ["python", INIT_SCRIPT],
            "env": _env_list(values, init=True),
            "volumeMounts": _volume_mounts(init=True),
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                          "limits": {"cpu": "1", "memory": "512Mi"}},
            "securityContext": _container_security()}
    flow: dict[str, Any] = {
        "name": "flow", "image": values.image, "command": [START_COMMAND],
        "env": _env_list(values, init=False),
        "ports": [{"name": "cluster", "containerPort": values.cluster_port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": values.metrics_port,
                   "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"},
                           "periodSeconds": 10, "failureThreshold": 3},
        "volumeMounts": _volume_mounts(init=False),
        "resources": values.resources,
        "securityContext": _container_security()}
    if values.kafka_secret:
        flow["envFrom"] = [{"secretRef": {"name": values.kafka_secret}}]
        init["envFrom"] = [{"secretRef": {"name": values.kafka_secret}}]
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": values.volume_size}}}
    if values.storage_class:
        claim["storageClassName"] = values.storage_class
    pod_spec = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_USER,
                            "runAsGroup": IMAGE_USER, "fsGroup": IMAGE_USER,
                            "fsGroupChangePolicy": "OnRootMismatch",
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [init],
        "containers": [flow],
        "volumes": [
            {"name": "config", "configMap": {"name": values.config_map, "defaultMode": 0o444}},
            {"name": "noise-key-secret",
             "secret": {"secretName": values.noise_key_secret, "defaultMode": 0o400,
                        "items": [{"key": NOISE_KEY_NAME, "path": NOISE_KEY_NAME}]}},
            {"name": "noise-key", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}]}
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": values.name, "namespace": values.namespace,
                     "labels": labels(values)},
        "spec": {
            "serviceName": values.service,
            "replicas": values.processes,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels(values)},
            "template": {
                "metadata": {
                    "labels": labels(values),
                    "annotations": {"prometheus.io/scrape": "true",
                                    "prometheus.io/port": str(values.metrics_port),
                                    "prometheus.io/path": "/metrics",
                                    "dpstream.io/config-sha256": config_digest}},
                "spec": pod_spec},
            "volumeClaimTemplates": [{"metadata": {"name": "recovery",
                                                   "labels": labels(values)},
                                      "spec": claim}]}}


def manifests(values: Values) -> list[dict[str, Any]]:
    """Every manifest of the flow, in the order kubectl should apply them."""
    return [config_map(values), headless_service(values), network_policy(values),
            stateful_set(values)]


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML has no stubs here
    """Multi-line strings (the flow's TOML) as literal blocks."""


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def render(values: Values) -> str:
    """The manifests as one YAML stream."""
    header = (f"# dpstream flow {values.name}: rendered by deploy/k8s/render.py; edit the "
              "values file and render again.\n"
              f"# The Secret {values.noise_key_secret} (key {NOISE_KEY_NAME}) is made by hand: "
              "docs/deploy.md.\n")
    docs: str = yaml.dump_all(manifests(values), Dumper=_Dumper, sort_keys=False,
                              default_flow_style=False, width=100, explicit_start=True)
    return header + docs


def main(argv: list[str] | None = None) -> int:
    """Render the values file named on the command line to standard output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("values", type=Path, help="values file (TOML)")
    parser.add_argument("--instance-id", help="override the values file's instance_id")
    args = parser.parse_args(argv)
    try:
        values = load_values(args.values, args.instance_id)
    except (ValuesError, OSError, tomllib.TOMLDecodeError) as exc:
        print(f"render: error: {exc}", file=sys.stderr)
        return 2
    if values.processes < values.owners:
        print(f"render: warning: {values.processes} processes but recovery.owners = "
              f"{values.owners}: the partitions of ordinals {values.processes}.."
              f"{values.owners - 1} must have been moved onto the remaining volumes "
              "(docs/deploy.md, scaling in)", file=sys.stderr)
    sys.stdout.write(render(values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
