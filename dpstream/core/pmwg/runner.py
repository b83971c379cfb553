"""What the black-box schedulers share: rerun a static DP algorithm as the database grows.

Both schedulers come from Cummings, Krehbiel, Lai, Tantipongpipat 2018, "Differential Privacy
for Growing Databases", Section 4 and appendix D. The database grows by one row per unit of its
public size ``t`` (``t = n, n + 1, ...``); a stream of linear queries must be answered at every
``t`` using a static ``(p, g)``-black box ``M`` (Definition 4;
:mod:`dpstream.core.pmwg.blackboxes`).
The schedulers are :class:`~dpstream.core.pmwg.bb_scheduler.BBScheduler` (Algorithm 4) and
:class:`~dpstream.core.pmwg.bb_improver.BBImprover` (Algorithm 5); this module holds their
common runner: the ledger, the current synopsis, the public clock and the state.

**The database size** (reading 6 of the paper; readings 1-3 are in
:mod:`dpstream.core.pmwg.bb_scheduler`, 4-5 in :mod:`dpstream.core.pmwg.bb_improver`). ``t`` is
public, as in the paper (``x_t`` has ``t`` rows). It is passed to the black box as ``n``.
Neighbouring inputs differ by one event (:mod:`dpstream.core.pmwg.blackboxes`).

**Exact, replay-safe noise.** The schedulers draw nothing themselves. A run
of the black box gets ``rng_for(*c) = key.stream(*coordinates, kind, box,
r, *c)``, where ``kind`` is ``"bbscheduler"`` or ``"bbimprover"``, ``box`` is
the black box's name and ``r`` is the epoch or ``t``. A replay after a crash
therefore reproduces the very same synopsis, and the black boxes sample
exactly (:mod:`dpstream.core.pmwg.blackboxes`). The pure ledger's charges are
exact: ``epsilon_i`` is computed as a rational and rounded *down* to a float
whose decimal value (what the ledger and the noise use) does not exceed it,
so no partial sum ever exceeds ``epsilon``. A run is first checked against
the ledger; the black box runs only if it fits, and the charge is committed
before the synopsis is returned. A run past the budget raises
:class:`~dpstream.errors.BudgetExhaustedError` and changes nothing.

**State** (:meth:`~dpstream.core.pmwg.bb_scheduler.BBScheduler.to_state`): the spec, the
black box's name, the current epoch (or last run ``t``) and the ``t`` it ran at, the last
observed ``t``, the released synopsis and the ledger. It holds no true counts and no key. It
must still be bound to the same spec, black box and key when it is loaded
(:meth:`~dpstream.core.pmwg.bb_scheduler.BBScheduler.from_state` checks the first two).
"""

from __future__ import annotations

import math
import sys
from typing import Any, ClassVar, Final, Generic, Protocol, Self, TypeVar

from dpstream.core._checks import integer_at_least
from dpstream.core.accounting.ledger import PrivacyCharge, PrivacyLedger
from dpstream.core.noise.coordinates import check_coordinates
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import RandomIntegers
from dpstream.core.pmwg.blackboxes import (
    BlackBox,
    PrecheckedBlackBox,
    Synopsis,
    synopsis_from_state,
)
from dpstream.errors import BudgetExhaustedError, InvalidParameterError

__all__ = ["ScheduleSpec"]

_STATE_VERSION: Final = 1
_SMALLEST_BETA: Final = sys.float_info.min
"""A ``beta_i`` that underflows is passed to the black box as the smallest normal float."""


# --- shared checks ------------------------------------------------------------------


def _check_probability(name: str, value: object, *, allow_zero: bool = False) -> float:
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (0 <= value < 1 if allow_zero else 0 < value < 1)
    ):
        return float(value)
    interval = "[0, 1)" if allow_zero else "(0, 1)"
    raise InvalidParameterError(f"{name} must be in {interval}, got {value!r}")


def _check_nonnegative(name: str, value: object) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0):
        raise InvalidParameterError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)


def _check_t(t: object) -> int:
    return integer_at_least("t", t, 0)


def _check_black_box(spec_values: dict[str, float], black_box: BlackBox) -> None:
    name = getattr(black_box, "name", None)
    if not isinstance(name, str) or not name:
        raise InvalidParameterError(f"the black box needs a non-empty str name, got {name!r}")
    for attr, value in spec_values.items():
        have = getattr(black_box, attr, None)
        if have != value:
            raise InvalidParameterError(
                f"the spec was made for {attr} = {value!r}, but black box {name!r} has "
                f"{attr} = {have!r}: build the spec with for_black_box()"
            )


class ScheduleSpec(Protocol):
    """What the runner needs of a scheduler's spec (``BBSchedulerSpec``, ``BBImproverSpec``)."""

    @property
    def delta(self) -> float:
        """``0`` for pure DP, else the ``delta`` of ``(epsilon, delta)``-DP."""
        ...

    def new_ledger(self) -> PrivacyLedger:
        """Return an empty ledger with the spec's accounting and budget."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """Return the parameters as JSON-safe data (for binding a state to its spec)."""
        ...


_SpecT = TypeVar("_SpecT", bound=ScheduleSpec)


class _Runner(Generic[_SpecT]):
    """What both schedulers share: the ledger, the synopsis, the clock and the state.

    A subclass names its ``_kind`` and says which of the spec's values the black
    box must match (:meth:`_bound`) and the parameters of its first run
    (:meth:`_first_run`, checked up front by a
    :class:`~dpstream.core.pmwg.blackboxes.PrecheckedBlackBox`).
    """

    _kind: ClassVar[str] = ""

    def __init__(
        self,
        spec: _SpecT,
        black_box: BlackBox,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
    ) -> None:
        self.spec: _SpecT = spec
        ledger = spec.new_ledger()
        _check_black_box(self._bound(), black_box)
        self.black_box = black_box
        self._key = noise
        self._coordinates = check_coordinates(coordinates)
        self._ledger = ledger
        self._round = -1  # the epoch (BBScheduler) or the t (BBImprover) of the last run
        self._run_t: int | None = None
        self._run_epsilon: float | None = None
        self._last_t: int | None = None
        self._synopsis: Synopsis | None = None
        if isinstance(black_box, PrecheckedBlackBox):
            black_box.check_run(*self._first_run())

    def _bound(self) -> dict[str, float]:
        """The spec's values the black box's attributes must equal."""
        raise NotImplementedError

    def _first_run(self) -> tuple[int, float, float, float]:
        """The ``(n, epsilon, alpha, beta)`` of the first run."""
        raise NotImplementedError

    # -- the run --
    def _advance(self, t: int) -> int:
        t = _check_t(t)
        if self._last_t is not None and t < self._last_t:
            raise InvalidParameterError(
                f"t must not decrease: got t = {t} after t = {self._last_t}"
            )
        return t

    def _run(
        self,
        counts: Any,
        t: int,
        round_: int,
        charge: PrivacyCharge,
        alpha: float,
        beta: float,
    ) -> Synopsis:
        if charge.epsilon == 0.0:
            raise BudgetExhaustedError(
                f"refused {charge.label}: its epsilon underflows a float; no further runs"
            )
        if not self._ledger.can_afford(charge):
            self._ledger.charge(charge)  # raises BudgetExhaustedError and changes nothing
        key, coordinates = self._key, self._coordinates
        prefix = (*coordinates, self._kind, self.black_box.name, round_)

        def rng_for(*sub: str | int) -> RandomIntegers:
            return key.stream(*prefix, *sub)

        synopsis = self.black_box.run(
            counts, t, charge.epsilon, alpha, max(beta, _SMALLEST_BETA), rng_for
        )
        self._ledger.charge(charge)  # checked above: commits
        self._ledger.record_release()
        self._round, self._run_t, self._run_epsilon = round_, t, charge.epsilon
        self._synopsis = synopsis
        self._last_t = t
        return synopsis

    # -- reporting --
    @property
    def ledger(self) -> PrivacyLedger:
        """The privacy ledger (what has been spent of the budget)."""
        return self._ledger

    @property
    def synopsis(self) -> Synopsis | None:
        """The current synopsis, or ``None`` before the first run."""
        return self._synopsis

    @property
    def run_t(self) -> int | None:
        """The database size at which the current synopsis was computed."""
        return self._run_t

    @property
    def run_epsilon(self) -> float | None:
        """The epsilon of the run that made the current synopsis (``None`` before the first)."""
        return self._run_epsilon

    @property
    def last_t(self) -> int | None:
        """The last database size observed."""
        return self._last_t

    def privacy_spent(self) -> tuple[float, float]:
        """Return ``(epsilon, delta)`` spent so far (Theorem 4's conversion when ``delta > 0``)."""
        delta = self.spec.delta
        if self._ledger.accounting == "pure":
            return self._ledger.spent, 0.0
        return self._ledger.epsilon_spent(delta), delta

    # -- state --
    def to_state(self) -> dict[str, Any]:
        """Return the state as JSON- and pickle-safe data (no key, no counts)."""
        return self._state(self.spec.to_dict())

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        spec: _SpecT,
        black_box: BlackBox,
        noise: NoiseKey,
        coordinates: tuple[str | int, ...],
    ) -> Self:
        """Rebuild from :meth:`to_state` with the same spec, black box and key.

        Raises:
            InvalidParameterError: the state is malformed or was made with another spec
                or black box.

        """
        runner = cls(spec, black_box, noise, coordinates)
        runner._load(state, spec.to_dict())
        return runner

    def _synopsis_from_state(self, state: dict[str, Any]) -> Synopsis:
        """Load a released synopsis; a runner whose black box releases another kind overrides it.

        ``_run`` passes its database (``counts``, a histogram for this module's black boxes)
        to the black box untouched, so a subclass may drive a black box over another kind of
        database (:mod:`dpstream.core.erm.ermg`).
        """
        return synopsis_from_state(state)

    def _state(self, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "kind": self._kind,
            "spec": spec,
            "black_box": self.black_box.name,
            "round": self._round,
            "run_t": self._run_t,
            "run_epsilon": self._run_epsilon,
            "last_t": self._last_t,
            "synopsis": None if self._synopsis is None else self._synopsis.to_state(),
            "ledger": self._ledger.to_state(),
        }

    def _load(self, state: dict[str, Any], spec: dict[str, Any]) -> None:
        try:
            if state["version"] != _STATE_VERSION or state["kind"] != self._kind:
                raise InvalidParameterError(
                    f"not a {self._kind} state of version {_STATE_VERSION}: "
                    f"kind {state['kind']!r}, version {state['version']!r}"
                )
            if state["spec"] != spec:
                raise InvalidParameterError(
                    f"{self._kind} state was made with spec {state['spec']!r}, "
                    f"but this one is {spec!r}"
                )
            if state["black_box"] != self.black_box.name:
                raise InvalidParameterError(
                    f"{self._kind} state was made with black box {state['black_box']!r}, "
                    f"not {self.black_box.name!r}"
                )
            ledger = PrivacyLedger.from_state(state["ledger"])
            fresh = self._ledger
            if ledger.accounting != fresh.accounting or ledger.to_state()["budget"] != \
                    fresh.to_state()["budget"]:
                raise InvalidParameterError(
                    f"{self._kind} state's ledger ({ledger!r}) does not match the spec's"
                )
            round_ = int(state["round"])
            run_t = None if state["run_t"] is None else int(state["run_t"])
            run_eps = None if state["run_epsilon"] is None else float(state["run_epsilon"])
            last_t = None if state["last_t"] is None else int(state["last_t"])
            synopsis = None if state["synopsis"] is None else self._synopsis_from_state(
                state["synopsis"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed {self._kind} state: {exc!r}") from None
        if (synopsis is None) != (round_ < 0) or (synopsis is None) != (run_t is None):
            raise InvalidParameterError(
                f"malformed {self._kind} state: inconsistent round and synopsis"
            )
        self._ledger = ledger
        self._round, self._run_t, self._run_epsilon = round_, run_t, run_eps
        self._last_t, self._synopsis = last_t, synopsis
