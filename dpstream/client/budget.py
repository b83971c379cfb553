"""Privacy spend, remaining budget and projected exhaustion per mechanism, from the metrics.

A flow publishes its spend as Prometheus gauges (``docs/metrics.md``):

* ``dpstream_privacy_spent`` / ``_remaining`` / ``_budget`` ``{flow, mechanism, unit}``: the
  largest spend of any key (the flow's event-level guarantee), the smallest remaining budget,
  the configured per-key budget;
* ``dpstream_histogram_privacy_spent`` / ``_budget`` ``{flow, histogram, mechanism}``: what a
  PMWG flow's histogram has spent per event;
* ``dpstream_model_privacy_spent`` / ``_budget`` ``{flow, stream}``: the most-charged event of
  an ERM flow's model stream;
* ``dpstream_budget_exhausted`` ``{flow, mechanism}``: 1 once a key, histogram or model stream
  of the mechanism stopped for want of budget (a status record, a ⊥ answer, an exhausted
  model was published);
* ``dpstream_flow_instance_info`` ``{flow, flow_instance}``: the flow instance a process runs
  (``instance=`` keeps only the processes of one instance: two instances of one flow name
  spend separate budgets over the same events).

:func:`from_metrics` reads them from flows' ``/metrics`` endpoints (several processes of a
flow: the largest spend wins, as it does for the guarantee); :func:`from_prometheus` from a
Prometheus server that scrapes them. A projection needs a burn rate: Prometheus gives it
over a window (``deriv`` of the spend, per second); a single endpoint gives it only when
sampled twice (:func:`from_metrics` with ``interval``); otherwise it is unknown.

A counter commits its whole per-key budget with a key's first release, so a counters flow
shows its spend at the counter's ε at once and then no burn at all: by design, not a warning.
PMWG's hard-query budget and an ERM stream's budget do run down over time.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from dpstream.errors import DpstreamError

__all__ = ["COUNTER_MECHANISMS", "BudgetRow", "from_metrics", "from_prometheus", "metrics_url"]

COUNTER_MECHANISMS: Final = frozenset({"tree-laplace", "blt-gaussian"})
"""The counters' mechanisms: each key's whole budget is charged with its first release."""


@dataclass(frozen=True)
class _Family:
    """One family of spend gauges: its name stem, the label that scopes it, its mechanism."""

    stem: str
    scope: str | None
    mechanism: str


FAMILIES: Final = (
    _Family("dpstream_privacy", None, "?"),
    _Family("dpstream_histogram_privacy", "histogram", "pmwg"),
    _Family("dpstream_model_privacy", "stream", "erm"),
)
_KINDS: Final = ("spent", "budget", "remaining")
_STOPPED: Final = "dpstream_budget_exhausted"
_INSTANCE_INFO: Final = "dpstream_flow_instance_info"
_HTTP_TIMEOUT: Final = 10.0

_Group = tuple[str, str, str | None, str | None]
"""(flow, mechanism, scope, unit)."""


@dataclass
class _Sample:
    """The spend gauges of one moment, combined over endpoints."""

    values: dict[_Group, dict[str, float]]
    stopped: set[tuple[str, str]]
    """(flow, mechanism) of ``dpstream_budget_exhausted`` series at 1."""


@dataclass(frozen=True)
class BudgetRow:
    """The spend of one mechanism of one flow (one histogram, one model stream).

    Attributes:
        flow: the flow's name.
        mechanism: ``tree-laplace``, ``blt-gaussian``, ``pmwg``, ``histogram``, ``erm``, ...
        scope: ``histogram=NAME`` or ``stream=NAME`` for the per-histogram and per-stream
            series, None for the flow-wide one.
        unit: the ledger unit (``epsilon``, ``rho``), None where the series do not say.
        spent: the largest spend of any privacy unit (event) so far.
        budget: what one may spend (None if not published).
        remaining: the smallest remaining budget (``budget - spent`` when not published).
        burn_rate: spend per second (None: unknown).
        stopped: a key, histogram or stream of this mechanism stopped for want of budget
            (``dpstream_budget_exhausted``).
    """

    flow: str
    mechanism: str
    scope: str | None
    unit: str | None
    spent: float
    budget: float | None
    remaining: float | None
    burn_rate: float | None
    stopped: bool = False

    @property
    def committed_up_front(self) -> bool:
        """A counter: every key pays its whole charge at once, and never runs down after."""
        return self.mechanism in COUNTER_MECHANISMS

    @property
    def exhausted(self) -> bool:
        """Nothing is left for further charges (not a warning for a counter: it has none)."""
        return self.remaining is not None and self.remaining <= 1e-12

    @property
    def seconds_to_exhaustion(self) -> float | None:
        """At the burn rate: 0 when exhausted, inf when not spending, None when unknown.

        A counter is never projected to run out (inf): its keys are charged once.
        """
        if self.committed_up_front:
            return math.inf
        if self.exhausted:
            return 0.0
        if self.remaining is None or self.burn_rate is None:
            return None
        if self.burn_rate <= 0:
            return math.inf
        return self.remaining / self.burn_rate

    @property
    def state(self) -> str:
        """``stopped``, ``committed``, ``exhausted``, ``spending``, ``not spending``, ``unknown``.

        ``stopped``: see :attr:`stopped`; ``committed``: a counter (see
        :attr:`committed_up_front`); ``unknown``: no burn rate.
        """
        if self.stopped:
            return "stopped"
        if self.committed_up_front:
            return "committed"
        seconds = self.seconds_to_exhaustion
        if seconds is None:
            return "unknown"
        if seconds == 0:
            return "exhausted"
        return "not spending" if math.isinf(seconds) else "spending"

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """Plain data: the fields, ``state``, ``exhaustion_seconds`` and ``exhaustion_at``.

        ``exhaustion_at`` is in Unix seconds; both are None when unknown or never.
        """
        seconds = self.seconds_to_exhaustion
        finite = seconds is not None and math.isfinite(seconds)
        now = time.time() if now is None else now
        return {**asdict(self), "state": self.state,
                "exhaustion_seconds": seconds if finite else None,
                "exhaustion_at": now + seconds if finite and seconds is not None else None}


def metrics_url(text: str) -> str:
    """``host:port``, ``http://host:port`` or a full URL -> the URL of the metrics page."""
    url = text if "://" in text else f"http://{text}"
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise DpstreamError(f"not an http(s) URL of a metrics endpoint: {text!r}")
    return url if parsed.path not in ("", "/") else url.rstrip("/") + "/metrics"


def from_metrics(urls: Sequence[str], *, flow: str | None = None,
                 interval: float | None = None, instance: str | None = None
                 ) -> list[BudgetRow]:
    """Read the spend from flows' metrics endpoints (one flow's processes, or several flows).

    Args:
        urls: the endpoints (``http://host:9464/metrics``; see :func:`metrics_url`).
        flow: keep only this flow.
        instance: keep only the endpoints running this flow instance (its id or a prefix,
            from ``dpstream_flow_instance_info{flow_instance}``).
        interval: sample again after this many seconds to measure the burn rate (None or 0:
            the rate is unknown).

    Raises:
        DpstreamError: an endpoint cannot be read or is not Prometheus text.
    """
    pages = [metrics_url(url) for url in urls]
    if not pages:
        raise DpstreamError("no metrics endpoint given")
    started = time.monotonic()
    first = _scrape_all(pages, flow, instance)
    first_at = (started + time.monotonic()) / 2
    if not interval:
        return _rows(first, {})
    time.sleep(max(0.0, started + interval - time.monotonic()))
    started = time.monotonic()
    second = _scrape_all(pages, flow, instance)
    elapsed = (started + time.monotonic()) / 2 - first_at
    rates = {}
    for group, values in second.values.items():
        before = first.values.get(group, {}).get("spent")
        if before is not None and "spent" in values and values["spent"] >= before:
            rates[group] = (values["spent"] - before) / elapsed
    return _rows(second, rates)  # a spend that went down (a restart) has no rate


def from_prometheus(url: str, *, flow: str | None = None, window: str = "1h",
                    instance: str | None = None) -> list[BudgetRow]:
    """Read the spend from Prometheus; the burn rate is ``deriv(spent[window])``.

    ``instance``: keep only the targets running this flow instance (its id or a prefix, from
    ``dpstream_flow_instance_info{flow_instance}``).

    Raises:
        DpstreamError: Prometheus cannot be reached or refuses a query.
    """
    base = url if "://" in url else f"http://{url}"
    selector = "" if flow is None else f'{{flow="{_escape(flow)}"}}'
    only = "" if instance is None else (
        f' and on(job, instance, flow) {_INSTANCE_INFO}'
        f'{{flow_instance=~"{_escape(re.escape(instance))}.*"}}')
    sample = _Sample({}, set())
    rates: dict[_Group, float] = {}
    for labels, value in _query(base, f"{_STOPPED}{selector}{only}"):
        if value > 0:
            sample.stopped.add((labels.get("flow", ""), labels.get("mechanism", "")))
    for family in FAMILIES:
        for kind in _KINDS:
            series = _query(base, f"{family.stem}_{kind}{selector}{only}")
            _merge(sample.values, family, kind, series)
        for labels, rate in _query(
                base, f"deriv({family.stem}_spent{selector}[{window}]){only}"):
            group = _group(family, labels)
            if math.isfinite(rate):
                rates[group] = max(rate, rates.get(group, -math.inf))
    return _rows(sample, rates)


# -- reading -------------------------------------------------------------------------------


def _scrape_all(urls: Iterable[str], flow: str | None, instance: str | None = None
                ) -> _Sample:
    sample = _Sample({}, set())
    for url in urls:
        found = list(_scrape(url))
        flows = None  # the flows this endpoint runs as the instance asked for
        if instance is not None:
            flows = {labels.get("flow") for family, kind, labels, _ in found
                     if kind == "instance" and labels.get("flow_instance", "").startswith(
                         instance)}
        for family, kind, labels, value in found:
            if kind == "instance":
                continue
            if flow is not None and labels.get("flow") != flow:
                continue
            if flows is not None and labels.get("flow") not in flows:
                continue
            if family is None:
                if value > 0:
                    sample.stopped.add((labels.get("flow", ""), labels.get("mechanism", "")))
            else:
                _merge(sample.values, family, kind, [(labels, value)])
    return sample


def _scrape(url: str) -> Iterable[tuple[_Family | None, str, dict[str, str], float]]:
    """The spend gauges of one endpoint (family None: ``dpstream_budget_exhausted``)."""
    text = _get(url, "metrics endpoint").decode("utf-8", errors="replace")
    wanted: dict[str, tuple[_Family | None, str]] = {
        f"{family.stem}_{kind}": (family, kind) for family in FAMILIES for kind in _KINDS}
    wanted[_STOPPED] = (None, "stopped")
    wanted[_INSTANCE_INFO] = (None, "instance")
    try:
        for metric in text_string_to_metric_families(text):
            for sample in metric.samples:
                if sample.name in wanted:
                    family, kind = wanted[sample.name]
                    yield family, kind, dict(sample.labels), float(sample.value)
    except ValueError as exc:
        raise DpstreamError(f"{url} is not a Prometheus metrics page: {exc}") from None


def _query(base: str, promql: str) -> list[tuple[dict[str, str], float]]:
    """An instant query's vector: ``[(labels, value)]``."""
    url = f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        body = json.loads(_get(url, "Prometheus"))
    except ValueError:
        raise DpstreamError(f"Prometheus at {base} answered something that is not JSON") \
            from None
    if body.get("status") != "success":
        raise DpstreamError(f"Prometheus at {base} refused {promql!r}: {body.get('error')}")
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise DpstreamError(f"Prometheus at {base} answered {promql!r} with a "
                            f"{data.get('resultType')}, not a vector")
    return [(item["metric"], float(item["value"][1])) for item in data.get("result", [])]


def _get(url: str, what: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT) as reply:
            data: bytes = reply.read()
            return data
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise DpstreamError(f"the {what} at {url} answered HTTP {exc.code}: {detail}") \
            from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DpstreamError(f"cannot read the {what} at {url}: {reason}") from None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


# -- combining -----------------------------------------------------------------------------


def _group(family: _Family, labels: dict[str, str]) -> _Group:
    scope = None if family.scope is None else f"{family.scope}={labels.get(family.scope, '')}"
    return (labels.get("flow", ""), labels.get("mechanism", family.mechanism), scope,
            labels.get("unit"))


def _merge(values: dict[_Group, dict[str, float]], family: _Family, kind: str,
           series: Iterable[tuple[dict[str, str], float]]) -> None:
    """Combine series of several processes: the largest spend and budget, the least left."""
    pick = min if kind == "remaining" else max
    for labels, value in series:
        if not math.isfinite(value):
            continue
        group = values.setdefault(_group(family, labels), {})
        group[kind] = pick(value, group[kind]) if kind in group else value


def _rows(sample: _Sample, rates: dict[_Group, float]) -> list[BudgetRow]:
    rows = []
    for group in sorted(sample.values, key=lambda g: tuple("" if x is None else x for x in g)):
        found = sample.values[group]
        if "spent" not in found:
            continue
        budget = found.get("budget")
        remaining = found.get("remaining")
        if remaining is None and budget is not None:
            remaining = max(0.0, budget - found["spent"])
        flow, mechanism, scope, unit = group
        rows.append(BudgetRow(flow, mechanism, scope, unit, found["spent"], budget,
                              remaining, rates.get(group), (flow, mechanism) in sample.stopped))
    return rows
