"""Flow kinds: each is a small module on the shared platform (:mod:`dpstream.platform`).

A flow kind reads its own configuration tables, names its topics, decodes its records
(a :class:`~dpstream.stream.clock.StepClock`), says what closing a step publishes (a
:class:`~dpstream.stream.barrier.StepBarrier`) and how outputs are encoded. Kafka input and
output, the step clock, dead letters, metrics, the instance binding and the command line are
the platform's. ``flow.kind`` in the configuration picks the kind.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

from dpstream.errors import ConfigError

__all__ = ["KINDS", "flow_kind"]

KINDS: Final = {"counters": "dpstream.kinds.counters.kind", "pmwg": "dpstream.kinds.pmwg.kind",
         "erm": "dpstream.kinds.erm.kind"}


def flow_kind(name: str) -> Any:
    """The flow kind called ``name`` (its module's ``KIND``)."""
    if name not in KINDS:
        raise ConfigError(f"flow.kind must be one of {', '.join(sorted(KINDS))}, got {name!r}")
    return importlib.import_module(KINDS[name]).KIND
