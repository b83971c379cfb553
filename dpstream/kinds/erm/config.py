"""The ERM kind's configuration: the model, its release schedule, its streams and the holdout.

:func:`parse_config` reads the ``[privacy]``, ``[model]``, ``[release]`` and ``[holdout]`` tables
into an :class:`ErmConfig` (the kind and its algorithms are described in
:mod:`dpstream.kinds.erm.kind`). The public holdout is read here, its rows checked as the
decoder (:mod:`dpstream.kinds.erm.events`) checks an event's: the row checks live here so
that both use the same ones.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson

from dpstream.config import FlowConfig, Section, build_spec, parse_common, positive
from dpstream.core.erm.contribution import PersonCost, noise_std, person_cost
from dpstream.core.erm.schedules.spec import ScheduleSpec
from dpstream.core.erm.spec import LEARNERS, ErmSpec
from dpstream.core.noise.coordinates import parameter_digest
from dpstream.errors import ConfigError

__all__ = ["ALGORITHMS", "MAX_STREAMS", "TOPICS", "ErmConfig", "Holdout", "parse_config"]

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
        """What a resume must not change: the model, the schedule and the streams.

        At ``unit = "user"`` also the ``[contribution]`` table (unit, field, period, caps): a
        resumed store with other caps is refused. (Left out at the event level, whose digest
        keeps its bytes.)
        """
        contribution = self.contribution
        extra = (repr(contribution),) if contribution.user_level else ()
        return parameter_digest(repr(sorted(self.model.to_dict().items())),
                                repr(sorted(self.schedule.to_dict().items())),
                                self.algorithm, *self.streams, *extra)

    def person_cost(self) -> PersonCost | None:
        """What one person may cost in all, per period (None at the event level).

        :func:`dpstream.core.erm.contribution.person_cost` derives it: every per-block charge
        covers one person's ``max_rows_per_block`` rows of a block, and a person has at most
        ``max_blocks`` blocks a period.
        """
        contribution = self.contribution
        if not contribution.user_level:
            return None
        return person_cost(self.schedule, self.model, contribution.cap("max_blocks"),
                           len(self.streams))

    def noise_std(self) -> dict[str, float]:
        """The noise std of each released coordinate (parameter units), by model role.

        At the configured caps (``max_rows_per_block`` scales it at ``unit = "user"``).
        """
        return noise_std(self.schedule, self.model)

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
                 f"to {'L1' if m.learner == 'objective' else 'L2'} norm {m.clip_norm:g}, "
                 f"lambda = {m.regularization:g}, Lipschitz L = {m.lipschitz:.4g}",
                 f"learner: {m.learner} ("
                 + ("certified objective perturbation, exact noise" if m.learner == "objective"
                    else "output perturbation, exact noise on a grid") + ")",
                 f"release: {self.algorithm}{sampling}, {len(self.streams)} model stream(s)"]
        cost = self.person_cost()
        if cost is None:
            lines.append(f"privacy unit: one event; accounting {self.accounting}; every event "
                         f"costs at most {self.budget:.6g} {self.unit} over all the models it "
                         "trains")
        else:
            lines.extend(self._describe_person(cost))
        note = getattr(spec, "describe", None)
        if callable(note):
            lines.extend("  " + line for line in str(note()).splitlines())
        if self.holdout is not None:
            lines.append(f"holdout: {self.holdout.rows} public rows from {self.holdout.path}")
        return "\n".join(lines)

    def _describe_person(self, cost: PersonCost) -> list[str]:
        """The user-level lines of :meth:`describe`."""
        c = self.contribution
        r, blocks = c.cap("max_rows_per_block"), c.cap("max_blocks")
        lines = [c.describe(),
                 f"a person's rows of one block (at most {r}) cost at most {self.budget:.6g} "
                 f"{self.unit} over all the models they train (each block's sensitivity is "
                 f"{r} x L/(lambda n)); a person has rows in at most {blocks} blocks a period"]
        if cost.accounting == "pure":
            lines.append(f"per person and period: epsilon <= {float(cost.stream_factor):.6g} x "
                         f"{blocks} x {float(cost.per_block):.6g} = {float(cost.total):.6g} "
                         f"(delta = {cost.delta(self.delta):.3g}: person-hash collisions)")
        else:
            how = ("kappa^2 B^2 rho (every run uses all blocks)" if cost.accounting == "ermg"
                   else f"kappa m B rho, m = {cost.overlap} blocks in one computation")
            lines.append(f"per person and period: rho <= {how} = {float(cost.total):.6g}, "
                         f"(epsilon, delta) = ({cost.epsilon(self.delta):.6g}, "
                         f"{cost.delta(self.delta):g}; with person-hash collisions) (kappa = "
                         f"{float(cost.stream_factor):.6g}); a "
                         "computation may span periods, so a person active in k periods pays "
                         "k^2 times this rho")
        stds = ", ".join(f"{k} {v:.4g}" for k, v in self.noise_std().items())
        lines.append(f"noise std per coordinate: {stds}")
        return lines


def _model_section(section: Section, accounting: str) -> tuple[ErmSpec, dict[str, Any]]:
    learner = section.get("learner", None, str)
    if learner is not None and learner not in LEARNERS:
        raise ConfigError(f"{section.where('learner')} must be one of "
                          f"{', '.join(repr(x) for x in LEARNERS)}, got {learner!r}")
    if learner == "objective" and accounting != "pure":
        raise ConfigError(f"{section.where('learner')} = 'objective' (objective perturbation) "
                          f"is pure epsilon-DP only, and privacy.accounting is {accounting!r}: "
                          "set learner = 'output' (the default under zCDP) or accounting = "
                          "'pure'")
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
        intercept=section.get("intercept", True, bool), accounting=accounting,
        learner=learner or ("objective" if accounting == "pure" else "output"))
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
              "label_field": section.get("label_field", "label", str),
              "learner": learner}
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
        update_regularization=section.get("update_regularization", None, float),
        max_history=section.get("max_history", None, int))
    section.finish()
    return algorithm, spec


def parse_config(raw: dict[str, Any], source: str = "<dict>") -> ErmConfig:
    """Validate an ERM configuration (as read from TOML)."""
    fields, tables = parse_common(
        raw, source, kind_tables=frozenset({"privacy", "model", "release", "holdout"}),
        topics=TOPICS, caps=("max_rows_per_block", "max_blocks"),
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
    if model_fields.pop("learner") is None and algorithm == "ermg":
        model = replace(model, learner="output")  # ERMG's black box is output perturbation
    elif algorithm == "ermg" and model.learner != "output":
        raise ConfigError("model.learner = 'objective' is not available with release.algorithm "
                          "= 'ermg' (its black box is output perturbation): set learner = "
                          "'output' or remove it")
    contribution = fields["contribution"]
    if contribution.user_level:
        model = replace(model, unit_rows=contribution.cap("max_rows_per_block"))
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
