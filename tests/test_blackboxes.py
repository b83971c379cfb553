"""Tests of the static black boxes (core.pmwg.blackboxes): the synopsis and NoisyHistogram."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
from support.recording import RecordingKey

from dpstream.core.noise.keys import NoiseKey
from dpstream.core.noise.samplers import discrete_laplace_variance
from dpstream.core.pmwg.blackboxes import (
    HistogramSynopsis,
    NoisyHistogram,
    synopsis_from_state,
)
from dpstream.errors import InvalidParameterError


def rng_for(seed: int, *prefix: str | int):
    key = NoiseKey.for_tests(seed)
    return lambda *c: key.stream("test", *prefix, *c)


def dlap_moments(scale: float) -> tuple[float, float]:
    """Return (variance, fourth moment) of DLap(scale), summed over the support."""
    q = math.exp(-1.0 / scale)
    norm = (1 - q) / (1 + q)
    ks = np.arange(1, int(200 * scale) + 50, dtype=np.float64)
    w = 2 * norm * q**ks
    return float(np.sum(w * ks**2)), float(np.sum(w * ks**4))


# --- the synopsis ----------------------------------------------------------------------


def test_histogram_synopsis_answers_and_round_trips() -> None:
    syn = HistogramSynopsis(np.array([0.5, 0.25, -0.125, 0.375]))
    assert syn.answer(np.array([1.0, 1.0, 0.0, 0.0])) == 0.75
    assert syn.answer(np.array([0, 1, 1, 0])) == 0.125  # integer weights are fine
    state = json.loads(json.dumps(syn.to_state()))
    assert synopsis_from_state(state) == syn
    with pytest.raises(InvalidParameterError, match=r"one entry per universe element \(N = 4\)"):
        syn.answer(np.ones(3))
    with pytest.raises(InvalidParameterError, match=r"finite and in \[0, 1\]"):
        syn.answer(np.array([0.0, 1.5, 0.0, 0.0]))
    with pytest.raises(InvalidParameterError, match="1-D numpy array"):
        syn.answer([1.0, 0.0, 0.0, 0.0])  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="unknown synopsis kind 'tree'"):
        synopsis_from_state({"kind": "tree"})
    with pytest.raises(InvalidParameterError, match="malformed synopsis state"):
        synopsis_from_state({"kind": "histogram", "version": 1})
    with pytest.raises(InvalidParameterError, match="finite"):
        HistogramSynopsis(np.array([0.0, math.inf]))



# --- NoisyHistogram ---------------------------------------------------------------------


def test_noisy_histogram_parameters() -> None:
    box = NoisyHistogram(1024)
    assert (box.name, box.p, box.p_prime, box.p_double_prime) == ("noisy-histogram", 1, 1, 0)
    assert box.g == pytest.approx(2 * (1 + 1024 * math.log(2)))
    assert box.noise_scale(0.5) == 2
    # the derived bound 2 (N ln 2 + ln(1/beta)) / (eps n) fits Definition 4 for beta <= 1/e
    for beta in (1 / math.e, 0.1, 0.05, 1e-9):
        bound = box.error_bound(10**6, 0.5, 1.0, beta)
        assert bound == pytest.approx(2 * (1024 * math.log(2) + math.log(1 / beta)) / 5e5)
        assert bound <= box.g * math.log(1 / beta) / (0.5 * 10**6) * (1 + 1e-12)
    with pytest.raises(InvalidParameterError, match="universe_size must be an integer >= 1"):
        NoisyHistogram(0)


def test_noisy_histogram_input_checks() -> None:
    box = NoisyHistogram(4)
    rf = rng_for(1)
    with pytest.raises(InvalidParameterError, match=r"one cell per universe element \(N = 4\)"):
        box.run(np.zeros(5, dtype=np.int64), 10, 1.0, 0.1, 0.05, rf)
    with pytest.raises(InvalidParameterError, match="1-D numpy array of integers"):
        box.run(np.zeros(4), 10, 1.0, 0.1, 0.05, rf)
    with pytest.raises(InvalidParameterError, match="got a negative cell$"):
        box.run(np.array([1, -1, 0, 0]), 10, 1.0, 0.1, 0.05, rf)
    with pytest.raises(InvalidParameterError, match=r"beta must be in \(0, 1\)"):
        box.run(np.zeros(4, dtype=np.int64), 10, 1.0, 0.1, 1.0, rf)
    with pytest.raises(InvalidParameterError, match="epsilon must be finite and > 0"):
        box.run(np.zeros(4, dtype=np.int64), 10, 0.0, 0.1, 0.5, rf)


def test_noisy_histogram_is_replay_safe() -> None:
    box = NoisyHistogram(16)
    counts = np.arange(16, dtype=np.int64) * 10
    a = box.run(counts, 1200, 1.0, 0.1, 0.05, rng_for(3))
    b = box.run(counts, 1200, 1.0, 0.1, 0.05, rng_for(3))
    c = box.run(counts, 1200, 1.0, 0.1, 0.05, rng_for(3, "other"))
    assert a == b and a != c
    key = RecordingKey(3)
    box.run(counts, 1200, 1.0, 0.1, 0.05, lambda *s: key.stream("p", *s))
    assert key.calls == [("p", "cells")]
    # noisy counts are integers: n y - counts is an integer noise vector (up to float division)
    noise = a.values * 1200 - counts
    assert np.allclose(noise, np.rint(noise), rtol=0, atol=1e-9)


@pytest.mark.statistical
def test_noisy_histogram_noise_variance_per_cell() -> None:
    # M = 40000 cells, eps = 0.5: the noise of each cell is DLap(2). With the mean known (0),
    # v = mean(Z^2) has sd sqrt((mu4 - sigma^4) / M). For DLap(2), mu4 / sigma^4 ~ 6, so the
    # relative sd is ~1.1%. A 5 sd tolerance (about 5.6%) fails a correct sampler with
    # probability ~6e-7 (CLT; M is large).
    cells, eps = 40_000, 0.5
    box = NoisyHistogram(cells)
    counts = np.random.default_rng(0).integers(0, 1000, size=cells, dtype=np.int64)
    n = int(counts.sum())
    syn = box.run(counts, n, eps, 0.1, 0.05, rng_for(7))
    noise = np.rint(syn.values * n).astype(np.int64) - counts
    var, mu4 = dlap_moments(2.0)
    assert var == pytest.approx(discrete_laplace_variance(Fraction(2)), rel=1e-12)
    sd = math.sqrt((mu4 - var**2) / cells)
    observed = float(np.mean(noise.astype(np.float64) ** 2))
    assert abs(observed - var) < 5 * sd
    assert abs(float(np.mean(noise))) < 5 * math.sqrt(var / cells)
    # power: noise of scale 2.2 (a 10% error in the scale) has a variance > 10 sd away
    assert abs(dlap_moments(2.2)[0] - var) > 10 * sd
