"""The PMWG flow, for ``python -m bytewax.run dpstream.flows.pmwg:flow``.

Run exactly like :mod:`dpstream.flows.counters` (same environment variables and Bytewax
options), with a configuration whose ``flow.kind = "pmwg"``.
"""

import sys

from dpstream.errors import DpstreamError
from dpstream.runner import flow_from_environment

try:
    flow = flow_from_environment(kind="pmwg")
except DpstreamError as _exc:
    print(f"dpstream: error: {_exc}", file=sys.stderr)
    sys.exit(2)
