"""The binary tree counter: pure epsilon-DP continual counting, unbounded horizon.

**Stated as OpenDP states a measurement**

* input domain: unbounded streams of integer increments ``x_0, x_1, ... >= 0``, one per
  step; input metric: event level, ``d_in = sum_t |x_t - x'_t|`` (add or remove one event:
  ``d_in = 1``).
* function: at every step ``t``, the prefix-count estimate, a fixed post-processing
  (Honaker combining) of binary-tree node counts, each node plus exact discrete Laplace
  noise ``DLap((m_j + 1) / epsilon)`` on the integers, ``m_j + 1`` the levels of epoch
  ``j``'s tree.
* output measure: pure epsilon-DP; privacy map: ``d_in ↦ epsilon d_in`` (with
  ``sensitivity = L``: ``d_in ↦ epsilon d_in / L``, below). One event moves
  ``m_j + 1`` nodes of one epoch by one (L1 sensitivity ``m_j + 1``, Laplace mechanism,
  Dwork & Roth 2014, Theorem 3.6), epochs hold disjoint events (parallel composition). The
  ledger charges ``TreeCounterSpec.charge = PrivacyCharge(epsilon=epsilon)`` once for the
  whole stream (a zCDP ledger counts it as ``epsilon^2 / 2``, BS16 Proposition 1.4).

**Sensitivity ``L`` (user-level privacy).** When one person may add up to ``L`` events to
the stream (``contribution.max_per_key``), the spec's ``sensitivity = L`` scales every node's
noise to ``DLap(L (m_j + 1) / epsilon)``, so that the charge ``epsilon`` covers all ``L``
events. Derivation: let the person's events be ``k_j >= 0`` events in epoch ``j`` with
``sum_j k_j <= L``. Each of them moves exactly ``m_j + 1`` nodes of epoch ``j``'s tree by one,
so the L1 distance between the two node vectors of epoch ``j`` is at most ``k_j (m_j + 1)``
(several events may hit the same node: the L1 norm only adds, never more). The discrete
Laplace mechanism with scale ``b`` on a vector of L1 distance ``D`` is ``D / b``-DP (Dwork &
Roth 2014, Theorem 3.6; exact on the integers, CKS 2020), so epoch ``j`` costs
``k_j (m_j + 1) / (L (m_j + 1) / epsilon) = epsilon k_j / L``. Epochs use disjoint noise, so
their costs add (sequential composition over the epochs the person touches):
``sum_j epsilon k_j / L <= epsilon``. Hence the privacy map ``d_in ↦ epsilon d_in / L`` and
``d_in <= L ↦ epsilon``. ``L = 1`` is the event level: the same scale, the same noise, the same
releases, bit for bit. The variance of every node (and so of every release) is that of
``DLap(L (m_j + 1) / epsilon)``: the std grows by about ``L`` (exactly ``L`` in the
continuous-Laplace limit).

The counter releases, after every time step, a private estimate of the number
of events seen so far (the prefix count).

**Binary tree mechanism** (Dwork, Naor, Pitassi, Rothblum 2010; Chan, Shi,
Song 2011). The steps of a horizon of ``2**m`` steps are the leaves of a
complete binary tree; every node holds the number of events in its range of
steps plus independent discrete Laplace noise. One event changes the true
value of exactly one node per level, i.e. of ``m + 1`` nodes, so noise of scale
``(m + 1) / epsilon`` on every node makes the whole tree epsilon-DP. A prefix
count is the sum of at most ``m`` node values.

**Unbounded horizon** (the hybrid idea of Chan, Shi, Song 2011). Time is cut
into epochs of doubling length: epoch 0 covers steps ``[0, H)``, epoch ``j``
covers ``[H (2**j - 1), H (2**(j + 1) - 1))``, of length ``H 2**j``. Each epoch
has its own tree, with ``m_j + 1`` levels (``m_j = log2(H 2**j)``) and node noise
of scale ``(m_j + 1) / epsilon``. One event lies in exactly one epoch and so
touches exactly one tree; by parallel composition the whole, never-ending
counter is epsilon-DP. Finished epochs contribute the estimate of their root.

**Variance-optimal combining** (Honaker 2015, in the online form of
TF-Privacy's efficient tree aggregation). When a node completes, its own noisy
value ``y`` (variance ``v``) and the sum ``e_c`` of its children's estimates
(variance ``var_c``) are two independent unbiased estimates of the same count;
their inverse-variance weighted mean ``(v e_c + var_c y) / (v + var_c)`` has
variance ``v var_c / (v + var_c)``. Only the maximal completed nodes are kept
(a stack of at most ``m_j`` entries), so memory is O(log T).

**Exact noise** (Canonne, Kamath, Steinke 2020). Node noise comes from the
exact discrete Laplace sampler of :mod:`dpstream.core.noise.samplers`, applied to
integer counts, so every noisy node value is an integer with an exactly
discrete-Laplace error (no floating-point holes, Mironov 2012). The combined
estimates are real numbers, but they are a fixed post-processing of those
integers. The noise of a node is a pure function of the secret key and the
node's coordinates: the counter's lane ``noise_key.lane(*coordinates)`` at
``(TAG_TREE, epoch, height, index)`` (:mod:`dpstream.core.noise.bulk`), so a
replay after a crash reproduces the very same releases, and the columnar
:mod:`dpstream.core.counting.key_table` draws bit-identical noise in bulk.

The state (:meth:`TreeCounter.to_state`) holds true partial counts: the
recovery store that keeps it must be treated as secret.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Final

from dpstream.core._checks import increment as checked_increment
from dpstream.core._checks import is_integer, positive_finite
from dpstream.core.accounting.ledger import PrivacyCharge, exact
from dpstream.core.counting.estimate import CounterEstimate
from dpstream.core.noise.bulk import laplace_one
from dpstream.core.noise.coordinates import TAG_TREE, check_coordinates
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_laplace_variance
from dpstream.errors import InvalidParameterError

__all__ = [
    "TreeCounter",
    "TreeCounterSpec",
    "analytic_std",
    "plain_tree_worst_std",
    "worst_step_std",
]

_STATE_VERSION: Final = 1


@functools.lru_cache(maxsize=256)
def _noise_scale(levels: int, epsilon: float, sensitivity: int = 1) -> Fraction:
    return Fraction(levels * sensitivity) / exact(epsilon)


@functools.lru_cache(maxsize=256)
def _node_variance(levels: int, epsilon: float, sensitivity: int = 1) -> float:
    return discrete_laplace_variance(_noise_scale(levels, epsilon, sensitivity))


@dataclass(frozen=True)
class TreeCounterSpec:
    """Parameters of a binary tree counter.

    Attributes:
        epsilon: the pure-DP epsilon of the whole (unbounded) counter.
        horizon: length ``H`` of epoch 0 (a power of two, at least 2); later
            epochs double in length.
        sensitivity: ``L``, the most events one protected unit adds to the stream (1: one
            event; ``contribution.max_per_key`` at the user level). Node noise is
            ``DLap(L (m_j + 1) / epsilon)``, so ``epsilon`` covers ``L`` events (module
            docstring).

    """

    epsilon: float
    horizon: int = 2**20
    sensitivity: int = 1

    mechanism: ClassVar[str] = "tree-laplace"

    def __post_init__(self) -> None:
        positive_finite("epsilon", self.epsilon)
        h = self.horizon
        if not is_integer(h) or h < 2 or (int(h) & (int(h) - 1)) != 0:
            raise InvalidParameterError(f"horizon must be a power of two >= 2, got {h!r}")
        if isinstance(self.sensitivity, bool) or not isinstance(self.sensitivity, int) or (
                self.sensitivity < 1):
            raise InvalidParameterError(
                f"sensitivity must be an integer >= 1, got {self.sensitivity!r}")

    @property
    def charge(self) -> PrivacyCharge:
        """The privacy cost of the whole counter, over all epochs."""
        return PrivacyCharge(epsilon=float(self.epsilon), label="tree counter")

    def epoch_bounds(self, epoch: int) -> tuple[int, int]:
        """Return ``(start, length)`` of epoch ``epoch`` in counter steps.

        Raises:
            InvalidParameterError: ``epoch`` is not a non-negative integer.

        """
        if not is_integer(epoch) or epoch < 0:
            raise InvalidParameterError(f"epoch must be an integer >= 0, got {epoch!r}")
        h = int(self.horizon)
        return h * ((1 << int(epoch)) - 1), h << int(epoch)

    def epoch_of(self, step: int) -> int:
        """Return the epoch that contains counter step ``step`` (0-based)."""
        if not is_integer(step) or step < 0:
            raise InvalidParameterError(f"step must be an integer >= 0, got {step!r}")
        return (int(step) // int(self.horizon) + 1).bit_length() - 1

    def levels(self, epoch: int) -> int:
        """Return the number of tree levels ``m_j + 1`` of epoch ``epoch``."""
        _, length = self.epoch_bounds(epoch)
        return length.bit_length()

    def noise_scale(self, epoch: int) -> Fraction:
        """Return the exact discrete Laplace scale ``L (m_j + 1) / epsilon`` of epoch ``epoch``."""
        return _noise_scale(self.levels(epoch), self.epsilon, self.sensitivity)

    def node_variance(self, epoch: int) -> float:
        """Return the variance ``v`` of one node's noise in epoch ``epoch``."""
        return _node_variance(self.levels(epoch), self.epsilon, self.sensitivity)


def _combined_variances(v: float, levels: int) -> list[float]:
    """Return the combined variance of a completed node at each height 0..levels-1.

    All nodes of one height have the same variance: ``var_0 = v`` and
    ``var_{h+1} = v (2 var_h) / (v + 2 var_h)`` (Honaker 2015), computed exactly
    as :class:`TreeCounter` does.
    """
    out = [v]
    for _ in range(levels - 1):
        var_c = out[-1] + out[-1]
        out.append(v * var_c / (v + var_c))
    return out


def _max_bit_sum(n: int, weights: list[float]) -> float:
    """Return ``max over 1 <= x <= n`` of the sum of ``weights[h]`` over set bits h of x.

    Weights are positive, so the maximum is attained at ``n`` itself or at ``n``
    with one set bit cleared and all lower bits set.
    """

    def bit_sum(x: int) -> float:
        return sum(w for h, w in enumerate(weights) if (x >> h) & 1)

    best = bit_sum(n)
    for b in range(n.bit_length()):
        if (n >> b) & 1 and b > 0:
            x = ((n >> (b + 1)) << (b + 1)) | ((1 << b) - 1)
            if x >= 1:
                best = max(best, bit_sum(x))
    return best


def _epoch_variances(spec: TreeCounterSpec, epoch: int, combine: bool) -> list[float]:
    v = spec.node_variance(epoch)
    levels = spec.levels(epoch)
    return _combined_variances(v, levels) if combine else [v] * levels


def _check_step(step: int, name: str = "t") -> int:
    if not is_integer(step) or step < 0:
        raise InvalidParameterError(f"{name} must be an integer >= 0, got {step!r}")
    return int(step)


def analytic_std(spec: TreeCounterSpec, t: int) -> float:
    """Return the standard deviation of the estimate released at counter step ``t``.

    It is ``sqrt(base + sum of var_h over the set bits h of s + 1)``, where ``s``
    is ``t``'s position inside its epoch, ``var_h`` the combined variance of a
    completed node of height ``h`` and ``base`` the sum of the root variances
    of the finished epochs. No noise is drawn.
    """
    t = _check_step(t)
    epoch = spec.epoch_of(t)
    start, _ = spec.epoch_bounds(epoch)
    base = sum(_epoch_variances(spec, j, True)[-1] for j in range(epoch))
    weights = _epoch_variances(spec, epoch, True)
    x = t - start + 1
    # summed top-down, in the counter's own order, so the two agree exactly
    within = sum(weights[h] for h in reversed(range(len(weights))) if (x >> h) & 1)
    return math.sqrt(base + within)


def _worst_std(spec: TreeCounterSpec, steps: int, combine: bool) -> float:
    steps = _check_step(steps, "T")
    if steps < 1:
        raise InvalidParameterError(f"T must be >= 1, got {steps}")
    worst = 0.0
    base = 0.0
    epoch = 0
    while True:
        start, length = spec.epoch_bounds(epoch)
        if start >= steps:
            break
        weights = _epoch_variances(spec, epoch, combine)
        worst = max(worst, base + _max_bit_sum(min(length, steps - start), weights))
        base += weights[-1]
        epoch += 1
    return math.sqrt(worst)


def worst_step_std(spec: TreeCounterSpec, T: int) -> float:
    """Return ``max(analytic_std(spec, t) for t < T)``, in O(log^3 T) time."""
    return _worst_std(spec, T, combine=True)


def plain_tree_worst_std(spec: TreeCounterSpec, T: int) -> float:
    """Return the worst-step std over ``t < T`` of the same tree *without* combining.

    The plain estimator sums the noisy values of the maximal completed nodes
    (Dwork et al. 2010; Chan et al. 2011). Uses the same discrete Laplace node
    variance, so the ratio to :func:`worst_step_std` is the gain of combining.
    """
    return _worst_std(spec, T, combine=False)


class TreeCounter:
    """A running binary tree counter with online Honaker combining.

    Args:
        spec: the counter's parameters.
        noise_key: the secret key all node noise is derived from.
        coordinates: the release's coordinates, e.g. ``(flow, mechanism, key)``;
            node noise is drawn at the lane of ``coordinates``, ``(TAG_TREE, epoch, height,
            index)``.
        state: a dict from :meth:`to_state` to resume from, or ``None`` to start.

    Raises:
        InvalidParameterError: ``coordinates`` is not a tuple of str/int, or
            ``state`` is malformed or was made with another spec.

    """

    __slots__ = (
        "spec",
        "_key",
        "_coordinates",
        "_lane",
        "_steps",
        "_base_value",
        "_base_var",
        "_stack",
        "_epoch_cache",
    )

    def __init__(
        self,
        spec: TreeCounterSpec,
        noise_key: NoiseKey,
        coordinates: tuple[str | int, ...],
        state: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self._key = noise_key
        self._coordinates = check_coordinates(coordinates)
        self._lane = noise_key.lane(*self._coordinates)
        self._epoch_cache: tuple[int, Fraction, float] | None = None
        # stack entries: [height, true_sum, estimate, variance]
        self._stack: list[list[Any]] = []
        self._steps = 0
        self._base_value = 0.0
        self._base_var = 0.0
        if state is not None:
            self._load(state)

    # -- state --
    def _load(self, state: dict[str, Any]) -> None:
        try:
            if state["version"] != _STATE_VERSION:
                raise InvalidParameterError(
                    f"unknown tree counter state version {state['version']!r}"
                )
            if (
                Fraction(state["epsilon"]) != Fraction(self.spec.epsilon)
                or state["horizon"] != self.spec.horizon
                or state.get("sensitivity", 1) != self.spec.sensitivity
            ):
                raise InvalidParameterError(
                    "tree counter state was made with epsilon="
                    f"{state['epsilon']!r}, horizon={state['horizon']!r}, but the spec has "
                    f"epsilon={self.spec.epsilon!r}, horizon={self.spec.horizon!r} (or another "
                    "sensitivity)"
                )
            self._steps = int(state["steps"])
            self._base_value = float(state["base_value"])
            self._base_var = float(state["base_var"])
            self._stack = [
                [int(h), int(true), float(est), float(var)] for h, true, est, var in state["stack"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidParameterError):
                raise
            raise InvalidParameterError(f"malformed tree counter state: {exc!r}") from None
        if self._steps < 0 or len(self._stack) > self.spec.levels(self.spec.epoch_of(self._steps)):
            raise InvalidParameterError("malformed tree counter state: inconsistent stack")

    def to_state(self) -> dict[str, Any]:
        """Return the counter's state as plain JSON- and pickle-safe data.

        It holds true partial counts (never the key): keep it secret.
        """
        state = {
            "version": _STATE_VERSION,
            "epsilon": float(self.spec.epsilon),
            "horizon": int(self.spec.horizon),
            "steps": self._steps,
            "base_value": self._base_value,
            "base_var": self._base_var,
            "stack": [list(entry) for entry in self._stack],
        }
        if self.spec.sensitivity != 1:  # the event level's snapshots stay as they were
            state["sensitivity"] = self.spec.sensitivity
        return state

    @property
    def steps_done(self) -> int:
        """The number of steps processed so far (the next step's index)."""
        return self._steps

    # -- the mechanism --
    def _epoch_params(self, epoch: int) -> tuple[Fraction, float]:
        cache = self._epoch_cache
        if cache is None or cache[0] != epoch:
            scale = self.spec.noise_scale(epoch)
            cache = (epoch, scale, discrete_laplace_variance(scale))
            self._epoch_cache = cache
        return cache[1], cache[2]

    def _noisy(self, true: int, epoch: int, height: int, index: int, scale: Fraction) -> int:
        return true + laplace_one(self._key, self._lane, scale, TAG_TREE, epoch, height, index)

    def step(self, increment: int) -> CounterEstimate:
        """Add the events of one time step and return the prefix-count estimate.

        Args:
            increment: the number of events in this step (an integer >= 0).

        Returns:
            The estimate for the step just processed (``step`` is 0-based).

        Raises:
            InvalidParameterError: ``increment`` is not a non-negative integer.

        """
        checked_increment(increment)
        t = self._steps
        epoch = self.spec.epoch_of(t)
        start, length = self.spec.epoch_bounds(epoch)
        local = t - start
        scale, v = self._epoch_params(epoch)
        stack = self._stack

        leaf = int(increment)
        stack.append([0, leaf, float(self._noisy(leaf, epoch, 0, local, scale)), v])
        while len(stack) >= 2 and stack[-1][0] == stack[-2][0]:
            h_r, true_r, est_r, var_r = stack.pop()
            _, true_l, est_l, var_l = stack.pop()
            height = h_r + 1
            true = true_l + true_r
            y = self._noisy(true, epoch, height, local >> height, scale)
            est_c = est_l + est_r
            var_c = var_l + var_r
            est = (v * est_c + var_c * y) / (v + var_c)
            var = v * var_c / (v + var_c)
            stack.append([height, true, est, var])

        value = self._base_value + sum(entry[2] for entry in stack)
        variance = self._base_var + sum(entry[3] for entry in stack)
        if local + 1 == length:  # the epoch's root is complete
            (root,) = stack
            self._base_value += root[2]
            self._base_var += root[3]
            stack.clear()
        self._steps = t + 1
        return CounterEstimate(step=t, value=value, std=math.sqrt(variance))

    def __repr__(self) -> str:
        return (
            f"TreeCounter(epsilon={self.spec.epsilon!r}, horizon={self.spec.horizon}, "
            f"steps_done={self._steps})"
        )
