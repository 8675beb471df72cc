"""Arrival modes as absolute intended send times, bounds, session plans, and pacing accuracy."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from paas_common.errors import InputError
from paasbench.load.schedule import (LoadConfig, Shard, Turns, arrivals, open_loop_times, session_plans,
                                     sleep_until)
from paasbench.trace.model import TraceRequest


def reqs(n, gap_ms=100.0, start_ms=1000.0):
    return [TraceRequest(start_ms + i * gap_ms, 10, 5, [i]) for i in range(n)]


def test_trace_mode_shifts_to_zero_and_scales():
    t = open_loop_times(reqs(4), LoadConfig(mode="trace", time_scale=0.5))
    assert t.tolist() == pytest.approx([0.0, 0.05, 0.10, 0.15])


def test_constant_rate_is_exact_and_bounded():
    t = open_loop_times(reqs(100), LoadConfig(mode="constant", rate=20.0, duration_s=1.0))
    assert t.tolist() == pytest.approx([i / 20 for i in range(20)])
    assert len(open_loop_times(reqs(100), LoadConfig(mode="constant", rate=20.0, max_requests=7))) == 7


def test_poisson_rate_and_determinism():
    a = arrivals(20001, 50.0, "poisson", 1.0, seed=3)
    gaps = np.diff(a)
    assert a[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert np.array_equal(a, arrivals(20001, 50.0, "poisson", 1.0, seed=3))
    assert not np.array_equal(a, arrivals(20001, 50.0, "poisson", 1.0, seed=4))


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_rate_changes_cv(burstiness):
    gaps = np.diff(arrivals(20001, 10.0, "gamma", burstiness, seed=1))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.08)


def test_sessions_plan_turns_and_think_time():
    rs = [TraceRequest(0, 10, 5, [0], session_id="a", turn=0),
          TraceRequest(500, 10, 5, [1], session_id="b", turn=0),
          TraceRequest(2000, 10, 5, [2], session_id="a", turn=1),
          TraceRequest(2600, 10, 5, [3]),                         # no session: its own
          TraceRequest(5000, 10, 5, [4], session_id="a", turn=2)]
    plans = session_plans(rs, LoadConfig(mode="sessions", time_scale=2.0, think_time_scale=0.5))
    assert [(p.start_s, p.turns) for p in plans] == [(0.0, [0, 2, 4]), (1.0, [1]), (5.2, [3])]
    # a recorded trace's gaps (2 s, 3 s × 0.5) hold the original response time: kept from the previous send
    assert plans[0].gap_s == pytest.approx([0.0, 1.0, 1.5]) and plans[0].think_s == [0.0, 0.0, 0.0]
    assert plans[0].intended(1, 0.0, 0.4) == pytest.approx(1.0)  # a 0.4 s answer: the gap is not stretched
    assert plans[0].intended(1, 0.0, 1.2) == pytest.approx(1.2)  # a slower answer: the user waits for it
    rs[4].extra["think_ms"] = 250.0  # generated traces say the pause itself (their gaps add a response time)
    plan = session_plans(rs, LoadConfig(mode="sessions"))[0]
    assert plan.think_s == pytest.approx([0.0, 0.0, 0.25]) and plan.gap_s == pytest.approx([0.0, 2.0, 0.0])
    assert plan.intended(2, 3.0, 4.0) == pytest.approx(4.25)  # after the answer, the pause
    by_rate = session_plans(rs, LoadConfig(mode="sessions", rate=2.0, seed=1))
    assert by_rate[0].start_s == 0.0 and len(by_rate) == 3


@pytest.mark.parametrize("bad", [
    dict(mode="poisson"), dict(mode="concurrency"), dict(mode="nope"), dict(mode="trace", time_scale=0),
    dict(mode="constant", rate=-1), dict(mode="trace", max_concurrency=0), dict(mode="trace", duration_s=0),
    dict(mode="poisson", rate=1, seed=-1)])
def test_bad_load_configs_are_input_errors(bad):
    with pytest.raises(InputError):
        LoadConfig(**bad).validate()


def test_sleep_until_hits_absolute_times_without_drift():
    # Correctness, not precision: never early, and a late wake-up is not carried into the next send. Every
    # 10th step the loop is stalled 3 ms on purpose (time.sleep, at least 3 ms however idle the box is):
    # a loop that sleeps relative to its own wake-up carries each stall on, >= 27 ms late by the last 10
    # sends; absolute deadlines catch up at once. Median wake-up precision (< 0.5 ms idle, vs a timer-only
    # sleep) is a speed figure that depends on how busy the machine is: benchmarks/bench_client.py --pacing.
    async def go():
        start = time.monotonic() + 0.01
        lags = []
        for i in range(100):  # 100 sends at 500/s
            target = start + i * 0.002
            await sleep_until(target)
            lags.append(time.monotonic() - target)
            if i % 10 == 5:
                time.sleep(0.003)
        return np.array(lags) * 1e3

    lags = asyncio.run(go())
    assert lags.min() >= 0
    # 9 stalls carried on would be >= 27 ms; a loaded 2-core box adds scheduling noise of a few ms, not 15
    assert np.median(lags[-10:]) < 15.0, lags


def test_a_send_time_goes_to_the_first_planned_request_whose_session_has_no_turn_in_flight():
    # a0 a1 b c: a1 follows a0 in session "a"; b and c have no session
    turns = Turns([(0, "a"), (1, "a"), (2, None), (3, None)])
    assert turns.take_now() == 0
    assert turns.take_now() == 2           # a1 waits for a0: the slot goes to b, the next planned request that can go
    turns.ended(0)
    assert turns.take_now() == 1           # a0 ended: a1 can go, and it was planned before c
    assert turns.take_now() == 3
    assert turns.take_now() is None


def test_a_send_time_with_no_request_that_can_go_waits_for_a_turn_to_end():
    async def go():
        turns = Turns([(0, "a"), (1, "a")])
        assert await turns.take() == 0
        waiting = asyncio.ensure_future(turns.take())
        await asyncio.sleep(0.01)
        assert not waiting.done()          # a1 cannot go before a0 has ended
        turns.ended(0)
        assert await asyncio.wait_for(waiting, 1.0) == 1
        turns.ended(1)
        assert await turns.take() is None  # nothing left: the slot is not held open
    asyncio.run(go())


def test_a_worker_keeps_whole_sessions_and_the_send_times_of_its_own_requests():
    order, sessions = [0, 1, 2, 3, 4], ["x", "y", "x", None, "y"]
    assert Shard(0, 2).by_session(order, sessions) == [0, 2]      # session x (first seen) on worker 0
    assert Shard(1, 2).by_session(order, sessions) == [1, 3, 4]   # y on worker 1; the lone request by its position
    assert Shard().by_session(order, sessions) == order
