"""A real Prometheus server (the Debian ``prometheus`` binary) for integration tests.

`PrometheusServer` writes a config that scrapes the given ``host:port`` targets every second,
starts Prometheus on a free loopback port with its TSDB in a temporary directory, and answers
PromQL queries through the HTTP API, so tests check metrics the way a dashboard would see them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import pytest

from dpstream.io.broker import free_port

__all__ = [
    "PrometheusServer",
    "Sample",
    "close_to",
    "find_prometheus",
    "find_promtool",
    "render_config",
]

Sample = tuple[dict[str, str], float]
"""One element of a query result: the series' labels and its value."""

_PORT_ATTEMPTS = 3


def _find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found is None and os.access(f"/usr/bin/{name}", os.X_OK):
        found = f"/usr/bin/{name}"
    return found


def find_prometheus() -> str:
    """Path of the ``prometheus`` binary; skips the calling test if it is not installed."""
    found = _find_tool("prometheus")
    if found is None:
        pytest.skip(
            "the 'prometheus' binary is not installed (neither on PATH nor /usr/bin/prometheus); "
            "install it with: apt-get install -y prometheus  (.ci/run does this)"
        )
    return found


def find_promtool() -> str:
    """Path of the ``promtool`` binary; skips the calling test if it is not installed."""
    found = _find_tool("promtool")
    if found is None:
        pytest.skip(
            "the 'promtool' binary is not installed (it comes with the Debian 'prometheus' "
            "package): apt-get install -y prometheus"
        )
    return found


def render_config(
    targets: Sequence[str], scrape_interval: str = "1s", job: str = "dpstream"
) -> str:
    """Return a Prometheus YAML config scraping ``targets`` (``host:port``) every interval."""
    for target in targets:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"scrape target must look like 'host:port', got {target!r}")
    # JSON strings are valid YAML scalars, which keeps quoting right without a YAML library.
    lines = [
        "global:",
        f"  scrape_interval: {json.dumps(scrape_interval)}",
        f"  evaluation_interval: {json.dumps(scrape_interval)}",
        "scrape_configs:",
        f"  - job_name: {json.dumps(job)}",
        f"    scrape_interval: {json.dumps(scrape_interval)}",
        f"    scrape_timeout: {json.dumps(scrape_interval)}",
        "    static_configs:",
        f"      - targets: {json.dumps(list(targets))}",
    ]
    return "\n".join(lines) + "\n"


class PrometheusServer:
    """Prometheus scraping ``targets`` every ``scrape_interval``, on a free loopback port.

    Args:
        targets: ``host:port`` endpoints serving ``/metrics``.
        scrape_interval: Prometheus duration, also used as scrape timeout.
        workdir: Directory for the config, the TSDB and the log; default: a fresh temp directory
            (removed by `stop`).
        start_timeout: Seconds to wait for ``/-/ready``.
    """

    def __init__(
        self,
        targets: Sequence[str],
        *,
        scrape_interval: str = "1s",
        workdir: str | os.PathLike[str] | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        if isinstance(targets, str):
            raise TypeError("targets must be a sequence of 'host:port' strings, not one string")
        self.targets = list(targets)
        self.config_text = render_config(self.targets, scrape_interval)
        self._user_workdir = Path(workdir) if workdir is not None else None
        self._start_timeout = start_timeout
        self.workdir: Path | None = None
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- paths / urls -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the running server, e.g. ``http://127.0.0.1:41234``."""
        if self.port is None:
            raise RuntimeError("Prometheus is not running; call start() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        """Where the generated config is written (exists once `write_config` or `start` ran)."""
        if self.workdir is None:
            self.workdir = self._make_workdir()
        return self.workdir / "prometheus.yml"

    @property
    def log_path(self) -> Path:
        """Prometheus' combined stdout/stderr log."""
        return self.config_path.parent / "prometheus.log"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, else ``None``."""
        return self._proc.pid if self._proc is not None else None

    def _make_workdir(self) -> Path:
        if self._user_workdir is not None:
            self._user_workdir.mkdir(parents=True, exist_ok=True)
            return self._user_workdir
        return Path(tempfile.mkdtemp(prefix="dpstream-prometheus-"))

    def write_config(self) -> Path:
        """Write the generated config file and return its path."""
        path = self.config_path
        path.write_text(self.config_text)
        return path

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> PrometheusServer:
        """Start Prometheus and wait until ``/-/ready`` answers 200."""
        if self._proc is not None:
            raise RuntimeError(f"Prometheus is already running (pid {self._proc.pid})")
        binary = find_prometheus()
        config = self.write_config()
        assert self.workdir is not None
        began = time.monotonic()
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            port = free_port()
            self._log = open(self.log_path, "ab")  # closed in stop()
            self._proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
            self.port = port
            problem = self._await_ready(began + self._start_timeout)
            if problem is None:
                return self
            exited = self._proc.poll() is not None
            self._terminate()
            if exited and attempt < _PORT_ATTEMPTS:
                continue  # probably lost the race for the port
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"Prometheus {problem} (log {self.log_path}):\n{tail}")
        raise AssertionError("unreachable")  # pragma: no cover

    def _await_ready(self, deadline: float) -> str | None:
        assert self._proc is not None
        while True:
            if self._proc.poll() is not None:
                return f"exited with status {self._proc.returncode} during start-up"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as reply:
                    if reply.status == 200:
                        return None
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                return f"was not ready on {self.url} within {self._start_timeout} s"
            time.sleep(0.1)

    def _terminate(self) -> None:
        proc, self._proc, self.port = self._proc, None, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """Stop Prometheus (SIGTERM, then SIGKILL) and remove a temporary workdir. Idempotent."""
        self._terminate()
        if self.workdir is not None and self._user_workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- queries ----------------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>`` and return the ``data`` member; raise on an API error."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:  # 400/422 carry a JSON error body
            detail = exc.read().decode(errors="replace")
            raise RuntimeError(f"Prometheus API {path} failed ({exc.code}): {detail}") from exc
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus API {path} failed: {body}")
        return body["data"]

    def query(self, promql: str) -> list[Sample]:
        """Evaluate an instant PromQL query; return ``[(labels, value), ...]``.

        A scalar result is returned as ``[({}, value)]``; range-vector (matrix) results are
        rejected, use an instant-vector expression instead.
        """
        data = self.api("query", query=promql)
        kind, result = data["resultType"], data["result"]
        if kind == "vector":
            return [(dict(item["metric"]), float(item["value"][1])) for item in result]
        if kind == "scalar":
            return [({}, float(result[1]))]
        raise ValueError(f"query {promql!r} returned a {kind}, expected an instant vector")

    def targets_health(self) -> list[tuple[str, str, str]]:
        """``(scrapeUrl, health, lastError)`` of every active target."""
        data = self.api("targets", state="active")
        return [(t["scrapeUrl"], t["health"], t["lastError"]) for t in data["activeTargets"]]

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[list[Sample]], bool] = bool,
        timeout: float = 30.0,
        interval: float = 0.25,
    ) -> list[Sample]:
        """Poll ``promql`` until ``predicate(result)`` is true and return that result.

        Raises:
            AssertionError: not satisfied within ``timeout`` seconds; the message shows the last
                result (or query error) and the targets' scrape health.
        """
        deadline = time.monotonic() + timeout
        last: list[Sample] | str = "no query ran"
        while True:
            try:
                result = self.query(promql)
            except (RuntimeError, urllib.error.URLError, OSError) as exc:
                last = f"query error: {exc}"
            else:
                if predicate(result):
                    return result
                last = result
            if time.monotonic() >= deadline:
                break
            time.sleep(interval)
        try:
            health: object = self.targets_health()
        except Exception as exc:  # only decorates the failure message
            health = f"unavailable ({exc})"
        raise AssertionError(
            f"PromQL {promql!r} did not satisfy the predicate within {timeout} s; "
            f"last result: {last}; targets: {health}"
        )


def close_to(expected: float, rel: float = 1e-9) -> Callable[[list[Sample]], bool]:
    """Predicate for `PrometheusServer.wait_for`: exactly one series whose value ~= expected."""

    def check(result: list[Sample]) -> bool:
        return len(result) == 1 and math.isclose(result[0][1], expected, rel_tol=rel)

    return check
