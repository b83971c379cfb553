"""dpstream: differentially private statistics released continually from event streams.

The public API is small; everything else is in private-by-convention modules.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dpstream.config import FlowConfig
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import (
    BudgetExhaustedError,
    ConfigError,
    DpstreamError,
    InvalidParameterError,
    NoiseKeyError,
)

__all__ = [
    "BudgetExhaustedError",
    "ConfigError",
    "DpstreamError",
    "FlowConfig",
    "InvalidParameterError",
    "NoiseKey",
    "NoiseKeyError",
    "PrivacyCharge",
    "PrivacyLedger",
    "load_config",
]
__version__ = "0.2.0"


def load_config(path: str | os.PathLike[str] | None = None,
                environ: Mapping[str, str] | None = None) -> Any:
    """Load a flow's configuration: :func:`dpstream.platform.load_config`.

    The platform (Bytewax, Kafka) is imported on the first call, not with the package, so
    that the core imports with numpy alone.
    """
    from dpstream.platform import load_config as load

    return load(path, environ)
