"""The suite's tiers: every test belongs to exactly one, and the fast tier keeps its promise.

=============  ===================================================================  ==============
tier           what its tests may use                                               how it is set
=============  ===================================================================  ==============
fast           pure Python and numpy in this process: no broker, no subprocess,     the default
               no Bytewax dataflow
statistical    as fast, but many draws (fixed seeds, derived tolerances)            marker
flow           Bytewax dataflows in memory, or other local processes (the CLI,       marker, or the
               ruff, mypy, a cluster of Bytewax processes), no broker                file's default
broker         the embedded Kafka-protocol broker (or old Kafka, or Prometheus)      fixture use
browser        headless chromium, or the page's assets linted by npm tools           marker/fixture
soak           long runs under load                                                 marker
=============  ===================================================================  ==============

Run one tier with ``python -m pytest -q -m fast`` (what a developer runs before each commit),
several with ``-m "fast or statistical"``; ``python -m pytest -q`` runs them all (``.ci/run``).

A test's tier is, in this order: the tier marker it (or its module's ``pytestmark``) carries;
``broker`` if it uses a broker or Prometheus fixture (directly or through another fixture);
``browser`` if it uses the ``browser_run`` fixture; its file's default from :data:`FILE_TIERS`;
otherwise ``fast``. The older markers still work: ``integration`` means ``broker``.

The fast tier is checked while it runs: a test counted fast that starts a process or builds a
Bytewax dataflow fails, naming the tier it belongs in, so the tier cannot drift slower unseen.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Final

import pytest

TIERS: Final = ("fast", "statistical", "flow", "broker", "browser", "soak")

DESCRIPTIONS: Final = {
    "fast": "pure Python and numpy: no broker, no subprocess, no Bytewax dataflow (the default)",
    "statistical": "statistical tests of samplers and mechanisms (fixed seeds, derived tolerances)",
    "flow": "Bytewax dataflows in memory, or other local processes; no broker",
    "broker": "needs the embedded Kafka-protocol broker (or old Kafka, or a real Prometheus)",
    "browser": "drives headless chromium, or lints the page's assets",
    "soak": "long runs under load",
}

# Markers of the suite before the tiers, read as tiers.
LEGACY: Final = {"integration": "broker"}

# Fixtures that make a test a broker (or browser) test wherever it is.
BROKER_FIXTURES: Final = frozenset({"broker", "topic_factory", "old_kafka", "prometheus_factory"})
BROWSER_FIXTURES: Final = frozenset({"browser_run"})

# Files whose unmarked tests are mostly flow (or soak) tests: their default tier. Elsewhere a
# test that builds a dataflow or starts a process carries ``@pytest.mark.flow`` itself.
FILE_TIERS: Final = {
    "test_core_isolation.py": "flow",
    "test_flow_erm.py": "flow",
    "test_flow_memory.py": "flow",
    "test_golden.py": "flow",
    "test_manifests.py": "flow",
    "test_soak.py": "soak",
    "test_soak_anomalies.py": "soak",
    "test_store_lock.py": "flow",
    "test_tooling.py": "flow",
    "test_trusted_clock.py": "flow",
}


def tier_of(item: pytest.Item) -> str:
    """The one tier ``item`` belongs to (see the module docstring for the order of the rules)."""
    marked = {m.name for m in item.iter_markers()}
    explicit = [t for t in TIERS if t in marked] or sorted({LEGACY[m] for m in LEGACY
                                                            if m in marked})
    if len(explicit) > 1:
        raise pytest.UsageError(f"{item.nodeid} carries several tiers ({', '.join(explicit)}); "
                                "give it one")
    if explicit:
        return explicit[0]
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & BROKER_FIXTURES:
        return "broker"
    if fixtures & BROWSER_FIXTURES:
        return "browser"
    return FILE_TIERS.get(item.path.name, "fast")


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: {DESCRIPTIONS[tier]}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        item.user_properties.append(("tier", tier))
        if item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))


# --- the fast tier's check ------------------------------------------------------------------

_running_fast: list[str] = []  # the node id of the fast test running now, if any


def _audit(event: str, args: tuple[object, ...]) -> None:
    if _running_fast and event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork"):
        test = _running_fast[0]
        _running_fast.clear()  # report once; the test fails with this error
        raise RuntimeError(f"{test} is in the fast tier but starts a process ({event}): mark it "
                           "flow (or broker), or list its file in tests/support/tiers.py")


def _dataflow_guard() -> None:
    try:
        from bytewax.dataflow import Dataflow
    except ImportError:  # pragma: no cover - bytewax is a dependency
        return
    original = Dataflow.__init__

    def guarded(self: Dataflow, *args: object, **kwargs: object) -> None:
        if _running_fast:
            test = _running_fast[0]
            raise RuntimeError(f"{test} is in the fast tier but builds a Bytewax dataflow: mark it "
                               "flow, or list its file in tests/support/tiers.py")
        original(self, *args, **kwargs)

    Dataflow.__init__ = guarded  # type: ignore[method-assign]


_installed: list[bool] = []


@pytest.fixture(autouse=True)
def _fast_tier_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a fast test that starts a process or builds a dataflow (see the module docstring)."""
    if request.node.get_closest_marker("fast") is None:
        yield
        return
    if not _installed:
        sys.addaudithook(_audit)
        _dataflow_guard()
        _installed.append(True)
    _running_fast[:] = [request.node.nodeid]
    try:
        yield
    finally:
        _running_fast.clear()


__all__ = ["FILE_TIERS", "TIERS", "tier_of"]
