"""Certified SLO verdicts: a step passes or fails a percentile term at a stated confidence, or says it cannot tell.

Why: a point estimate of a p50 from 7 requests passes or fails on luck, and a sweep that bisects on such verdicts
reports a bracket with no stated confidence. MLPerf LoadGen certifies a latency percentile with a binomial test
(at 0.99 confidence, 459 queries with none over the limit certify a p99); this module does the same, both ways,
and for every percentile term of an SLO.

The test, for a term ``pQ(metric) <= T`` over ``n`` window requests: a request is *bad* when its value breaks the
bound (a failed request is bad too: it did not meet its TTFT either), ``k`` of them. The term holds exactly when
the share of bad requests in the request distribution is at most ``1 - Q``. Distribution-free and exact:

* **pass** when ``P[Binom(n, 1 - Q) <= k] <= alpha``: so few bad ones would be that unlikely were the term broken;
* **fail** when ``P[Binom(n, 1 - Q) >= k] <= alpha``: so many would be that unlikely were it held;
* otherwise **undecided**.

This is the order-statistic interval of the percentile read against the threshold: pass is "the interval's upper
end meets T". :func:`percentile_interval` gives the interval itself, for the report.

A step looks at its data several times as it runs (``paasbench/sweep/sequential.py``). Each look spends part of
the error budget: with ``K`` looks each test runs at ``alpha = (1 - confidence) / K`` (Bonferroni), so the chance
of a wrong verdict over all the looks stays within ``1 - confidence``. A step fails when *any* term fails, so the
fail side is also split over the certified terms; it passes only when *every* term passes, which needs no split
(a wrong pass needs the broken term itself to pass).

What is not certified, and why (each term says ``"point"``):

* ``error_rate`` bounds pass on the point estimate and fail when the binomial test says the rate is above the
  bound: certifying ``error_rate <= 1%`` takes 299 requests without one failure at 0.95, more than a long-context
  step holds, and the failures already count as bad in every percentile term;
* ``itl`` percentiles: per-token gaps of one stream are not independent draws;
* means, extremes and scalar figures (hit ratio, TPM): no distribution-free interval from so few requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from paasbench.metrics.slo import OPS, Gate

CERTIFIED_STATS = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99, "p999": 0.999}
CERTIFIED_METRICS = {"ttft_ms", "tpot_ms", "e2e_ms", "schedule_lag_ms", "ttft_from_send_ms"}


def binom_cdf(k: int, n: int, p: float) -> float:
    """``P[Binom(n, p) <= k]``, summed in log space (n up to the hundreds of thousands a step can hold)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    j = np.arange(k + 1, dtype=np.float64)
    logs = (math.lgamma(n + 1) - np.array([math.lgamma(x + 1) for x in j])
            - np.array([math.lgamma(n - x + 1) for x in j]) + j * math.log(p) + (n - j) * math.log1p(-p))
    top = logs.max()
    return float(min(1.0, math.exp(top) * np.exp(logs - top).sum()))


def binom_sf(k: int, n: int, p: float) -> float:
    """``P[Binom(n, p) >= k]``."""
    return 1.0 - binom_cdf(k - 1, n, p)


def requests_to_pass(q: float, alpha: float) -> int:
    """The fewest requests that can certify a ``p(q)`` bound (none of them bad): ``ceil(ln alpha / ln q)``.
    p99 at 0.99 confidence and one look: 459 (MLPerf's figure); at 0.95: 299; p50 at 0.95: 5."""
    return max(1, math.ceil(math.log(alpha) / math.log(q) - 1e-12))


def percentile_interval(values: Sequence[float], q: float, confidence: float) -> tuple[float, float]:
    """A two-sided distribution-free interval of the ``q`` quantile from ``values``: order statistics
    ``x(l) <= x_q <= x(u)`` with ``P[x(l) > x_q] = P[B < l] <= a/2`` and ``P[x(u) < x_q] = P[B >= u] <= a/2``,
    ``B ~ Binom(n, q)``. An end the sample cannot bound is ``-inf`` / ``inf``."""
    xs = np.sort(np.asarray(values, dtype=np.float64))
    n, half = len(xs), (1.0 - confidence) / 2
    lo, hi = -math.inf, math.inf
    for j in range(n, 0, -1):                       # the largest l with P[B <= l - 1] <= a/2
        if binom_cdf(j - 1, n, q) <= half:
            lo = float(xs[j - 1])
            break
    for j in range(1, n + 1):                       # the smallest u with P[B >= u] <= a/2
        if binom_sf(j, n, q) <= half:
            hi = float(xs[j - 1])
            break
    return lo, hi


@dataclass(frozen=True, slots=True)
class TermVerdict:
    """One SLO term at one look."""

    gate: str                 # the term as written canonically, e.g. "p50(ttft) <= 6000 ms"
    kind: str                 # "certified" | "point"
    verdict: str              # "pass" | "fail" | "undecided"
    n: int                    # requests judged
    bad: int                  # of them breaking the bound (failed requests included), certified terms
    measured: float | None    # the point estimate (the summary's figure)
    interval: tuple[float, float] | None = None   # the percentile's interval at the confidence (certified)
    p_pass: float | None = None   # P[Binom(n, 1-Q) <= bad]: small = clearly held
    p_fail: float | None = None   # P[Binom(n, 1-Q) >= bad]: small = clearly broken

    def to_dict(self) -> dict[str, Any]:
        return {"gate": self.gate, "kind": self.kind, "verdict": self.verdict, "n": self.n, "bad": self.bad,
                "measured": self.measured,
                "interval": None if self.interval is None else [_finite(x) for x in self.interval],
                "p_pass": self.p_pass, "p_fail": self.p_fail}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def certifiable(gate: Gate) -> bool:
    """A percentile of a per-request latency: the binomial test applies."""
    return gate.stat in CERTIFIED_STATS and gate.key in CERTIFIED_METRICS


def judge_term(gate: Gate, values: Sequence[float], failed: int, summary: dict[str, Any], *,
               alpha_pass: float, alpha_fail: float, confidence: float) -> TermVerdict:
    """One term. ``values``: the metric of the window's successful requests (NaN where a request has none, e.g.
    TPOT of a one-token answer: left out); ``failed``: the window's failed requests, each bad; ``summary``: the
    window's summary, for the point estimate and the point-judged terms."""
    measured = gate.measure(summary)
    if not certifiable(gate):
        return _point(gate, summary, measured, alpha_fail)
    xs = np.asarray(values, dtype=np.float64)
    xs = xs[~np.isnan(xs)]
    ok = OPS[gate.op]
    bad = int(sum(not ok(float(x), gate.threshold) for x in xs)) + failed
    n = int(xs.size) + failed
    q = CERTIFIED_STATS[gate.stat or ""]
    if n == 0:
        return TermVerdict(gate.label, "certified", "undecided", 0, 0, measured)
    p_pass, p_fail = binom_cdf(bad, n, 1 - q), binom_sf(bad, n, 1 - q)
    verdict = "pass" if p_pass <= alpha_pass else "fail" if p_fail <= alpha_fail else "undecided"
    # the interval over every judged request, a failed one counting as past any bound on the side it breaks
    fill = math.inf if gate.lower_is_better else -math.inf
    interval = percentile_interval(np.concatenate([xs, np.full(failed, fill)]), q, confidence)
    return TermVerdict(gate.label, "certified", verdict, n, bad, measured, interval, p_pass, p_fail)


def _point(gate: Gate, summary: dict[str, Any], measured: float | None, alpha_fail: float) -> TermVerdict:
    """A term judged on its point estimate; an ``error_rate`` upper bound also fails on the binomial test."""
    requests = summary.get("requests") or {}
    n, failed = int(requests.get("total") or 0), int(requests.get("failed") or 0)
    if gate.key == "error_rate" and gate.lower_is_better and n:
        if binom_sf(failed, n, gate.threshold) <= alpha_fail and failed / n > gate.threshold:
            return TermVerdict(gate.label, "point", "fail", n, failed, measured)
    if measured is None:
        return TermVerdict(gate.label, "point", "undecided", n, 0, None)
    return TermVerdict(gate.label, "point", "pass" if OPS[gate.op](measured, gate.threshold) else "fail", n, 0,
                       measured)


def term_values(gate: Gate, frame: Any) -> list[float]:
    """The per-request values a certified term judges, from a ``summary.records_frame`` of the window's
    successful requests."""
    return [] if gate.key not in frame else frame[gate.key].tolist()


def judge_terms(gates: Iterable[Gate], frame: Any, failed: int, summary: dict[str, Any], *, confidence: float,
                looks: int) -> list[TermVerdict]:
    """Every term at one of ``looks`` looks (module docstring: the error budget)."""
    gates = list(gates)
    alpha = (1.0 - confidence) / max(1, looks)
    n_certified = max(1, sum(certifiable(g) for g in gates))
    return [judge_term(g, term_values(g, frame), failed, summary, alpha_pass=alpha,
                       alpha_fail=alpha / n_certified, confidence=confidence) for g in gates]


def combine(terms: Sequence[TermVerdict], *, final: bool) -> str:
    """The step's verdict from its terms: fail when a certified term failed (a point term only at the last look:
    more requests can still move a point estimate), pass when every term passed, else undecided."""
    if any(t.verdict == "fail" and (t.kind == "certified" or final) for t in terms):
        return "fail"
    if terms and all(t.verdict == "pass" for t in terms):
        return "pass"
    return "undecided"


def binding(terms: Sequence[TermVerdict]) -> str | None:
    """The term that decided a failing (or undecided) step: a failed one, else the least clear."""
    failed = [t for t in terms if t.verdict == "fail"]
    if failed:
        return failed[0].gate
    open_ = [t for t in terms if t.verdict == "undecided"]
    return min(open_, key=lambda t: t.p_pass if t.p_pass is not None else 1.0).gate if open_ else None


def minimum_requests(gates: Iterable[Gate], confidence: float, looks: int) -> list[dict[str, Any]]:
    """What each certified term needs to pass at the least, with one look and with ``looks``: printed before a
    sweep starts, so a window too short to ever certify a p99 is seen before the cluster time is spent."""
    out = []
    for g in gates:
        if certifiable(g):
            q = CERTIFIED_STATS[g.stat or ""]
            out.append({"gate": g.label, "one_look": requests_to_pass(q, 1 - confidence),
                        "with_looks": requests_to_pass(q, (1 - confidence) / max(1, looks)), "looks": looks})
    return out
