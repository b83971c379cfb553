"""Turn a released model (``dpstream.model/1``) into a ready scikit-learn-compatible classifier.

A consumer of the models topic does::

    from dpstream.estimator import ReleasedClassifier
    clf = ReleasedClassifier.from_record(message.value)      # bytes, str or dict
    clf.predict(X); clf.predict_proba(X); clf.score(X, y)

The classifier follows scikit-learn's conventions (``classes_``, ``coef_``, ``intercept_``,
``n_features_in_``, ``predict``, ``predict_proba``, ``decision_function``, ``score``,
``get_params``), so it drops into ``sklearn.metrics`` and pipelines; it is already fitted, and
``fit`` refuses (a released model is trained by the flow, privately). With scikit-learn
installed it *is* a scikit-learn estimator (``ClassifierMixin``, ``BaseEstimator``); without,
it works the same on numpy alone. Rows are clipped to the model's ``clip_norm`` before
scoring, in the model's norm (``features.norm``: L2, or L1 for the objective-perturbation
learner), exactly as the flow clipped them for training: a model trained on clipped features is
only meaningful on them.

Which model to use: the one the stream's latest ``dpstream.serving/1`` record names::

    from dpstream.client import RecordConsumer
    with RecordConsumer("kafka:9092", "models", flow="churn", from_beginning=True) as c:
        while c.poll(timeout=1.0):  # read what is there
            pass
    clf = ReleasedClassifier.latest(c.latest, stream="default")  # None: none released yet
Everything here is post-processing of a private release: it costs no privacy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import orjson

from dpstream.errors import DpstreamError
from dpstream.schemas import MODEL_SCHEMA, Model, Record, Serving

try:  # with scikit-learn installed, the classifier is one of its estimators (tags, clone, ...)
    from sklearn.base import BaseEstimator, ClassifierMixin

    _BASES: tuple[type, ...] = (ClassifierMixin, BaseEstimator)
except ImportError:  # pragma: no cover - scikit-learn is optional
    _BASES = ()

__all__ = ["ReleasedClassifier", "SchemaError"]


class SchemaError(DpstreamError):
    """A record is not a ``dpstream.model/1`` model (or lacks what a classifier needs)."""


class ServingStore(Protocol):
    """What :meth:`ReleasedClassifier.latest` reads of a store (the client's ``LatestValues``)."""

    def servings(self, flow: str | None = None) -> list[Serving]:
        """Every stream's latest serving record."""

    def served(self, flow: str, stream: str, instance: Any = ...) -> Model | None:
        """The model the latest serving record of ``stream`` names, if held."""


def _served_in_order(records: Iterable[Record], stream: str
                     ) -> dict[tuple[str, str | None], tuple[Serving, Model | None]]:
    """Per (flow, instance): the latest serving record of ``stream`` and the model it names.

    The model is the one of the named role and level as it stood when the serving record was
    read (None if it was not read before it).
    """
    models: dict[tuple[str, str | None, str | None, int | None], Model] = {}
    out: dict[tuple[str, str | None], tuple[Serving, Model | None]] = {}
    for record in records:
        if isinstance(record, Model) and record.stream == stream and record.has_weights:
            models[(record.flow, record.instance, record.role, record.level)] = record
        elif isinstance(record, Serving) and record.stream == stream:
            slot = (record.flow, record.instance)
            held = out.get(slot)
            if held is not None and held[0].step >= record.step:
                continue  # a replayed or older copy
            named = record.model
            model = None if named is None else models.get(
                (record.flow, record.instance, named.role, named.level))
            out[slot] = (record, model if model is not None and named is not None
                         and model.step == named.step else None)
    return out


class ReleasedClassifier(*_BASES):  # type: ignore[misc]
    """A private logistic-regression model released by an ERM flow, ready to predict.

    Args:
        classes: the labels, in the model's order.
        coef: weights for raw features, shape ``(1, d)`` (binary) or ``(K, d)``.
        intercept: shape ``(1,)`` or ``(K,)``.
        clip_norm: rows are clipped to this norm before scoring.
        record: the release record it came from (window, privacy cost, ...), if any.
        norm: the clipping's norm, ``"l2"`` (output perturbation) or ``"l1"`` (the objective
            learner); a record's ``features.norm``.
    """

    _estimator_type = "classifier"

    def __init__(self, classes: list[Any], coef: Any, intercept: Any, clip_norm: float,
                 record: dict[str, Any] | None = None, norm: str = "l2") -> None:
        self.classes_ = np.asarray(classes)
        if norm not in ("l1", "l2"):
            raise SchemaError(f"a model's clipping norm must be 'l1' or 'l2', got {norm!r}")
        self.norm = norm
        self.coef_ = np.atleast_2d(np.asarray(coef, dtype=np.float64))
        self.intercept_ = np.atleast_1d(np.asarray(intercept, dtype=np.float64))
        self.clip_norm = float(clip_norm)
        self.record = record or {}
        k = len(self.classes_)
        rows = 1 if k == 2 else k
        if k < 2 or self.coef_.shape[0] != rows or self.intercept_.shape != (rows,):
            raise SchemaError(f"a model of {k} classes needs {rows} weight row(s) and "
                              f"intercept(s), got coef {self.coef_.shape} and intercept "
                              f"{self.intercept_.shape}")
        if not (np.isfinite(self.coef_).all() and np.isfinite(self.intercept_).all()
                and self.clip_norm > 0):
            raise SchemaError("a model's weights must be finite and its clip_norm > 0")
        self.n_features_in_ = int(self.coef_.shape[1])

    @classmethod
    def from_record(cls, record: Model | bytes | str | dict[str, Any]) -> ReleasedClassifier:
        """Build the classifier of one record of the models topic.

        Raises:
            SchemaError: not a ``dpstream.model/1`` record with weights (for example the
                "exhausted" status record of a stream whose budget is spent).
        """
        if isinstance(record, Model):
            record = record.to_dict()
        if not isinstance(record, dict):
            try:
                record = orjson.loads(record)
            except orjson.JSONDecodeError:
                raise SchemaError("a model record must be JSON") from None
        if not isinstance(record, dict) or record.get("schema") != MODEL_SCHEMA:
            raise SchemaError(f"not a {MODEL_SCHEMA} record (schema "
                              f"{record.get('schema') if isinstance(record, dict) else None!r})")
        if "coef" not in record:
            raise SchemaError(f"this {record.get('role')!r} record carries no model: "
                              f"{record.get('reason')}")
        try:
            return cls(record["classes"], record["coef"], record["intercept"],
                       record["features"]["clip_norm"], record,
                       record["features"].get("norm") or "l2")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SchemaError(f"malformed {MODEL_SCHEMA} record: {exc!r}") from None

    @classmethod
    def latest(cls, records: ServingStore | Iterable[Record], *, stream: str,
               flow: str | None = None, instance: Any = None) -> ReleasedClassifier | None:
        """The classifier of the model that ``stream``'s latest serving record names.

        Args:
            records: a consumer's store (``RecordConsumer(...).latest``), or the models
                topic's records in the order they were published (decoded with
                :func:`dpstream.client.decode`; read from the beginning, or at least since
                the named model).
            stream: the model stream.
            flow: the flow (needed only when the records hold several flows).
            instance: the flow instance (needed only when they hold several; None: not
                chosen).

        Returns:
            None while the stream has no serving record that names a model (no model
            released yet), or when the named model was published before ``records`` begin.

        Raises:
            SchemaError: several flows (or instances) and none chosen.
        """
        if not isinstance(records, (list, tuple)) and hasattr(records, "served"):
            store: ServingStore = records  # type: ignore[assignment]
            slots = {(s.flow, s.instance) for s in store.servings() if s.stream == stream}
            found = None
        else:
            found = _served_in_order(records, stream)
            slots = set(found)
        flows = sorted({f for f, _ in slots})
        if flow is None:
            if len(flows) > 1:
                raise SchemaError(f"model stream {stream!r} is served by several flows "
                                  f"({', '.join(flows)}): name one (flow=...)")
            if not flows:
                return None
            flow = flows[0]
        instances = [i for f, i in slots if f == flow]
        if instance is None:
            if len(instances) > 1:
                raise SchemaError(f"flow {flow!r} has {len(instances)} instances: name one "
                                  "(instance=...); their models are independent releases")
            if not instances:
                return None
            instance = instances[0]
        if found is None:
            model = store.served(flow, stream, instance)
        else:
            model = found.get((flow, instance), (None, None))[1]
        return None if model is None else cls.from_record(model)

    # -- scikit-learn's estimator interface --
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor's parameters (scikit-learn convention)."""
        return {"classes": list(self.classes_), "coef": self.coef_,
                "intercept": self.intercept_, "clip_norm": self.clip_norm, "norm": self.norm}

    def set_params(self, **params: Any) -> ReleasedClassifier:
        """Refused: a released model is fixed."""
        raise SchemaError("a released model cannot be changed")

    def fit(self, X: Any, y: Any = None) -> ReleasedClassifier:  # noqa: N803
        """Refused: the model was trained privately by the flow."""
        raise SchemaError("a released model is already fitted (by the flow, privately); "
                          "it cannot be refitted on other data")

    def __sklearn_is_fitted__(self) -> bool:
        return True

    def _rows(self, X: Any) -> np.ndarray:  # noqa: N803
        x = np.asarray(X, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.n_features_in_:
            raise ValueError(f"X must have shape (n, {self.n_features_in_}), got {x.shape}")
        norms = np.linalg.norm(x, ord=1 if self.norm == "l1" else 2, axis=1)
        scale = np.minimum(1.0, self.clip_norm / np.maximum(norms, np.finfo(float).tiny))
        rows: np.ndarray = x * scale[:, None]
        return rows

    def decision_function(self, X: Any) -> np.ndarray:  # noqa: N803
        """Scores: shape ``(n,)`` for two classes (> 0 means ``classes_[1]``), else ``(n, K)``."""
        scores: np.ndarray = self._rows(X) @ self.coef_.T + self.intercept_
        result: np.ndarray = scores[:, 0] if len(self.classes_) == 2 else scores
        return result

    def predict_proba(self, X: Any) -> np.ndarray:  # noqa: N803
        """Class probabilities, shape ``(n, K)`` in the order of ``classes_``."""
        scores = self.decision_function(X)
        if len(self.classes_) == 2:
            p1 = 0.5 * (1.0 + np.tanh(0.5 * scores))  # a sigmoid that never overflows
            return np.column_stack([1.0 - p1, p1])
        shifted = scores - scores.max(axis=1, keepdims=True)
        e = np.exp(shifted)
        probabilities: np.ndarray = e / e.sum(axis=1, keepdims=True)
        return probabilities

    def predict(self, X: Any) -> np.ndarray:  # noqa: N803
        """The most probable class of each row."""
        scores = self.decision_function(X)
        index = (scores > 0).astype(int) if len(self.classes_) == 2 else scores.argmax(axis=1)
        classes: np.ndarray = self.classes_[index]
        return classes

    def score(self, X: Any, y: Any) -> float:  # noqa: N803
        """Mean accuracy on ``(X, y)`` (scikit-learn's ``ClassifierMixin.score``)."""
        return float(np.mean(self.predict(X) == np.asarray(y)))

    def __repr__(self) -> str:
        window = self.record.get("window", {})
        return (f"ReleasedClassifier(classes={list(self.classes_)}, d={self.n_features_in_}, "
                f"stream={self.record.get('stream')!r}, steps={window.get('first_step')}.."
                f"{window.get('last_step')})")
