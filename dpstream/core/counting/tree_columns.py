"""The binary tree counters of many keys as columns: one group, stepped together.

:class:`TreeGroup` is the columnar equivalent of ``n`` independent
:class:`~dpstream.core.counting.tree_counter.TreeCounter` objects that started at the same step
(the binary tree mechanism, Dwork, Naor, Pitassi, Rothblum 2010 and Chan, Shi, Song 2011,
Algorithm 2 of paper 001, with the doubling epochs of Chan, Shi, Song 2011; see
:mod:`dpstream.core.counting.tree_counter`, whose module docstring has the sensitivity argument:
one event is in one node of every height, so each node's Laplace noise of scale
``height / epsilon`` per epoch gives epsilon-DP per epoch; nothing here changes it).

They are at the same counter step, so they share the epoch, the position in it, the node noise
scale and the shape of the stack of maximal completed nodes. The stack is a list of dense
columns (true sums as int64, Honaker-combined estimates as float64; Honaker 2015 in the online
form of TF-Privacy's tree aggregation); a step appends a leaf column and merges the carry chain
with a few vectorized operations, the noise of every node completed in the step drawn with one
bulk call per height (:func:`dpstream.core.noise.bulk.laplace`, at each key's lane and the
coordinates ``(TAG_TREE, epoch, height, index)`` of the per-key counter: the same values, so
the noise is exact and replay-safe). The variances depend on the shape alone, so they are
Python floats, computed with the very expressions of ``TreeCounter``; the estimates are
combined with the same IEEE operations (``(v e_c + var_c y) / (v + var_c)``, the prefix sum
over the stack bottom to top), so they are equal bit for bit.

**State** (:meth:`TreeGroup.to_state`): the group's shared fields, its step, the finished
epochs' base and the stack's true sums and estimates -- true counts, so the store is secret;
never a lane or a noise value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from dpstream.core.counting.blt_columns import CounterGroup
from dpstream.core.counting.tree_counter import TreeCounterSpec
from dpstream.core.noise import bulk as bulk_noise
from dpstream.core.noise.coordinates import TAG_TREE
from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_laplace_variance

__all__ = ["TreeGroup", "TreeNode"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
WordArray = npt.NDArray[np.uint64]
RowArray = npt.NDArray[np.int32]


class TreeNode:
    """A maximal completed node of a group's stack: one column per key."""

    __slots__ = ("height", "true", "est", "var")

    def __init__(self, height: int, true: IntArray, est: FloatArray, var: float) -> None:
        self.height, self.true, self.est, self.var = height, true, est, var


class TreeGroup(CounterGroup):
    """The tree counters of the keys whose counter started at the same step.

    They are at the same counter step, so they share the epoch, the node noise scale, the
    stack's shape and the variances (Python floats); the per-key parts are columns.
    """

    __slots__ = ("steps", "base_value", "base_var", "stack")

    def __init__(self, start: int, code: int, rows: RowArray, keys: Sequence[str],
                 lanes: WordArray, initial: FloatArray | None, initial_var: float) -> None:
        super().__init__(start, code, rows, keys, lanes, initial, initial_var)
        self.steps = 0  # counter steps done (the next one's index)
        self.base_value: FloatArray | None = None  # finished epochs' roots (None: 0.0)
        self.base_var = 0.0
        self.stack: list[TreeNode] = []

    def keep(self, mask: npt.NDArray[np.bool_]) -> None:
        """Keep only the keys where ``mask`` is True (a new key list: the old one is shared)."""
        super().keep(mask)
        if self.base_value is not None:
            self.base_value = self.base_value[mask]
        for node in self.stack:
            node.true, node.est = node.true[mask], node.est[mask]

    def step(self, spec: TreeCounterSpec, noise: NoiseKey,
             leaf: IntArray) -> tuple[FloatArray, float]:
        """One step of every counter: ``TreeCounter.step``, column by column.

        ``leaf`` holds the keys' increments (in the group's order). Returns the estimates
        (``TreeCounter``'s value, without the initial count) and their variance.
        """
        lanes = self.lanes
        t = self.steps
        epoch = spec.epoch_of(t)
        start, length = spec.epoch_bounds(epoch)
        local = t - start
        scale = spec.noise_scale(epoch)
        v = discrete_laplace_variance(scale)
        stack = self.stack
        y = leaf + bulk_noise.laplace(noise, lanes, scale, TAG_TREE, epoch, 0, local)
        stack.append(TreeNode(0, leaf, y.astype(np.float64), v))
        while len(stack) >= 2 and stack[-1].height == stack[-2].height:
            right = stack.pop()
            left = stack.pop()
            height = right.height + 1
            true = left.true + right.true
            y = true + bulk_noise.laplace(noise, lanes, scale, TAG_TREE, epoch, height,
                                          local >> height)
            var_c = left.var + right.var
            # est = (v * est_c + var_c * y) / (v + var_c), the same IEEE operations in place
            est = left.est + right.est
            est *= v
            est += var_c * y
            est /= v + var_c
            stack.append(TreeNode(height, true, est, v * var_c / (v + var_c)))
        # TreeCounter: value = base + sum(estimates) with sum() starting at 0 (0 + e0 = e0
        # here: no estimate is ever -0.0), in the stack's order; float additions commute
        value = stack[0].est.copy()
        for node in stack[1:]:
            value += node.est
        if self.base_value is not None:
            value += self.base_value
        variance = self.base_var + sum(node.var for node in stack)
        if local + 1 == length:  # the epoch's root is complete
            (root,) = stack
            self.base_value = (root.est.copy() if self.base_value is None
                               else self.base_value + root.est)
            self.base_var += root.var
            stack.clear()
        self.steps = t + 1
        return value, variance

    def to_state(self) -> dict[str, Any]:
        """Plain data: the shared fields and the stack (true sums: secret); no lanes."""
        return {
            **self.shared_state(), "steps": self.steps,
            "base_value": None if self.base_value is None else self.base_value.copy(),
            "base_var": self.base_var,
            "stack": [[n.height, n.true.copy(), n.est.copy(), n.var] for n in self.stack],
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take the counters' part of a :meth:`to_state` snapshot (the shared part is given)."""
        self.steps = int(state["steps"])
        base = state["base_value"]
        self.base_value = None if base is None else np.array(base, dtype=np.float64)
        self.base_var = float(state["base_var"])
        self.stack = [TreeNode(int(h), np.array(true, dtype=np.int64),
                               np.array(est, dtype=np.float64), float(var))
                      for h, true, est, var in state["stack"]]
