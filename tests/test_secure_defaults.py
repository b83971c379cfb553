"""Issue 22 item 10: exact counts stay home by default; check-config prints what releases carry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from bytewax.testing import TestingSink, TestingSource, run_main
from prometheus_client import CollectorRegistry
from support.messages import message

from dpstream import runner
from dpstream.cli import main
from dpstream.core.noise.keys import NoiseKey
from dpstream.metrics import FlowMetrics
from dpstream.platform import build_flow, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "counters.example.toml"
ORIGIN = 1_790_000_000  # 2026-09-21T14:13:20Z


def test_exact_counts_are_off_and_metrics_bind_this_host_by_default():
    config = parse_config({"flow": {"origin": "2026-09-21T14:13:20Z"},
                           "admission": {"mode": "declared", "keys": ["a"]}})
    assert config.metrics_exact_counts is False
    assert config.metrics_host == "127.0.0.1"
    example = load_config(EXAMPLE, environ={})
    assert example.metrics_exact_counts is False
    assert example.metrics_host == "127.0.0.1"
    opened = load_config(EXAMPLE, environ={"DPSTREAM_METRICS_HOST": "0.0.0.0"})
    assert opened.metrics_host == "0.0.0.0"


def test_the_metrics_endpoint_binds_the_configured_host(monkeypatch):
    seen = {}

    def fake_server(port, addr, registry):
        seen.update(port=port, addr=addr)

    monkeypatch.setattr("dpstream.metrics.start_http_server", fake_server)
    monkeypatch.setattr(runner, "process_id", lambda: 0)
    metrics = FlowMetrics("f", CollectorRegistry())
    runner.serve_metrics(metrics, 9999)
    assert seen == {"port": 9999, "addr": "127.0.0.1"}
    runner.serve_metrics(metrics, 9999, "0.0.0.0")
    assert seen["addr"] == "0.0.0.0"


def test_the_progress_line_carries_exact_counts_only_when_they_are_on():
    metrics = FlowMetrics("f", CollectorRegistry(), exact_counts=True)
    metrics.observe_input("events", 1234)
    metrics.observe_input("dead_letter:invalid JSON", 7)
    quiet = runner.progress_line(metrics.registry, exact_counts=False)
    assert "1234" not in quiet and "events" not in quiet and "dead letters" not in quiet
    loud = runner.progress_line(metrics.registry, exact_counts=True)
    assert "1234 events" in loud and "7 dead letters" in loud


def test_the_container_and_kubernetes_files_open_the_endpoint_explicitly():
    assert "DPSTREAM_METRICS_HOST=0.0.0.0" in (ROOT / "deploy/container/Dockerfile").read_text()
    assert "DPSTREAM_METRICS_HOST: 0.0.0.0" in (ROOT / "deploy/compose/compose.yaml").read_text()
    assert '"DPSTREAM_METRICS_HOST": "0.0.0.0"' in (ROOT / "deploy/k8s/render.py").read_text()


def _zcdp_open(delta: float):
    return parse_config({
        "flow": {"name": "z", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 2},
        "privacy": {"accounting": "zcdp", "budget": 1.0, "delta": delta},
        "admission": {"mode": "open", "initial_rho": 0.2},
        "monitor": {"epsilon": 0.5, "horizon": 100},
        "counter": {"rho": 0.25, "horizon": 256},
        "metrics": {"port": 0},
    })


@pytest.mark.flow
@pytest.mark.parametrize("accounting", ["zcdp", "pure"])
def test_check_config_prints_the_epsilon_delta_every_release_carries(tmp_path, capsys,
                                                                      accounting):
    if accounting == "zcdp":
        config = _zcdp_open(0.05)
        text = ('[privacy]\naccounting = "zcdp"\nbudget = 1.0\ndelta = 0.05\n'
                '[admission]\nmode = "open"\ninitial_rho = 0.2\n'
                '[monitor]\nepsilon = 0.5\nhorizon = 100\n[counter]\nrho = 0.25\nhorizon = 256\n')
    else:
        config = parse_config({
            "flow": {"name": "z", "origin": "2026-09-21T14:13:20Z", "step": "1s", "shards": 2},
            "privacy": {"accounting": "pure", "budget": 1.0, "delta": 1e-3},
            "admission": {"mode": "open"}, "monitor": {"epsilon": 0.2, "horizon": 100},
            "counter": {"epsilon": 0.5}, "metrics": {"port": 0}})
        text = ('[privacy]\naccounting = "pure"\nbudget = 1.0\ndelta = 1e-3\n'
                '[admission]\nmode = "open"\n[monitor]\nepsilon = 0.2\nhorizon = 100\n'
                '[counter]\nepsilon = 0.5\n')
    path = tmp_path / "z.toml"
    path.write_text('[flow]\nname = "z"\norigin = "2026-09-21T14:13:20Z"\nstep = "1s"\n'
                    'shards = 2\n[metrics]\nport = 0\n' + text)
    assert main(["check-config", str(path)]) == 0
    printed = capsys.readouterr().out
    match = re.search(r"as \(epsilon, delta\): \(([0-9.e+-]+), ([0-9.e+-]+)\) per key", printed)
    assert match, printed
    eps, delta = float(match.group(1)), float(match.group(2))
    # a release of an admitted key, through the whole flow
    threshold = config.privacy.monitor.threshold
    items = [message(0, "hot", ORIGIN + step + i / (4 * threshold), step * 10**4 + i)
             for step in range(12) for i in range(4 * threshold)]
    sink: list = []
    flow = build_flow(config, NoiseKey.for_tests(5), instance="z-1", partitions=1,
                      source=TestingSource(items, 500), sink=TestingSink(sink))
    run_main(flow)
    releases = [json.loads(v) for role, _k, v in sink if role == "releases"]
    assert releases
    privacy = releases[-1]["privacy"]
    if accounting == "zcdp":
        carried = privacy["approx_dp"]["epsilon"], privacy["approx_dp"]["delta"]
        assert carried[1] > 0.05  # the admission delta is in it
    else:
        carried = privacy["spent"], privacy["delta"]
    assert f"{carried[0]:.4g}" == f"{eps:.4g}"
    assert f"{carried[1]:.3g}" == f"{delta:.3g}"
    assert config.release_epsilon_delta() == pytest.approx(carried, rel=1e-12)
