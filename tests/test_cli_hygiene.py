"""The small operator points of issue 22, item 11: each one a regression test.

The recovery store made and kept private by `dpstream run`, a one-line error instead of
Bytewax's NoPartitionsError, Ctrl-C's exit status, a closed stdout pipe, `tail --timeout`,
plain `--help`, refused nonsensical demo arguments, the "new flow instance" line only for a new
instance, kafka-python's "blocking the event loop" diagnostic kept out of the output, and the
Python range Bytewax installs on.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import metadata
from pathlib import Path

import pytest

from dpstream.cli import main

ROOT = Path(__file__).parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


# --- requires-python -------------------------------------------------------------------------

def test_requires_python_stops_where_bytewax_wheels_stop():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bound = project["requires-python"]
    versions = [tuple(map(int, c.rsplit(" ", 1)[1].split("."))) for c in
                metadata("bytewax").get_all("Classifier") or ()
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    newest = max(versions)  # 0.21.1: (3, 12); it has no wheels (and no sdist build) past it
    assert bound == f">=3.11,<{newest[0]}.{newest[1] + 1}", bound
