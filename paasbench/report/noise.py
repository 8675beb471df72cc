"""Is a latency difference between two single results more than their own requests' noise?

``paasbench compare`` sets one run (or a sweep's best step) beside another. Ten requests a side give a p50 that
could sit almost anywhere between their 2nd and 9th values, so "+111%" from them may say nothing. Each
percentile gets a distribution-free interval from its own run's requests: with n requests, the q-quantile lies
between the order statistics X(r) and X(s), r and s the binomial(n, q) quantiles at (1 − confidence)/2 and
(1 + confidence)/2 (the textbook interval; it assumes nothing about the latency distribution). A change whose
interval, from the two sides' intervals, holds 0 is **within noise**. Too few requests leave a percentile's
interval open at one end (26 requests cannot bound a p90: all 26 fall below it 6.5% of the time); a change the
bounded ends do not decide is then "too few requests to tell"; one they do decide is a change.

This is the noise of one run's requests only. Two runs of the same code also differ run to run (the machine's
state; :mod:`paasbench.gate.stats` says why the gate replicates runs), so a difference outside these intervals is
still not a verdict: that takes ``paasbench ab`` and ``gate --paired``. The intervals only keep compare from
colouring a difference its own requests cannot carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from paasbench.report.curves import measurement_window, request_latencies
from paasbench.report.load import RunResult

CONFIDENCE = 0.95
LEVELS = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99}
BLOCKS = ("ttft_ms", "tpot_ms", "e2e_ms")   # the per-request figures records.jsonl keeps (request_latencies)


@dataclass(frozen=True, slots=True)
class Interval:
    """A quantile's interval; ``None`` ends are unbounded (too few requests to bound them)."""

    low: float | None
    high: float | None
    n: int


@dataclass(frozen=True, slots=True)
class Noise:
    """The relative change (current / baseline − 1) a pair of percentile intervals allows."""

    low: float             # -1.0 at worst (a latency is never below 0)
    high: float            # inf when unbounded
    n_base: int
    n_cur: int
    bounded: bool = True   # both sides' intervals have both ends (else too few requests for that percentile)

    @property
    def holds_zero(self) -> bool:
        return self.low <= 0.0 <= self.high


def quantile_interval(values: Sequence[float], q: float, confidence: float = CONFIDENCE) -> Interval:
    """The distribution-free interval of the ``q``-quantile from ``values`` (order statistics, binomial ranks)."""
    from scipy.stats import binom

    x = sorted(v for v in values if v is not None and math.isfinite(v))
    n = len(x)
    if n == 0:
        return Interval(None, None, 0)
    alpha = 1.0 - confidence
    r = int(binom.ppf(alpha / 2, n, q))          # 1-based rank of the lower end
    s = int(binom.ppf(1 - alpha / 2, n, q)) + 1  # 1-based rank of the upper end
    return Interval(float(x[r - 1]) if r >= 1 else None, float(x[s - 1]) if s <= n else None, n)


def change_noise(base: Interval, cur: Interval) -> Noise | None:
    """The change the two intervals allow; None when a side has no requests."""
    if base.n == 0 or cur.n == 0:
        return None
    low = cur.low / base.high - 1.0 if cur.low is not None and base.high else -1.0
    high = cur.high / base.low - 1.0 if cur.high is not None and base.low else math.inf
    bounded = None not in (base.low, base.high, cur.low, cur.high)
    return Noise(low, high, base.n, cur.n, bounded)


def latency_noise(base: RunResult, cur: RunResult, path: str) -> Noise | None:
    """The noise of the change in ``path`` (``ttft_ms.p50``) from each run's own window requests
    (records.jsonl), or None when the metric is not a per-request percentile or a side kept no records."""
    block, _, stat = path.partition(".")
    if block not in BLOCKS or stat not in LEVELS or base.records_path is None or cur.records_path is None:
        return None
    sides = [request_latencies(r.records_path, measurement_window(r.meta))[block] for r in (base, cur)]
    return change_noise(*(quantile_interval(v, LEVELS[stat]) for v in sides))
