"""Flow configurations for the tests: one builder a kind, overridden table by table.

A test says only what differs from the usual test flow::

    tables = counters(broker.bootstrap, topics, name="ops", origin=ORIGIN, steps=60,
                      kafka={"tail": False}, metrics={"exact_counts": True})
    path = write(tmp_path / "flow.toml", tables)

``topics`` maps the roles (``events``, ``releases``, ``alerts``, ``dead``; PMWG's ``queries`` and
``answers``, ERM's ``models``) to topic names. An override table is merged into the default one;
a value of ``None`` removes that setting. ``origin`` is Unix seconds; ``steps`` sets
``flow.end`` that many 1-second steps later (a bounded run needs it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Tables = dict[str, dict[str, Any]]

KEYS = ("a", "b")


def iso(seconds: float) -> str:
    """Unix seconds as an ISO-8601 UTC time, as configurations write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _flow(name: str, origin: float, steps: int | None, **more: Any) -> dict[str, Any]:
    flow = {"name": name, "step": "1s", "origin": iso(origin)}
    if steps is not None:
        flow["end"] = iso(origin + steps)
    flow.update({"shards": 2, "clock": "producer"}, **more)
    return flow


def _merge(defaults: Tables, overrides: Mapping[str, Mapping[str, Any] | None]) -> Tables:
    tables = {name: dict(table) for name, table in defaults.items()}
    for name, table in overrides.items():
        if table is None:
            tables.pop(name, None)
            continue
        merged = tables.setdefault(name, {})
        for key, value in table.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
    return tables


def counters(bootstrap: str, topics: Mapping[str, str], *, name: str = "it",
             origin: float | None = None, steps: int | None = None,
             keys: Sequence[str] = KEYS, **overrides: Mapping[str, Any] | None) -> Tables:
    """A declared-keys counters flow under the producer clock (pure ε 0.9, budget 1)."""
    return _merge({
        "flow": _flow(name, time.time() if origin is None else origin, steps),
        "kafka": {"brokers": [bootstrap], "input_topic": topics["events"],
                  "releases_topic": topics["releases"], "alerts_topic": topics["alerts"],
                  "dead_letter_topic": topics["dead"], "startup_timeout": "5s"},
        "privacy": {"budget": 1.0},
        "counter": {"epsilon": 0.9, "horizon": 4096},
        "admission": {"mode": "declared", "keys": list(keys)},
        "metrics": {"port": 0},
    }, overrides)


def pmwg(bootstrap: str, topics: Mapping[str, str], histograms: Sequence[Mapping[str, Any]], *,
         name: str = "it", origin: float | None = None, steps: int | None = None,
         **overrides: Mapping[str, Any] | None) -> Tables:
    """A PMWG flow under the producer clock (pure, budget 1) over ``histograms``."""
    tables = _merge({
        "flow": {"kind": "pmwg", **_flow(name, time.time() if origin is None else origin, steps)},
        "kafka": {"brokers": [bootstrap], "input_topic": topics["events"],
                  "queries_topic": topics["queries"], "answers_topic": topics["answers"],
                  "dead_letter_topic": topics["dead"], "startup_timeout": "5s"},
        "privacy": {"accounting": "pure", "budget": 1.0},
        "metrics": {"port": 0},
    }, overrides)
    return {**tables, "histograms": [dict(h) for h in histograms]}  # type: ignore[dict-item]


def erm(bootstrap: str, topics: Mapping[str, str], *, name: str = "it",
        origin: float | None = None, steps: int | None = None,
        **overrides: Mapping[str, Any] | None) -> Tables:
    """An ERM flow under the producer clock: two classes, streams "a" and "b" (field "s"),
    the continual schedule; ``model.dimension`` and ``privacy.epsilon`` are the test's."""
    return _merge({
        "flow": {"kind": "erm", **_flow(name, time.time() if origin is None else origin, steps)},
        "events": {"time_field": "ts"},
        "kafka": {"brokers": [bootstrap], "input_topic": topics["events"],
                  "models_topic": topics["models"], "dead_letter_topic": topics["dead"],
                  "startup_timeout": "5s"},
        "privacy": {"accounting": "pure"},
        "metrics": {"port": 0},
        "model": {"classes": ["no", "yes"], "regularization": 0.05, "streams": ["a", "b"],
                  "stream_field": "s"},
        "release": {"algorithm": "continual", "base_blocks": 2},
    }, overrides)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(k)} = {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} in TOML")


def render(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """The TOML text of ``tables``: tables and arrays of tables (a list of tables) of values
    (scalars, lists, inline tables)."""
    lines: list[str] = []
    for name, table in tables.items():
        for one in table if isinstance(table, list) else [table]:
            lines.append(f"[[{name}]]" if isinstance(table, list) else f"[{name}]")
            lines.extend(f"{key} = {_value(value)}" for key, value in one.items())
    return "\n".join(lines) + "\n"


def write(path: Path, tables: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write ``tables`` as TOML to ``path``; returns it."""
    path.write_text(render(tables))
    return path
