"""The live page (`dpstream.web.LiveView`): its bounded state, its server, what a browser draws.

The browser tests run Debian's chromium headless against a real LiveView fed a deterministic
sequence, read the DOM it built (the band and line paths, the budget bars with their labels,
the alert and status rows) and decode its screenshot by hand (zlib + numpy) to check that the
plot's colours are where the data puts them. The last test runs `dpstream demo` and reads its
page.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dpstream.demo import _budget_from_metrics
from dpstream.io.broker import free_port
from dpstream.metrics import FlowMetrics
from dpstream.web import (
    BAND_Z,
    MAX_ALERTS,
    MAX_KEYS,
    MAX_POINTS,
    MAX_STATUSES,
    STATE_SCHEMA,
    LiveView,
)

ORIGIN = datetime(2024, 1, 1, tzinfo=UTC)
STEPS = 60
STD = 30.0


def window(step: int) -> dict[str, str]:
    start = ORIGIN + timedelta(seconds=step)
    iso = [t.isoformat().replace("+00:00", "Z") for t in (start, start + timedelta(seconds=1))]
    return {"start": iso[0], "end": iso[1]}


def release(key: str, step: int, value: float, std: float = STD, *, mechanism: str = "tree",
            spent: float = 1.0, budget: float = 1.0, accounting: str = "pure") -> dict[str, Any]:
    return {"schema": "dpstream.release/1", "flow": "test", "mechanism": mechanism, "key": key,
            "step": step, "window": window(step), "value": value, "std": std,
            "privacy": {"unit": "event", "accounting": accounting, "spent": spent,
                        "budget": budget, "delta": 0.0}}


def alert(key: str, step: int) -> dict[str, Any]:
    return {"schema": "dpstream.alert/1", "flow": "test", "key": key, "step": step,
            "window": window(step), "threshold": 40, "epsilon": 0.2}


def status(key: str, step: int) -> dict[str, Any]:
    return {"schema": "dpstream.status/1", "flow": "test", "status": "budget_exhausted",
            "key": key, "step": step, "window": window(step), "refused": "counter",
            "reason": "the charge would exceed the budget", "spent": 1.0, "budget": 1.0,
            "accounting": "pure"}


def rising(step: int) -> float:
    """The main key's values: a straight rise, so the line must climb left to right."""
    return 100.0 + 20.0 * step


def fed_view() -> LiveView:
    """A LiveView with the deterministic sequence the browser tests draw."""
    view = LiveView(title="dpstream test view")
    for step in range(STEPS):
        view.add_release(release("page-000", step, rising(step)))
        if step % 3 == 0:
            view.add_release(release("page-001", step, 50.0 + 3 * step, 10.0))
    view.add_alert(alert("page-000", 5))
    view.add_alert(alert("page-001", 20))
    view.set_budget([{"mechanism": "tree-laplace", "unit": "epsilon", "spent": 0.6, "budget": 1.0},
                     {"mechanism": "pmwg", "unit": "rho", "spent": 0.25, "budget": 0.5}])
    view.add_status(status("page-001", 40))
    return view


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


# -- the state ----------------------------------------------------------------------------------


def test_state_has_the_documented_shape_and_is_strict_json():
    view = fed_view()
    state = view.state()
    json.dumps(state, allow_nan=False)  # what the server sends
    assert state["schema"] == STATE_SCHEMA
    assert state["default_key"] == "page-000"  # the most releases
    assert state["key"] == "page-000" and state["key_tracked"]
    assert [p["step"] for p in state["series"]] == list(range(STEPS))
    first = state["series"][0]
    assert first == {"step": 0, "t": (ORIGIN + timedelta(seconds=1)).timestamp(),
                     "value": 100.0, "std": STD}
    assert state["band"]["z"] == BAND_Z == 1.96
    assert [k["key"] for k in state["keys"]] == ["page-000", "page-001"]
    assert state["keys"][1] == {"key": "page-001", "releases": 20, "last_step": 57,
                                "alerted": True, "exhausted": True}
    assert state["counts"] == {"releases": STEPS + 20, "alerts": 2, "statuses": 1,
                               "keys_evicted": 0, "keys_tracked": 2, "rejected": 0}
    assert state["budget"] == {"source": "metrics", "rows": [
        {"mechanism": "pmwg", "unit": "rho", "spent": 0.25, "budget": 0.5, "fraction": 0.5},
        {"mechanism": "tree-laplace", "unit": "epsilon", "spent": 0.6, "budget": 1.0,
         "fraction": 0.6}]}
    assert [(a["key"], a["step"]) for a in state["alerts"]] == [("page-000", 5), ("page-001", 20)]
    assert state["statuses"][0]["refused"] == "counter"
    assert view.state("page-001")["series"][-1] == {
        "step": 57, "t": (ORIGIN + timedelta(seconds=58)).timestamp(), "value": 221.0,
        "std": 10.0}
    unknown = view.state("page-999")
    assert unknown["key"] == "page-999" and not unknown["key_tracked"] and unknown["series"] == []


def test_empty_view_has_no_default_key():
    state = LiveView().state()
    assert state["default_key"] is None and state["key"] is None and state["series"] == []
    assert state["budget"] == {"source": None, "rows": []}


def test_points_per_key_are_bounded_to_the_latest_steps():
    view = LiveView()
    for step in range(MAX_POINTS + 50):
        view.add_release(release("k", step, float(step)))
    state = view.state()
    assert len(state["series"]) == MAX_POINTS
    assert state["series"][0]["step"] == 50 and state["series"][-1]["step"] == MAX_POINTS + 49
    assert state["keys"][0]["releases"] == MAX_POINTS + 50


def test_keys_are_bounded_evicting_the_least_recently_updated():
    view = LiveView()
    for i in range(MAX_KEYS):
        view.add_release(release(f"key-{i:04d}", 0, 1.0))
    view.add_release(release("key-0000", 1, 2.0))  # key 0 is now the most recent
    for i in range(MAX_KEYS, MAX_KEYS + 5):
        view.add_release(release(f"key-{i:04d}", 1, 1.0))
    state = view.state()
    tracked = {k["key"] for k in state["keys"]}
    assert len(tracked) == MAX_KEYS and state["counts"]["keys_evicted"] == 5
    assert "key-0000" in tracked
    assert not tracked & {f"key-{i:04d}" for i in range(1, 6)}  # the five oldest others
    assert {f"key-{i:04d}" for i in range(MAX_KEYS, MAX_KEYS + 5)} <= tracked


def test_alerts_and_statuses_are_bounded_and_replays_are_not_counted_twice():
    view = LiveView()
    for step in range(MAX_ALERTS + 30):
        view.add_alert(alert("a", step))
        view.add_status(status("s", step))
    view.add_alert(alert("a", MAX_ALERTS + 29))  # a replay of the last one
    view.add_status(status("s", MAX_STATUSES + 29))
    state = view.state()
    assert len(state["alerts"]) == MAX_ALERTS and state["alerts"][0]["step"] == 30
    assert len(state["statuses"]) == MAX_STATUSES
    assert state["counts"]["alerts"] == MAX_ALERTS + 30
    assert state["counts"]["statuses"] == MAX_STATUSES + 30


def test_a_replayed_release_replaces_and_a_late_one_is_put_in_step_order():
    view = LiveView()
    for step in (0, 1, 3):
        view.add_release(release("k", step, float(step)))
    view.add_release(release("k", 1, 1.0))  # replay: same coordinates
    view.add_release(release("k", 2, 2.0))  # arrives after step 3
    state = view.state()
    assert [p["step"] for p in state["series"]] == [0, 1, 2, 3]
    assert state["keys"][0]["releases"] == 4


def test_a_record_without_a_window_is_placed_by_its_step():
    view = LiveView()
    view.add_release({"key": "k", "step": 3, "value": 5.0, "std": 1.0})
    assert view.state()["series"] == [{"step": 3, "t": None, "value": 5.0, "std": 1.0}]


def test_malformed_records_are_counted_by_reason_never_raised_nor_echoed():
    view = LiveView()
    secret = 987654.321
    view.add_release({"key": "k", "step": 1, "value": math.nan, "std": 1.0})
    view.add_release({"key": "k", "step": True, "value": secret, "std": 1.0})
    view.add_release({"key": "k" * 1000, "step": 1, "value": secret, "std": 1.0})
    view.add_release({"key": "k", "step": 1, "value": secret, "std": -1.0})
    view.add_alert({"key": None, "step": 1})
    view.add_status({"key": "k", "step": -1})
    view.set_budget([{"mechanism": "m", "unit": "epsilon", "spent": math.inf, "budget": 1.0}])
    view.add_release([secret])
    state = view.state()
    assert state["counts"]["rejected"] == 8 and state["keys"] == [] and state["alerts"] == []
    assert state["rejected"] == {
        "release without a usable key, step, value or std": 4,
        "alert without a usable key or step": 1, "status without a usable key or step": 1,
        "budget row without a mechanism, unit, spent or budget": 1,
        "release that is not a JSON object": 1}
    assert str(secret) not in json.dumps(state) and "kkkk" not in json.dumps(state)


def test_budget_rows_come_from_the_releases_until_set():
    view = LiveView()
    view.add_release(release("a", 0, 1.0, mechanism="blt", spent=0.2, budget=0.5,
                             accounting="rho"))
    view.add_release(release("b", 0, 1.0, mechanism="blt", spent=0.3, budget=0.5,
                             accounting="rho"))
    view.add_release(release("a", 1, 1.0, mechanism="blt", spent=0.2, budget=0.5,
                             accounting="rho"))
    view.add_release(release("c", 0, 1.0, mechanism="tree", spent=1.0, budget=1.0))
    assert view.state()["budget"] == {"source": "releases", "rows": [
        {"mechanism": "blt", "unit": "rho", "spent": 0.3, "budget": 0.5, "fraction": 0.6},
        {"mechanism": "tree", "unit": "pure", "spent": 1.0, "budget": 1.0, "fraction": 1.0}]}
    view.set_budget([{"mechanism": "tree", "unit": "epsilon", "spent": 0.0, "budget": 0.0}])
    assert view.state()["budget"] == {"source": "metrics", "rows": [
        {"mechanism": "tree", "unit": "epsilon", "spent": 0.0, "budget": 0.0,
         "fraction": None}]}


def test_concurrent_writers_and_readers_lose_nothing():
    view = LiveView()
    writers, per_writer = 4, 400
    errors: list[BaseException] = []
    done = threading.Event()

    def write(w: int) -> None:
        try:
            for step in range(per_writer):
                view.add_release(release(f"w{w}", step, float(step)))
                if step % 40 == 0:
                    view.add_alert(alert(f"w{w}", step))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def read() -> None:
        try:
            while not done.is_set():
                for key in (None, "w0"):
                    state = view.state(key)
                    steps = [p["step"] for p in state["series"]]
                    assert steps == sorted(steps)
                    json.dumps(state, allow_nan=False)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    reader.join()
    assert errors == []
    state = view.state()
    assert state["counts"]["releases"] == writers * per_writer
    assert state["counts"]["alerts"] == writers * per_writer // 40
    assert all(k["releases"] == per_writer for k in state["keys"])


# -- the server ---------------------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[LiveView, str]]:
    view = fed_view()
    url = view.start()
    try:
        yield view, url
    finally:
        view.stop()


def test_server_serves_the_page_and_the_state_then_stops(served):
    view, url = served
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url)
    code, headers, page = get(url)
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert b"dpstream test view" in page
    code, headers, body = get(url + "state.json?key=page-001")
    assert code == 200 and headers["Content-Type"].startswith("application/json")
    state = json.loads(body)
    assert state["key"] == "page-001" and len(state["series"]) == 20
    assert get(url + "nothing-here")[0] == 404
    view.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_the_page_loads_nothing_from_elsewhere_and_its_csp_admits_its_own_code(served):
    view, url = served
    _, headers, raw = get(url)
    page = raw.decode()
    for needle in ("src=", "href=", "url(", "@import", "<link", "<img", "<iframe", "//cdn"):
        assert needle not in page, needle
    # The only URL in the page is the SVG namespace, which is a name, not a fetch.
    assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}
    csp = headers["Content-Security-Policy"]
    for tag in ("script", "style"):
        body = re.search(rf"<{tag}>(.*?)</{tag}>", page, re.S)
        assert body is not None
        import base64
        import hashlib
        digest = base64.b64encode(hashlib.sha256(body.group(1).encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp, tag


def test_the_server_logs_no_request_line(served, capfd):
    _, url = served
    get(url + "state.json?key=secret-page-name")
    get(url + "missing?key=secret-page-name")
    out, err = capfd.readouterr()
    assert "secret-page-name" not in out + err


def test_budget_rows_are_read_from_the_flows_metrics():
    registry = CollectorRegistry()
    metrics = FlowMetrics("demo", registry)
    metrics.set_budget("tree-laplace", "epsilon", 1.0)
    text = generate_latest(registry) + (
        b"# TYPE dpstream_privacy_spent_rho gauge\n"
        b'dpstream_privacy_spent_rho{flow="x",mechanism="blt"} 0.25\n'
        b"# TYPE dpstream_privacy_budget_rho gauge\n"
        b'dpstream_privacy_budget_rho{flow="x",mechanism="blt"} 0.5\n')

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        rows = _budget_from_metrics(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    assert rows == [{"mechanism": "blt", "unit": "rho", "spent": 0.25, "budget": 0.5},
                    {"mechanism": "tree-laplace", "unit": "epsilon", "spent": 0.0,
                     "budget": 1.0}]
    assert _budget_from_metrics(f"http://127.0.0.1:{free_port()}/metrics") == []


# -- a real browser -----------------------------------------------------------------------------


def find_chromium() -> str:
    """Debian's chromium; fails the calling test when it is not installed (never skips:
    the README's test command and ``.ci/run`` install it)."""
    found = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)
    if found is None:
        pytest.fail("chromium is not installed; install it with: apt-get install -y chromium "
                    "(the README's test command and .ci/run do this)")
    return found


def chromium(profile: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run headless chromium on ``url`` with the isolating flags; fail on a non-zero exit."""
    command = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
               "--window-size=1200,900", "--virtual-time-budget=5000", *args, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


class Dom(HTMLParser):
    """The elements of a dumped DOM: (tag, attributes, text directly inside)."""

    def __init__(self, markup: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str], list[str]]] = []
        self._open: list[int] = []
        self.feed(markup)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}, []))
        if tag not in {"meta", "br", "input", "img", "link"}:
            self._open.append(len(self.elements) - 1)

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self.elements[self._open.pop()][0] == tag:
                break

    def handle_data(self, data: str) -> None:
        if self._open:
            self.elements[self._open[-1]][2].append(data)

    def by_id(self, ident: str) -> tuple[str, dict[str, str], list[str]]:
        found = [e for e in self.elements if e[1].get("id") == ident]
        assert len(found) == 1, f"{len(found)} elements with id {ident}"
        return found[0]

    def by_class(self, name: str) -> list[tuple[str, dict[str, str], list[str]]]:
        return [e for e in self.elements if name in e[1].get("class", "").split()]

    def row_texts(self, name: str) -> list[list[str]]:
        """The cell texts of each ``tr`` of class ``name`` (a cell's button text included)."""
        rows, current = [], None
        for tag, attrs, text in self.elements:
            if tag == "tr":
                current = [] if name in attrs.get("class", "").split() else None
                if current is not None:
                    rows.append(current)
            elif current is not None and tag == "td":
                current.append("".join(text))
            elif current is not None and tag == "button" and current:
                current[-1] += "".join(text)
        return rows


def path_points(d: str) -> list[tuple[float, float]]:
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", d)]
    return list(zip(numbers[::2], numbers[1::2], strict=True))


@pytest.fixture(scope="module")
def browser_run(tmp_path_factory) -> dict[str, Any]:
    """A fed LiveView's DOM as chromium built it (default key, then page-001) and a screenshot."""
    tmp = tmp_path_factory.mktemp("browser")
    view = fed_view()
    url = view.start()
    try:
        shot = tmp / "page.png"
        chromium(tmp / "profile", url, f"--screenshot={shot}")
        dom = Dom(chromium(tmp / "profile", url, "--dump-dom").stdout)
        picked = Dom(chromium(tmp / "profile", url + "#key=page-001", "--dump-dom").stdout)
    finally:
        view.stop()
    return {"shot": shot, "dom": dom, "picked": picked}


@pytest.mark.browser
def test_browser_draws_the_count_line_inside_its_band(browser_run):
    dom: Dom = browser_run["dom"]
    body = next(e for e in dom.elements if e[0] == "body")
    assert int(body[1]["data-updates"]) >= 2  # the page polled the state more than once
    line = path_points(dom.by_id("count-line")[1]["d"])
    band = path_points(dom.by_id("count-band")[1]["d"])
    assert len(line) == STEPS and len(band) == 2 * STEPS
    upper, lower = band[:STEPS], band[STEPS:][::-1]
    xs = [x for x, _ in line]
    assert xs == sorted(xs) and xs[0] < xs[-1]
    assert all(u[0] == p[0] == w[0] for u, p, w in zip(upper, line, lower, strict=True))
    assert all(u[1] < p[1] < w[1] for u, p, w in zip(upper, line, lower, strict=True))
    assert line[0][1] > line[-1][1]  # rising values: the line climbs (SVG y grows downwards)
    # The band's half-width is 1.96 std, in the line's own pixels per count.
    pixels_per_count = (line[0][1] - line[-1][1]) / (rising(STEPS - 1) - rising(0))
    half = [(w[1] - u[1]) / 2 / pixels_per_count for u, w in zip(upper, lower, strict=True)]
    assert max(abs(h - BAND_Z * STD) for h in half) < 0.5
    assert dom.by_class("alert-marker")  # page-000's alert, on its chart
    assert "page-000" in "".join(dom.by_id("count-heading")[2])
    options = [a.get("value") for tag, a, _ in dom.elements if tag == "option"]
    assert options == ["", "page-000", "page-001"]


@pytest.mark.browser
def test_browser_draws_budget_bars_with_labels(browser_run):
    dom: Dom = browser_run["dom"]
    bars = dom.by_class("budget-bar")
    assert [b[1]["aria-label"] for b in bars] == ["pmwg: 0.25 of 0.5 ρ spent (50 %)",
                                                 "tree-laplace: 0.6 of 1 ε spent (60 %)"]
    assert [float(r[1]["width"]) for r in dom.by_class("budget-spent")] == [125.0, 150.0]
    assert "metrics" in "".join(dom.by_id("budget-source")[2])


@pytest.mark.browser
def test_browser_lists_alerts_and_budget_exhausted_statuses(browser_run):
    dom: Dom = browser_run["dom"]
    alerts = dom.row_texts("alert-row")
    assert [row[:3] for row in alerts] == [["20", "00:00:21", "page-001"],
                                          ["5", "00:00:06", "page-000"]]
    assert len(dom.by_class("alert-tick")) == 2
    assert dom.row_texts("status-row") == [["40", "page-001", "counter", "1 of 1 ε",
                                            "the charge would exceed the budget"]]
    assert "1 budget-exhausted status" in "".join(dom.by_id("status-summary")[2])


@pytest.mark.browser
def test_browser_follows_the_key_in_the_address(browser_run):
    dom: Dom = browser_run["picked"]
    assert "page-001" in "".join(dom.by_id("count-heading")[2])
    assert len(path_points(dom.by_id("count-line")[1]["d"])) == 20


def decode_png(path: Path) -> np.ndarray:
    """An 8-bit RGB or RGBA PNG as an (height, width, channels) array (filters undone by hand)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    idat = bytearray()
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IDAT":
            idat += body
        else:
            chunks[kind] = body
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert depth == 8 and colour in (2, 6) and interlace == 0
    channels = 3 if colour == 2 else 4
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(bytes(idat)), dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, row = raw[y, 0], raw[y, 1:]
        if kind == 0:
            out[y] = row
        elif kind == 1:  # Sub: a running sum per channel, modulo 256
            out[y] = np.cumsum(row.reshape(width, channels), axis=0, dtype=np.uint8).ravel()
        elif kind == 2:
            out[y] = row + previous
        else:
            out[y] = _unfilter_slow(kind, row.tolist(), previous.tolist(), channels)
        previous = out[y]
    return out.reshape(height, width, channels)


def _unfilter_slow(kind: int, row: list[int], up: list[int], bpp: int) -> list[int]:
    """Undo the Average (3) or Paeth (4) filter of one row."""
    out = [0] * len(row)
    for i, byte in enumerate(row):
        left = out[i - bpp] if i >= bpp else 0
        upper_left = up[i - bpp] if i >= bpp else 0
        if kind == 3:
            predicted = (left + up[i]) // 2
        else:
            estimate = left + up[i] - upper_left
            pa, pb, pc = abs(estimate - left), abs(estimate - up[i]), abs(estimate - upper_left)
            predicted = left if pa <= pb and pa <= pc else (up[i] if pb <= pc else upper_left)
        out[i] = (byte + predicted) & 0xFF
    return out


def colour_mask(image: np.ndarray, hex_colour: str, tolerance: int = 8) -> np.ndarray:
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    return (np.abs(image[:, :, :3].astype(np.int16) - rgb) <= tolerance).all(axis=2)


@pytest.mark.browser
def test_screenshot_shows_line_band_bars_and_alerts_where_they_belong(browser_run):
    image = decode_png(browser_run["shot"])
    assert image.shape[:2] == (900, 1200)
    line, band = colour_mask(image, "#08519c"), colour_mask(image, "#9ecae1")
    spent, alerts = colour_mask(image, "#e6550d"), colour_mask(image, "#cb181d")
    exhausted = colour_mask(image, "#fee0d2", 2)
    assert band.sum() > 5000 and line.sum() > 300, (band.sum(), line.sum())
    # The band: one dense region in the count panel (left column, upper half). Anti-aliased
    # blue text elsewhere can match its colour in a few pixels, hence the percentiles.
    by, bx = np.nonzero(band)
    x0, x1 = np.percentile(bx, [0.5, 99.5])
    y0, y1 = np.percentile(by, [0.5, 99.5])
    assert x1 < 790 and 90 < y0 and y1 < 500, (x0, x1, y0, y1)
    stray = ~((bx >= x0 - 5) & (bx <= x1 + 5) & (by >= y0 - 5) & (by <= y1 + 5))
    assert stray.sum() < 0.01 * band.sum()
    assert x1 - x0 > 500 and y1 - y0 > 150  # spread over the plot, not a dot
    # The line: inside the band's box, and at each column inside the band's vertical extent.
    ly, lx = np.nonzero(line)
    inside = (lx >= x0 - 5) & (lx <= x1 + 5) & (ly >= y0 - 10) & (ly <= y1 + 10)
    ly, lx = ly[inside], lx[inside]
    assert lx.size > 300
    for x in range(int(x0) + 20, int(x1) - 20, 40):
        column_band, column_line = by[bx == x], ly[lx == x]
        assert column_band.size and column_line.size, x
        assert column_band.min() - 3 <= column_line.mean() <= column_band.max() + 3, x
    # Rising values: the line is lower on the screen at the left than at the right.
    left, right = ly[lx < x0 + 100].mean(), ly[lx > x1 - 100].mean()
    assert left > right + 100, (left, right)
    # Budget bars in the right column: two, their orange widths as 0.5 : 0.6.
    sy, sx = np.nonzero(spent)
    assert sx.min() > 790 and sy.max() < 480
    rows = sorted(set(sy.tolist()))
    groups = [[rows[0]]]
    for y in rows[1:]:
        (groups[-1].append(y) if y - groups[-1][-1] <= 1 else groups.append([y]))
    assert len(groups) == 2, groups
    widths = [int(spent[g[len(g) // 2]].sum()) for g in groups]
    assert abs(widths[0] / widths[1] - 0.5 / 0.6) < 0.03, widths
    # Alerts drawn in red (timeline ticks and the chart's marker); the exhausted row tinted.
    assert alerts.sum() > 100
    ey, ex = np.nonzero(exhausted)
    assert exhausted.sum() > 1000 and ex.min() > 790 and ey.min() > 480


# -- the demo -----------------------------------------------------------------------------------


def wait_for(condition, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def state_of(url: str) -> dict[str, Any] | None:
    try:
        return json.loads(get(url + "state.json")[2])
    except (OSError, ValueError):
        return None


@pytest.mark.integration
@pytest.mark.slow
def test_demo_serves_the_live_page(tmp_path):
    web_port, metrics_port = free_port(), free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", DPSTREAM_DEMO_WEB_PORT=str(web_port),
               DPSTREAM_DEMO_METRICS_PORT=str(metrics_port))
    demo = subprocess.Popen([sys.executable, "-m", "dpstream.cli", "demo", "--duration", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(demo.stdout or []), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{web_port}/"
    try:
        wait_for(lambda: f"live page: {url}" in "".join(lines), 30, "the page's URL")

        def ready() -> dict[str, Any] | None:
            state = state_of(url)
            return state if state and state["series"] and state["alerts"] and (
                state["budget"]["source"] == "metrics") else None

        state = wait_for(ready, 40, "releases, alerts and metrics on the page")
        assert state["budget"]["rows"][0]["unit"] == "epsilon"
        dom = Dom(chromium(tmp_path / "profile", url, "--dump-dom").stdout)
        assert [b[1]["aria-label"].split(":")[0] for b in dom.by_class("budget-bar")] == [
            state["budget"]["rows"][0]["mechanism"]]
        assert len(path_points(dom.by_id("count-line")[1]["d"])) >= 1
        assert dom.row_texts("alert-row")
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGTERM)  # the demo stops in order on SIGTERM
        code = demo.wait(60)
        reader.join(10)
    text = "".join(lines)
    assert f"Live plots in your browser: {url}" in text, text[-3000:]
    assert code == 0, text[-3000:]
    with socket.socket() as sock:  # the page is gone with the demo
        assert sock.connect_ex(("127.0.0.1", web_port)) != 0
