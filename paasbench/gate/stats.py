"""How sure a regression gate can be: the change between two sets of runs, a Student-t interval on the log ratio,
and Holm's correction across the metrics judged together.

The unit of replication is the **run**: requests within one run share the machine's state (what else ran, the
caches, the clock speed), so their spread says little about how the next run will differ — two runs of the same
code on a shared 2-core box differed by +24% in p50 TTFT. Each run gives one value per metric; a side is the
list of those values.

**Why a t-interval on log ratios, not a bootstrap.** Gates run on 2–12 results a side. A percentile bootstrap over
three values a side can only recombine what it saw, so its interval is far narrower than the true spread: two sets
of identical sim runs (3 a side, interleaved) got "modeled TTFT p50 +28.0% [+6.0%, +42.8%] regression". The
t-interval widens as the sample shrinks (t(0.975, 4 df) = 2.78, not 1.96), which is what a small sample needs.
Latencies and throughputs are positive and their run-to-run noise is multiplicative, so the change is taken on the
log scale: ``d = mean(log current) − mean(log baseline)`` (Welch's standard error and degrees of freedom), and
reported as the relative change ``exp(d) − 1`` (+0.10 = 10% higher). Where a side holds zeros or negatives (an
error rate of 0) the same interval is taken on the difference of means relative to the baseline's mean.

**Paired** (:func:`paired_change`): when round i of A and round i of B ran back to back (``paasbench ab``), the
interval is on the mean of the per-round log ratios, so the load the machine was under in a round, shared by both
of its runs, drops out (engine CPU per prefill token moved 9% between rounds but under 1% within a round).

**Exact figures.** A metric with no spread at all on either side (the sim twin's modeled time at concurrency 1) has
a zero-width interval: its change is known exactly from two runs a side.

**Many metrics at once.** The gate judges some 20 metrics; at 95% each, one of them would cross by chance in most
comparisons of unchanged code. :func:`holm` applies Holm's step-down correction to the one-sided p-values of
"worse than the tolerance allows", so the family of metrics together is held to the stated level.

**The floor.** Below :data:`MIN_RUNS` results on a side (pairs, when paired) a metric that shows spread cannot be
judged: its interval is shown but no regression or improvement is called ("no confidence").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MIN_RUNS = 3     # results a side (or pairs) below which a noisy metric's change is shown but never called


@dataclass(frozen=True, slots=True)
class Change:
    """Relative change, current vs baseline (+0.10 = 10% higher), with its interval at ``confidence``.

    ``d``, ``se`` and ``df`` are the test statistic's parts on the scale the interval was built on (``scale``: "log"
    for ``log(current/baseline)``, "relative" for ``(current − baseline)/|baseline|``); ``sign`` is −1 once
    :meth:`flipped` (a metric where higher is better, read in its worse direction).
    """

    estimate: float
    low: float
    high: float
    n_base: int
    n_cur: int
    confidence: float
    d: float = 0.0
    se: float = 0.0
    df: float = math.inf
    scale: str = "log"
    sign: int = 1

    @property
    def has_confidence(self) -> bool:
        """At least two runs on each side: run-to-run noise was seen on both."""
        return self.n_base >= 2 and self.n_cur >= 2

    @property
    def exact(self) -> bool:
        """No spread on either side: the change is known, not estimated."""
        return self.has_confidence and self.se == 0.0

    @property
    def judgeable(self) -> bool:
        """Enough results to call a change: exact, or at least ``MIN_RUNS`` a side."""
        return self.exact or min(self.n_base, self.n_cur) >= MIN_RUNS

    def flipped(self) -> "Change":
        """The same change with the sign reversed (for metrics where higher is better)."""
        return Change(-self.estimate, -self.high, -self.low, self.n_base, self.n_cur, self.confidence,
                      self.d, self.se, self.df, self.scale, -self.sign)

    def p_beyond(self, tolerance: float) -> float:
        """One-sided p-value of "the true change, read in this object's direction, is no more than ``tolerance``":
        small when the change is confidently worse than the tolerance allows."""
        return _p_exceeds(self, tolerance)


def _threshold(c: Change, rel: float) -> float | None:
    """The relative change ``rel`` in the worse direction on the statistic's own scale, or None if unreachable."""
    raw = rel * c.sign                                    # back to current-vs-baseline terms
    if c.scale == "log":
        return math.log1p(raw) if raw > -1 else None
    return raw


def _p_exceeds(c: Change, tolerance: float) -> float:
    if math.isinf(c.estimate):
        return 0.0 if c.estimate > 0 else 1.0
    thr = _threshold(c, tolerance)
    if thr is None:                                       # a fall of more than 100%: nothing can be that worse
        return 1.0
    beyond = (c.d - thr) * c.sign                         # > 0: the estimate lies beyond the tolerance
    if c.se == 0.0:
        return 0.0 if beyond > 0 else 1.0
    from scipy.stats import t as student_t
    return float(student_t.sf(beyond / c.se, c.df))


def _check(b: np.ndarray, c: np.ndarray, confidence: float) -> None:
    if b.size == 0 or c.size == 0 or not (np.isfinite(b).all() and np.isfinite(c).all()):
        raise ValueError("the gate's statistics need finite values on both sides")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")


def _welch(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """``mean(y) − mean(x)``, its standard error and Welch–Satterthwaite degrees of freedom."""
    vx = float(np.var(x, ddof=1)) / x.size if x.size > 1 else 0.0
    vy = float(np.var(y, ddof=1)) / y.size if y.size > 1 else 0.0
    se = math.sqrt(vx + vy)
    denom = (vx * vx / (x.size - 1) if x.size > 1 else 0.0) + (vy * vy / (y.size - 1) if y.size > 1 else 0.0)
    df = (vx + vy) ** 2 / denom if denom > 0 else math.inf
    return float(np.mean(y) - np.mean(x)), se, df


def _interval(d: float, se: float, df: float, confidence: float, scale: str, n_base: int, n_cur: int) -> Change:
    if se == 0.0 or not math.isfinite(df):
        q = 0.0 if se == 0.0 else _t_quantile(confidence, 1e9)
    else:
        q = _t_quantile(confidence, df)
    lo, hi = d - q * se, d + q * se
    to_rel = math.expm1 if scale == "log" else (lambda v: v)
    return Change(to_rel(d), to_rel(lo), to_rel(hi), n_base, n_cur, confidence, d, se, df, scale)


def _t_quantile(confidence: float, df: float) -> float:
    from scipy.stats import t as student_t
    return float(student_t.ppf(0.5 + confidence / 2, df))


def median_change(base: Sequence[float], cur: Sequence[float], *, confidence: float = 0.95) -> Change:
    """Change from ``base`` to ``cur`` (one value per run, unpaired), with a Welch t-interval on the log ratio.

    The name is kept from the bootstrap-of-medians era; with all values positive the estimate is the ratio of
    geometric means, which for the gate's run-level figures sits within a fraction of a percent of the ratio of
    medians and, unlike it, has an interval that is honest at three runs a side.
    """
    b, c = np.asarray(base, dtype=np.float64), np.asarray(cur, dtype=np.float64)
    _check(b, c, confidence)
    if (b > 0).all() and (c > 0).all():
        d, se, df = _welch(np.log(b), np.log(c))
        return _interval(d, se, df, confidence, "log", b.size, c.size)
    return _relative(b, c, confidence)


def _relative(b: np.ndarray, c: np.ndarray, confidence: float) -> Change:
    """Zeros or negatives on a side: the difference of means relative to the baseline's mean."""
    scale = abs(float(np.mean(b)))
    diff, se, df = _welch(b, c)
    if scale == 0.0:
        est = 0.0 if diff == 0 else math.copysign(math.inf, diff)
        low = 0.0 if diff >= 0 else -math.inf
        high = 0.0 if diff <= 0 else math.inf
        return Change(est, min(low, est), max(high, est), b.size, c.size, confidence, diff, se, df, "relative")
    return _interval(diff / scale, se / scale, df, confidence, "relative", b.size, c.size)


def paired_change(base: Sequence[float], cur: Sequence[float], *, confidence: float = 0.95) -> Change:
    """Change when ``base[i]`` and ``cur[i]`` ran back to back (interleaved A/B rounds): the mean of the per-round
    log ratios ``log(cur[i] / base[i])`` with a one-sample t-interval over the rounds.

    Pairing removes what the two runs of a round shared — the machine's load then, which on a shared box moves
    both sides by several percent from one round to the next — and leaves only what differed within the round.
    """
    b, c = np.asarray(base, dtype=np.float64), np.asarray(cur, dtype=np.float64)
    if b.size != c.size:
        raise ValueError("paired_change needs the same number of values on both sides")
    _check(b, c, confidence)
    if (b > 0).all() and (c > 0).all():
        r, scale = np.log(c / b), "log"
    elif (b != 0).all():
        r, scale = (c - b) / np.abs(b), "relative"
    else:
        return _relative(b, c, confidence)
    d = float(np.mean(r))
    se = float(np.std(r, ddof=1)) / math.sqrt(r.size) if r.size > 1 else 0.0
    if r.size > 1 and se < 1e-12 * max(1.0, abs(d)):     # identical ratios: rounding, not spread
        se = 0.0
    return _interval(d, se, r.size - 1 if r.size > 1 else math.inf, confidence, scale, b.size, c.size)


def runs_to_decide(base: Sequence[float], cur: Sequence[float], tolerance: float, alpha: float, *,
                   paired: bool = False, worse_is_lower: bool = False, limit: int = 1000) -> int | None:
    """How many results to add on each side before "worse than ``tolerance``" would be decided at ``alpha``,
    if the change and each side's run-to-run spread stayed as measured; None past ``limit`` (or when the change
    is not beyond the tolerance, so no number of results would call it).

    The same test as the gate's (Welch on the log values, or the paired one on per-round log ratios) with each
    side's standard deviation held and its count grown: k more a side shrinks the standard error as
    sqrt(s_b²/(n_b + k) + s_c²/(n_c + k)). At least :data:`MIN_RUNS` a side is required, as the gate requires.
    ``alpha`` is the level the metric's p-value must reach (the gate passes α/m, Holm's strictest step over m
    metrics, so the figure is the most a side could need)."""
    b, c = np.asarray(base, dtype=np.float64), np.asarray(cur, dtype=np.float64)
    if not ((b > 0).all() and (c > 0).all()) or b.size == 0 or c.size == 0:
        return None
    thr = math.log1p(-tolerance if worse_is_lower else tolerance)
    from scipy.stats import t as student_t

    if paired and b.size == c.size:
        r = np.log(c / b)
        d, sd = float(np.mean(r)), float(np.std(r, ddof=1)) if r.size > 1 else 0.0
        beyond = (thr - d) if worse_is_lower else (d - thr)
        if beyond <= 0:
            return None
        for k in range(max(0, MIN_RUNS - r.size), limit + 1):
            n = r.size + k
            if sd == 0.0 or student_t.sf(beyond / (sd / math.sqrt(n)), n - 1) <= alpha:
                return k
        return None
    lb, lc = np.log(b), np.log(c)
    d = float(np.mean(lc) - np.mean(lb))
    beyond = (thr - d) if worse_is_lower else (d - thr)
    if beyond <= 0:
        return None
    vb = float(np.var(lb, ddof=1)) if b.size > 1 else 0.0
    vc = float(np.var(lc, ddof=1)) if c.size > 1 else 0.0
    if b.size < 2 or c.size < 2:      # a side with one result shows no spread: take the other side's for both
        vb = vc = max(vb, vc)
    for k in range(max(0, MIN_RUNS - min(b.size, c.size)), limit + 1):
        nb, nc = b.size + k, c.size + k
        eb, ec = vb / nb, vc / nc
        se = math.sqrt(eb + ec)
        if se == 0.0:
            return k
        df = (eb + ec) ** 2 / (eb * eb / (nb - 1) + ec * ec / (nc - 1))
        if student_t.sf(beyond / se, df) <= alpha:
            return k
    return None


def holm(p_values: Sequence[float], alpha: float) -> list[bool]:
    """Holm's step-down procedure: which hypotheses are rejected with the familywise error held at ``alpha``.

    Sort the p-values; reject the k-th smallest while ``p_(k) <= alpha / (m − k + 1)``; stop at the first that fails.
    """
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out = [False] * m
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (m - rank):
            break
        out[i] = True
    return out


def fmt_interval(ch: Change) -> str:
    """``[+8.1%, +12.0%]``."""
    return f"[{fmt_pct(ch.low)}, {fmt_pct(ch.high)}]"


def fmt_pct(v: float) -> str:
    return ("+∞" if v > 0 else "−∞") if math.isinf(v) else f"{round(v * 100, 1) + 0.0:+.1f}%"   # no "-0.0%"
