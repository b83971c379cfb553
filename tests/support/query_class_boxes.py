"""MWEM and SmallDB: static black boxes over a finite query class, kept as test oracles.

The paper (Cummings, Krehbiel, Lai, Tantipongpipat 2018, Corollary 10 and
appendix D) names them as black boxes for the schedulers. dpstream does not
configure them (production uses the noisy histogram of
:mod:`dpstream.core.pmwg.blackboxes`), so they live with the tests: they give
the schedulers a second black box (SmallDB is a
:class:`~dpstream.core.pmwg.blackboxes.PrecheckedBlackBox` that refuses runs
before seeing data) and their own tests check the exact exponential mechanism.
Both are ``epsilon``-DP under add/remove and replace-one-row neighbours alike,
because they only use linear queries, which move by at most ``1/n`` either way.

**MWEM** (Hardt, Ligett, McSherry 2012, Algorithm 1) for a finite class of
``k`` queries, given as a ``k x N`` matrix ``Q`` in ``[0, 1]``. ``A_0`` is
uniform, with mass ``n``. Each of ``T`` rounds does three things:

1. Select a query with the exponential mechanism at ``epsilon / (2T)``. The
   utility is ``|q(A) - q(B)|``, of sensitivity one count.
2. Measure it with discrete Laplace noise at ``epsilon / (2T)``.
3. Apply the multiplicative-weights update
   ``A(x) *= exp(q(x) (m - q(A)) / (2n))`` and renormalise to ``n``.

The output is the average of ``A_0 .. A_{T-1}``, divided by ``n``.
Privacy: ``2T`` mechanisms at ``epsilon/(2T)``, basic composition. *The query
grid*: ``Q`` is rounded to ``W = round(Q 2^16)`` (integers in
``[0, 2^16]``). A true answer ``a_j = W_j . counts`` is an exact integer in
units of ``2^-16`` count, and one event changes it by at most ``2^16``. The
measurement ``a_j + DLap(2^16 2T / epsilon)`` is therefore exactly
``epsilon/(2T)``-DP. Utilities ``|a_j - round(W_j . A)|`` are integers:
``A`` is public (post-processing of earlier releases), and the sensitivity
is ``2^16``. *Accuracy* (our derivation of HLM's Theorem 2.2 with explicit
``beta``; the constants are ours, not from the paper). Split ``beta`` over
``T`` selections and ``T`` measurements. Each selection loses at most
``S = (4T/epsilon)(ln k + ln(2T/beta))`` counts (exponential mechanism,
Dwork & Roth Theorem 3.11). Each measurement is off by at most
``M = (2T/epsilon) ln(4T/beta)`` counts, since
``P(|DLap(b)| > x) <= 2 exp(-x/b)``. Measurements are clamped to ``[0, n]``,
which keeps the MW step ``|eta| <= 1/2``. HLM's potential argument then
gives, with probability ``1 - beta``, a maximum error over ``Q`` of at most
``2 sqrt(ln N / T) + (M + S) / n + 2^-15``. The last term covers the query
grid (``2^-17`` on each side) and the rounded utilities. ``T`` is given, or
chosen to minimise this bound (public inputs only, capped at
``max_rounds``). Its rate is ``O((ln N ln(kT/beta) / (epsilon n))^(1/3))``,
so we declare ``p = p' = 1/3``, ``p'' = 0`` and
``g = (ln N ln k)^(1/3)`` (``C = 1``). Those constants are *not from the
paper* and not a proven Definition-4 bound: the true bound is larger by a
constant and ``log T`` factors, and :meth:`MWEM.error_bound` computes it.

**SmallDB** (Blum, Ligett, Roth 2008) for a finite class of ``k`` queries.
It is the exponential mechanism over all databases ``y`` of
``m = max(ceil(ln k / alpha^2), floor(ln(2k) / (2 alpha^2)) + 1)`` rows (the
second term only matters for ``k <= 2``). There are ``K = C(N + m - 1, m)``
such multisets of cells. The utility ``-max_j |Q_j . (x - y)|``, with
``x = counts/n`` and ``y`` normalised by ``m``, has sensitivity ``1/n``. On
the grid it is the integer ``-max_j |m a_j - n W_j . y|``, of sensitivity
``m 2^16``. SmallDB takes exponential time: a run that would score more than
:data:`MAX_SMALLDB_CANDIDATES` ``= 10^6`` candidates is refused. It is only
for tiny universes, as Corollary 10 uses it. *Accuracy*: sampling ``m`` rows
from ``x`` shows that some ``y`` is within ``alpha`` on all ``k`` queries
(Hoeffding plus a union bound, which needs ``m > ln(2k) / (2 alpha^2)``).
The exponential mechanism loses at most ``2 (ln K + ln(1/beta)) / (epsilon n)``
with probability ``1 - beta``, and the grid adds ``2^-15``, which gives
:meth:`SmallDB.error_bound`. With ``ln K <= m ln N`` this is the BLR rate,
``(p, g) = (1/3, (ln N ln k)^(1/3))`` as the paper states (Corollary 10),
with ``C = 1`` in our instantiation. That ``C = 1`` is a choice, not a
theorem: for the ``alpha`` a scheduler requests, SmallDB delivers about
``alpha (1 + 2 / ln(1/beta)) + 2 ln(1/beta) / (epsilon n) + 2^-15``.

**Exact sampling.** All noise comes from the exact samplers of
:mod:`dpstream.core.noise.samplers` (Canonne, Kamath, Steinke 2020). The exponential
mechanism is implemented exactly by rejection: propose a candidate uniformly
and accept it with probability ``exp(-lambda (u_max - u))``, using
:func:`~dpstream.core.noise.samplers.bernoulli_exp` on the rational argument (integer
utilities, rational ``lambda = epsilon' / (2 Delta)``). An accepted index then
has probability exactly proportional to ``exp(lambda u)``: this *is* the
exponential mechanism, so the textbook privacy and accuracy proofs apply
unchanged. Gumbel or float-weight sampling would leave floating-point holes
(Mironov 2012). Permute-and-flip (McKenna & Sheldon 2020) would also be
exact, but it is a different mechanism with its own analysis. The expected
number of proposals is ``K / sum exp(-lambda (u_max - u))``, at most ``K``.
A proposal costs a few microseconds, so a SmallDB run near the ``10^6``
candidate cap can take several seconds. It is exponential time by design.
The running time depends on the data; timing is outside the guarantee.
Floating point appears only in post-processing of released values (the MW
update, the synopsis).

**Replay safety.** A run draws only from ``rng_for(*coordinates)``, so a
replay reproduces the same synopsis.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from dpstream.core._checks import integer_at_least, positive_finite
from dpstream.core.accounting.ledger import exact
from dpstream.core.noise.samplers import RandomIntegers, bernoulli_exp, discrete_laplace
from dpstream.core.pmwg.blackboxes import HistogramSynopsis, RngFor, _check_counts, _check_run
from dpstream.errors import InvalidParameterError

__all__ = [
    "MAX_SMALLDB_CANDIDATES",
    "QUERY_GRID",
    "MWEM",
    "SmallDB",
    "exponential_mechanism",
    "quantize_queries",
]

FloatArray: TypeAlias = npt.NDArray[np.float64]
IntArray: TypeAlias = npt.NDArray[np.int64]

QUERY_GRID: Final = 1 << 16
"""Query weights are rounded to multiples of ``1 / QUERY_GRID`` (``2^-16``)."""
GRID_SLACK: Final = 2.0**-15
"""The error bound's allowance for the query grid and rounded utilities (normalised units)."""
MAX_SMALLDB_CANDIDATES: Final = 10**6
"""SmallDB refuses to score more candidate databases than this."""
DEFAULT_MAX_ROUNDS: Final = 1000
_INT64_SAFE: Final = 1 << 62
_BATCH_ENTRIES: Final = 1 << 22


def quantize_queries(queries: object) -> IntArray:
    """Return ``round(Q 2^16)`` for a ``k x N`` query matrix ``Q`` with entries in ``[0, 1]``.

    The integer weights make every true answer an exact integer in units of
    ``2^-16`` count, with sensitivity ``2^16`` (one count).

    Raises:
        InvalidParameterError: ``queries`` is not a non-empty 2-D array of finite numbers
            in ``[0, 1]``.

    """
    if not isinstance(queries, np.ndarray) or queries.ndim != 2 or 0 in queries.shape:
        raise InvalidParameterError(
            "queries must be a non-empty 2-D numpy array (k queries x N cells), got "
            + (f"shape {queries.shape}" if isinstance(queries, np.ndarray)
               else f"a {type(queries).__name__}")
        )
    if queries.dtype.kind not in "iuf":
        raise InvalidParameterError(f"queries must be numbers, got dtype {queries.dtype}")
    q = queries.astype(np.float64)
    if not bool(np.all(np.isfinite(q))) or q.min() < 0.0 or q.max() > 1.0:
        raise InvalidParameterError("queries must be finite and in [0, 1]")
    return np.rint(q * QUERY_GRID).astype(np.int64)


def _exact_answers(weights: IntArray, counts: IntArray) -> list[int]:
    """Return ``weights @ counts`` exactly (Python ints), in int64 when it cannot overflow."""
    total = int(counts.sum(dtype=object))
    if total * QUERY_GRID < _INT64_SAFE:
        return [int(v) for v in weights @ counts]
    obj = counts.astype(object)
    return [int(np.dot(row.astype(object), obj)) for row in weights]


def exponential_mechanism(
    rng: RandomIntegers, utilities: Sequence[int] | npt.NDArray[Any], rate: Fraction
) -> int:
    """Return index ``i`` with probability proportional to ``exp(rate * utilities[i])``, exactly.

    Rejection sampling: propose ``i`` uniformly and accept it with probability
    ``exp(-rate (max(utilities) - utilities[i]))``, drawn exactly by
    :func:`~dpstream.core.noise.samplers.bernoulli_exp` (integer utilities, rational
    ``rate``). With ``rate = epsilon / (2 Delta)`` for utilities of
    sensitivity ``Delta`` it is the exponential mechanism (McSherry & Talwar
    2007), ``epsilon``-DP. It needs at most ``len(utilities)`` proposals in
    expectation.

    Raises:
        InvalidParameterError: no candidates, or a negative ``rate``.

    """
    size = len(utilities)
    if size == 0:
        raise InvalidParameterError("the exponential mechanism needs at least one candidate")
    if rate < 0:
        raise InvalidParameterError(f"rate must be >= 0, got {rate}")
    best = int(np.max(utilities)) if isinstance(utilities, np.ndarray) else max(utilities)
    while True:
        i = rng.randbelow(size)
        if bernoulli_exp(rng, rate * (best - int(utilities[i]))):
            return i


# --- MWEM ---------------------------------------------------------------------------


def _check_query_class(queries: object, box: str) -> IntArray:
    weights = quantize_queries(queries)
    k, size = weights.shape
    if size < 2 or k < 2:
        raise InvalidParameterError(
            f"{box} needs N >= 2 cells and k >= 2 queries (g = (ln N ln k)^(1/3) must be > 0), "
            f"got N = {size}, k = {k}"
        )
    return weights


class _QueryClassBox:
    """What MWEM and SmallDB share: a ``k x N`` query class and ``(1/3, 1/3, 0, g)``.

    ``g = (ln N ln k)^(1/3)``; ``box`` names the black box in error messages.
    """

    __slots__ = ("name", "p", "p_prime", "p_double_prime", "g", "_weights")

    def __init__(self, queries: npt.NDArray[Any], name: str, box: str) -> None:
        self._weights = _check_query_class(queries, box)
        k, size = self._weights.shape
        self.name = name
        self.p = 1.0 / 3.0
        self.p_prime = 1.0 / 3.0
        self.p_double_prime = 0.0
        self.g = (math.log(size) * math.log(k)) ** (1.0 / 3.0)

    @property
    def universe_size(self) -> int:
        """The number of cells ``N``."""
        return int(self._weights.shape[1])

    @property
    def query_count(self) -> int:
        """The number of queries ``k``."""
        return int(self._weights.shape[0])


class MWEM(_QueryClassBox):
    """Multiplicative weights with the exponential mechanism (Hardt, Ligett, McSherry 2012).

    ``(p, p', p'', g) = (1/3, 1/3, 0, (ln N ln k)^(1/3))``: our constants, not
    the paper's, and not a proven Definition-4 bound. :meth:`error_bound` is the
    bound actually derived (module docstring).

    Args:
        queries: the ``k x N`` query matrix, entries in ``[0, 1]`` (rounded to ``2^-16``).
        rounds: the number of rounds ``T``; ``None`` chooses the ``T`` that minimises
            :meth:`error_bound` for each run's public ``(n, epsilon, beta)``.
        max_rounds: the largest ``T`` considered when ``rounds`` is ``None``.

    Raises:
        InvalidParameterError: bad queries (``N`` and ``k`` must be >= 2) or rounds.

    """

    __slots__ = ("_rounds", "_max_rounds")

    def __init__(
        self,
        queries: npt.NDArray[Any],
        rounds: int | None = None,
        max_rounds: int = DEFAULT_MAX_ROUNDS,
    ) -> None:
        super().__init__(queries, "mwem", "MWEM")
        self._rounds = None if rounds is None else integer_at_least("rounds", rounds, 1)
        self._max_rounds = integer_at_least("max_rounds", max_rounds, 1)

    @property
    def weights(self) -> IntArray:
        """The integer query weights ``round(Q 2^16)`` (a copy)."""
        return self._weights.copy()

    def _bound(self, rounds: FloatArray, n: int, eps: float, beta: float) -> FloatArray:
        t = rounds
        size, k = self.universe_size, self.query_count
        measure = (2.0 * t / eps) * np.log(4.0 * t / beta)
        select = (4.0 * t / eps) * (math.log(k) + np.log(2.0 * t / beta))
        result: FloatArray = 2.0 * np.sqrt(math.log(size) / t) + (measure + select) / n
        return result + GRID_SLACK

    def rounds_for(self, n: int, epsilon: float, beta: float) -> int:
        """Return the number of rounds a run with these public parameters uses."""
        if self._rounds is not None:
            return self._rounds
        size, eps = _check_run(n, epsilon, 1.0, beta)
        candidates = np.arange(1, self._max_rounds + 1, dtype=np.float64)
        return int(np.argmin(self._bound(candidates, size, eps, beta))) + 1

    def error_bound(self, n: int, epsilon: float, alpha: float, beta: float) -> float:
        """Return the maximum error over the query class that holds w.p. ``1 - beta``.

        It is ``2 sqrt(ln N / T) + (M + S) / n + 2^-15`` with
        ``M = (2T/epsilon) ln(4T/beta)`` and ``S = (4T/epsilon)(ln k + ln(2T/beta))``
        (module docstring; ``alpha`` is not used).
        """
        size, eps = _check_run(n, epsilon, alpha, beta)
        rounds = self.rounds_for(size, eps, beta)
        return float(self._bound(np.array([float(rounds)]), size, eps, beta)[0])

    def run(
        self,
        counts: npt.NDArray[np.int64],
        n: int,
        epsilon: float,
        alpha: float,
        beta: float,
        rng_for: RngFor,
    ) -> HistogramSynopsis:
        """Run MWEM for ``T`` rounds; round ``i`` draws from ``rng_for("round", i)``.

        ``T`` comes from the public ``(n, epsilon, beta)`` (:meth:`rounds_for`);
        ``alpha`` is not used.

        Raises:
            InvalidParameterError: bad counts or parameters.

        """
        size_n = self.universe_size
        cells = _check_counts(counts, size_n)
        n, eps = _check_run(n, epsilon, alpha, beta)
        rounds = self.rounds_for(n, eps, beta)
        truth = _exact_answers(self._weights, cells)  # units of 2^-16 count
        # exponential mechanism at epsilon/(2T) on utilities of sensitivity 2^16
        rate = exact(eps) / (4 * rounds * QUERY_GRID)
        # discrete Laplace at epsilon/(2T) on answers of sensitivity 2^16
        scale = Fraction(2 * rounds * QUERY_GRID) / exact(eps)
        grid_weights = self._weights.astype(np.float64)  # exact: integers <= 2^16
        queries = grid_weights / QUERY_GRID
        hist = np.full(size_n, n / size_n, dtype=np.float64)
        total = np.zeros(size_n, dtype=np.float64)
        for i in range(rounds):
            total += hist
            estimates = np.rint(grid_weights @ hist)  # public: a function of released values
            utilities = [abs(a - int(e)) for a, e in zip(truth, estimates.tolist(), strict=True)]
            rng = rng_for("round", i)
            j = exponential_mechanism(rng, utilities, rate)
            noisy = truth[j] + discrete_laplace(rng, scale)
            measured = min(max(noisy / QUERY_GRID, 0.0), float(n))  # clamping only helps
            q = queries[j]
            hist = hist * np.exp(q * ((measured - float(q @ hist)) / (2.0 * n)))
            hist *= n / hist.sum()
        return HistogramSynopsis(total / (rounds * n))

    def __repr__(self) -> str:
        return f"MWEM(N={self.universe_size}, k={self.query_count}, rounds={self._rounds})"


# --- SmallDB ------------------------------------------------------------------------


def _multiset_count(cells: int, size: int, cap: int) -> int | None:
    """Return ``C(cells + size - 1, size)`` if it is at most ``cap``, else ``None``."""
    count = 1
    for r in range(1, min(size, cells - 1) + 1):
        count = count * (max(size, cells - 1) + r) // r
        if count > cap:
            return None
    return count


def _log10_multiset_count(cells: int, size: int) -> float:
    return (math.lgamma(cells + size) - math.lgamma(size + 1) - math.lgamma(cells)) / math.log(10)


def _candidates(cells: int, size: int) -> Iterator[tuple[int, ...]]:
    """All multisets of ``size`` cells, in a fixed order.

    Each one is either the sorted cells themselves (when ``size <= cells - 1``)
    or the stars-and-bars positions of ``cells - 1`` bars among
    ``cells + size - 1`` slots.
    """
    if size <= cells - 1:
        return itertools.combinations_with_replacement(range(cells), size)
    return itertools.combinations(range(cells + size - 1), cells - 1)


def _as_counts(rows: IntArray, cells: int, size: int) -> IntArray:
    """Turn candidate rows (see :func:`_candidates`) into cell-count vectors of sum ``size``."""
    if size <= cells - 1:
        out = np.zeros((rows.shape[0], cells), dtype=np.int64)
        for r in range(rows.shape[1]):
            np.add.at(out, (np.arange(rows.shape[0]), rows[:, r]), 1)
        return out
    first = np.full((rows.shape[0], 1), -1, dtype=np.int64)
    last = np.full((rows.shape[0], 1), cells + size - 1, dtype=np.int64)
    return np.diff(np.concatenate([first, rows, last], axis=1), axis=1) - 1


class SmallDB(_QueryClassBox):
    """The exponential mechanism over small databases (Blum, Ligett, Roth 2008).

    ``(p, p', p'', g) = (1/3, 1/3, 0, (ln N ln k)^(1/3))``, i.e. Corollary 10's
    ``(1/3, C (log N log k)^(1/3))`` with ``C = 1`` in our instantiation.
    Exponential time: runs that would score more than ``10^6`` candidates are
    refused.

    Args:
        queries: the ``k x N`` query matrix, entries in ``[0, 1]`` (rounded to ``2^-16``).

    Raises:
        InvalidParameterError: bad queries (``N`` and ``k`` must be >= 2).

    """

    __slots__ = ()

    def __init__(self, queries: npt.NDArray[Any]) -> None:
        super().__init__(queries, "smalldb", "SmallDB")

    def database_size(self, alpha: float) -> int:
        """Return ``m = max(ceil(ln k / alpha^2), floor(ln(2k) / (2 alpha^2)) + 1)``."""
        a2 = positive_finite("alpha", alpha) ** 2
        k = self.query_count
        return max(math.ceil(math.log(k) / a2), math.floor(math.log(2 * k) / (2 * a2)) + 1)

    def candidate_count(self, alpha: float) -> int | None:
        """Return ``K = C(N + m - 1, m)``, or ``None`` if it exceeds ``10^6``."""
        return _multiset_count(self.universe_size, self.database_size(alpha),
                               MAX_SMALLDB_CANDIDATES)

    def check_run(self, n: int, epsilon: float, alpha: float, beta: float) -> None:
        """Refuse a run that would score more than ``10^6`` candidate databases.

        Raises:
            InvalidParameterError: the candidate count exceeds :data:`MAX_SMALLDB_CANDIDATES`,
                or a parameter is out of range.

        """
        _check_run(n, epsilon, alpha, beta)
        if self.candidate_count(alpha) is None:
            m, size = self.database_size(alpha), self.universe_size
            raise InvalidParameterError(
                f"SmallDB would score C(N + m - 1, m) = about "
                f"10^{_log10_multiset_count(size, m):.1f} candidate databases (N = {size}, "
                f"m = {m} rows for alpha = {alpha:.4g}, k = {self.query_count}), more than "
                f"{MAX_SMALLDB_CANDIDATES}: SmallDB takes exponential time and is only for "
                "tiny universes (as Corollary 10 uses it); use MWEM or a larger alpha"
            )

    def error_bound(self, n: int, epsilon: float, alpha: float, beta: float) -> float:
        """Return ``alpha + 2^-15 + 2 (ln K + ln(1/beta)) / (epsilon n)`` (w.p. ``1 - beta``).

        Raises:
            InvalidParameterError: as :meth:`check_run`.

        """
        self.check_run(n, epsilon, alpha, beta)
        count = self.candidate_count(alpha)
        assert count is not None
        return float(alpha) + GRID_SLACK + 2.0 * (math.log(count) + math.log(1.0 / beta)) / (
            float(epsilon) * int(n)
        )

    def _candidate_answers(self, rows: IntArray, m: int) -> IntArray:
        """Return ``W_j . y`` (exact integers ``<= m 2^16``) for rows of ``_candidates``."""
        size = self.universe_size
        if m <= size - 1:  # rows list the m cells: gather and add, O(m k) per candidate
            by_cell = self._weights.T
            answers = by_cell[rows[:, 0]].copy()
            for r in range(1, rows.shape[1]):
                answers += by_cell[rows[:, r]]
            return answers
        result: IntArray = _as_counts(rows, size, m) @ self._weights.T  # N <= m here
        return result

    def _losses(self, truth: list[int], n: int, m: int) -> npt.NDArray[Any]:
        """Return ``max_j |m a_j - n W_j . y|`` for every candidate ``y``, in candidate order."""
        size = self.universe_size
        k = self.query_count
        wide = max(truth, default=0) * m >= _INT64_SAFE or n * m * QUERY_GRID >= _INT64_SAFE
        dtype: Any = object if wide else np.int64
        scaled_truth = np.array([m * a for a in truth], dtype=dtype)
        width = min(m, size - 1)
        batch = max(1, _BATCH_ENTRIES // max(width, size, k))
        parts: list[npt.NDArray[Any]] = []
        it = _candidates(size, m)
        while True:
            chunk = list(itertools.islice(it, batch))
            if not chunk:
                break
            rows = np.array(chunk, dtype=np.int64).reshape(len(chunk), width)
            answers = self._candidate_answers(rows, m)
            diff = np.abs(scaled_truth[None, :] - answers.astype(dtype) * n)
            parts.append(diff.max(axis=1))
        return np.concatenate(parts)

    def run(
        self,
        counts: npt.NDArray[np.int64],
        n: int,
        epsilon: float,
        alpha: float,
        beta: float,
        rng_for: RngFor,
    ) -> HistogramSynopsis:
        """Sample a database of ``m`` rows with the exact exponential mechanism.

        All draws come from ``rng_for("select")``.

        Raises:
            InvalidParameterError: bad counts or parameters, or too many candidates.

        """
        size = self.universe_size
        cells = _check_counts(counts, size)
        self.check_run(n, epsilon, alpha, beta)
        n = int(n)
        m = self.database_size(alpha)
        truth = _exact_answers(self._weights, cells)
        losses = self._losses(truth, n, m)
        # utility -loss has sensitivity m 2^16 (units 2^-16 / (n m)); rate epsilon / (2 Delta)
        rate = exact(epsilon) / (2 * m * QUERY_GRID)
        chosen = exponential_mechanism(rng_for("select"), -losses, rate)
        row = next(itertools.islice(_candidates(size, m), chosen, None))
        y = _as_counts(np.array([row], dtype=np.int64).reshape(1, len(row)), size, m)[0]
        return HistogramSynopsis(y.astype(np.float64) / m)

    def __repr__(self) -> str:
        return f"SmallDB(N={self.universe_size}, k={self.query_count})"
