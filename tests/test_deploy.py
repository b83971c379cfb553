"""Deployment material: Prometheus config and rules are valid; the dashboard uses real metrics."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dpstream.metrics import FlowMetrics

DEPLOY = Path(__file__).parent.parent / "deploy"


def metric_names():
    registry = FlowMetrics("x").registry
    names = set()
    for family in registry.collect():
        names |= {s.name for s in family.samples} | {family.name}
    return names | {"dpstream_releases_total", "dpstream_events_total",
                    "dpstream_dead_letters_total", "dpstream_refused_releases_total",
                    "dpstream_alerts_total"}


def test_prometheus_config_and_rules_are_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    out = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_and_rules_only_use_metrics_that_exist():
    used = set(re.findall(r"dpstream_[a-z_]+", (DEPLOY / "grafana-dashboard.json").read_text()
                          + (DEPLOY / "dpstream-alerts.yml").read_text()))
    assert used and used <= metric_names(), used - metric_names()
    json.loads((DEPLOY / "grafana-dashboard.json").read_text())
