"""The live page's assets (dpstream/web: page.html, page.css, page.js) pass their linters.

ESLint, Stylelint and html-validate come from the npm registry at the versions locked in
tools/web-lint/package-lock.json: ``npm ci`` runs once (again only when the lock file changes),
then each linter checks the package's file, and a broken copy of it, to show that it would fail.
Skipped only when node or npm is not installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools" / "web-lint"
WEB = ROOT / "dpstream" / "web"
INSTALLED = TOOLS / "node_modules" / ".installed-lock-sha256"

# linter, its configuration, the asset, a broken line added to a copy of it
LINTERS = {
    "eslint": ("eslint.config.mjs", "page.js", "\nundefinedFunction(pageState);\n"),
    "stylelint": ("stylelint.config.json", "page.css", "\nmain { colr: red; }\n"),
    "html-validate": ("htmlvalidate.json", "page.html", "\n<p id=\"status\">twice</p>\n"),
}


@pytest.fixture(scope="module")
def linters() -> Path:
    """``tools/web-lint/node_modules/.bin``, installed by ``npm ci`` if the lock file changed."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed: the page's assets cannot be linted")
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    major, minor = (int(part) for part in version.strip().lstrip("v").split(".")[:2])
    assert (major, minor) >= (18, 18), f"the linters need node >= 18.18, found {version}"
    lock = hashlib.sha256((TOOLS / "package-lock.json").read_bytes()).hexdigest()
    with open(TOOLS / "package.json", "rb") as guard:  # one npm ci at a time
        fcntl.flock(guard, fcntl.LOCK_EX)
        if not INSTALLED.exists() or INSTALLED.read_text() != lock:
            out = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=TOOLS,
                                 capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, out.stdout + out.stderr
            INSTALLED.write_text(lock)
    return TOOLS / "node_modules" / ".bin"


def lint(bin_dir: Path, linter: str, config: str, target: Path) -> subprocess.CompletedProcess[str]:
    """Run ``linter`` with its configuration in tools/web-lint on ``target`` (from its folder)."""
    return subprocess.run([str(bin_dir / linter), "--config", str(TOOLS / config), target.name],
                          cwd=target.parent, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_COLOR": "1"})


@pytest.mark.parametrize("linter", sorted(LINTERS))
def test_the_asset_passes_its_linter(linters: Path, linter: str) -> None:
    config, asset, _broken = LINTERS[linter]
    out = lint(linters, linter, config, WEB / asset)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("linter", sorted(LINTERS))
def test_the_linter_fails_a_broken_copy(linters: Path, linter: str, tmp_path: Path) -> None:
    config, asset, broken = LINTERS[linter]
    copy = tmp_path / asset
    copy.write_text((WEB / asset).read_text(encoding="utf-8") + broken, encoding="utf-8")
    out = lint(linters, linter, config, copy)
    assert out.returncode != 0, out.stdout + out.stderr
    assert asset in out.stdout + out.stderr  # it names the file it refused


def test_the_assets_are_package_files() -> None:
    """What dpstream.web serves is read from the installed package (importlib.resources)."""
    from dpstream import web

    files = resources.files("dpstream.web")
    for asset in ("page.html", "page.css", "page.js"):
        assert files.joinpath(asset).read_text(encoding="utf-8") == (WEB / asset).read_text(
            encoding="utf-8")
    page = web.LiveView(title="assets").page().decode()
    assert (WEB / "page.css").read_text(encoding="utf-8") in page
    assert (WEB / "page.js").read_text(encoding="utf-8").replace(
        "__POLL__", str(web.POLL_MILLISECONDS)) in page
    assert "__STYLE__" not in page and "__SCRIPT__" not in page and "__TITLE__" not in page
