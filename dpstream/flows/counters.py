r"""The counters flow, for ``python -m bytewax.run``: Kafka events -> private counts -> Kafka.

From any directory, with dpstream installed::

    DPSTREAM_CONFIG=/etc/dpstream/counters.toml DPSTREAM_NOISE_KEY_FILE=/secret/noise.key \
    DPSTREAM_RECOVERY_DIR=/var/lib/dpstream/recovery \
        python -m bytewax.run dpstream.flows.counters:flow \
            -w 2 -r /var/lib/dpstream/recovery -s 5 -b 0

``-r`` with ``-s`` (snapshot interval) and ``-b`` (backup interval, seconds of older
snapshots to keep) must come together; ``DPSTREAM_RECOVERY_DIR`` must name the ``-r``
directory (the flow instance is recorded there; initialise it once with
``mkdir -p DIR && chmod 700 DIR && python -m bytewax.recovery DIR 1``, or let
``dpstream run --recovery-dir DIR`` do it; without partitions the start stops with that hint).
For a multi-process cluster add ``-i N -a "host0:2101;host1:2101"``: each process serves its
metrics on ``metrics.port + N``, and every process binds one flow instance: share one ``-r``
directory, or give every process the same ``DPSTREAM_INSTANCE_ID`` (docs/deploy.md).
``dpstream run --config FILE`` does the same in one process.

A configuration or start-up error prints one line (``dpstream: error: ...``) and exits 2.
"""

from dpstream.runner import flow_module

flow = flow_module("counters")
