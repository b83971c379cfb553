"""The baselines' own Python environments (their pins clash with dpstream's; never imported).

A bench runs a baseline library (PipelineDP, diffprivlib) in a virtual environment built from
its pinned requirements file under ``bench/baselines/``, once: the environment keeps a copy of
the requirements it was built from and is rebuilt when they change.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path


def baseline_python(where: Path, requirements: Path, name: str) -> Path:
    """The interpreter of ``name``'s environment in ``where``, built from ``requirements``
    (pip, PyPI) when missing or built from other requirements."""
    python = where / "bin" / "python"
    stamp = where / "requirements.txt"
    wanted = requirements.read_text()
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"creating the {name} environment in {where} ...", file=sys.stderr, flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(requirements)],
                   check=True)
    stamp.write_text(wanted)
    return python


def installed_versions(python: Path, *distributions: str) -> str:
    """The versions of ``distributions`` in the environment of ``python``, space-separated."""
    names = ", ".join(f"version({d!r})" for d in distributions)
    out = subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                          f"print({names})"], capture_output=True, text=True, check=True)
    return out.stdout.strip()
