"""What a window of T seconds cannot see: the overload a run that long can hold by chance.

A certified step decides the SLO's percentiles over its own window, and a verification holds the answer's load for
``--verify-for`` seconds. A buyer asks whether the load holds for as long as it runs. Near the capacity those part:
a load a little past it grows its queue so slowly that the queue's own swing hides the growth for minutes. On the
twin's white-paper 64K bucket, whose truth held 30 minutes is [2.95, 3.0) req/s, 300 s verifications passed 3.0
and 3.012 req/s, and 3.05 req/s met the SLO over its first 15 minutes before it broke it (reports/ground-truth/).
Five of twenty seeded 64K answers started at 3.0-3.071 req/s and missed the truth that way
(reports/certified-sweep/, "the lower end less the overload its window could hold").

The margin is the queue's arithmetic, measured on the window itself. Over a window of ``T`` seconds the requests in
the system change by ``X = arrivals - departures`` (a departure: the request's end, or its failure). Past the
capacity ``mu`` by a share ``eps``, ``X`` drifts by about ``eps * lambda * T``; its swing is ``sqrt(var * T)``, where
``var`` is the net flow's variance per second, measured here from the window's bins (arrivals by intended send,
departures by end; 10 s bins, or twenty bins where the window is shorter than 200 s). A drift smaller than ``z``
swings is one the window holds by chance more often than ``1 - confidence``. So a load ``lambda`` that held for ``T``
seconds says, at that confidence, only that the capacity is at least ``lambda / (1 + delta)`` with::

    delta = z * sqrt(var * T) / (lambda * T)

For Poisson arrivals and exponential service near the capacity ``var`` is ``2 * lambda``; the twin's 64K steps
measured 0.59-0.96 ``lambda`` (departures follow arrivals where the queue is short), so ``delta`` is 4.2-5.5% at
2.88-3.01 req/s over 300 s (``benchmarks/horizon_margin.py``). The margin falls as ``1 / sqrt(lambda * T)``: a longer
verification, or a higher rate, sees a smaller overload. It is the answer's lower end (``buckets[].certified``'s
``horizon``); the load that held and its figures stay what was measured.

The upper end, the certified fail, gets no margin. A fail on queue growth alone has a window no longer than a pass's,
but growth below the capacity is rare where an overload held by chance is not: on the white-paper 64K bucket the
upper end lay above the truth's lower end in all but one of 35 sweeps, where a margin would take the interval's
median width from 9.5% to 22.7% on twenty seeds (``benchmarks/horizon_margin.py`` measures that side, docs/sweep.md).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Iterable

import numpy as np

from paasbench.metrics.records import RequestRecord

MAX_BIN_S = 10.0     # net flow is counted in bins this long, or shorter where the window would hold fewer than
MIN_BINS = 20        # this many: a variance from 20 bins is within about 0.5-1.7x of the true one at 95%; from the
                     # six 10 s bins a 60 s search step would get, 0.2-2.6x (the default white-paper sweep's answers
                     # are such steps)


def unseen_overload(records: Iterable[RequestRecord], window: tuple[float, float], confidence: float,
                    ) -> dict[str, Any] | None:
    """The overload share ``delta`` a run over ``window`` (seconds on the run's clock) holds with probability above
    ``1 - confidence``, from its own net flow (module docstring); None for an empty window or one with no arrivals."""
    w0, w1 = window
    held_s = w1 - w0
    if held_s <= 0:
        return None
    bin_s = min(MAX_BIN_S, held_s / MIN_BINS)
    edges = w0 + bin_s * np.arange(int(held_s / bin_s + 1e-9) + 1)
    recs = list(records)
    arrivals = np.histogram([r.intended_send_s for r in recs], edges)[0]
    departures = np.histogram([r.end_s for r in recs if r.end_s is not None], edges)[0]
    span_s = edges[-1] - w0
    rate = float(arrivals.sum()) / span_s
    if rate <= 0:
        return None
    var_per_s = float(np.var(arrivals - departures, ddof=1)) / bin_s
    z = NormalDist().inv_cdf(confidence)
    delta = z * math.sqrt(var_per_s * span_s) / (rate * span_s)
    return {"held_s": round(span_s, 3), "bin_s": round(bin_s, 3), "arrival_rate": rate,
            "net_flow_var_per_s": var_per_s, "confidence": confidence, "overload_unseen": delta}


def long_run_low(load: float, margin: dict[str, Any] | None) -> float:
    """The lowest capacity a load that held (with its :func:`unseen_overload` ``margin``) is consistent with."""
    return load if margin is None else load / (1.0 + margin["overload_unseen"])


def answer_horizon(load: float, margin: dict[str, Any] | None) -> dict[str, Any] | None:
    """A certified answer's ``horizon``: its pass's margin and the interval's lower end, ``low``; None without one."""
    return None if margin is None else {**margin, "low": long_run_low(load, margin)}
