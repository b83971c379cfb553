"""Running a flow as `dpstream run` in a child process, for the real-broker tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest


def iso(seconds: int) -> str:
    """Unix seconds as an ISO-8601 UTC time (for a configuration's origin)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def start_flow(config: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    """Start `dpstream run --config`; ephemeral unless a recovery directory is given."""
    if "--recovery-dir" not in args:
        args = (*args, "--ephemeral")
    return subprocess.Popen([sys.executable, "-m", "dpstream.cli", "run", "--config",
                             str(config), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    """Wait for a bounded run; it must exit 0 with no traceback or panic. Returns its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the flow did not finish within {timeout} s:\n"
                    f"{out.decode(errors='replace')[-3000:]}")
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "Traceback" not in text and "panicked" not in text, text[-3000:]
    return text
