#!/usr/bin/env python3
"""Why the gate left its percentile bootstrap (docs/slo.md, "Which interval, and why not a bootstrap"): the null and
power experiments of tests/test_gate_stats.py, run both against the bootstrap the gate used before commit 25444da
(read from git history, so this needs a git checkout) and against today's t-interval with Holm
(paasbench/gate/stats.py). The tests assert bounds; this prints the rates the docs quote.

    python scripts/gate_bootstrap_rates.py          # about 15 s of CPU
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Callable

import numpy as np

from paasbench.gate.stats import holm, median_change

OLD = "25444da^:paasbench/gate/stats.py"


def old_median_change() -> Callable:
    src = subprocess.run(["git", "show", OLD], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    mod = sys.modules["old_stats"] = types.ModuleType("old_stats")     # dataclasses look their module up
    exec(compile(src, OLD, "exec"), mod.__dict__)
    return mod.median_change


def misses(change: Callable) -> float:
    """Share of 2,000 identical 3-vs-3 sets (10% log-normal noise) whose 95% interval misses the true change, 0."""
    rng = np.random.default_rng(7)          # test_three_a_side_is_not_judged_narrower_than_it_is
    out = 0
    for _ in range(2000):
        ch = change(np.exp(0.1 * rng.standard_normal(3)), np.exp(0.1 * rng.standard_normal(3)))
        out += not (ch.low <= 0 <= ch.high)
    return out / 2000


def alarms(family: Callable[[list], bool]) -> float:
    """Share of 200 comparisons of 20 metrics of unchanged code (15% noise, 3 runs a side) that call a regression."""
    rng = np.random.default_rng(11)         # test_twenty_metrics_of_unchanged_code_rarely_cry_wolf
    return sum(family([(np.exp(0.15 * rng.standard_normal(3)), np.exp(0.15 * rng.standard_normal(3)))
                       for _ in range(20)]) for _ in range(200)) / 200


def caught(sigma: float) -> int:
    """Of 10 trials, how often Holm over 20 metrics calls a real +10% change against a 5% tolerance, 6 runs a side."""
    rng = np.random.default_rng(3)          # test_a_real_ten_percent_slowdown_is_still_caught_with_six_a_side
    n = 0
    for _ in range(10):
        base, cur = np.exp(sigma * rng.standard_normal(6)), 1.1 * np.exp(sigma * rng.standard_normal(6))
        others = [median_change(np.exp(sigma * rng.standard_normal(6)), np.exp(sigma * rng.standard_normal(6)))
                  for _ in range(19)]
        n += holm([median_change(base, cur).p_beyond(0.05)] + [ch.p_beyond(0.05) for ch in others], 0.05)[0]
    return n


def main() -> int:
    old = old_median_change()
    print(f"95% interval missing a true change of 0 (2,000 3-vs-3 sets): bootstrap {100 * misses(old):.1f}%, "
          f"t-interval {100 * misses(median_change):.1f}%")
    boot = alarms(lambda ms: any(old(b, c).low > 0.05 for b, c in ms))          # each metric at 95%, no correction
    now = alarms(lambda ms: any(holm([median_change(b, c).p_beyond(0.05) for b, c in ms], 0.05)))
    print(f"20 metrics of unchanged code, a regression called (200 comparisons): bootstrap {100 * boot:.0f}%, "
          f"Holm {100 * now:.1f}%")
    print(f"a real +10% against a 5% tolerance, 6 runs a side, caught of 10: noise 1.25% {caught(0.0125)}, "
          f"noise 2% {caught(0.02)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
