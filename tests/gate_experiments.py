"""The gate's null and power experiments, seeded: tests/test_gate_stats.py asserts bounds on what they give for the
gate's interval (paasbench/gate/stats.py), and scripts/gate_bootstrap_rates.py prints the rates docs/slo.md quotes,
for that interval and for the bootstrap it replaced. One copy, so the figures the docs quote are the experiments the
tests run."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from paasbench.gate.stats import holm, median_change

Change = Callable[[Any, Any], Any]          # (baseline runs, current runs) -> an interval with .low/.high


def misses(change: Change = median_change) -> float:
    """Share of 2,000 pairs of identical 3-run sets (10% log-normal run noise) whose 95% interval misses the true
    change, 0."""
    rng = np.random.default_rng(7)
    out = 0
    for _ in range(2000):
        ch = change(np.exp(0.1 * rng.standard_normal(3)), np.exp(0.1 * rng.standard_normal(3)))
        out += not (ch.low <= 0 <= ch.high)
    return out / 2000


def holm_alarm(pairs: Sequence[tuple[Any, Any]]) -> bool:
    """The gate's family verdict: Holm at 5% over every metric's p of exceeding a 5% tolerance."""
    return any(holm([median_change(b, c).p_beyond(0.05) for b, c in pairs], 0.05))


def alarms(family: Callable[[list[tuple[Any, Any]]], bool] = holm_alarm) -> float:
    """Share of 200 comparisons of 20 metrics of unchanged code (15% log-normal noise, 3 runs a side) in which
    ``family`` (the 20 metrics' (baseline, current) runs -> a regression called?) calls a regression."""
    rng = np.random.default_rng(11)
    return sum(family([(np.exp(0.15 * rng.standard_normal(3)), np.exp(0.15 * rng.standard_normal(3)))
                       for _ in range(20)]) for _ in range(200)) / 200


def caught(sigma: float) -> int:
    """Of 10 trials, how often Holm over 20 metrics calls a real +10% change on one of them against a 5% tolerance,
    6 runs a side, ``sigma`` log-normal run noise."""
    rng = np.random.default_rng(3)
    n = 0
    for _ in range(10):
        base, cur = np.exp(sigma * rng.standard_normal(6)), 1.1 * np.exp(sigma * rng.standard_normal(6))
        others = [median_change(np.exp(sigma * rng.standard_normal(6)), np.exp(sigma * rng.standard_normal(6)))
                  for _ in range(19)]
        n += holm([median_change(base, cur).p_beyond(0.05)] + [ch.p_beyond(0.05) for ch in others], 0.05)[0]
    return n
