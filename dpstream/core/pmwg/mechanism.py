"""Private multiplicative weights for growing databases (PMWG), on exact-noise sparse vector.

**Stated as OpenDP states a measurement**

* input domain: count histograms over ``N`` cells of a growing database with a public,
  non-decreasing size ``t >= n``, and adaptively chosen linear queries; input metric: add
  or remove one event (``d_in = 1``: one cell moves by one); at the user level one person's
  at most ``m = spec.sensitivity`` rows (``m`` cells move by one; see "Time and sensitivity").
* function: Algorithm 1 of paper 003: each query's two differences go to NSG
  (:mod:`dpstream.core.pmwg.sparse_vector`); an easy query is answered ``f(y)``, a hard one
  by NSG's noisy answer, followed by a multiplicative-weights step; bottom after the
  hard-query cap.
* output measure: pure epsilon-DP (``pure``) or rho-zCDP (``zcdp``, reported as
  ``(epsilon, delta)``-DP, Theorem 4); privacy map: ``1 ↦`` the sum over rounds of each
  round's cost, pure ``S_t0 + S_t1 / 8`` and zCDP ``(S_t0^2 + (S_t1 / 8)^2) / 2``, bounded by
  (B.1) (Theorem 11) resp. ``tau / 2`` (Theorems 16 and 19). Modes paper/solved charge
  ``PmwgSpec.worst_case_charge()``, ``SIGMA (1 + 10^-9)`` times (B.1) resp. ``tau / 2``, once
  when the mechanism starts; practical mode charges ``PmwgSpec.round_charge(t0)``,
  ``(9/8) S_t0`` resp. ``(S_t0^2 + (S_t0 / 8)^2) / 2``, per round (a filter).

PMWG answers an adaptively chosen stream of linear queries on a database that grows over
time, under pure epsilon-DP or, for the ``delta > 0`` version, zCDP (event level: neighbouring
streams differ by one event).

**Paper.** Cummings, Krehbiel, Lai, Tantipongpipat, *Differential Privacy for Growing
Databases* (NeurIPS 2018): Algorithm 1 (PMWG), Theorem 11 and its privacy sum (B.1),
Theorem 12 (B.2), Theorem 5, Lemma 14, the generalised noise (B.5) with Theorems 16 and 19,
Lemma 18 and its sum ``tau``; the sparse vector subroutines Algorithm 2 (NATG) and
Algorithm 3 (NSG) with Theorems 20-26 (appendices B and C); Theorem 4 (zCDP composition,
Bun & Steinke 2016) in the main body.

The mechanism's parts: the parameters, noise function and privacy accounting are
:class:`~dpstream.core.pmwg.spec.PmwgSpec` (:mod:`dpstream.core.pmwg.spec`); the sparse
vector with exact noise, its grid and the privacy of one round are
:class:`~dpstream.core.pmwg.sparse_vector.NumericSparse`; the hard-query cap's sums are in
:mod:`dpstream.core.pmwg.hard_query_sums`; the accuracy report is
:mod:`dpstream.core.pmwg.guarantee`.

**The mechanism (Algorithm 1).** A public histogram ``y`` over the ``N`` cells starts
uniform at time ``n``. A query ``f`` (weights ``w_i`` in ``[0, 1]``) is answered at the
public database size ``t``: PMWG sends ``f' = f - f(y)`` and ``f(y) - f`` to NSG with
threshold ``T = 2 alpha / 3``. If NSG says neither is above the threshold the query is
*easy* and the answer is ``f(y)``, computed from public data alone. Otherwise it is *hard*:
the answer is NSG's noisy numeric answer, the hard-query counter grows, and ``y`` takes a
multiplicative-weights step with learning rate ``alpha/6`` towards the answer. When data
arrived since the last query (``t' < t``) ``y`` is first mixed with the uniform
distribution: ``y <- (t'/t) y + ((t - t')/t) (1/N)`` (Lemma 6 bounds what this costs the
potential argument). Once ``sum h_tau > 36/alpha^2 (log N + sum_{tau=n+1}^t b_tau)``,
``b_tau = log N/tau + log(tau-1)/tau + log(tau/(tau-1))`` (Corollary 7), Algorithm 1
"returns bottom"; we read that as **halting the algorithm**: that query and every later one
is answered ``None`` (bottom) for good, which is what Theorem 11's proof needs (it assumes
the check holds at every time).

**Time and sensitivity.** The caller passes the true count histogram and a **public size**
``t >= n``, non-decreasing between calls (in the flow: a privately released, monotone
estimate of the database size, paid for elsewhere; it must never be the true size, whose
changes would then be published by the uniform update and the noise scale). The query value is
``f(D_t) = weighted_count(counts) / (2^16 t)`` exactly (weights are multiples of
``2^-16``). Adding or removing one event changes ``weighted_count`` by at most ``2^16``,
so ``f(D_t)`` has sensitivity ``Delta_t = 1/t``, and ``f(y)`` is public: that is all the
proofs use (privacy does not need ``t`` to equal the true size; accuracy does, as ``f(D_t)``
is then the fraction the theorems speak of). ``xi_t = c t^p`` is non-decreasing and
``xi_t Delta_t = c t^(p-1)`` is non-increasing, the assumptions of Theorem 20.

*A person, not an event* (``spec.sensitivity = m``, the user level's ``max_rows``). When
neighbouring databases differ by one person's rows, at most ``m`` (the bounding stage keeps
each person's first ``m`` rows per period), ``weighted_count`` moves by at most
``m 2^16`` and ``f(D_t)`` by ``Delta_t = m / t`` (each of the ``m`` rows moves one cell by
one, weights in ``[0, 1]``; ``f(y)`` and ``t`` are public). Nothing else in the proofs
changes: every bound is a function of ``xi_t Delta_t = c m t^(p-1)``, which the spec
computes with ``m`` (and its ``c`` is ``m`` times smaller, so the charges are the configured
ones, per person); the mechanism's code is the same.

**The double-halt issue.** Algorithm 1 sends both ``f'_{2j-1} = f - f(y)`` and
``f'_{2j} = f(y) - f`` to NSG. Noise can make the first halt its round; the second then
starts a new round and can halt it too: two halted rounds for one hard query, whereas
(B.1) pays once per hard query (it sets NSG's number of halts at ``t`` to ``h_t``), so
(B.1) would undercount. Here, when ``f'_{2j-1}`` halts, ``f'_{2j}`` is **not asked**:
Algorithm 1 never uses ``a'_{2j}`` then (the query is hard and its answer is built from
``a'_{2j-1}``), and the next query starts a fresh round exactly as NSG does after any halt.
*Claim:* every hard query halts exactly one round and every halted round belongs to exactly
one hard query. *Proof:* a query asks ``f'_{2j-1}`` and, only if that did not halt,
``f'_{2j}``, all in the round open at that moment (opened by its first ``f'`` if none is);
a round ends only by a halt; so a query halts at most one round, and it halts one iff it is
hard (Algorithm 1's definition of hard). Hence the number of NATG halts at time ``t`` is
exactly ``h_t`` and Theorem 24's sum, and with it (B.1), holds for this implementation.
:attr:`Pmwg.halted_rounds` counts the halts actually made (tests assert it equals
:attr:`Pmwg.hard_queries`).

**Accounting** (:mod:`dpstream.core.pmwg.spec`). Modes paper/solved commit the worst case
to the :class:`~dpstream.core.accounting.ledger.PrivacyLedger` (part of the state) when the
mechanism starts; practical mode charges each round when it starts, a privacy filter, and a
round the ledger cannot pay ends the mechanism ("privacy budget exhausted", for good).
:attr:`Answer.spent` is the ledger's total.

**Randomness** is exact and replay-safe: every draw is the sparse vector's, at
``(*coordinates, "pmwg", spec.digest, "natg", ...)``
(:mod:`dpstream.core.pmwg.sparse_vector`). The same call sequence gives the same answers.

**Public histogram in O(support) per query.** ``y = z / Z`` with ``z`` unnormalised
(float64) and a tracked mass ``Z``. An easy query costs one ``weighted_sum`` and one
``weighted_count``; a hard query one ``multiply`` on the query's support:
``exp(-alpha/6 (1 - w_i)) = exp(-alpha/6) exp(alpha/6 w_i)`` and the constant cancels in the
normalisation, so ``r = f`` is ``multiply(z, -alpha/6)`` and ``r = 1 - f`` is
``multiply(z, +alpha/6)``, and ``Z`` moves by the returned change (each step changes ``Z``
by a factor in ``[e^-1/6, e^1/6]``, so tracking it loses no precision). The uniform update
is the only dense pass, done lazily at the first query after ``t`` grows; it recomputes
``Z``. ``z`` is rescaled whenever ``Z`` leaves ``[1e-200, 1e200]``.

**State** (:meth:`Pmwg.to_state`): the histogram (bytes), its mass, the time of the last
query, the hard-query count and the running sum of ``b_tau``, the NSG round counters, the
halt reason and the ledger. Every field is a function of released outputs (the kind of each
answer is released): the state holds no true counts and no noise (the open round's
threshold is re-derived from the key).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Literal, Protocol

import numpy as np
import numpy.typing as npt

from dpstream.core.accounting.ledger import PrivacyLedger
from dpstream.core.noise.coordinates import check_coordinates
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.pmwg.hard_query_sums import _fsum2, hard_query_increment
from dpstream.core.pmwg.sparse_vector import NumericSparse, _pow2, dlap_variance
from dpstream.core.pmwg.spec import PmwgSpec
from dpstream.errors import InvalidParameterError

__all__ = [
    "HARD_BUDGET_EXCEEDED",
    "PRIVACY_BUDGET_EXHAUSTED",
    "WEIGHT_UNIT",
    "Answer",
    "LinearQueryLike",
    "Pmwg",
]

WEIGHT_UNIT: Final = 2**16
"""Query weights are integers ``units_i`` in ``[0, WEIGHT_UNIT]``; ``w_i = units_i / 2^16``."""
_MASS_RANGE: Final = (1e-200, 1e200)
_STATE_VERSION: Final = 1

Kind = Literal["easy", "hard", "bottom"]

HARD_BUDGET_EXCEEDED: Final = "hard-query budget exceeded"
PRIVACY_BUDGET_EXHAUSTED: Final = "privacy budget exhausted"


class LinearQueryLike(Protocol):
    """What PMWG needs of a linear query (implemented by ``dpstream.core.pmwg.queries``).

    ``support_size`` and ``key`` are read-only here so that frozen dataclasses and
    properties satisfy the protocol as well as plain attributes.
    """

    @property
    def support_size(self) -> int:
        """The number of cells with a nonzero weight."""
        ...

    @property
    def key(self) -> str:
        """A stable identifier of the query."""
        ...

    def weighted_count(self, counts: npt.NDArray[Any]) -> int:
        """Return ``sum units_i counts_i`` exactly, ``units_i = round(w_i 2^16)`` in [0, 2^16]."""
        ...

    def weighted_sum(self, values: npt.NDArray[Any]) -> float:
        """Return ``sum (units_i / 2^16) values_i``."""
        ...

    def multiply(self, values: npt.NDArray[Any], log_factor: float) -> float:
        """In place ``values_i *= exp(log_factor units_i / 2^16)`` on the support.

        Returns:
            The change of ``sum values_i`` over the support.

        """
        ...


# --- PMWG ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One PMWG answer.

    Attributes:
        value: the answer (a fraction of the database), or ``None`` for bottom.
        kind: ``"easy"`` (``f(y)``), ``"hard"`` (NSG's noisy answer) or ``"bottom"``.
        reason: why bottom (``"hard-query budget exceeded"`` or ``"privacy budget
            exhausted"``), else ``None``.
        t: the public size the query was answered at.
        spent: the ledger's total after this answer (epsilon or rho).
        hard_queries: the number of hard queries so far (including one that hit the cap).
        noise_std: for a hard answer, the std of its noise (fraction units); else ``None``.

    """

    value: float | None
    kind: Kind
    reason: str | None
    t: int
    spent: float
    hard_queries: int
    noise_std: float | None = None


class Pmwg:
    """PMWG (Algorithm 1) on NSG, answering linear queries on a growing database.

    Args:
        spec: the parameters.
        noise: the secret key all noise is derived from.
        coordinates: the release's coordinates (flow instance, mechanism, key, ...); draws
            are at ``(*coordinates, "pmwg", spec.digest, "natg", ...)``.
        state: a dict from :meth:`to_state` to resume from, or ``None`` to start (which
            commits the worst-case charge in modes paper/solved).

    Raises:
        InvalidParameterError: bad coordinates, or a malformed or mismatched state.

    """

    __slots__ = (
        "spec", "_key", "_coordinates", "_nsg", "ledger", "_z", "_mass", "_t_last",
        "hard_queries", "_b_t", "_b_hi", "_b_lo", "halted", "_ask_both", "queries",
        "_rate", "_threshold",
    )

    def __init__(
        self,
        spec: PmwgSpec,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
        state: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self._key = noise
        self._coordinates = check_coordinates(coordinates)
        base = (*self._coordinates, "pmwg", spec.digest)
        cells = int(spec.universe_size)
        self._rate = float(spec.alpha) / 6.0
        self._threshold = spec.threshold_value
        self._ask_both = False  # tests only: Algorithm 1 read literally (double halts)
        if state is None:
            self._nsg = NumericSparse(noise, base)
            self.ledger = spec.new_ledger()
            if spec.mode != "practical":
                self.ledger.charge(spec.worst_case_charge())
            self._z: npt.NDArray[np.float64] = np.ones(cells, dtype=np.float64)
            self._mass = float(cells)
            self._t_last = int(spec.n)
            self.hard_queries = 0
            self._b_t = int(spec.n)
            self._b_hi = 0.0
            self._b_lo = 0.0
            self.halted: str | None = None
            self.queries = 0
        else:
            self._load(state, base)

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Return the state as plain, pickle-safe data (the histogram as float64 bytes).

        Every field is a function of released outputs: no true counts, no noise.
        """
        return {
            "version": _STATE_VERSION,
            "digest": self.spec.digest,
            "histogram": self._z.astype("<f8").tobytes(),
            "mass": self._mass,
            "t_last": self._t_last,
            "hard_queries": self.hard_queries,
            "b_sum": [self._b_t, self._b_hi, self._b_lo],
            "halted": self.halted,
            "queries": self.queries,
            "nsg": self._nsg.to_state(),
            "ledger": self.ledger.to_state(),
        }

    def _load(self, state: dict[str, Any], base: tuple[str | int, ...]) -> None:
        try:
            if state["version"] != _STATE_VERSION:
                raise InvalidParameterError(f"unknown PMWG state version {state['version']!r}")
            if state["digest"] != self.spec.digest:
                raise InvalidParameterError(
                    "PMWG state was made with other parameters (digest "
                    f"{state['digest']!r}, the spec's is {self.spec.digest!r})")
            z = np.frombuffer(bytes(state["histogram"]), dtype="<f8").astype(np.float64)
            if z.shape != (int(self.spec.universe_size),):
                raise InvalidParameterError(
                    f"PMWG state holds {z.size} cells, the spec has {self.spec.universe_size}")
            self._z = z
            self._mass = float(state["mass"])
            self._t_last = int(state["t_last"])
            self.hard_queries = int(state["hard_queries"])
            b_t, b_hi, b_lo = state["b_sum"]
            self._b_t, self._b_hi, self._b_lo = int(b_t), float(b_hi), float(b_lo)
            halted = state["halted"]
            self.halted = None if halted is None else str(halted)
            self.queries = int(state["queries"])
            self._nsg = NumericSparse(self._key, base, state["nsg"])
            self.ledger = PrivacyLedger.from_state(state["ledger"])
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed PMWG state: {exc!r}") from None

    # -- read-only views --
    @property
    def halted_rounds(self) -> int:
        """The number of NATG rounds that halted (equals :attr:`hard_queries`)."""
        return self._nsg.halted_rounds

    @property
    def rounds_started(self) -> int:
        """The number of NATG rounds started so far."""
        return self._nsg.round_index + (1 if self._nsg.is_open else 0)

    def histogram(self) -> npt.NDArray[np.float64]:
        """Return a copy of the public histogram ``y`` (normalised)."""
        return self._z / float(np.sum(self._z))

    @property
    def mass(self) -> float:
        """The tracked mass ``Z`` of the unnormalised histogram."""
        return self._mass

    # -- helpers --
    def _bottom(self, t: int) -> Answer:
        return Answer(None, "bottom", self.halted, t, self.ledger.spent, self.hard_queries)

    def _halt(self, reason: str, t: int) -> Answer:
        self.halted = reason
        return self._bottom(t)

    def _uniform_update(self, t: int) -> None:
        """Mix ``y`` with uniform for the data that arrived in ``(t_last, t]`` (dense pass)."""
        z = self._z
        total = float(np.sum(z))
        t_last = self._t_last
        z *= t_last / (t * total)
        z += (t - t_last) / (t * z.size)
        self._mass = float(np.sum(z))
        self._t_last = t

    def _rescale_if_needed(self) -> None:
        lo, hi = _MASS_RANGE
        if not lo <= self._mass <= hi:
            self._z /= self._mass
            self._mass = float(np.sum(self._z))

    def _cap(self, t: int) -> int:
        if t > self._b_t:
            inc = hard_query_increment(int(self.spec.universe_size), self._b_t, t)
            self._b_hi, self._b_lo = _fsum2(self._b_hi, self._b_lo, inc)
            self._b_t = t
        log_n = math.log(int(self.spec.universe_size))
        return self.spec._cap_of(math.fsum((log_n, self._b_hi, self._b_lo)))

    def _check_counts(self, counts: object) -> npt.NDArray[Any]:
        cells = int(self.spec.universe_size)
        if not isinstance(counts, np.ndarray) or counts.shape != (cells,) \
                or not np.issubdtype(counts.dtype, np.integer):
            shape = getattr(counts, "shape", None)
            dtype = getattr(counts, "dtype", type(counts).__name__)
            raise InvalidParameterError(
                f"counts must be an integer numpy array of shape ({cells},), got shape "
                f"{shape} and dtype {dtype}")
        return counts

    def _ensure_round(self, t: int) -> bool:
        """Open an NSG round at ``t`` if none is open; False if it cannot be paid."""
        if self._nsg.is_open:
            return True
        if self.spec.mode == "practical":
            charge = self.spec.round_charge(t)
            if not self.ledger.can_afford(charge):
                return False
            self.ledger.charge(charge)
        self._nsg.start_round(self.spec.grid_exponent(t))
        return True

    def _ask_second_too(self, xi_q: Fraction, diff: Fraction, t: int, exponent: int) -> None:
        """Tests only: Algorithm 1 read literally, ``f'_{2j}`` is sent to NSG after a halt.

        It starts a new round, which can halt too: a second halted round for one hard query
        (the double-halt issue of the module docstring). Its answer is never used.
        """
        nsg = self._nsg
        if not self._ensure_round(t):
            return
        if nsg.compare(xi_q * (-diff - self._threshold), 2):
            nsg.answer(xi_q * -diff, exponent)
        else:
            nsg.next_query()

    # -- the mechanism --
    def answer(self, query: LinearQueryLike, counts: npt.NDArray[Any], t: int) -> Answer:
        """Answer ``query`` on the database ``counts`` of public size ``t`` (Algorithm 1).

        Args:
            query: the linear query.
            counts: the true count histogram (integers, ``N`` cells); secret.
            t: the public database size, ``>= n`` and non-decreasing between calls.

        Returns:
            The answer; ``None`` (bottom) for good once a budget is exceeded.

        Raises:
            InvalidParameterError: ``t`` is not a valid public size, or ``counts`` has the
                wrong shape or dtype (nothing about the data is in the message).

        """
        t = self.spec._check_t(t)
        if t < self._t_last:
            raise InvalidParameterError(
                f"t must be non-decreasing: got {t} after {self._t_last}")
        counts = self._check_counts(counts)
        self.queries += 1
        if self.halted is not None:
            self._t_last = max(self._t_last, t)
            return self._bottom(t)
        if t > self._t_last:
            self._uniform_update(t)
        nsg = self._nsg
        if not self._ensure_round(t):  # practical mode: a round is paid when it starts
            return self._halt(PRIVACY_BUDGET_EXHAUSTED, t)
        f_y = query.weighted_sum(self._z) / self._mass
        f_d = Fraction(int(query.weighted_count(counts)), WEIGHT_UNIT * t)
        xi = self.spec.xi(t)
        xi_q = Fraction(xi)
        f_y_q = Fraction(f_y)
        diff = f_d - f_y_q  # f'_{2j-1}(D_t); f'_{2j} = -diff
        which = 0
        if nsg.compare(xi_q * (diff - self._threshold), 1):
            which = 1
        elif nsg.compare(xi_q * (-diff - self._threshold), 2):
            which = 2
        if which == 0:
            nsg.next_query()
            return Answer(f_y, "easy", None, t, self.ledger.spent, self.hard_queries)
        # hard: h_t += 1, then Algorithm 1's check (before releasing a numeric answer)
        self.hard_queries += 1
        if self.hard_queries > self._cap(t):
            nsg.close_unanswered()
            return self._halt(HARD_BUDGET_EXCEEDED, t)
        exponent = self.spec.grid_exponent(t)
        signed = diff if which == 1 else -diff
        noisy = nsg.answer(xi_q * signed, exponent)  # eta-units
        if which == 1 and self._ask_both:
            self._ask_second_too(xi_q, diff, t, exponent)
        a_prime = noisy / xi_q
        value = float(f_y_q + a_prime) if which == 1 else float(f_y_q - a_prime)
        g1 = _pow2(exponent)
        std = math.sqrt(dlap_variance(Fraction(8) / g1)) * float(g1) / xi
        # multiplicative weights, learning rate alpha/6
        if value < f_y:
            change = query.multiply(self._z, -self._rate)  # r = f
        else:
            change = query.multiply(self._z, self._rate)  # r = 1 - f, constant dropped
        self._mass += change
        self._rescale_if_needed()
        return Answer(value, "hard", None, t, self.ledger.spent, self.hard_queries, std)

    def __repr__(self) -> str:
        return (
            f"Pmwg(mode={self.spec.mode!r}, accounting={self.spec.accounting!r}, "
            f"hard_queries={self.hard_queries}, halted={self.halted!r})"
        )
