r"""The counters flow: Kafka events -> private per-key counts and alerts -> Kafka.

Run it on a Bytewax cluster with, for example::

    DPSTREAM_CONFIG=deploy/counters.example.toml DPSTREAM_NOISE_KEY_FILE=/secret/noise.key \
    DPSTREAM_RECOVERY_DIR=/secret/recovery \
        python -m bytewax.run flows.counters:flow -w 2 -r /secret/recovery -s 5

``DPSTREAM_RECOVERY_DIR`` must name the ``-r`` directory: the flow instance is recorded there.

or simply ``dpstream run --config deploy/counters.example.toml``.
"""

from dpstream.cli import flow_from_environment

flow = flow_from_environment()
