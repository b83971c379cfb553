"""`dpstream demo`, the README's first command, shows private releases within 30 seconds."""

import os
import re
import subprocess
import sys

import pytest

from dpstream.io.broker import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_shows_releases_quickly_and_exits_cleanly():
    env = dict(os.environ, DPSTREAM_DEMO_METRICS_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-m", "dpstream.cli", "demo", "--duration", "15",
                          "--rate", "5000"], capture_output=True, text=True, timeout=120, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    first = re.search(r"first release after ([0-9.]+) s", text)
    assert first, text[-3000:]
    assert float(first.group(1)) < 30
    assert re.search(r"-- step \d+: [1-9]\d* keys admitted", text)
    assert re.search(r"page-\d{3}\s+-?[0-9.]+ ± [0-9.]+", text)
    assert "noise key fingerprint" in text
    assert "malformed records" in text
