"""Flow kinds: each is a small package on the shared platform (:mod:`dpstream.platform`).

A flow kind (:class:`dpstream.kind.FlowKind`) reads its own configuration tables, names its
topics, decodes its records (a :class:`~dpstream.stream.clock.StepClock`), says what closing a
step publishes (a :class:`~dpstream.stream.barrier.StepBarrier`) and how outputs are encoded.
Kafka input and output, the step clock, dead letters, metrics, the instance binding and the
command line are the platform's, and so is the registry of the kinds
(:data:`dpstream.platform.KINDS`). ``flow.kind`` in the configuration picks the kind.
"""
