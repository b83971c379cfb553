"""The ERM flow kind: private classifiers released continually from a stream of labelled events.

Events (JSON objects with a feature vector, a label and an event time) are placed in steps by
the shared step clock. **One step is one block** of the paper's algorithms (Watson et al.,
:mod:`dpstream.core.erm.schedules`): a block holds whatever events fall in its step, and every
objective is normalised by the *public, nominal* block size ``b0`` (``release.block_size``)
times the number of blocks it spans — never by the private number of events, so one event
more or less changes exactly one block and moves each minimiser by at most ``L/(λ n̄)``
(:mod:`dpstream.core.erm.spec`). Cutting blocks by counts (the paper's "dynamic time
steps") would let one event shift every later block, so it is not offered.

Each configured **model stream** (``model.streams``; events name theirs in
``model.stream_field``) runs its own release schedule from step 0 (the origin): the set of
streams and their start are public, so no stream's existence or start reveals an event.
Streams are spread over shards by name. When a step closes, each stream's block (its events
sorted by input partition and offset, so a replay trains on the very same rows in the very
same order) goes to its schedule, and every model the schedule releases is published on the
models topic (``dpstream.model/1``): weights and intercept for raw (clipped) features, the
classes, the data window it depends on, its privacy cost and the per-event budget. A model
may be scored on a **public holdout** (``holdout.path``) — never on the private stream.

Algorithms (``release.algorithm``): ``continual`` (Algorithm 4 with Algorithm 2's bases: 2ε
per event, Theorem 4's remark), ``multi-resolution`` (Algorithm 2), ``sliding-window``
(Algorithm 5), ``independent`` (each block alone: the baseline), each with ``sampling``
(Algorithms 6–8) under pure ε; ``ermg`` (paper 003, Theorem 31: BBImprover over output
perturbation, (ε, δ)).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import bytewax.operators as op
import numpy as np
import orjson
from bytewax.dataflow import Stream

from dpstream import schemas
from dpstream.config import FlowConfig, Section, build_spec, parse_common, positive
from dpstream.core._checks import fraction_text
from dpstream.core.erm.model import PrivateModel, predict
from dpstream.core.erm.schedules.schedule import ReleaseSchedule
from dpstream.core.erm.schedules.spec import ScheduleSpec
from dpstream.core.erm.spec import Block, ErmSpec
from dpstream.core.noise.coordinates import parameter_digest
from dpstream.core.noise.keys import NoiseKey
from dpstream.errors import BudgetExhaustedError, ConfigError
from dpstream.kind import ClockFactory, FlowKind, FlowParts
from dpstream.kinds.erm.metrics import register_metrics
from dpstream.messages import DeadLetter, Encoded, RawBatch
from dpstream.stream.barrier import MechanismShard
from dpstream.stream.clock import ShardUpdate, StepClock, bad_time, event_seconds
from dpstream.stream.operators import stepped_shards
from dpstream.stream.sharding import shard_of

__all__ = ["KIND", "ErmConfig", "ModelRecord"]

TOPICS: Final = {"input_topic": "events", "models_topic": "models",
                 "dead_letter_topic": "dead-letters"}
ALGORITHMS: Final = ("continual", "multi-resolution", "sliding-window", "independent", "ermg")
MAX_STREAMS: Final = 1024


# -- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Holdout:
    """Public labelled data the released models are scored on (never the private stream)."""

    path: str
    z: np.ndarray
    y: np.ndarray

    @property
    def rows(self) -> int:
        """How many holdout rows were read."""
        return int(self.y.shape[0])


@dataclass(frozen=True, kw_only=True)
class ErmConfig(FlowConfig):
    """The whole configuration of an ERM flow."""

    model: ErmSpec
    algorithm: str
    schedule: Any
    """The release schedule's spec (:class:`ScheduleSpec`, or ERMG's spec)."""
    streams: tuple[str, ...]
    features_field: str
    label_field: str
    stream_field: str | None
    delta: float
    holdout: Holdout | None

    @property
    def accounting(self) -> str:
        """``pure`` (ε) or ``zcdp`` (ρ)."""
        return str(self.model.accounting)

    @property
    def unit(self) -> str:
        """The unit of the per-event bound."""
        if self.algorithm == "ermg":
            return f"epsilon (of (epsilon, {self.delta:g})-DP)"
        return "epsilon" if self.accounting == "pure" else "rho"

    @property
    def budget(self) -> float:
        """What one event may cost at most, over every model it trains (the theorems' bound)."""
        return float(self.schedule.budget())

    @property
    def mechanisms_digest(self) -> str:
        """What a resume must not change: the model, the schedule and the streams."""
        return parameter_digest(repr(sorted(self.model.to_dict().items())),
                                repr(sorted(self.schedule.to_dict().items())),
                                self.algorithm, *self.streams)

    def describe(self) -> str:
        """A human summary of the privacy guarantee of the flow."""
        spec, m = self.schedule, self.model
        sampling = " with sampling" if getattr(spec, "sampling", False) else ""
        lines = [f"flow {self.name!r} (erm): one step = one block of nominal "
                 f"b0 = {spec.block_size} events, {self.step_seconds:g} s from "
                 f"{self.origin.isoformat()}",
                 self.describe_clock(),
                 f"model: {'binary logistic' if len(m.classes) == 2 else 'multinomial'} "
                 f"regression, d = {m.dimension}, classes {list(m.classes)}, features clipped "
                 f"to L2 norm {m.clip_norm:g}, lambda = {m.regularization:g}, "
                 f"Lipschitz L = {m.lipschitz:.4g}",
                 f"release: {self.algorithm}{sampling}, {len(self.streams)} model stream(s)",
                 f"privacy unit: one event; accounting {self.accounting}; every event costs at "
                 f"most {self.budget:.6g} {self.unit} over all the models it trains"]
        note = getattr(spec, "describe", None)
        if callable(note):
            lines.extend("  " + line for line in str(note()).splitlines())
        if self.holdout is not None:
            lines.append(f"holdout: {self.holdout.rows} public rows from {self.holdout.path}")
        return "\n".join(lines)


def _model_section(section: Section, accounting: str) -> tuple[ErmSpec, dict[str, Any]]:
    classes = section.get("classes", None, list)
    if not classes or len(classes) < 2:
        raise ConfigError(f"{section.where('classes')} must list at least two labels, "
                          f"got {classes!r}")
    if not all(isinstance(c, (str, int)) and not isinstance(c, bool) for c in classes):
        raise ConfigError(f"{section.where('classes')} must hold strings or integers")
    spec = build_spec(
        ErmSpec, "[model]", classes=tuple(classes),
        dimension=section.get("dimension", None, int),
        clip_norm=section.get("clip_norm", 1.0, float),
        regularization=section.get("regularization", 0.01, float),
        intercept=section.get("intercept", True, bool), accounting=accounting)
    streams = section.get("streams", ["default"], list)
    if (not streams or len(streams) > MAX_STREAMS or len(set(streams)) != len(streams)
            or not all(isinstance(s, str) and 0 < len(s) <= 64 for s in streams)):
        raise ConfigError(f"{section.where('streams')} must list 1-{MAX_STREAMS} distinct "
                          f"names of 1-64 characters, got {streams!r}")
    stream_field = section.get("stream_field", None, str)
    if stream_field is None and len(streams) > 1:
        raise ConfigError(f"{section.where('stream_field')} must name the event field that "
                          f"picks one of the {len(streams)} model streams")
    fields = {"streams": tuple(streams), "stream_field": stream_field,
              "features_field": section.get("features_field", "features", str),
              "label_field": section.get("label_field", "label", str)}
    section.finish()
    return spec, fields


def _schedule_section(section: Section, privacy: dict[str, Any]) -> tuple[str, Any]:
    algorithm = section.get("algorithm", "continual", str)
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"{section.where('algorithm')} must be one of "
                          f"{', '.join(ALGORITHMS)}, got {algorithm!r}")
    block_size = section.get("block_size", 1024, int)
    if algorithm == "ermg":
        from dpstream.core.erm.ermg import ErmgSpec  # noqa: PLC0415 (only this algorithm)

        spec: ErmgSpec | ScheduleSpec = build_spec(
            ErmgSpec, "[release]", epsilon=privacy["epsilon"], delta=privacy["delta"],
            block_size=block_size, beta=section.get("beta", 0.05, float),
            first_blocks=section.get("first_blocks", 8, int), c=section.get("c", 0.1, float))
        section.finish()
        return algorithm, spec
    spec = build_spec(
        ScheduleSpec, "[release]", algorithm=algorithm, epsilon=privacy["epsilon"],
        block_size=block_size, base_blocks=section.get("base_blocks", 8, int),
        window_blocks=section.get("window_blocks", 7, int),
        sampling=section.get("sampling", False, bool), accounting=privacy["accounting"],
        update_regularization=section.get("update_regularization", None, float))
    section.finish()
    return algorithm, spec


def parse_config(raw: dict[str, Any], source: str = "<dict>") -> ErmConfig:
    """Validate an ERM configuration (as read from TOML)."""
    fields, tables = parse_common(
        raw, source, kind_tables=frozenset({"privacy", "model", "release", "holdout"}),
        topics=TOPICS,
        origin_required=("for an erm flow: every model stream's schedule steps from block 0, "
                         "which starts at the origin (set it near the deployment time, e.g. "
                         "origin = '2026-11-20T00:00:00Z')"))
    tables["events"].finish()
    privacy = tables["privacy"]
    accounting = privacy.get("accounting", "pure", str)
    if accounting not in ("pure", "zcdp"):
        raise ConfigError(f"privacy.accounting must be 'pure' or 'zcdp', got {accounting!r}")
    if accounting == "pure":
        epsilon = positive(privacy.get("epsilon", 1.0, float), "privacy.epsilon")
        privacy.used.add("rho")
    else:
        epsilon = positive(privacy.get("rho", 0.5, float), "privacy.rho")
        privacy.used.add("epsilon")
    delta = privacy.get("delta", 1e-6, float)
    if not 0 <= delta < 1:
        raise ConfigError(f"privacy.delta must be in [0, 1), got {delta!r}")
    privacy.finish()
    model, model_fields = _model_section(tables["model"], accounting)
    algorithm, schedule = _schedule_section(
        tables["release"], {"epsilon": epsilon, "delta": delta, "accounting": accounting})
    if algorithm == "ermg" and accounting != "pure":
        raise ConfigError("release.algorithm = 'ermg' takes privacy.epsilon and privacy.delta "
                          "(BBImprover's own zCDP accounting, Theorem 29); set "
                          "privacy.accounting = 'pure'")
    holdout_section = tables["holdout"]
    path = holdout_section.get("path", None, str)
    holdout_section.finish()
    config = ErmConfig(model=model, algorithm=algorithm, schedule=schedule, delta=delta,
                       holdout=None, **model_fields, **fields)
    if path is not None:
        config = _with_holdout(config, path, source)
    return config


def _with_holdout(config: ErmConfig, path: str, source: str) -> ErmConfig:
    """Read the public holdout (JSON lines with the events' feature and label fields)."""
    file = Path(path)
    if not file.is_absolute() and source not in ("<dict>", ""):
        file = Path(source).parent / file
    try:
        lines = file.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"holdout.path: cannot read {str(file)!r}: {exc.strerror}") from None
    rows, labels = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise ConfigError(f"holdout.path {str(file)!r} line {number}: invalid JSON"
                              ) from None
        problem, x, label = _features_and_label(record, config)
        if problem is not None:
            raise ConfigError(f"holdout.path {str(file)!r} line {number}: {problem}")
        rows.append(x)
        labels.append(label)
    if not rows:
        raise ConfigError(f"holdout.path {str(file)!r} holds no rows")
    matrix, problems = _feature_matrix(rows, config)
    if problems:
        row, problem = min(problems.items())
        raise ConfigError(f"holdout.path {str(file)!r} row {row + 1}: {problem}")
    z = config.model.features(matrix)
    holdout = Holdout(str(file), z, np.asarray(labels, dtype=np.int64))
    return _replace(config, holdout=holdout)


def _replace(config: ErmConfig, **changes: Any) -> ErmConfig:
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(config, **changes)


def _features_and_label(record: Any, config: ErmConfig) -> tuple[str | None, Any, int]:
    """Why an event's features or label are unusable (no value is echoed), or the row.

    Only the shape is checked here; :func:`_feature_matrix` checks the numbers of a whole
    batch at once.
    """
    if not isinstance(record, dict):
        return "not a JSON object", None, -1
    x = record.get(config.features_field)
    if type(x) is not list or len(x) != config.model.dimension:
        return _not_numbers(config), None, -1
    index = _class_indices(config.model.classes).get(_label_key(record.get(config.label_field)))
    if index is None:
        return (f"field {config.label_field!r} must be one of the configured classes", None,
                -1)
    return None, x, index


def _not_numbers(config: ErmConfig) -> str:
    return (f"field {config.features_field!r} must be a list of {config.model.dimension} "
            "numbers")


def _feature_matrix(rows: list[list[Any]], config: ErmConfig
                    ) -> tuple[np.ndarray, dict[int, str]]:
    """The rows as a float matrix, and why some rows are unusable (by row index).

    Every row is judged on its own content only (never on its batch): numbers (JSON
    ``true``/``false`` count as 1/0), all finite. One numpy conversion does the common case;
    a batch with a bad row is converted row by row to find it.
    """
    d = config.model.dimension
    problems: dict[int, str] = {}
    try:
        matrix = np.array(rows)
        fast = matrix.ndim == 2 and matrix.dtype.kind in "biuf"
    except (ValueError, TypeError, OverflowError):
        fast = False
    if fast:
        matrix = matrix.astype(np.float64, copy=False)
    else:
        matrix = np.zeros((len(rows), d))
        for i, row in enumerate(rows):
            if all(isinstance(v, (int, float)) for v in row):
                try:
                    matrix[i] = row
                    continue
                except OverflowError:
                    pass
            problems[i] = _not_numbers(config)
    finite = np.isfinite(matrix).all(axis=1) if len(rows) else np.ones(0, dtype=bool)
    for i in np.flatnonzero(~finite).tolist():
        problems.setdefault(i, f"field {config.features_field!r} holds a non-finite number")
    return matrix, problems


def _label_key(label: Any) -> tuple[str, Any] | None:
    """A label with its type: the integer 1 and the string "1" are different classes."""
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        return None
    return type(label).__name__, label


@functools.lru_cache(maxsize=64)
def _class_indices(classes: tuple[Any, ...]) -> dict[tuple[str, Any] | None, int]:
    return {_label_key(c): i for i, c in enumerate(classes)}


# -- records in: the clock's decoding ------------------------------------------------------


class ErmClock(StepClock):
    """Decodes events into feature rows (clipped, mapped), label indices and their stream."""

    def __init__(self, config: ErmConfig, state: dict[str, Any] | None = None) -> None:
        super().__init__(config, state)
        self.config = config
        self.stream_index = {s: i for i, s in enumerate(config.streams)}
        self.shard_of = [shard_of(s, config.shards) for s in config.streams]
        self._z = np.empty((0, config.model.columns))
        self._y = np.empty(0, dtype=np.int64)
        self._streams = np.empty(0, dtype=np.int64)
        self._order = np.empty((0, 2), dtype=np.int64)

    def decode(self, partition: int, messages: RawBatch, dead: list[DeadLetter]
               ) -> tuple[list[Any], list[float], list[int]]:
        """Events with usable features, label, stream and time; the rest are dead letters."""
        config = self.config
        time_field, stream_field = config.time_field, config.stream_field
        features_field, label_field = config.features_field, config.label_field
        d, classes = config.model.dimension, _class_indices(config.model.classes)
        stream_index, loads, dead_letter = self.stream_index, orjson.loads, self.dead_letter
        rows: list[list[float]] = []
        labels: list[int] = []
        streams: list[int] = []
        order: list[tuple[int, int | None]] = []  # (partition, offset) of each row
        times: list[float] = []
        refs: list[int] = []
        for i, message in enumerate(messages):  # the hot loop: checks inlined, cheapest first
            try:
                record = loads(message[1]) if message[1] is not None else None
            except orjson.JSONDecodeError:
                dead.append(dead_letter("invalid JSON", message))
                continue
            if type(record) is not dict:
                dead.append(dead_letter("not a JSON object", message))
                continue
            x = record.get(features_field)
            if type(x) is not list or len(x) != d:
                dead.append(dead_letter(_not_numbers(config), message))
                continue
            label = record.get(label_field)
            index = classes.get((type(label).__name__, label)) if type(label) in (str, int) \
                else None
            if index is None:
                dead.append(dead_letter(
                    f"field {label_field!r} must be one of the configured classes", message))
                continue
            ts = record.get(time_field)
            ts = float(ts) if type(ts) is float or type(ts) is int else event_seconds(ts)
            if ts is None or not math.isfinite(ts):
                dead.append(dead_letter(bad_time(time_field), message))
                continue
            stream = 0
            if stream_field is not None:
                value = record.get(stream_field)
                found = stream_index.get(value) if type(value) is str else None
                if found is None:
                    dead.append(dead_letter(
                        f"field {stream_field!r} must name a configured model stream",
                        message))
                    continue
                stream = found
            rows.append(x)
            labels.append(index)
            streams.append(stream)
            order.append((partition, message[2]))
            times.append(ts)
            refs.append(i)
        matrix, problems = _feature_matrix(rows, config)
        keep = np.ones(len(rows), dtype=bool)
        for j, problem in sorted(problems.items()):
            dead.append(self.dead_letter(problem, messages[refs[j]]))
            keep[j] = False
        count = int(keep.sum())
        self._z = (config.model.features(matrix[keep]) if count
                   else np.empty((0, config.model.columns)))
        self._y = np.asarray(labels, dtype=np.int64)[keep]
        self._streams = np.asarray(streams, dtype=np.int64)[keep]
        self._order = np.asarray(order, dtype=np.int64).reshape(len(rows), 2)[keep]
        kept = np.flatnonzero(keep).tolist()
        return list(range(count)), [times[j] for j in kept], [refs[j] for j in kept]

    def route(self, payloads: list[Any] | np.ndarray, steps: int | list[int]
              ) -> list[dict[int, Any]]:
        """Per shard and step: each stream's rows (features, labels, partition and offset)."""
        per_shard: list[dict[int, Any]] = [{} for _ in range(self.config.shards)]
        if not payloads:
            return per_shard
        rows = np.asarray(payloads, dtype=np.int64)
        step_array = (np.full(len(rows), steps, dtype=np.int64) if isinstance(steps, int)
                      else np.asarray(steps, dtype=np.int64))
        streams = self._streams[rows]
        for step in np.unique(step_array).tolist():
            in_step = step_array == step
            for stream in np.unique(streams[in_step]).tolist():
                pick = rows[in_step & (streams == stream)]
                name = self.config.streams[stream]
                bucket = per_shard[self.shard_of[stream]].setdefault(step, {})
                bucket[name] = [(self._z[pick], self._y[pick], self._order[pick])]
        return per_shard


# -- steps: the shard ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRecord:
    """One published model (before encoding)."""

    stream: str
    algorithm: str
    step: int
    role: str
    level: int | None
    first_step: int
    last_step: int
    depends_on: tuple[tuple[int, int], ...]
    model: PrivateModel | None
    cost: float
    spent: float
    budget: float
    accuracy: float | None
    reason: str | None = None


def _make_schedule(config: ErmConfig, noise: NoiseKey, coords: tuple[Any, ...],
                   state: dict[str, Any] | None, train: Any = None) -> Any:
    if config.algorithm == "ermg":
        from dpstream.core.erm.ermg import Ermg  # noqa: PLC0415

        if state is None:
            return Ermg(config.schedule, config.model, noise, coords)
        return Ermg.from_state(state, config.schedule, config.model, noise, coords)
    if state is None:
        return ReleaseSchedule(config.schedule, config.model, noise, coords, train=train)
    return ReleaseSchedule.from_state(state, config.schedule, config.model, noise, coords,
                                      train=train)


class _Stream:
    """One model stream: its schedule, fed one block per step."""

    def __init__(self, config: ErmConfig, name: str, noise: NoiseKey, coords: tuple[Any, ...],
                 state: dict[str, Any] | None, train: Any = None) -> None:
        self.config, self.name = config, name
        self.exhausted: bool = bool(state and state.get("exhausted"))
        self.schedule = _make_schedule(config, noise, coords,
                                       None if state is None else state["schedule"], train)

    def to_state(self) -> dict[str, Any]:
        return {"schedule": self.schedule.to_state(), "exhausted": self.exhausted}

    def step(self, step: int, block: Block) -> list[ModelRecord]:
        config = self.config
        if self.exhausted:
            return []
        try:
            releases = self.schedule.add_block(step, block)
        except BudgetExhaustedError:
            self.exhausted = True
            return [ModelRecord(self.name, config.algorithm, step, "exhausted", None, step, step,
                                (), None, 0.0, float(self.schedule.max_block_spend()),
                                config.budget, None,
                                "the privacy budget of this model stream is spent: no "
                                "further models")]
        spent = float(self.schedule.max_block_spend())
        out = []
        for r in releases:
            accuracy = None
            if config.holdout is not None:
                guess = predict(config.model, r.model.params, config.holdout.z)
                accuracy = float(np.mean(guess == config.holdout.y))
            out.append(ModelRecord(self.name, config.algorithm, step, r.role, r.level,
                                   r.first_step, r.last_step, tuple(r.depends_on), r.model,
                                   float(r.cost), spent, config.budget, accuracy))
        return out


class ErmShard(MechanismShard):
    """The model streams of one shard: each closed step is one block of each stream."""

    members_key = "streams"
    mechanism = "erm"

    def __init__(self, config: ErmConfig, noise: NoiseKey, instance: str, partitions: int,
                 state: dict[str, Any] | None = None, train: Any = None) -> None:
        self.train = train  # None: private training (another trainer only for bench/)
        super().__init__(config, noise, instance, partitions, state)

    def names(self) -> list[str]:
        """The configured model streams."""
        return list(self.config.streams)

    def build(self, name: str, coordinates: tuple[Any, ...],
              state: dict[str, Any] | None) -> _Stream:
        """A model stream and its schedule (new, or from its snapshot)."""
        return _Stream(self.config, name, self.noise, coordinates, state, self.train)

    def merge(self, step: int, bucket: dict[str, Any]) -> None:
        """Add one partition's rows for ``step``."""
        pending = self.pending.setdefault(step, {})
        for name, parts in bucket.items():
            pending.setdefault(name, []).extend(parts)

    def close(self, step: int, bucket: dict[str, Any] | None) -> list[ModelRecord]:
        """Give every stream of this shard its block (rows in partition, offset order)."""
        bucket = bucket or {}
        columns = self.config.model.columns
        out = []
        for name in sorted(self.members):
            parts = bucket.get(name)
            if parts:
                z = np.concatenate([p[0] for p in parts])
                y = np.concatenate([p[1] for p in parts])
                where = np.concatenate([p[2] for p in parts])
                order = np.lexsort((where[:, 1], where[:, 0]))
                block = Block(z[order], y[order])
            else:
                block = Block(np.empty((0, columns)), np.empty(0, dtype=np.int64))
            out.extend(self.members[name].step(step, block))
        return out


# -- records out -----------------------------------------------------------------------------


class ModelEncoder:
    """Encodes models as ``dpstream.model/1`` records (keyed by model stream)."""

    def __init__(self, config: ErmConfig, instance: str = "") -> None:
        self.config, self.instance = config, instance

    def _window(self, first: int, last: int) -> schemas.Window:
        return schemas.Window.of_steps(self.config.origin, self.config.step_seconds, first, last,
                                       steps=True)

    def encode(self, m: ModelRecord) -> Encoded:
        """One model record on the models topic."""
        config = self.config
        if config.algorithm == "ermg":  # BBImprover charges rho; spent and budget are the
            accounting, delta = "approx_dp", config.delta  # epsilon of (eps, delta)
        else:
            accounting, delta = config.accounting, None
        privacy = schemas.Privacy(unit="event", accounting=accounting, cost=m.cost,
                                  spent=m.spent, budget=m.budget, delta=delta)
        shared: dict[str, Any] = dict(
            flow=config.name, instance=self.instance, stream=m.stream,
            algorithm=config.algorithm, role=m.role, level=m.level, step=m.step,
            released=self._window(m.step, m.step),
            window=self._window(m.first_step, m.last_step),
            depends_on=tuple(tuple(pair) for pair in m.depends_on),
            classes=tuple(config.model.classes), privacy=privacy)
        if m.model is None:
            record = schemas.Model(**shared, reason=m.reason)
        else:
            coef, intercept = config.model.linear_model(m.model.params)
            record = schemas.Model(
                **shared, coef=coef.tolist(), intercept=intercept.tolist(),
                features=schemas.ModelFeatures(dimension=config.model.dimension,
                                               clip_norm=float(config.model.clip_norm)),
                noise=schemas.ModelNoise(std=float(m.model.noise_std),
                                         grid=fraction_text(m.model.grid)),
                holdout=(None if m.accuracy is None else schemas.ModelHoldout(
                    accuracy=m.accuracy, rows=config.holdout.rows)))  # type: ignore[union-attr]
        return "models", m.stream.encode(), schemas.encode(record)


# -- the kind --------------------------------------------------------------------------------


class ErmKind:
    """The ERM flow kind (see the module docstring)."""

    name: Final[str] = "erm"
    inputs: Final[tuple[str, ...]] = ("input_topic",)
    outputs: Final[Mapping[str, str]] = {"models": "models_topic",
                                         "dead_letters": "dead_letter_topic"}
    topics: Final[Mapping[str, str]] = TOPICS

    def parse_config(self, raw: dict[str, Any], source: str) -> ErmConfig:
        """Validate an ERM configuration."""
        return parse_config(raw, source)

    def binding(self, config: ErmConfig) -> ErmConfig:
        """What a flow instance binds (the model, schedule and streams digest)."""
        return config

    def clock(self, config: ErmConfig, bases: Mapping[str, int]) -> ClockFactory:
        """The clock factory."""
        return lambda state: ErmClock(config, state)

    def wire(self, parts: FlowParts[ErmConfig], updates: Stream[tuple[str, ShardUpdate]]
             ) -> Stream[Encoded]:
        """Model-stream shards releasing models step by step, encoded as model records.

        ``parts.options["train"]`` replaces the private trainer: only ``bench/``'s
        non-private baseline uses it.
        """
        config = parts.config
        metrics = parts.metrics
        if metrics is not None:
            metrics.set_kind("erm")
            unit = "epsilon" if config.algorithm == "ermg" or config.accounting == "pure" \
                else "rho"
            for stream in config.streams:
                metrics.set_budget(config.algorithm, unit, config.budget, stream)
        models = stepped_shards(
            "models", updates,
            lambda state: ErmShard(config, parts.noise, parts.instance, parts.partitions,
                                   state, parts.options.get("train")),
            metrics, register_metrics(metrics).observe_models if metrics is not None else None)
        return op.map("encode", models, ModelEncoder(config, parts.instance).encode)


KIND: Final[FlowKind[ErmConfig, ErmConfig, Encoded]] = ErmKind()
