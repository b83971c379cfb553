"""Deployment material: Prometheus config and rules are valid and unit-tested; the dashboard,
the rules and their tests use real metrics."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dpstream.metrics import FlowMetrics

DEPLOY = Path(__file__).parent.parent / "deploy"
RULES = DEPLOY / "dpstream-alerts.yml"
RULE_TESTS = DEPLOY / "dpstream-alerts.test.yml"


def metric_names():
    """Every sample and family name of a fresh FlowMetrics, counters also as ``<name>_total``
    (a counter family without children yields no samples, and its family name lacks _total)."""
    registry = FlowMetrics("x").registry
    names = set()
    for family in registry.collect():
        names |= {s.name for s in family.samples} | {family.name}
        if family.type == "counter":
            names.add(family.name + "_total")
    return names


def promtool():
    found = shutil.which("promtool")
    if found is None and os.access("/usr/bin/promtool", os.X_OK):
        found = "/usr/bin/promtool"
    if found is None:
        pytest.fail("promtool is not installed (neither on PATH nor /usr/bin/promtool); it comes "
                    "with the Debian 'prometheus' package: apt-get install -y prometheus "
                    "(.ci/run does this)")
    return found


def run_promtool(*args):
    out = subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=DEPLOY)
    assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"
    return out.stdout + out.stderr


def alert_blocks():
    """``{alert name: its text}`` of every alerting rule in the rules file."""
    parts = re.split(r"^\s*- alert: ", RULES.read_text(), flags=re.M)[1:]
    return {part.split("\n", 1)[0].strip(): part for part in parts}


def test_prometheus_config_is_valid():
    """The config, the job name the rules select and the rule file it loads."""
    out = run_promtool("check", "config", str(DEPLOY / "prometheus.yml"))
    assert "1 rule files found" in out, out
    assert re.search(r"job_name: dpstream\b", (DEPLOY / "prometheus.yml").read_text())


def test_alert_rules_are_valid():
    out = run_promtool("check", "rules", str(RULES))
    assert f"{len(alert_blocks())} rules found" in out, out


def test_alert_rules_pass_their_unit_tests():
    out = run_promtool("test", "rules", str(RULE_TESTS))
    assert "SUCCESS" in out, out


def test_every_alert_says_how_bad_and_what_to_do():
    blocks = alert_blocks()
    assert {"DpstreamDown", "DpstreamTargetMissing", "DpstreamRefusedCharges", "DpstreamStalled",
            "DpstreamPartitionBehind", "DpstreamOutputBacklog", "DpstreamKafkaClientErrors",
            "DpstreamDeadLetters"} <= set(blocks)
    for name, text in blocks.items():
        assert re.search(r"severity: (warning|critical)\b", text), name
        assert "summary:" in text and "description:" in text, name


def test_a_spent_counter_budget_is_not_an_alert():
    """A counter charges a key's whole budget with its first release: remaining = 0 is healthy."""
    assert "DpstreamBudgetNearlySpent" not in alert_blocks()
    assert "dpstream_privacy_remaining" not in RULES.read_text()


def test_every_alert_is_unit_tested_quiet_and_firing():
    tests = RULE_TESTS.read_text()
    healthy = tests[tests.index("- name: healthy flow"):]
    healthy = healthy[:healthy.index("\n  - name:")]
    for name in alert_blocks():
        assert re.search(rf"alertname: {name}\}}", healthy), f"{name}: no quiet check when healthy"
        assert re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels:", tests), \
            f"{name}: no test where it fires"


def test_dashboard_and_rules_only_use_metrics_that_exist():
    texts = [(DEPLOY / name).read_text() for name in
             ("grafana-dashboard.json", "dpstream-alerts.yml", "dpstream-alerts.test.yml")]
    used = set(re.findall(r"dpstream_[a-z_]+", "".join(texts)))
    assert used and used <= metric_names(), used - metric_names()
    json.loads(texts[0])
