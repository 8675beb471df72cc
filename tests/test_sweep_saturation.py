"""Queue-growth detection on synthetic record sets: a stable server, a queueing one, a lagging client."""

from __future__ import annotations

import numpy as np
import pytest

from paasbench.records import RequestRecord
from paasbench.sweep.saturation import detect


def rec(i: int, t: float, ttft: float, dur: float, lag: float = 0.0, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=i, request_id=str(i), session_id=None, turn=None, intended_send_s=t,
                         actual_send_s=t + lag, first_token_s=t + ttft if ok else None,
                         end_s=t + ttft + dur if ok else None, error_kind=None if ok else "total_timeout")


def poisson_times(rate: float, t_end: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1 / rate, size=int(rate * t_end * 2)))[: int(rate * t_end)]


def test_stable_server_is_not_saturated():
    rng = np.random.default_rng(1)
    recs = [rec(i, t, 0.2 + rng.normal(0, 0.02), 0.5) for i, t in enumerate(poisson_times(4, 30))]
    out = detect(recs, (5.0, 25.0))
    assert out["judged"] and not out["saturated"], out
    assert 0.9 < out["served_ratio"] < 1.1


def test_growing_queue_is_saturated():
    # service 0.5 s per request, arrivals every 0.4 s: each request waits 0.1 s longer than the last
    recs, free = [], 0.0
    for i, t in enumerate(np.arange(0, 30, 0.4)):
        start = max(t, free)
        free = start + 0.5
        recs.append(rec(i, float(t), start - t + 0.05, free - start))
    out = detect(recs, (5.0, 25.0))
    assert out["saturated"]
    assert any("TTFT grew" in r for r in out["reasons"]) and any("in-flight" in r for r in out["reasons"])
    assert out["ttft_slope_ms_per_s"] > 100
    assert out["served_ratio"] == pytest.approx(0.8, abs=0.05)       # serves 2/s of the 2.5/s offered


def test_client_lag_growth_is_saturated():
    recs = [rec(i, t, 0.1, 0.1, lag=0.1 * t) for i, t in enumerate(np.arange(0, 30, 0.25))]
    out = detect(recs, (0.0, 30.0))
    assert out["saturated"] and any("schedule lag" in r for r in out["reasons"])


def test_unfinished_requests_are_saturation():
    recs = [rec(i, t, 0.1, 0.1, ok=(i % 5 != 0)) for i, t in enumerate(np.arange(0, 20, 0.2))]
    out = detect(recs, (0.0, 20.0))
    assert out["saturated"] and out["unfinished_ratio"] > 0.15


def test_small_absolute_growth_on_a_fast_server_is_noise():
    recs = [rec(i, t, 0.003 + 0.0002 * t, 0.01) for i, t in enumerate(np.arange(0, 20, 0.1))]
    assert not detect(recs, (0.0, 20.0))["saturated"]    # 3 ms -> 7 ms: doubled, but not a queue


def test_too_few_requests_is_not_judged():
    out = detect([rec(0, 1.0, 5.0, 1.0)], (0.0, 10.0))
    assert not out["judged"] and not out["saturated"]


def test_warmup_outside_window_is_ignored():
    # huge TTFTs during warm-up only (cold caches), steady afterwards
    recs = [rec(i, t, 3.0 if t < 5 else 0.2, 0.2) for i, t in enumerate(np.arange(0, 25, 0.2))]
    assert not detect(recs, (5.0, 25.0))["saturated"]


def test_arrival_lump_without_queueing_is_not_saturation():
    # 1 req/s in the first half, 10 req/s in the second, every request served in 0.5 s in parallel:
    # in flight grows 0.5 -> 5 with no queue at all; time in system stays 0.5 s
    times = list(np.arange(0, 10, 1.0)) + list(np.arange(10, 20, 0.1))
    recs = [rec(i, float(t), 0.1, 0.4) for i, t in enumerate(times)]
    out = detect(recs, (0.0, 20.0))
    assert out["inflight_last_third"] > 4 * out["inflight_first_third"]
    assert not out["saturated"], out["reasons"]


def test_unfinished_requests_count_even_in_a_small_step():
    recs = [rec(i, float(t), 0.1, 0.1, ok=(i % 3 != 0)) for i, t in enumerate(range(10))]
    out = detect(recs, (0.0, 10.0))
    assert not out["judged"] and out["saturated"] and "never finished" in out["reasons"][0]
    one = [rec(i, float(t), 0.1, 0.1, ok=(i != 4)) for i, t in enumerate(range(10))]
    assert not detect(one, (0.0, 10.0))["saturated"]               # a single straggler is not a backlog
