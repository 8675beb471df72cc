"""How sure a regression gate can be: the change of the median between two sets of runs, with a bootstrap
confidence interval.

The unit of replication is the **run**: requests within one run share the machine's state (what else ran, the
caches, the clock speed), so their spread says little about how the next run will differ — two runs of the same
code on a shared 2-core box differed by +24% in p50 TTFT. Each run gives one value per metric; a side is the
list of those values. The change is ``median(current) / median(baseline) - 1``; its interval is a percentile
bootstrap (resample each side's runs with replacement, recompute the change, take the central ``confidence``
share). A bootstrap rather than a rank test (Mann-Whitney / Hodges-Lehmann) because a rank test cannot reach 95%
with fewer than four runs per side and says nothing about a change of a median of medians, while the bootstrap
works for any statistic and for a deterministic metric gives the exact, zero-width interval. With few runs the
interval is the range of what was seen (2 vs 2: every current run against every baseline run), an honest
lower bound on the uncertainty rather than a calibrated 95%; with one run on a side it has no width at all,
which is why the gate then says its verdict carries no confidence.

When the runs were interleaved (``paasbench ab``: round i of A and round i of B back to back), the gate can
pair them (:func:`paired_change`): the bootstrap then resamples per-round changes, and the load the machine was
under in a round, shared by both of its runs, drops out. Measured on the shared dev box: engine CPU per prefill
token moved 9% between rounds but under 1% within a round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

REPS = 4000


@dataclass(frozen=True, slots=True)
class Change:
    """Relative change of the median, current vs baseline (+0.10 = 10% higher), with its interval."""

    estimate: float
    low: float
    high: float
    n_base: int
    n_cur: int
    confidence: float

    @property
    def has_confidence(self) -> bool:
        """At least two runs on each side: run-to-run noise was seen on both."""
        return self.n_base >= 2 and self.n_cur >= 2

    def flipped(self) -> "Change":
        """The same change with the sign reversed (for metrics where higher is better)."""
        return Change(-self.estimate, -self.high, -self.low, self.n_base, self.n_cur, self.confidence)


def _ratio(base: np.ndarray, cur: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (cur - base) / np.abs(base)
    zero = base == 0
    out[zero] = np.where(cur[zero] == 0, 0.0, np.copysign(np.inf, cur[zero]))
    return out


def median_change(base: Sequence[float], cur: Sequence[float], *, confidence: float = 0.95, reps: int = REPS,
                  seed: int = 0) -> Change:
    """Change of the median from ``base`` to ``cur`` (one value per run) and its bootstrap interval.

    Seeded, so the same inputs always give the same verdict.
    """
    b, c = np.asarray(base, dtype=np.float64), np.asarray(cur, dtype=np.float64)
    if b.size == 0 or c.size == 0 or not (np.isfinite(b).all() and np.isfinite(c).all()):
        raise ValueError("median_change needs finite values on both sides")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    point = float(_ratio(np.array([np.median(b)]), np.array([np.median(c)]))[0])
    rng = np.random.default_rng(seed)
    mb = np.median(b[rng.integers(0, b.size, (reps, b.size))], axis=1)
    mc = np.median(c[rng.integers(0, c.size, (reps, c.size))], axis=1)
    boot = _ratio(mb, mc)
    # a zero median on the baseline side: quantiles of ±inf are not numbers
    return _change(point, boot, boot if np.isinf(boot).any() else None, b.size, c.size, confidence)


def paired_change(base: Sequence[float], cur: Sequence[float], *, confidence: float = 0.95, reps: int = REPS,
                  seed: int = 0) -> Change:
    """Change when ``base[i]`` and ``cur[i]`` ran back to back (interleaved A/B rounds): the median of the
    per-pair changes ``cur[i] / base[i] - 1``, with a bootstrap over the pairs.

    Pairing removes what the two runs of a round shared — the machine's load then, which on a shared box moves
    both sides by several percent from one round to the next — and leaves only what differed within the round.
    """
    b, c = np.asarray(base, dtype=np.float64), np.asarray(cur, dtype=np.float64)
    if b.size == 0 or b.size != c.size or not (np.isfinite(b).all() and np.isfinite(c).all()):
        raise ValueError("paired_change needs the same number of finite values on both sides")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    r = _ratio(b, c)
    point = float(np.median(r))
    rng = np.random.default_rng(seed)
    boot = np.median(r[rng.integers(0, r.size, (reps, r.size))], axis=1)
    return _change(point, boot, r if np.isinf(r).any() or np.isnan(boot).any() else None, b.size, c.size,
                   confidence)


def _change(point: float, boot: np.ndarray, extremes: np.ndarray | None, n_base: int, n_cur: int,
            confidence: float) -> Change:
    """The central ``confidence`` share of the bootstrap ``boot`` (or, where its quantiles are not numbers, the
    range of ``extremes``), widened to hold the point estimate."""
    if extremes is not None:
        low, high = float(np.min(extremes)), float(np.max(extremes))
    else:
        tail = (1 - confidence) / 2
        low, high = (float(v) for v in np.quantile(boot, [tail, 1 - tail]))
    return Change(point, min(low, point), max(high, point), int(n_base), int(n_cur), confidence)


def fmt_interval(ch: Change) -> str:
    """``[+8.1%, +12.0%]``."""
    return f"[{fmt_pct(ch.low)}, {fmt_pct(ch.high)}]"


def fmt_pct(v: float) -> str:
    return ("+∞" if v > 0 else "−∞") if math.isinf(v) else f"{round(v * 100, 1) + 0.0:+.1f}%"   # no "-0.0%"
