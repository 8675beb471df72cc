#!/usr/bin/env python3
"""Why the gate left its percentile bootstrap (docs/slo.md, "Which interval, and why not a bootstrap"): the null and
power experiments tests/test_gate_stats.py runs (tests/gate_experiments.py, the one copy), run both against the
bootstrap the gate used before commit 25444da (read from git history, so this needs a git checkout) and against
today's t-interval with Holm (paasbench/gate/stats.py). The tests assert bounds; this prints the rates the docs quote.

    python scripts/gate_bootstrap_rates.py          # about 15 s of CPU
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gate_experiments import alarms, caught, holm_alarm, misses  # noqa: E402

from paasbench.gate.stats import median_change  # noqa: E402

OLD = "25444da^:paasbench/gate/stats.py"


def old_median_change() -> Callable:
    src = subprocess.run(["git", "show", OLD], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    mod = sys.modules["old_stats"] = types.ModuleType("old_stats")     # dataclasses look their module up
    exec(compile(src, OLD, "exec"), mod.__dict__)
    return mod.median_change


def main() -> int:
    old = old_median_change()
    print(f"95% interval missing a true change of 0 (2,000 3-vs-3 sets): bootstrap {100 * misses(old):.1f}%, "
          f"t-interval {100 * misses(median_change):.1f}%")
    boot = alarms(lambda ms: any(old(b, c).low > 0.05 for b, c in ms))          # each metric at 95%, no correction
    now = alarms(holm_alarm)
    print(f"20 metrics of unchanged code, a regression called (200 comparisons): bootstrap {100 * boot:.0f}%, "
          f"Holm {100 * now:.1f}%")
    print(f"a real +10% against a 5% tolerance, 6 runs a side, caught of 10: noise 1.25% {caught(0.0125)}, "
          f"noise 2% {caught(0.02)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
