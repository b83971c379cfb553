"""dpstream: differentially private statistics released continually from event streams.

The public API is small; everything else is in private-by-convention modules.
"""

from dpstream.config import FlowConfig
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger
from dpstream.core.noise.samplers import NoiseKey
from dpstream.errors import (
    BudgetExhaustedError,
    ConfigError,
    DpstreamError,
    InvalidParameterError,
    NoiseKeyError,
)
from dpstream.platform import load_config

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
__version__ = "0.1.0"
