"""Consume what dpstream flows publish: typed records, schema checks, the latest value per key.

The consumer side of dpstream, on kafka-python::

    from dpstream.client import RecordConsumer, Release, Status

    with RecordConsumer("kafka:9092", ["releases", "alerts"], flow="demo",
                        from_beginning=True) as consumer:
        for record in consumer:                 # live, de-duplicated, until interrupted
            if isinstance(record, Release):
                low, high = record.interval()   # value -+ 1.96 std
                print(record.key, record.step, record.value, "+-", record.std)
            elif isinstance(record, Status):    # budget exhausted: the key stops releasing
                print(record.key, "stopped:", record.reason)
        consumer.latest.release("demo", "page-007")   # the latest value of one key

* **Typed records** (defined in :mod:`dpstream.schemas`): :class:`Release`, :class:`Status`,
  :class:`Alert`, :class:`Answer` (PMWG), :class:`Model` (ERM; a classifier with
  :meth:`dpstream.estimator.ReleasedClassifier.from_record`) and
  :class:`DeadLetter` (operators only), immutable, decoded by :func:`decode`
  (:mod:`dpstream.client.records`) with schema-version checks (:class:`SchemaVersionError`,
  :class:`UnknownRecordError`).
* **The model to serve** (:class:`Serving`, ERM): :meth:`ReleasedClassifier.latest` builds
  the classifier of the model a stream's latest serving record names.
* **The latest value per key** (:class:`LatestValues`), with replayed copies recognised.
* **A live consumer** (:class:`RecordConsumer`): records that are not dpstream's are counted
  and skipped, never raised.
* **The privacy spend** of running flows (:func:`budget_from_metrics`,
  :func:`budget_from_prometheus`), with the burn rate and projected exhaustion.

Everything here is post-processing of published, private records (or of operator metrics):
it costs no privacy. ``docs/consumers.md`` says what each topic's audience may see.
"""

from dpstream.client.budget import BudgetRow
from dpstream.client.budget import from_metrics as budget_from_metrics
from dpstream.client.budget import from_prometheus as budget_from_prometheus
from dpstream.client.consumer import ReadStats, Received, RecordConsumer
from dpstream.client.latest import LatestValues, StoreCounts
from dpstream.client.records import RecordError, SchemaVersionError, UnknownRecordError, decode
from dpstream.estimator import ReleasedClassifier
from dpstream.schemas import (
    SUPPORTED_SCHEMAS,
    Alert,
    Answer,
    ApproxDp,
    DeadLetter,
    Model,
    Privacy,
    Record,
    Release,
    ServedModel,
    Serving,
    Status,
    Window,
)

__all__ = [
    "SUPPORTED_SCHEMAS",
    "Alert",
    "Answer",
    "ApproxDp",
    "BudgetRow",
    "DeadLetter",
    "LatestValues",
    "Model",
    "Privacy",
    "ReadStats",
    "Received",
    "Record",
    "RecordConsumer",
    "RecordError",
    "Release",
    "ReleasedClassifier",
    "SchemaVersionError",
    "ServedModel",
    "Serving",
    "Status",
    "StoreCounts",
    "UnknownRecordError",
    "Window",
    "budget_from_metrics",
    "budget_from_prometheus",
    "decode",
]
