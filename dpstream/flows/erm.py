"""The ERM flow, for ``python -m bytewax.run dpstream.flows.erm:flow``.

Run exactly like :mod:`dpstream.flows.counters` (same environment variables and Bytewax
options), with a configuration whose ``flow.kind = "erm"``.
"""

from dpstream.runner import flow_module

flow = flow_module("erm")
