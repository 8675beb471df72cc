"""Is a step sustainable? Queue-growth and served-vs-offered signals read from the step's own records.

A step can meet a latency SLO for its first minute and still be past capacity: requests arrive faster
than they leave, queues grow, and a longer step would fail. The signals, over the requests whose
*intended* send lies in the window (the step's scheduled set, ``docs/metrics.md``):

* **Served < offered** -- fewer than 80% of them (and two or more short, or none at all) were served: got
  their first token (prefill done) by the drain deadline (window end + drain), without failing. A target at
  capacity serves at its capacity, whatever arrives; a target answering 503 serves nothing. Judged at any
  sample size.
* **Unfinished** -- more than 5% (and two or more) never finished, or hit a first-byte/total timeout:
  the backlog seen from the other side. Judged at any sample size.
* **TTFT growth** -- TTFT (from the intended send) of the window's last third against its first: the
  server's queue grows.
* **Time-in-system growth** -- the same for each request's own time in system (intended send to end;
  to its failure, or to the last end seen, if it never finished). That is Little's law's W measured
  per request: an estimate from in-flight counts divided by the arrival rate is wrong on a step that
  starts from an idle server, where the window's first requests find nothing in flight before them
  (an idle server with 10 s answers "grew" 2.6 -> 11 s that way).
* **Schedule-lag growth** -- sends later and later behind their schedule: sessions whose previous turn has not
  ended when their next send time comes (the server answers too slowly for the sessions in flight:
  ``RequestRecord.turn_wait_s``), or a client that cannot keep up.

A growth signal fires when the last third is larger than the first in relative *and* absolute terms
(so a fast idle server going 3 ms -> 6 ms is not a queue) *and* the shift is systematic: a one-sided
Mann-Whitney test of last third > first third at p < 0.01. The test is what lets small steps be judged
(20-30 requests, as a 256K context bucket near capacity holds): a queue orders the thirds completely
(p ~ 0.001 with 7 requests a third), while one long answer among seven moves a median but not the
ranks. With fewer than ``min_per_third`` (5) requests in a third the growth signals give no verdict
(``judged: False``); served-vs-offered and unfinished still do.

**A swing is not a queue that only grows.** Near its capacity a stable server's queue swings up and back down for
as long as it runs, and a window's last third lands on a swing as often as not. On the twin's white-paper 64K
bucket, held 30 minutes (reports/ground-truth/), 2.95 req/s kept its p50 TTFT between 0.2 and 5.6 s by 150 s
segment, 0.86 s over its second quarter-hour, against a 6 s bound; its first 300 s "grew" 0.48 -> 1.82 s
(p = 4e-8), and a certified verification of them failed it. 3.05 req/s met the bound over its first 15 minutes
and then broke it (p50 8.5-18.9 s by segment). No test on a few minutes tells such a swing from slow overload
by its shape; what tells them apart is where the growth has carried the latency the SLO bounds. So TTFT growth
counts only once the last third reaches ``slo_share`` (half) of the SLO's bound on TTFT, at that gate's own
statistic (its p50 for ``p50(ttft)``), and time-in-system growth likewise against an E2E bound; a growth short of
that is kept as a ``swing`` in the figures. Where the SLO bounds no TTFT, TTFT growth counts as before (time in
system: below). A sweep's search steps, a minute long, count any growth (:data:`GROWTH_ALONE`,
:func:`step_limits`): on so short a window the level reached did not part a swing from overload (seeded 64K point
steps passed 3.261 req/s at 43% of the bound). Judged against the bound, 300 s verifications replayed on those
runs' first minutes passed every run at 2.80-2.966 req/s (``benchmarks/rejudge.py``).

**Time in system, where the SLO bounds only the first token.** A backlog anywhere in the server delays first
tokens (a disaggregated decode worker streams the first token; a full colocated engine queues new prompts), so a
queue shows in TTFT. A time in system that grows while TTFT stays flat is the decode side slowing down, longer
answers and the bigger decode batch they make, which settles below capacity: counted alone it failed a white-paper
64K step at half the capacity (1.51 req/s: 4.05 -> 9.98 s, p50 TTFT 131-144 ms by third). Where the SLO bounds
none of E2E, TPOT and ITL (:func:`bounds_decode`) that growth is a ``swing``; where it bounds E2E it is judged
against the bound as TTFT is; where it bounds TPOT or ITL, or there is no SLO, it counts as before.

A cold start cannot fake growth: every figure is a per-request time, and a cold cache makes the
*first* third slower, not the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from paasbench.metrics.records import RequestRecord
from paasbench.metrics.slo import Gate


@dataclass(frozen=True, slots=True)
class SaturationLimits:
    ttft_growth_ratio: float = 1.5      # last-third median TTFT / first-third median
    ttft_growth_min_ms: float = 250.0   # ... and at least this many ms more
    tis_growth_ratio: float = 1.5       # time in system, last / first third
    tis_growth_min_s: float = 0.5       # ... and at least this many seconds more
    lag_growth_min_ms: float = 500.0    # last-third median schedule lag − first-third
    growth_p_max: float = 0.01          # one-sided Mann-Whitney p-value below which a shift is systematic
    unfinished_max: float = 0.05        # share of the window's requests that never finished
    served_ratio_min: float = 0.8       # served by the deadline / arrivals due in the window
    min_per_third: int = 5              # growth signals need this many requests in each third
    slo_share: float = 0.5              # TTFT / time-in-system growth counts once its last third reaches this
                                        # share of the SLO's bound on TTFT / E2E (where the SLO bounds them)
    slo_share_early: float = 1.0        # ... on a certified step's looks before its window is covered (sequential.py)


DECODE_KEYS = ("e2e_ms", "tpot_ms", "itl_ms")   # the SLO keys a request's time after its first token moves
# any systematic growth counts, near the bound or not
GROWTH_ALONE = SaturationLimits(slo_share=0.0, slo_share_early=0.0)


def step_limits(phase: str) -> SaturationLimits:
    """The saturation test's limits for a step in ``phase``. A search step (60 s of window at white-paper 64K; a
    plan's probes too) counts any queue growth; a verification, five windows long, counts a growth once it nears
    the SLO's bound (module docstring, "A swing is not a queue that only grows"). Measured on the twin's 64K
    bucket (docs/sweep.md, "Saturation"): judged against the bound, 60 s point steps passed 3.261 and 3.064 req/s
    (TTFT grew to 43% and 17% of the bound), loads that do not hold for 30 minutes, and two of three certified
    searches passed loads their verification then failed, leaving no budget to walk down; a 60 s window is too
    short to tell a swing from overload by its level, while 300 s replayed on 30-minute runs told them apart at
    every load that holds."""
    return SaturationLimits() if phase == "verify" else GROWTH_ALONE


def mann_whitney_p(first: np.ndarray, last: np.ndarray) -> float:
    """One-sided p-value that ``last`` tends to exceed ``first`` (Mann-Whitney U, normal approximation
    with tie and continuity corrections; good from ~5 per group)."""
    n1, n2 = len(first), len(last)
    if not n1 or not n2:
        return 1.0
    both = np.concatenate([first, last])
    order = both.argsort(kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    values, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    ranks = np.bincount(inverse, weights=ranks)[inverse] / counts[inverse]     # mid-ranks for ties
    u = ranks[n1:].sum() - n2 * (n2 + 1) / 2                                    # U of `last`
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - float((counts ** 3 - counts).sum()) / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (u - n1 * n2 / 2 - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


def _thirds(xs: np.ndarray, ys: np.ndarray, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
    third = (end - start) / 3
    return ys[xs < start + third], ys[xs >= end - third]


def _lag_cause(recs: list[RequestRecord], since: float) -> str:
    """Whose lag it was in the window's last third: the sessions' (their sends waited for a previous turn to end:
    the server is behind) when that wait is most of it, else the client's."""
    late = [r for r in recs if r.intended_send_s >= since and r.actual_send_s is not None]
    lag = sum(r.actual_send_s - r.intended_send_s for r in late)   # type: ignore[operator]
    held = sum(r.turn_wait_s or 0.0 for r in late)
    if lag > 0 and held >= lag / 2:
        return "sends waited for their session's previous turn to end: the server answers too slowly"
    return "client cannot send on time"


def bound_reach(values: np.ndarray, gates: Sequence[Gate], key: str, to_unit: float = 1.0) -> float | None:
    """How far ``values`` (a third's) reach the SLO's upper bounds on ``key``: the largest ratio of the third's own
    statistic of a gate (its p50 for ``p50(ttft)``, its p99 for ``p99(ttft)``) to that gate's bound, in the gate's
    unit (``to_unit`` converts). None where no gate bounds ``key`` from above."""
    bounds = [g for g in gates if g.key == key and g.stat and g.lower_is_better and g.threshold > 0]
    if not bounds or not len(values):
        return None
    v = values * to_unit

    def stat(name: str) -> float:
        if name in ("mean", "max", "min"):
            return float(getattr(np, name)(v))
        return float(np.percentile(v, 99.9 if name == "p999" else float(name[1:])))

    return max(stat(g.stat) / g.threshold for g in bounds)   # type: ignore[arg-type]


def bounds_decode(gates: Sequence[Gate]) -> bool:
    """Whether the SLO bounds what happens after the first token (E2E, TPOT or ITL) from above: where it bounds
    none, time-in-system growth without TTFT growth is no saturation (module docstring, "Time in system")."""
    return any(g.key in DECODE_KEYS and g.lower_is_better for g in gates)


def detect(records: Iterable[RequestRecord], window: tuple[float, float], *, drain_s: float = 0.0,
           limits: SaturationLimits = SaturationLimits(), gates: Sequence[Gate] = ()) -> dict:
    """Saturation verdict and figures of one step; ``drain_s`` after the window end is the deadline by
    which a window request must have been served (as for the step's rates, ``metrics.summarize``); ``gates``: the
    SLO, whose bounds on TTFT and E2E a growth of those must approach before it counts (module docstring)."""
    start, end = window
    records_all = list(records)
    recs = [r for r in records_all if start <= r.intended_send_s < end]
    deadline = end + drain_s
    out: dict = {"judged": False, "saturated": False, "reasons": [], "requests": len(recs)}
    reasons: list[str] = out["reasons"]

    def swing(text: str) -> None:   # a growth short of what counts: kept in the figures, not a reason
        out.setdefault("swings", []).append(text)

    if not recs:
        return out

    # at any sample size: counts, not medians; of the requests the run let reach the deadline: one it cancelled
    # first (a certified step stopped on known misses, a Ctrl-C) was not given the drain, so it says nothing here
    given = [r for r in recs if r.error_kind != "cancelled"]
    served = sum(1 for r in given if r.ok and r.first_token_s is not None and r.first_token_s <= deadline)
    out["served"] = served
    out["served_ratio"] = served / len(given) if given else 1.0
    # one straggler is no backlog, but a step that served nothing sustained nothing
    if given and out["served_ratio"] < limits.served_ratio_min and (len(given) - served >= 2 or not served):
        reasons.append(f"served {served} of {len(given)} arrivals by {drain_s:g} s after the window")
    unfinished = sum(1 for r in recs if r.end_s is None or r.error_kind in ("total_timeout", "first_byte_timeout"))
    out["unfinished_ratio"] = unfinished / len(recs)
    if unfinished >= 2 and out["unfinished_ratio"] > limits.unfinished_max:
        reasons.append(f"{unfinished} of {len(recs)} requests never finished")

    t = np.array([r.intended_send_s for r in recs])
    last_seen = max((r.end_s for r in records_all if r.end_s is not None), default=deadline)
    growth = [
        ("ttft", [(r.first_token_s - r.intended_send_s) * 1e3 if r.ok and r.first_token_s is not None else math.nan
                  for r in recs]),
        ("tis", [((r.end_s if r.end_s is not None else last_seen) - r.intended_send_s) for r in recs]),
        ("lag", [(r.actual_send_s - r.intended_send_s) * 1e3 if r.actual_send_s is not None else math.nan
                 for r in recs]),
    ]
    for name, values in growth:
        v = np.asarray(values, dtype=np.float64)
        keep = ~np.isnan(v)
        first, last = _thirds(t[keep], v[keep], start, end)
        if min(len(first), len(last)) < limits.min_per_third:
            continue
        out["judged"] = True
        m0, m1 = float(np.median(first)), float(np.median(last))
        p = mann_whitney_p(first, last)
        systematic = p < limits.growth_p_max
        if name == "ttft":
            reach = bound_reach(last, gates, "ttft_ms")
            out.update(ttft_first_third_ms=m0, ttft_last_third_ms=m1, ttft_growth_p=p,
                       ttft_slope_ms_per_s=(m1 - m0) / ((end - start) * 2 / 3), ttft_last_third_of_slo=reach)
            if systematic and m1 > m0 * limits.ttft_growth_ratio and m1 - m0 > limits.ttft_growth_min_ms:
                if reach is None or reach >= limits.slo_share:
                    reasons.append(f"TTFT grew {m0:.0f} -> {m1:.0f} ms across the step")
                else:
                    swing(f"TTFT grew {m0:.0f} -> {m1:.0f} ms, {reach:.0%} of the SLO's bound")
        elif name == "tis":
            reach = bound_reach(last, gates, "e2e_ms", to_unit=1e3)
            out.update(time_in_system_first_s=m0, time_in_system_last_s=m1, time_in_system_growth_p=p,
                       time_in_system_last_third_of_slo=reach)
            if systematic and m1 > m0 * limits.tis_growth_ratio and m1 - m0 > limits.tis_growth_min_s:
                if reach is None and gates and not bounds_decode(gates):
                    swing(f"time in system grew {m0:.2f} -> {m1:.2f} s; the SLO bounds no E2E, TPOT or ITL")
                elif reach is None or reach >= limits.slo_share:
                    reasons.append(f"time in system grew {m0:.2f} -> {m1:.2f} s across the step")
                else:
                    swing(f"time in system grew {m0:.2f} -> {m1:.2f} s, {reach:.0%} of the SLO's bound")
        else:
            out.update(lag_growth_ms=m1 - m0, lag_growth_p=p)
            if systematic and m1 - m0 > limits.lag_growth_min_ms:
                reasons.append(f"schedule lag grew by {m1 - m0:.0f} ms ({_lag_cause(recs, end - (end - start) / 3)})")
    out["saturated"] = bool(reasons)
    return out
