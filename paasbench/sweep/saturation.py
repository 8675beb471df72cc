"""Is a step sustainable? Queue-growth signals read from the step's own request records.

A step can meet a latency SLO for its first minute and still be past capacity: requests arrive faster
than they leave, queues grow, and a longer step would fail. We split the measurement window into
thirds and compare the last third with the first:

* **TTFT growth** -- median TTFT (from the intended send time) rising across the window means requests
  wait longer and longer: the server's queue grows.
* **Schedule-lag growth** -- the client sending later and later behind its schedule (a concurrency cap
  or session turns backing up, or the client itself saturated).
* **In-flight growth** -- more requests outstanding at the end than at the start *for the same arrival
  rate*: judged on Little's law time in system (mean in-flight / arrival rate), since Poisson arrivals
  alone make the raw in-flight count swing.
* **Served < offered** -- fewer completions inside the window than 80% of the arrivals due in it: the
  target completes at its capacity, not at the offered rate.
* **Unfinished** -- requests due in the window that never completed (timeouts, or still running when
  the step ended) are the same backlog seen from the other side.

A signal fires only when it is large in both relative and absolute terms, so noise on a fast, idle
server (TTFT 3 ms → 6 ms) is not called saturation. Fewer than ``min_requests`` (30) in the window: no
verdict (``judged: False``); the step is then judged on its SLO alone. Comparing thirds of three requests
each is noise: on the white-paper workload (lognormal 500-token answers) time in system "doubled" between
thirds of a lightly loaded 9-request step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from paasbench.records import RequestRecord


@dataclass(frozen=True, slots=True)
class SaturationLimits:
    ttft_growth_ratio: float = 1.5      # last-third median TTFT / first-third median
    ttft_growth_min_ms: float = 250.0   # ... and at least this many ms more
    lag_growth_min_ms: float = 500.0    # last-third median schedule lag − first-third
    inflight_growth_ratio: float = 1.5  # time in system (Little: in-flight / arrival rate), last / first third
    time_in_system_growth_min_s: float = 0.5   # ... and at least this many seconds more
    unfinished_max: float = 0.05        # share of the window's requests that never finished
    served_ratio_min: float = 0.8       # completions in the window / arrivals due in it
    min_requests: int = 30             # ~10 per third: fewer and a single long request moves a median


def _thirds(xs: np.ndarray, ys: np.ndarray, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
    third = (end - start) / 3
    return ys[xs < start + third], ys[xs >= end - third]


def detect(records: Iterable[RequestRecord], window: tuple[float, float], *,
           limits: SaturationLimits = SaturationLimits()) -> dict:
    start, end = window
    records_all = list(records)
    recs = [r for r in records_all if start <= r.intended_send_s < end]
    out: dict = {"judged": False, "saturated": False, "reasons": [], "requests": len(recs)}
    reasons: list[str] = out["reasons"]
    # Requests that never finish are a backlog at any sample size (two or more, so one straggler is not).
    unfinished = sum(1 for r in recs if r.end_s is None or r.error_kind in ("total_timeout", "first_byte_timeout"))
    out["unfinished_ratio"] = unfinished / len(recs) if recs else 0.0
    if unfinished >= 2 and out["unfinished_ratio"] > limits.unfinished_max:
        reasons.append(f"{unfinished} of {len(recs)} requests never finished")
    if len(recs) < limits.min_requests:
        out["saturated"] = bool(reasons)
        return out
    out["judged"] = True

    ok = [r for r in recs if r.ok and r.first_token_s is not None]
    if len(ok) >= limits.min_requests:
        t = np.array([r.intended_send_s for r in ok])
        ttft = np.array([(r.first_token_s - r.intended_send_s) * 1e3 for r in ok])  # type: ignore[operator]
        first, last = _thirds(t, ttft, start, end)
        if len(first) and len(last):
            m0, m1 = float(np.median(first)), float(np.median(last))
            out["ttft_first_third_ms"], out["ttft_last_third_ms"] = m0, m1
            out["ttft_slope_ms_per_s"] = (m1 - m0) / ((end - start) * 2 / 3)
            if m1 > m0 * limits.ttft_growth_ratio and m1 - m0 > limits.ttft_growth_min_ms:
                reasons.append(f"TTFT grew {m0:.0f} -> {m1:.0f} ms across the step")

    sent = [r for r in recs if r.actual_send_s is not None]
    if sent:
        t = np.array([r.intended_send_s for r in sent])
        lag = np.array([(r.actual_send_s - r.intended_send_s) * 1e3 for r in sent])  # type: ignore[operator]
        first, last = _thirds(t, lag, start, end)
        if len(first) and len(last):
            growth = float(np.median(last) - np.median(first))
            out["lag_growth_ms"] = growth
            if growth > limits.lag_growth_min_ms:
                reasons.append(f"schedule lag grew by {growth:.0f} ms (client cannot send on time)")

    # In flight at time x: sent at or before x, not yet ended; averaged over a grid in each third. Raw
    # in-flight growth also follows the arrivals (a Poisson lump late in the step raises it with no queue
    # at all), so the signal is Little's law time in system, W = L / lambda, per third.
    begin = np.array([r.actual_send_s if r.actual_send_s is not None else r.intended_send_s for r in recs])
    finish = np.array([r.end_s if r.end_s is not None else np.inf for r in recs])
    intended = np.array([r.intended_send_s for r in recs])
    grid = np.linspace(start, end, 61)
    inflight = ((begin[None, :] <= grid[:, None]) & (finish[None, :] > grid[:, None])).sum(axis=1)
    f3, l3 = _thirds(grid, inflight.astype(float), start, end)
    third = (end - start) / 3
    n_first = int((intended < start + third).sum())
    n_last = int((intended >= end - third).sum())
    if len(f3) and len(l3) and n_first and n_last:
        a, b = float(f3.mean()), float(l3.mean())
        w0, w1 = a / (n_first / third), b / (n_last / third)
        out.update(inflight_first_third=a, inflight_last_third=b, time_in_system_first_s=w0,
                   time_in_system_last_s=w1)
        if w1 > w0 * limits.inflight_growth_ratio and w1 - w0 > limits.time_in_system_growth_min_s:
            reasons.append(f"time in system (in-flight / arrival rate) grew {w0:.2f} -> {w1:.2f} s "
                           f"(in flight {a:.1f} -> {b:.1f})")

    # Served vs offered: completions inside the window against arrivals due in it. A server at capacity
    # completes at its capacity, whatever arrives.
    all_ends = np.array([r.end_s for r in records_all if r.end_s is not None and r.ok])
    done = int(((all_ends >= start) & (all_ends < end)).sum())
    out["served_ratio"] = done / len(recs)
    if out["served_ratio"] < limits.served_ratio_min:
        reasons.append(f"completed {done} requests in the window for {len(recs)} arrivals")

    out["saturated"] = bool(reasons)
    return out
