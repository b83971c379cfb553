"""Deployment material: the Prometheus config, recording and alerting rules are valid and
unit-tested; the Grafana provisioning and dashboard are consistent; all of them use real
metrics. (tests/test_observability.py runs them against a real Prometheus and real flows.)"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dpstream.kinds.erm.metrics import register_metrics as erm_series
from dpstream.kinds.erm.shard import ModelRecord
from dpstream.kinds.pmwg.metrics import register_metrics as pmwg_series
from dpstream.kinds.pmwg.shard import AnswerRecord
from dpstream.metrics import FlowMetrics

DEPLOY = Path(__file__).parent.parent / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
RULES = PROMETHEUS / "dpstream-alerts.yml"
RULE_TESTS = PROMETHEUS / "dpstream-alerts.test.yml"
RECORDING = PROMETHEUS / "dpstream-recording.yml"
RECORDING_TESTS = PROMETHEUS / "dpstream-recording.test.yml"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "dpstream.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "dpstream.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "dpstream.yml"
OFFLINE_VARIABLES = {"$__rate_interval": "1m", "$flow": ".*"}
"""What the dashboard's template variables stand for when its queries are checked here."""


def full_metrics() -> FlowMetrics:
    """A FlowMetrics of every flow kind with every series family present."""
    metrics = FlowMetrics("x")
    metrics.set_kind("counters")
    metrics.set_budget("pmwg", "epsilon", 1.0, "h")
    pmwg_series(metrics).observe_answers([AnswerRecord(
        "h", "pmwg", "q", 0, 10, "bottom", None, None, "privacy budget exhausted", 0.5, 1.0, 1)])
    erm_series(metrics).observe_models([ModelRecord(
        "s", "continual", 0, "base", 0, 0, 0, (), None, 0.5, 0.5, 1.0, 0.9)])
    return metrics


def metric_names():
    """Every sample and family name of FlowMetrics, counters also as ``<name>_total`` (a
    counter family without children yields no samples, and its family name lacks _total),
    and every series the recording rules record."""
    names = {"up"}
    for family in full_metrics().registry.collect():
        names |= {s.name for s in family.samples} | {family.name}
        if family.type == "counter":
            names.add(family.name + "_total")
    return names | recorded_names()


def recorded_names():
    return set(re.findall(r"- record: (\S+)", RECORDING.read_text()))


def promtool():
    found = shutil.which("promtool")
    if found is None and os.access("/usr/bin/promtool", os.X_OK):
        found = "/usr/bin/promtool"
    if found is None:
        pytest.fail("promtool is not installed (neither on PATH nor /usr/bin/promtool); it comes "
                    "with the Debian 'prometheus' package: apt-get install -y prometheus "
                    "(.ci/run does this)")
    return found


def run_promtool(*args, cwd=PROMETHEUS):
    out = subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"
    return out.stdout + out.stderr


def alert_blocks():
    """``{alert name: its text}`` of every alerting rule in the rules file."""
    parts = re.split(r"^\s*- alert: ", RULES.read_text(), flags=re.M)[1:]
    return {part.split("\n", 1)[0].strip(): part for part in parts}


def dashboard():
    return json.loads(DASHBOARD.read_text())


def graph_panels():
    """Every panel that queries (rows excluded), also those nested in collapsed rows."""
    out = []
    for panel in dashboard()["panels"]:
        out.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return out


def panel_queries(variables):
    """``[(panel title, refId, expr with the template variables substituted)]``."""
    out = []
    for panel in graph_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in variables.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], target["refId"], expr))
    return out


def provisioned_uid():
    [uid] = re.findall(r"^\s+uid: (\S+)", DATASOURCES.read_text(), flags=re.M)
    return uid


# -- Prometheus --------------------------------------------------------------------------------


@pytest.mark.flow
def test_prometheus_config_is_valid():
    """The config, the job name the rules select and the rule files it loads."""
    out = run_promtool("check", "config", "prometheus.yml")
    assert "2 rule files found" in out, out
    text = (PROMETHEUS / "prometheus.yml").read_text()
    assert re.search(r"job_name: dpstream\b", text)
    assert "- dpstream-recording.yml" in text and "- dpstream-alerts.yml" in text


def test_the_old_paths_are_gone():
    for old in ("prometheus.yml", "dpstream-alerts.yml", "dpstream-alerts.test.yml",
                "grafana-dashboard.json"):
        assert not (DEPLOY / old).exists(), old


@pytest.mark.flow
def test_recording_rules_are_valid_and_pass_their_unit_tests():
    out = run_promtool("check", "rules", RECORDING.name)
    assert f"{len(recorded_names())} rules found" in out, out
    assert "SUCCESS" in run_promtool("test", "rules", RECORDING_TESTS.name)
    tests = RECORDING_TESTS.read_text()
    for name in recorded_names():
        assert name in tests, f"{name}: no unit test"


def test_burn_rate_and_projected_exhaustion_are_recorded_per_mechanism():
    text = RECORDING.read_text()
    for name in ("flow_mechanism_unit:dpstream_privacy_spent:deriv1h",
                 "flow_mechanism_unit:dpstream_privacy_exhaustion_seconds:deriv1h"):
        assert f"- record: {name}" in text
    for expr in re.findall(r"by \(([^)]*)\)", text):  # per flow and mechanism, always
        assert {"job", "flow", "mechanism"} <= {label.strip() for label in expr.split(",")}


@pytest.mark.flow
def test_alert_rules_are_valid():
    out = run_promtool("check", "rules", RULES.name)
    assert f"{len(alert_blocks())} rules found" in out, out


@pytest.mark.flow
def test_alert_rules_pass_their_unit_tests():
    out = run_promtool("test", "rules", RULE_TESTS.name)
    assert "SUCCESS" in out, out


def test_every_alert_says_how_bad_and_what_to_do():
    blocks = alert_blocks()
    assert {"DpstreamDown", "DpstreamTargetMissing", "DpstreamRefusedCharges", "DpstreamStalled",
            "DpstreamPartitionBehind", "DpstreamOutputBacklog", "DpstreamKafkaClientErrors",
            "DpstreamDeadLetters", "DpstreamPmwgBudgetLow", "DpstreamBudgetExhausted",
            "DpstreamLagGrowing", "DpstreamNoStepClosed", "DpstreamTopologyChanged",
            "DpstreamUndecodableRecords", "DpstreamClockSkew"} <= set(blocks)
    for name, text in blocks.items():
        assert re.search(r"severity: (warning|critical)\b", text), name
        assert "summary:" in text and "description:" in text, name


def test_a_spent_counter_budget_is_not_an_alert():
    """A counter charges a key's whole budget with its first release, and ERM and noisy-histogram
    schedules converge toward their bound: only PMWG's spend warns."""
    assert "DpstreamBudgetNearlySpent" not in alert_blocks()
    for name, text in alert_blocks().items():
        expr = text.split("labels:", 1)[0]
        if re.search(r"privacy_(spent|remaining)", expr):
            assert 'mechanism="pmwg"' in expr, name
    exhausted = alert_blocks()["DpstreamBudgetExhausted"]
    assert 'dpstream_flow_info{kind="counters"}' in exhausted  # counters: RefusedCharges
    refused = alert_blocks()["DpstreamRefusedCharges"]
    assert 'dpstream_flow_info{kind!="counters"}' in refused


def test_every_alert_is_unit_tested_quiet_and_firing():
    tests = RULE_TESTS.read_text()
    healthy = tests[tests.index("- name: healthy flow"):]
    healthy = healthy[:healthy.index("\n  - name:")]
    for name in alert_blocks():
        assert re.search(rf"alertname: {name}\}}", healthy), f"{name}: no quiet check when healthy"
        assert re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels:", tests), \
            f"{name}: no test where it fires"


def test_the_healthy_flows_cover_every_kind():
    healthy = RULE_TESTS.read_text().split("- name: healthy flow", 1)[1].split("\n  - name:")[0]
    for kind in ("counters", "pmwg", "erm"):
        assert f'kind="{kind}"' in healthy, kind


def test_dashboard_and_rules_only_use_metrics_that_exist():
    texts = [path.read_text() for path in (DASHBOARD, RULES, RULE_TESTS, RECORDING,
                                           RECORDING_TESTS)]
    used = set(re.findall(r"(?:flow_mechanism_unit:)?dpstream_[a-z_]+(?::[a-z_0-9]+)?",
                          "".join(texts)))
    used -= {"dpstream_privacy_"}  # prose: "dpstream_privacy_{spent,...}"
    assert used and used <= metric_names(), used - metric_names()


# -- Grafana ---------------------------------------------------------------------------------


def test_datasource_provisioning_names_a_prometheus_with_a_fixed_uid():
    text = DATASOURCES.read_text()
    assert re.search(r"^apiVersion: 1$", text, flags=re.M)
    assert re.search(r"^\s+type: prometheus$", text, flags=re.M)
    assert re.search(r"^\s+url: http://\S+:9090$", text, flags=re.M)
    assert provisioned_uid() == "dpstream-prometheus"


def test_dashboard_provisioning_loads_the_dashboards_directory():
    text = PROVIDERS.read_text()
    assert re.search(r"^apiVersion: 1$", text, flags=re.M)
    assert re.search(r"^\s+type: file$", text, flags=re.M)
    assert re.search(r"^\s+path: /\S+$", text, flags=re.M)
    assert list(DASHBOARD.parent.glob("*.json")) == [DASHBOARD]


def test_every_panel_and_target_uses_the_provisioned_datasource():
    uid = provisioned_uid()
    board = dashboard()
    assert board["uid"] == "dpstream" and board["title"]
    for variable in board["templating"]["list"]:
        assert variable["datasource"] == {"type": "prometheus", "uid": uid}, variable["name"]
    panels = graph_panels()
    assert len(panels) >= 20
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"])["uid"] == uid, panel["title"]


def test_panels_have_unique_ids_titles_and_non_overlapping_places():
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in graph_panels()]
    assert len(titles) == len(set(titles))
    cells = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in graph_panels():
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_the_dashboard_shows_what_the_issue_asks_for():
    exprs = " ".join(expr for _t, _r, expr in panel_queries({}))
    for needle in ("dpstream_privacy_spent", "dpstream_privacy_remaining:min",
                   "dpstream_privacy_spent:deriv1h", "dpstream_privacy_exhaustion_seconds",
                   "dpstream_releases_total", "dpstream_refused_releases_total",
                   "dpstream_hard_queries", "dpstream_bottom_answers_total",
                   "dpstream_models_released_total", "dpstream_dead_letters_total",
                   "dpstream_events_total", "dpstream_step_lag_seconds", "dpstream_up",
                   "dpstream_budget_exhausted"):
        assert needle in exprs, needle
    assert all('flow=~"$flow"' in expr or "up{" in expr for _t, _r, expr in panel_queries({}))


@pytest.mark.flow
def test_every_panel_query_parses(tmp_path):
    """promtool parses each query (as a recording rule) with the variables substituted."""
    queries = panel_queries(OFFLINE_VARIABLES)
    assert not [q for q in queries if "$" in q[2]], "a template variable is left"
    rules = {"groups": [{"name": "panels", "rules": [
        {"record": f"panel:q{i}", "expr": expr} for i, (_t, _r, expr) in enumerate(queries)]}]}
    path = tmp_path / "panels.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    out = run_promtool("check", "rules", str(path), cwd=tmp_path)
    assert f"{len(queries)} rules found" in out, out
