"""A live web page of a flow's releases, alerts and privacy budget, for people without Grafana.

:class:`LiveView` keeps a small, bounded picture of what a flow published and serves it from
a standard-library HTTP server in a daemon thread:

* ``GET /`` -- one self-contained HTML page (inline CSS and JavaScript, no external resource:
  it works on a machine without internet), assembled from this package's ``page.html``,
  ``page.css`` and ``page.js``. A Content-Security-Policy with the hashes of the
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
import re
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
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


# -- the page: package files (page.html, page.css, page.js), linted by the test suite -----------


def _asset(name: str) -> str:
    return resources.files("dpstream.web").joinpath(name).read_text(encoding="utf-8")


# The inline style and script are the files after a newline; the CSP hashes exactly these texts.
_STYLE: Final = "\n" + _asset("page.css")
_SCRIPT: Final = "\n" + _asset("page.js")
_TEMPLATE: Final = _asset("page.html")


def _hash(source: str) -> str:
    digest = hashlib.sha256(source.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


_SCRIPT_TEXT: Final = _SCRIPT.replace("__POLL__", str(POLL_MILLISECONDS))
_CSP: Final = ("default-src 'none'; script-src " + _hash(_SCRIPT_TEXT) + "; style-src "
               + _hash(_STYLE) + "; connect-src 'self'; img-src 'self'; base-uri 'none'; "
               "form-action 'none'; frame-ancestors 'none'")


def _page(title: str) -> bytes:
    """The whole page for ``title`` (escaped), with the inline style and script."""
    values = {"TITLE": html.escape(title), "STYLE": _STYLE, "SCRIPT": _SCRIPT_TEXT}
    # one pass over the template: nothing substituted is searched again (a title or an
    # asset holding a placeholder's text stays as it is)
    return re.sub(r"__(TITLE|STYLE|SCRIPT)__", lambda m: values[m.group(1)], _TEMPLATE).encode()
