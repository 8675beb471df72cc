"""The gate's statistics (paasbench/gate/stats.py): a known shift is detected, no shift passes, deterministic figures
give exact intervals, and pairing interleaved rounds removes what a round's two runs shared."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paasbench.gate.stats import median_change, paired_change


def runs(n: int, centre: float, noise: float, seed: int) -> list[float]:
    return list(centre * (1 + noise * np.random.default_rng(seed).standard_normal(n)))


def test_a_known_shift_is_detected():
    base, cur = runs(8, 100.0, 0.02, 1), runs(8, 120.0, 0.02, 2)       # +20%, 2% run-to-run noise
    ch = median_change(base, cur)
    assert 0.15 < ch.low <= ch.estimate <= ch.high < 0.25
    assert ch.has_confidence and ch.low > 0.05          # beyond a 5% tolerance: a regression


def test_no_shift_passes():
    for seed in range(20):                              # same distribution both sides, many draws
        ch = median_change(runs(6, 100.0, 0.03, seed), runs(6, 100.0, 0.03, seed + 100))
        assert ch.low <= 0.05 and ch.high >= -0.05      # never confidently beyond a 5% tolerance
        assert ch.low < ch.high


def test_the_interval_widens_with_noise_and_is_seeded():
    quiet = median_change(runs(6, 100, 0.01, 3), runs(6, 100, 0.01, 4))
    loud = median_change(runs(6, 100, 0.10, 3), runs(6, 100, 0.10, 4))
    assert loud.high - loud.low > 3 * (quiet.high - quiet.low)
    assert median_change([1, 2, 3], [2, 3, 4]) == median_change([1, 2, 3], [2, 3, 4])


def test_deterministic_figures_give_an_exact_interval():
    ch = median_change([26.6, 26.6], [29.26, 29.26])
    assert ch.low == pytest.approx(0.1) and ch.high == pytest.approx(0.1)


def test_one_run_per_side_has_no_confidence():
    ch = median_change([100.0], [130.0])
    assert not ch.has_confidence and ch.low == ch.high == pytest.approx(0.3)
    assert not median_change([100.0, 101.0], [130.0]).has_confidence


def test_two_by_two_interval_is_the_range_of_the_pairs():
    ch = median_change([100, 110], [110, 121])
    assert ch.low == pytest.approx(110 / 110 - 1) and ch.high == pytest.approx(121 / 100 - 1)


def test_pairing_removes_the_rounds_shared_load():
    load = [0.8, 1.3, 1.0, 1.15]                          # the machine's state, shared by both runs of a round
    base = [100 * f for f in load]
    cur = [110 * f * (1 + d) for f, d in zip(load, (0.005, -0.004, 0.002, 0.0))]
    unpaired, paired = median_change(base, cur), paired_change(base, cur)
    assert unpaired.low < 0.05                           # unpaired: the load swamps a 10% change
    assert 0.09 < paired.low <= paired.high < 0.11       # paired: 10% seen, to within the within-round noise
    with pytest.raises(ValueError):
        paired_change([1.0, 2.0], [1.0])


def test_zero_baseline_and_bad_input():
    ch = median_change([0.0, 0.0], [0.0, 0.02])          # error rate 0 -> 1%: an infinite relative change
    assert math.isinf(ch.estimate) and ch.low == 0.0
    with pytest.raises(ValueError):
        median_change([], [1.0])
    with pytest.raises(ValueError):
        median_change([float("nan")], [1.0])
