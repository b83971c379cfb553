"""A live web page of a flow's releases, alerts and privacy budget, for people without Grafana.

:class:`LiveView` keeps a small, bounded picture of what a flow published and serves it from
a standard-library HTTP server in a daemon thread:

* ``GET /`` -- one self-contained HTML page (inline CSS and JavaScript, no external resource:
  it works on a machine without internet). A Content-Security-Policy with the hashes of the
  inline script and style forbids loading anything from elsewhere.
* ``GET /state.json`` (``?key=K`` chooses the key whose series is sent) -- the current state;
  the page fetches it every second and draws by hand in SVG:

  (a) the chosen key's private count against time (the end of each step's event-time window;
      the step number when a record has no window), with an error band of
      ``value ± 1.96·std``. ``std`` is the analytic standard deviation of the noise that the
      release reports, so the band is a 95 % interval for Gaussian noise (zCDP's discrete
      Gaussian) and about 94 % for a single Laplace draw (the tree's sums of several discrete
      Laplace draws lie in between). A key picker chooses the key; by default the page follows
      the key with the most releases (ties: the key seen first);
  (b) the privacy budget spent per mechanism: bars of spent against budget in the ledger's unit
      (ε for pure accounting, ρ for zCDP). The rows come from :meth:`LiveView.set_budget`
      (e.g. the flow's metrics) once it was called, else from the releases' ``privacy`` fields
      (per mechanism and unit, the largest spend of any key and its budget: what
      ``dpstream_privacy_spent`` shows);
  (c) the monitor alerts (a timeline and a table of step, window end and key) and the
      budget-exhausted status records (keys that stop releasing).

**Bounded memory.** At most :data:`MAX_KEYS` keys are tracked, each with its last
:data:`MAX_POINTS` releases; a new key beyond the cap evicts the key updated least recently.
The last :data:`MAX_ALERTS` alerts and :data:`MAX_STATUSES` statuses are kept, and at most
:data:`MAX_MECHANISMS` budget rows. Keys longer than :data:`MAX_KEY_LENGTH` characters are
rejected. The page shows the caps.

**Bad records** are counted by reason (``rejected`` in the state and on the page), never
raised and never logged with their contents.

**Privacy.** The page shows what the releases and alerts topics publish, to whoever can open
it: serve it where that topic's audience is (the default address is 127.0.0.1). The HTTP server
logs nothing (request lines name keys), and no error message carries a released value.

**Thread safety.** Every method may be called from any thread; one lock guards the state.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from dpstream.errors import DpstreamError

__all__ = [
    "BAND_Z",
    "MAX_ALERTS",
    "MAX_KEYS",
    "MAX_KEY_LENGTH",
    "MAX_MECHANISMS",
    "MAX_POINTS",
    "MAX_STATUSES",
    "STATE_SCHEMA",
    "LiveView",
]

MAX_KEYS: Final = 200
"""Keys tracked at once; a new key beyond this evicts the key updated least recently."""
MAX_POINTS: Final = 500
"""Releases kept per key (the latest steps)."""
MAX_ALERTS: Final = 200
"""Alerts kept (the latest)."""
MAX_STATUSES: Final = 200
"""Budget-exhausted statuses kept (the latest)."""
MAX_MECHANISMS: Final = 32
"""Budget rows kept (one per mechanism and unit)."""
MAX_KEY_LENGTH: Final = 256
"""Longer keys are rejected (they would make the memory bound meaningless)."""
BAND_Z: Final = 1.96
"""Half-width of the error band in noise standard deviations (95 % for Gaussian noise)."""
STATE_SCHEMA: Final = "dpstream.liveview/1"
POLL_MILLISECONDS: Final = 1000


# -- the state ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Point:
    """One release of a key: its step, window end (Unix seconds, if known), value and std."""

    step: int
    t: float | None
    value: float
    std: float


@dataclass(slots=True)
class _Series:
    """A tracked key: its latest releases and what the key list shows about it."""

    first_seen: int
    points: list[_Point] = field(default_factory=list)
    releases: int = 0
    exhausted: bool = False


def _number(value: object) -> float | None:
    """``value`` as a finite float, or None (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _step(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _key(value: object) -> str | None:
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_LENGTH:
        return None
    return value


def _window_end(record: dict[str, Any]) -> float | None:
    """The end of a record's window (``{"start", "end"}`` or ``[start, end]``), Unix seconds."""
    window = record.get("window")
    end = window.get("end") if isinstance(window, dict) else (
        window[1] if isinstance(window, list | tuple) and len(window) == 2 else None)
    if not isinstance(end, str):
        return None
    try:
        return datetime.fromisoformat(end).timestamp()
    except ValueError:
        return None


def _text(value: object, limit: int = 200) -> str:
    """A short display string of a field the flow fills from its configuration."""
    return str(value)[:limit] if value is not None else ""


class LiveView:
    """A live page of a flow's releases, alerts, statuses and budget (see the module doc).

    Args:
        host: address to serve on (127.0.0.1: this machine only).
        port: TCP port; 0 picks a free one (:meth:`start` returns the URL).
        title: the page's title.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, title: str = "dpstream") -> None:
        if not 0 <= port <= 65535:
            raise DpstreamError(f"the live view's port must be in 0..65535, got {port}")
        self.host, self.port, self.title = host, port, title
        self._lock = threading.Lock()
        self._series: OrderedDict[str, _Series] = OrderedDict()  # least recently updated first
        self._seen = 0
        self._alerts: deque[dict[str, Any]] = deque(maxlen=MAX_ALERTS)
        self._statuses: deque[dict[str, Any]] = deque(maxlen=MAX_STATUSES)
        self._alerted: set[str] = set()  # keys of the kept alerts
        self._derived_budget: dict[tuple[str, str], tuple[float, float]] = {}
        self._set_budget: list[dict[str, Any]] | None = None
        self._counts: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._page = _page(title)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- feeding it ---------------------------------------------------------------------------

    def add_release(self, record: dict[str, Any]) -> None:
        """Take a decoded ``dpstream.release/1`` body (a dict as on the releases topic)."""
        if not isinstance(record, dict):
            return self._reject("release that is not a JSON object")
        key, step = _key(record.get("key")), _step(record.get("step"))
        value, std = _number(record.get("value")), _number(record.get("std"))
        if key is None or step is None or value is None or std is None or std < 0:
            return self._reject("release without a usable key, step, value or std")
        point = _Point(step, _window_end(record), value, std)
        privacy = record.get("privacy")
        with self._lock:
            self._counts["releases"] += 1
            self._add_point(key, point)
            if isinstance(privacy, dict):
                self._derive_budget(record.get("mechanism"), privacy)
        return None

    def add_alert(self, record: dict[str, Any]) -> None:
        """Take a decoded ``dpstream.alert/1`` body."""
        if not isinstance(record, dict):
            return self._reject("alert that is not a JSON object")
        key, step = _key(record.get("key")), _step(record.get("step"))
        if key is None or step is None:
            return self._reject("alert without a usable key or step")
        alert = {"key": key, "step": step, "t": _window_end(record),
                 "threshold": _number(record.get("threshold")),
                 "epsilon": _number(record.get("epsilon"))}
        with self._lock:
            if any(a["key"] == key and a["step"] == step for a in self._alerts):
                return None  # a replayed alert
            self._counts["alerts"] += 1
            self._alerts.append(alert)
            self._alerted = {a["key"] for a in self._alerts}
        return None

    def add_status(self, record: dict[str, Any]) -> None:
        """Take a decoded ``dpstream.status/1`` body (a key's budget is exhausted)."""
        if not isinstance(record, dict):
            return self._reject("status that is not a JSON object")
        key, step = _key(record.get("key")), _step(record.get("step"))
        if key is None or step is None:
            return self._reject("status without a usable key or step")
        status = {"key": key, "step": step, "t": _window_end(record),
                  "status": _text(record.get("status")), "refused": _text(record.get("refused")),
                  "reason": _text(record.get("reason"), 400),
                  "spent": _number(record.get("spent")), "budget": _number(record.get("budget")),
                  "unit": _text(record.get("accounting"))}
        with self._lock:
            if any(s["key"] == key and s["step"] == step for s in self._statuses):
                return None  # a replayed status
            self._counts["statuses"] += 1
            self._statuses.append(status)
            if key in self._series:
                self._series[key].exhausted = True
        return None

    def set_budget(self, rows: list[dict[str, Any]]) -> None:
        """Show these budget rows (``{"mechanism", "unit", "spent", "budget"}``, e.g. from metrics).

        Replaces the rows of the previous call; from the first call on, the rows derived from
        the releases are no longer shown.
        """
        kept: list[dict[str, Any]] = []
        for row in rows:
            spent, budget = _number(row.get("spent")), _number(row.get("budget"))
            mechanism, unit = row.get("mechanism"), row.get("unit")
            if (not isinstance(mechanism, str) or not isinstance(unit, str) or spent is None
                    or budget is None or spent < 0 or budget < 0):
                self._reject("budget row without a mechanism, unit, spent or budget")
                continue
            kept.append({"mechanism": mechanism[:100], "unit": unit[:20], "spent": spent,
                         "budget": budget})
        kept.sort(key=lambda r: (r["mechanism"], r["unit"]))
        with self._lock:
            self._set_budget = kept[:MAX_MECHANISMS]

    def _reject(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    def _add_point(self, key: str, point: _Point) -> None:
        """Store a release under the lock: replace a replayed step, keep steps in order."""
        series = self._series.get(key)
        if series is None:
            if len(self._series) >= MAX_KEYS:
                self._series.popitem(last=False)
                self._counts["keys_evicted"] += 1
            self._seen += 1
            series = self._series[key] = _Series(first_seen=self._seen)
        self._series.move_to_end(key)
        points = series.points
        if points and point.step <= points[-1].step:
            index = next(i for i, p in enumerate(points) if p.step >= point.step)
            if points[index].step == point.step:
                points[index] = point  # a replay: the same release again
                return
            points.insert(index, point)
        else:
            points.append(point)
        series.releases += 1
        if len(points) > MAX_POINTS:
            del points[: len(points) - MAX_POINTS]

    def _derive_budget(self, mechanism: object, privacy: dict[str, Any]) -> None:
        spent, budget = _number(privacy.get("spent")), _number(privacy.get("budget"))
        unit = privacy.get("accounting")
        if not isinstance(mechanism, str) or not isinstance(unit, str) or spent is None \
                or budget is None:
            return
        slot = (mechanism[:100], unit[:20])
        if slot not in self._derived_budget and len(self._derived_budget) >= MAX_MECHANISMS:
            return
        old_spent, _ = self._derived_budget.get(slot, (-math.inf, 0.0))
        if spent >= old_spent:
            self._derived_budget[slot] = (spent, budget)

    # -- reading it ---------------------------------------------------------------------------

    def state(self, key: str | None = None) -> dict[str, Any]:
        """The page's state as JSON-ready data; ``key`` chooses the series (default: see doc)."""
        with self._lock:
            order = sorted(self._series.items(),
                           key=lambda item: (-item[1].releases, item[1].first_seen))
            keys = [{"key": k, "releases": s.releases,
                     "last_step": s.points[-1].step if s.points else None,
                     "alerted": k in self._alerted, "exhausted": s.exhausted}
                    for k, s in order]
            default = order[0][0] if order else None
            chosen = key if key else default
            series = self._series.get(chosen) if chosen is not None else None
            points = [{"step": p.step, "t": p.t, "value": p.value, "std": p.std}
                      for p in (series.points if series else [])]
            budget = self._budget_rows()
            alerts, statuses = list(self._alerts), list(self._statuses)
            counts = {name: self._counts[name]
                      for name in ("releases", "alerts", "statuses", "keys_evicted")}
            rejected = dict(self._rejected)
        return {
            "schema": STATE_SCHEMA, "title": self.title,
            "generated": datetime.now().timestamp(),
            "limits": {"keys": MAX_KEYS, "points_per_key": MAX_POINTS, "alerts": MAX_ALERTS,
                       "statuses": MAX_STATUSES, "mechanisms": MAX_MECHANISMS},
            "band": {"z": BAND_Z, "label": "value ± 1.96·std (95 % for Gaussian noise)"},
            "counts": {**counts, "keys_tracked": len(keys), "rejected": sum(rejected.values())},
            "rejected": rejected,
            "keys": keys,
            "default_key": default,
            "key": chosen, "key_tracked": series is not None, "series": points,
            "budget": budget, "alerts": alerts, "statuses": statuses,
        }

    def _budget_rows(self) -> dict[str, Any]:
        """The budget rows to show (under the lock): the set ones, else those from releases."""
        source: str | None
        if self._set_budget is not None:
            source, rows = "metrics", [dict(r) for r in self._set_budget]
        else:
            source = "releases" if self._derived_budget else None
            rows = [{"mechanism": m, "unit": u, "spent": s, "budget": b}
                    for (m, u), (s, b) in sorted(self._derived_budget.items())]
        for row in rows:
            row["fraction"] = row["spent"] / row["budget"] if row["budget"] > 0 else None
        return {"source": source, "rows": rows}

    # -- serving it ---------------------------------------------------------------------------

    def start(self) -> str:
        """Start serving in a daemon thread (once); return the page's URL."""
        if self._server is None:
            handler = type("_BoundHandler", (_Handler,), {"view": self})
            self._server = ThreadingHTTPServer((self.host, self.port), handler)
            self._server.daemon_threads = True
            self._thread = threading.Thread(target=self._server.serve_forever,
                                            kwargs={"poll_interval": 0.2},
                                            name="dpstream-liveview", daemon=True)
            self._thread.start()
        return self.url

    @property
    def url(self) -> str:
        """The page's URL (the bound port once started)."""
        port = self._server.server_address[1] if self._server is not None else self.port
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/"

    def stop(self) -> None:
        """Stop serving (idempotent); the state is kept."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(5)

    def page(self) -> bytes:
        """The HTML page (what ``GET /`` serves)."""
        return self._page


class _Handler(BaseHTTPRequestHandler):
    """Serves the page and its state; logs nothing (request lines name keys)."""

    view: LiveView
    server_version = "dpstream-liveview"

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        """Answer ``/``, ``/state.json`` and ``/favicon.ico``; 404 otherwise."""
        url = urlsplit(self.path)
        if url.path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", self.view.page(), page=True)
        elif url.path == "/state.json":
            key = parse_qs(url.query).get("key", [""])[0] or None
            body = json.dumps(self.view.state(key), allow_nan=False, ensure_ascii=False)
            self._send(200, "application/json; charset=utf-8", body.encode())
        elif url.path == "/favicon.ico":
            self._send(204, "image/x-icon", b"")
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def _send(self, code: int, content_type: str, body: bytes, page: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        if page:
            self.send_header("Content-Security-Policy", _CSP)
        self.end_headers()
        if body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        """Log nothing: a request line can name a key."""


# -- the page -----------------------------------------------------------------------------------

_STYLE: Final = """
:root { font-family: system-ui, "DejaVu Sans", sans-serif; color: #1a1a1a; background: #fafafa; }
body { margin: 0 16px 16px; }
header { display: flex; align-items: baseline; gap: 24px; flex-wrap: wrap; }
h1 { font-size: 1.4rem; margin: 12px 0 4px; }
h2 { font-size: 1.05rem; margin: 0 0 6px; }
#intro { margin: 0; color: #404040; }
#status { margin: 0 0 8px; color: #404040; flex-basis: 100%; }
body.offline #status { color: #a50f15; font-weight: bold; }
main { display: grid; grid-template-columns: 770px minmax(300px, 1fr); gap: 12px; }
section { background: #fff; border: 1px solid #d0d0d0; border-radius: 6px; padding: 10px 12px; }
svg { display: block; width: 100%; height: auto; }
svg text { font-size: 12px; fill: #262626; }
.controls { display: flex; gap: 8px; align-items: center; margin-bottom: 4px; flex-wrap: wrap; }
#key-picker { font-size: 0.95rem; max-width: 320px; }
#latest { color: #262626; }
.note { font-size: 0.85rem; color: #404040; margin: 4px 0; }
.swatch-line { color: #08519c; font-weight: bold; }
.swatch-band { color: #3182bd; font-weight: bold; }
table { border-collapse: collapse; width: 100%; font-size: 0.85rem; }
caption { text-align: left; font-size: 0.85rem; color: #404040; padding-bottom: 2px; }
th, td { text-align: left; padding: 2px 6px; border-bottom: 1px solid #e5e5e5; }
.table-box { max-height: 190px; overflow-y: auto; }
tr.status-row td { background: #fee0d2; }
#status-summary.bad { color: #a50f15; font-weight: bold; }
button.key-link { font: inherit; border: none; background: none; color: #08519c;
  text-decoration: underline; cursor: pointer; padding: 0; }
@media (max-width: 1100px) { main { grid-template-columns: 1fr; } }
"""

_SCRIPT: Final = r"""
"use strict";
const SVG_NS = "http://www.w3.org/2000/svg";
const POLL_MS = __POLL__;
const UNITS = {pure: "ε", epsilon: "ε", eps: "ε", rho: "ρ", zcdp: "ρ"};
const C = {band: "#9ecae1", line: "#08519c", spent: "#e6550d", budget: "#d9d9d9",
           alert: "#cb181d", axis: "#737373", grid: "#ececec"};
let chosenKey = readHash();
let keySignature = null;
let timer = null;
let inFlight = false;
let updates = 0;

function readHash() {
  const m = location.hash.match(/^#key=(.*)$/);
  return m ? decodeURIComponent(m[1]) : "";
}
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}
function node(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}
function unit(u) { return UNITS[u] || u || ""; }
function fmt(x) {
  if (x === null || x === undefined) return "–";
  const a = Math.abs(x);
  if (Number.isInteger(x) && a < 1e7) return String(x);
  if (a >= 1000) return x.toFixed(0);
  if (a >= 10) return x.toFixed(1);
  if (a === 0) return "0";
  return x.toPrecision(3).replace(/\.?0+$/, "");
}
function clock(t) { return new Date(t * 1000).toISOString().slice(11, 19); }
function when(item) { return item.t === null ? "step " + item.step : clock(item.t); }
function clear(e, keep) {
  for (const child of Array.from(e.childNodes)) {
    if (!keep || !keep.includes(child.nodeName)) e.removeChild(child);
  }
}
function niceTicks(lo, hi, count, steps) {
  const span = hi - lo;
  let step = steps.find(s => span / s <= count);
  if (step === undefined) {
    const mag = Math.pow(10, Math.floor(Math.log10(span / count)));
    step = [1, 2, 5, 10].map(m => m * mag).find(s => span / s <= count);
  }
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600];

function schedule(ms) { clearTimeout(timer); timer = setTimeout(poll, ms); }
async function poll() {
  if (inFlight) return;
  inFlight = true;
  try {
    const query = chosenKey ? "?key=" + encodeURIComponent(chosenKey) : "";
    const response = await fetch("state.json" + query, {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
    document.body.classList.remove("offline");
  } catch (err) {
    document.body.classList.add("offline");
    setText("status", "No connection to the live view (" + err.message + "); retrying.");
  } finally {
    inFlight = false;
    schedule(POLL_MS);
  }
}
function setText(id, text) { document.getElementById(id).textContent = text; }

function render(state) {
  updates += 1;
  document.body.dataset.updates = String(updates);
  const c = state.counts;
  let line = "Updated " + clock(state.generated) + " UTC · " + c.keys_tracked +
    " keys tracked (at most " + state.limits.keys + ", last " + state.limits.points_per_key +
    " releases each) · " + c.releases + " releases · " + c.alerts + " alerts · " +
    "budget-exhausted statuses: " + c.statuses;
  if (c.keys_evicted) line += " · " + c.keys_evicted + " keys no longer tracked";
  if (c.rejected) line += " · " + c.rejected + " malformed records ignored";
  setText("status", line);
  renderPicker(state);
  renderCount(state);
  renderBudget(state);
  renderAlerts(state);
  renderStatuses(state);
}

function renderPicker(state) {
  const picker = document.getElementById("key-picker");
  const names = state.keys.map(k => k.key).sort();
  const signature = JSON.stringify([names, state.default_key]);
  if (signature === keySignature) return;
  keySignature = signature;
  clear(picker);
  const auto = state.default_key ? " — " + state.default_key : "";
  picker.appendChild(node("option", {value: ""}, "Most releases" + auto));
  for (const name of names) picker.appendChild(node("option", {value: name}, name));
  if (chosenKey && !names.includes(chosenKey)) {
    picker.appendChild(node("option", {value: chosenKey}, chosenKey + " (not tracked)"));
  }
  picker.value = chosenKey;
}

function chooseKey(name) {
  chosenKey = name;
  history.replaceState(null, "", name ? "#key=" + encodeURIComponent(name) : "#");
  document.getElementById("key-picker").value = name;
  schedule(0);
}

function renderCount(state) {
  const chart = document.getElementById("count-chart");
  clear(chart, ["title", "desc"]);
  const W = 760, H = 330, L = 72, R = 34, T = 14, B = 48;
  const pts = state.series;
  const name = state.key;
  document.getElementById("count-heading").textContent =
    "Private count of " + (name === null ? "a key" : "key " + name) + " over time";
  if (!pts.length) {
    const why = name === null ? "Waiting for the first release…" :
      "No releases of this key are kept (it is not tracked).";
    chart.appendChild(svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle",
                                   id: "count-empty"}, why));
    setText("count-chart-title", why);
    setText("latest", "");
    clear(document.querySelector("#series-table tbody"));
    return;
  }
  const z = state.band.z;
  const byTime = pts.every(p => p.t !== null);
  const xs = pts.map(p => byTime ? p.t : p.step);
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  let y0 = Math.min(...pts.map(p => p.value - z * p.std));
  let y1 = Math.max(...pts.map(p => p.value + z * p.std));
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.06;
  y0 -= pad; y1 += pad;
  const X = v => L + (v - x0) / (x1 - x0) * (W - L - R);
  const Y = v => T + (y1 - v) / (y1 - y0) * (H - T - B);
  const axes = svg("g", {class: "axes", "aria-hidden": "true"});
  for (const v of niceTicks(y0, y1, 6, [])) {
    axes.appendChild(svg("line", {x1: L, x2: W - R, y1: Y(v), y2: Y(v), stroke: C.grid}));
    const label = Math.abs(v) < 1e-9 * (y1 - y0) ? "0" : fmt(Number(v.toPrecision(12)));
    axes.appendChild(svg("text", {x: L - 6, y: Y(v) + 4, "text-anchor": "end"}, label));
  }
  for (const v of niceTicks(x0, x1, 7, byTime ? TIME_STEPS : [])) {
    axes.appendChild(svg("line", {x1: X(v), x2: X(v), y1: H - B, y2: H - B + 5,
                                  stroke: C.axis}));
    axes.appendChild(svg("text", {x: X(v), y: H - B + 18, "text-anchor": "middle"},
                         byTime ? clock(v) : String(Math.round(v))));
  }
  axes.appendChild(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: C.axis}));
  axes.appendChild(svg("line", {x1: L, x2: L, y1: T, y2: H - B, stroke: C.axis}));
  axes.appendChild(svg("text", {x: (L + W - R) / 2, y: H - 8, "text-anchor": "middle"},
                       byTime ? "end of the step's window (UTC)" : "step"));
  const mid = (T + H - B) / 2;
  axes.appendChild(svg("text", {x: 14, y: mid, "text-anchor": "middle",
                                transform: "rotate(-90 14 " + mid + ")"}, "private count"));
  chart.appendChild(axes);
  const at = (i, v) => X(xs[i]).toFixed(1) + " " + Y(v).toFixed(1);
  const upper = pts.map((p, i) => at(i, p.value + z * p.std));
  const lower = pts.map((p, i) => at(i, p.value - z * p.std)).reverse();
  chart.appendChild(svg("path", {id: "count-band", class: "band", fill: C.band, stroke: C.band,
                                 "stroke-width": 1,
                                 d: "M" + upper.join(" L") + " L" + lower.join(" L") + " Z"}));
  chart.appendChild(svg("path", {id: "count-line", class: "line", fill: "none", stroke: C.line,
                                 "stroke-width": 2.5, "stroke-linejoin": "round",
                                 d: "M" + pts.map((p, i) => at(i, p.value)).join(" L")}));
  for (const a of state.alerts.filter(a => a.key === name)) {
    const ax = byTime && a.t !== null ? a.t : (byTime ? null : a.step);
    if (ax === null || ax < x0 || ax > x1) continue;
    const marker = svg("line", {class: "alert-marker", x1: X(ax), x2: X(ax), y1: T, y2: H - B,
                                stroke: C.alert, "stroke-width": 1.5, "stroke-dasharray": "5 4"});
    marker.appendChild(svg("title", {}, "alert at step " + a.step));
    chart.appendChild(marker);
  }
  const widest = Math.max(...pts.map(p => 2 * z * p.std));
  if (widest < 0.03 * (y1 - y0)) {
    chart.appendChild(svg("text", {id: "count-thin-band", x: L + 8, y: T + 14},
                          "The band is thin here: the noise is small next to counts this large."));
  }
  const last = pts[pts.length - 1];
  chart.appendChild(svg("circle", {id: "count-latest", cx: X(xs[xs.length - 1]),
                                   cy: Y(last.value), r: 4, fill: C.line}));
  const lastText = "latest (" + when(last) + ", step " + last.step + "): " + fmt(last.value) +
    " ± " + fmt(z * last.std) + " (noise std " + fmt(last.std) + ")";
  setText("latest", lastText);
  setText("count-chart-title", "Private count of key " + name + ": " + pts.length +
          " releases from step " + pts[0].step + " to " + last.step + "; " + lastText);
  const body = document.querySelector("#series-table tbody");
  clear(body);
  for (const p of pts.slice(-20).reverse()) {
    const row = node("tr");
    for (const cell of [String(p.step), when(p), fmt(p.value), fmt(p.std),
                        fmt(p.value - z * p.std) + " … " + fmt(p.value + z * p.std)]) {
      row.appendChild(node("td", {}, cell));
    }
    body.appendChild(row);
  }
}

function renderBudget(state) {
  const chart = document.getElementById("budget-chart");
  clear(chart, ["title", "desc"]);
  const rows = state.budget.rows;
  const W = 380, BW = 250, ROW = 54;
  const H = Math.max(1, rows.length) * ROW + 8;
  chart.setAttribute("viewBox", "0 0 " + W + " " + H);
  const source = {metrics: "Source: the flow's metrics.",
                  releases: "Source: the releases' privacy fields (largest spend of any key)."};
  setText("budget-source", source[state.budget.source] || "No budget known yet.");
  if (!rows.length) {
    chart.appendChild(svg("text", {x: 8, y: 30}, "No budget known yet."));
    return;
  }
  rows.forEach((r, i) => {
    const y = 8 + i * ROW;
    const frac = r.fraction === null ? 0 : Math.max(0, Math.min(1, r.fraction));
    const pct = r.fraction === null ? "" : " (" + Math.round(r.fraction * 100) + " %)";
    const label = r.mechanism + ": " + fmt(r.spent) + " of " + fmt(r.budget) + " " + unit(r.unit) +
      " spent" + pct;
    const g = svg("g", {class: "budget-bar", role: "img", "aria-label": label,
                        "data-mechanism": r.mechanism, "data-fraction": frac.toFixed(4)});
    g.appendChild(svg("text", {x: 0, y: y + 12}, r.mechanism + " (" + unit(r.unit) + ")"));
    g.appendChild(svg("rect", {class: "budget-total", x: 0, y: y + 18, width: BW, height: 18,
                               fill: C.budget, stroke: C.axis}));
    g.appendChild(svg("rect", {class: "budget-spent", x: 0, y: y + 18,
                               width: (BW * frac).toFixed(1), height: 18, fill: C.spent}));
    g.appendChild(svg("text", {x: BW + 8, y: y + 32}, fmt(r.spent) + " / " + fmt(r.budget) + pct));
    chart.appendChild(g);
  });
}

function renderAlerts(state) {
  const alerts = state.alerts;
  const line = document.getElementById("alert-timeline");
  clear(line, ["title", "desc"]);
  const W = 760, H = 46, L = 10, R = 10;
  line.appendChild(svg("line", {x1: L, x2: W - R, y1: 30, y2: 30, stroke: "#737373"}));
  if (alerts.length) {
    const byTime = alerts.every(a => a.t !== null);
    const xs = alerts.map(a => byTime ? a.t : a.step);
    let x0 = Math.min(...xs), x1 = Math.max(...xs);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    const X = v => L + (v - x0) / (x1 - x0) * (W - L - R);
    alerts.forEach((a, i) => {
      const tick = svg("line", {class: "alert-tick", x1: X(xs[i]), x2: X(xs[i]), y1: 8, y2: 30,
                                stroke: C.alert, "stroke-width": 3});
      tick.appendChild(svg("title", {}, "step " + a.step + ": " + a.key));
      line.appendChild(tick);
    });
    line.appendChild(svg("text", {x: L, y: 44}, byTime ? clock(x0) : "step " + x0));
    line.appendChild(svg("text", {x: W - R, y: 44, "text-anchor": "end"},
                         byTime ? clock(x1) : "step " + x1));
  }
  setText("alert-timeline-title", alerts.length + " alerts on a time line");
  const tracked = new Set(state.keys.map(k => k.key));
  const body = document.querySelector("#alerts-table tbody");
  clear(body);
  for (const a of alerts.slice().reverse()) {
    const row = node("tr", {class: "alert-row"});
    row.appendChild(node("td", {}, String(a.step)));
    row.appendChild(node("td", {}, when(a)));
    const cell = node("td");
    if (tracked.has(a.key)) {
      const b = node("button", {class: "key-link", type: "button",
                                title: "show this key's count"}, a.key);
      b.addEventListener("click", () => chooseKey(a.key));
      cell.appendChild(b);
    } else {
      cell.textContent = a.key;
    }
    row.appendChild(cell);
    row.appendChild(node("td", {}, fmt(a.threshold)));
    row.appendChild(node("td", {}, fmt(a.epsilon)));
    body.appendChild(row);
  }
  setText("alerts-summary", alerts.length ?
          "Newest first; the last " + state.limits.alerts + " are kept." : "No alerts yet.");
}

function renderStatuses(state) {
  const statuses = state.statuses;
  const summary = document.getElementById("status-summary");
  summary.textContent = statuses.length ? statuses.length + " budget-exhausted status" +
    (statuses.length === 1 ? "" : "es") + ": these keys stop releasing." :
    "None: no key has run out of budget.";
  summary.className = statuses.length ? "bad" : "";
  const body = document.querySelector("#status-table tbody");
  clear(body);
  for (const s of statuses.slice().reverse()) {
    const row = node("tr", {class: "status-row"});
    for (const cell of [String(s.step), s.key, s.refused,
                        fmt(s.spent) + " of " + fmt(s.budget) + " " + unit(s.unit), s.reason]) {
      row.appendChild(node("td", {}, cell));
    }
    body.appendChild(row);
  }
}

document.getElementById("key-picker").addEventListener("change", e => chooseKey(e.target.value));
window.addEventListener("hashchange", () => {
  if (readHash() !== chosenKey) chooseKey(readHash());
});
poll();
"""

_BODY: Final = """<header>
<h1 id="title">__TITLE__</h1>
<p id="intro">What the flow publishes, live: private counts, privacy spend, alerts.</p>
<p id="status" role="status" aria-live="polite">Connecting…</p>
</header>
<main>
<section id="count-panel" aria-labelledby="count-heading">
<h2 id="count-heading">Private count of a key over time</h2>
<div class="controls">
<label for="key-picker">Key</label>
<select id="key-picker"><option value="">Most releases</option></select>
<span id="latest"></span>
</div>
<svg id="count-chart" viewBox="0 0 760 330" role="img"
 aria-labelledby="count-chart-title count-chart-desc">
<title id="count-chart-title">Waiting for the first release…</title>
<desc id="count-chart-desc">The dark line is the released private count at the end of each
step's window; the light band around it is value ± 1.96 × the noise standard deviation.</desc>
</svg>
<p class="note"><span class="swatch-line">Line</span>: the released value (true count + noise
added on purpose, which makes it private). <span class="swatch-band">Band</span>: value ± 1.96 ×
the noise's standard deviation, where the true count lies about 95 % of the time (exactly 95 %
for Gaussian noise, about 94 % for Laplace noise). Dashed red: the key's alert.</p>
<details><summary>Latest values as a table</summary>
<table id="series-table"><caption>The last 20 releases of the chosen key, newest first</caption>
<thead><tr><th scope="col">step</th><th scope="col">window end (UTC)</th><th scope="col">value</th>
<th scope="col">noise std</th><th scope="col">band</th></tr></thead><tbody></tbody></table>
</details>
</section>
<section id="budget-panel" aria-labelledby="budget-heading">
<h2 id="budget-heading">Privacy budget spent per mechanism</h2>
<svg id="budget-chart" viewBox="0 0 380 62" role="group" aria-labelledby="budget-heading"></svg>
<p id="budget-source" class="note"></p>
<p class="note">Orange: spent; grey: the per-key budget (ε for pure accounting, ρ for zCDP).
A counter commits a key's whole budget with its first release, for all its future releases,
so a full counter bar is normal. A key that runs out shows below as budget-exhausted.</p>
</section>
<section id="alerts-panel" aria-labelledby="alerts-heading">
<h2 id="alerts-heading">Monitor alerts (a key passed its private threshold test)</h2>
<svg id="alert-timeline" viewBox="0 0 760 46" role="img" aria-labelledby="alert-timeline-title">
<title id="alert-timeline-title">No alerts yet</title></svg>
<p id="alerts-summary" class="note"></p>
<div class="table-box"><table id="alerts-table"><caption>Alerts</caption>
<thead><tr><th scope="col">step</th><th scope="col">window end (UTC)</th><th scope="col">key</th>
<th scope="col">threshold</th><th scope="col">ε</th></tr></thead><tbody></tbody></table></div>
</section>
<section id="status-panel" aria-labelledby="status-heading">
<h2 id="status-heading">Budget exhausted</h2>
<p id="status-summary"></p>
<div class="table-box"><table id="status-table"><caption>Budget-exhausted statuses</caption>
<thead><tr><th scope="col">step</th><th scope="col">key</th><th scope="col">refused</th>
<th scope="col">spent</th><th scope="col">reason</th></tr></thead><tbody></tbody></table></div>
</section>
</main>
"""


def _hash(source: str) -> str:
    digest = hashlib.sha256(source.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


_SCRIPT_TEXT: Final = _SCRIPT.replace("__POLL__", str(POLL_MILLISECONDS))
_CSP: Final = ("default-src 'none'; script-src " + _hash(_SCRIPT_TEXT) + "; style-src "
               + _hash(_STYLE) + "; connect-src 'self'; img-src 'self'; base-uri 'none'; "
               "form-action 'none'; frame-ancestors 'none'")


def _page(title: str) -> bytes:
    """The whole page for ``title`` (escaped), with the inline style and script."""
    head = (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n")
    body = _BODY.replace("__TITLE__", html.escape(title))
    return (head + body + f"<script>{_SCRIPT_TEXT}</script>\n</body>\n</html>\n").encode()
