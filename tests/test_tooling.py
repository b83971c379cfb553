"""The code meets the house tooling: ruff everywhere, mypy --strict on the whole package."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "ruff", "check", "dpstream", "flows", "tests", "tools", "bench",
     "deploy"],
    [sys.executable, "-m", "mypy"],
], ids=["ruff", "mypy"])
def test_tool_passes(command):
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
