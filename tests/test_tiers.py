"""The suite's tiers (tests/support/tiers.py): one tier a test, and a fast tier that stays fast."""

import os
import textwrap
from pathlib import Path

import pytest

PLUGIN = "support.tiers"

# each check runs a small suite in its own pytest process (the tiers' state is per process)
pytestmark = pytest.mark.flow


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get(
        "PYTHONPATH")])))
    pytester.makeconftest(f'pytest_plugins = ["{PLUGIN}"]')
    pytester.makepyfile(test_sample=textwrap.dedent('''
        import subprocess, sys
        import pytest

        def test_pure():
            assert sum(range(4)) == 6

        def test_starts_a_process():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        @pytest.mark.flow
        def test_starts_a_process_in_the_flow_tier():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_builds_a_dataflow():
            from bytewax.dataflow import Dataflow
            Dataflow("x")

        @pytest.mark.statistical
        def test_many_draws():
            assert True

        @pytest.mark.integration
        def test_an_older_marker():
            assert True
    '''))
    return pytester


def test_a_fast_test_that_starts_a_process_or_builds_a_dataflow_fails_naming_its_tier(suite):
    result = suite.runpytest_subprocess("-q", "-m", "fast", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2, deselected=3)
    result.stdout.fnmatch_lines([
        "*test_starts_a_process is in the fast tier but starts a process*mark it flow*",
        "*test_builds_a_dataflow is in the fast tier but builds a Bytewax dataflow*",
    ])


def test_every_test_has_one_tier_and_the_tiers_partition_the_suite(suite):
    counts = {}
    for tier in ("fast", "statistical", "flow", "broker", "browser", "soak"):
        result = suite.runpytest_subprocess("-q", "--collect-only", "-m", tier,
                                            "-p", "no:cacheprovider")
        counts[tier] = sum(1 for line in result.outlines if "::" in line)
    assert counts == {"fast": 3, "statistical": 1, "flow": 1, "broker": 1, "browser": 0,
                      "soak": 0}


def test_a_test_with_two_tiers_is_a_usage_error(suite):
    suite.makepyfile(test_two=textwrap.dedent('''
        import pytest

        @pytest.mark.fast
        @pytest.mark.flow
        def test_both():
            pass
    '''))
    result = suite.runpytest_subprocess("-q", "test_two.py", "-p", "no:cacheprovider")
    assert result.ret != 0
    assert "carries several tiers (fast, flow)" in result.stderr.str() + result.stdout.str()
