"""The PMWG flow, for ``python -m bytewax.run dpstream.flows.pmwg:flow``.

Run exactly like :mod:`dpstream.flows.counters` (same environment variables and Bytewax
options), with a configuration whose ``flow.kind = "pmwg"``.
"""

from dpstream.runner import flow_module

flow = flow_module("pmwg")
