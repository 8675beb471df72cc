"""The twin's step sleeps absorb the worker's own host time (reference_server/engine/sim.py), and its routing
estimate is its model, not the wall clock (reference_server/routing.py PrefillEstimator).

A real sim worker (engine, scheduler, engine loop) runs one request; a fake host cost is injected into the
engine loop's per-step work (before each scheduler step). The truth each test
compares against is the same run's modeled clock, so the load of the box moves both sides alike."""

from __future__ import annotations

import time

import pytest
from sim_worker import STEP_S, run_one, sim_worker


def test_host_time_below_the_modeled_step_is_overlapped():
    w = sim_worker()
    seq, emits = run_one(w, host_s=0.4 * STEP_S, prompt=64, out=21)
    modeled_tpot = (seq.m_end - seq.m_first) / (len(seq.output) - 1)
    wall_tpot = (emits[-1] - emits[0]) / (len(emits) - 1)
    assert STEP_S <= modeled_tpot < 1.2 * STEP_S     # the fixed step, plus the tiny model's roofline
    # before: each step slept its whole modeled 20 ms on top of the 8 ms host cost (wall TPOT 1.4x modeled)
    assert wall_tpot < 1.1 * modeled_tpot, (wall_tpot, modeled_tpot)
    assert w.engine.host_bound_steps <= 2        # a late wake-up on a loaded box, at most


def test_host_time_beyond_the_modeled_step_is_counted_host_bound():
    w = sim_worker()
    seq, emits = run_one(w, host_s=2 * STEP_S, prompt=64, out=11)
    wall_tpot = (emits[-1] - emits[0]) / (len(emits) - 1)
    eng = w.engine
    assert eng.host_bound_steps >= 9              # every step after the first (the first follows an idle wait)
    # the excess over the modeled step is what the twin ran slower than the device: wall minus modeled
    per_step = eng.host_bound_seconds_total / eng.host_bound_steps
    assert per_step == pytest.approx(wall_tpot - STEP_S, rel=0.2), (per_step, wall_tpot)
    t = seq.timings()
    assert t["host_bound_ms"] == pytest.approx(1e3 * eng.host_bound_seconds_total, rel=1e-9)
    assert w.stats()["host_bound_s"] == pytest.approx(eng.host_bound_seconds_total)


def test_sim_routing_estimate_ignores_wall_clock_steps():
    """Two instances of one twin must route alike: the prefill estimate is the model's, whatever the host did."""
    w = sim_worker(chunk=64)
    before = w.offer("other", list(range(5000, 5512)))["prefill_s"]
    assert before == pytest.approx(w.estimator.prefill_s(512, 0))
    run_one(w, host_s=3 * STEP_S, prompt=512, out=2)   # 8 prefill chunks, each host-bound 3x
    # before: the estimate learned the real/modeled ratio of those steps (engine time, a late wake-up): it moved
    assert w.offer("other", list(range(5000, 5512)))["prefill_s"] == pytest.approx(before, rel=1e-9)


def test_host_bound_time_reaches_metrics_the_sweep_and_its_warning():
    """The worker's count goes out on /metrics, the sweep's scrape turns it into the step's host-bound share of
    busy time, and a run's summary share above 10% is a warning."""
    from paasbench.metrics import prometheus as prom
    from paasbench.metrics.verify import host_bound_warning
    from reference_server.metrics import RouterMetrics, render

    w = sim_worker()
    scrape = lambda at_s: prom.Scrape(url="worker", at_s=at_s,  # noqa: E731
                                      samples=prom.parse(render(RouterMetrics(), [w.stats()])))
    before = scrape(0.0)
    run_one(w, host_s=2 * STEP_S, prompt=64, out=11)
    after = scrape(10.0)
    stats = w.stats()
    assert 'paasbench_pool_host_bound_seconds_total{pool="mixed"} ' in render(RouterMetrics(), [stats])
    share = prom.step_figures(before, after)["pools"]["mixed"]["host_bound_share"]
    assert share == pytest.approx(stats["host_bound_s"] / stats["busy_s"], rel=1e-6)
    assert 0.3 < share < 0.7          # 40 ms of host per ~22 ms modeled step: about half of the busy time
    assert host_bound_warning(0.25, " (step 001)").startswith("host-bound twin (step 001): 25% of the wall E2E")
    assert host_bound_warning(0.05) is None and host_bound_warning(None) is None


def test_a_late_wake_up_is_overlapped_by_the_next_step(monkeypatch):
    """On a busy host a sleeping worker wakes late; the twin keeps its modeled pace by counting the lateness as
    host time of the next step (before: every step lost it)."""
    from reference_server.engine.base import SeqStep

    w = sim_worker()
    eng, real_sleep = w.engine, time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: real_sleep(s + 0.3 * STEP_S))    # every wake-up 6 ms late
    t0 = time.perf_counter()
    for i in range(10):
        eng.step([SeqStep("a", [1], i, [0])])
    wall = time.perf_counter() - t0
    modeled = eng.modeled_seconds_total
    assert wall < 1.1 * modeled, (wall, modeled)       # before: 1.3x (10 late wake-ups); now only the last one
    assert eng.host_bound_steps == 0
