"""The queueing models a plan sizes its headroom with (paasbench/plan/queueing.py), against exact results and against a
simulation of the queue they model (docs/plan.md, "Queueing headroom")."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

from paasbench.plan.queueing import (erlang_c, max_rate_for_occupancy, mgc_wait, occupancy_quantile,
                                     ttft_quantile)


def test_erlang_c_known_values():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)            # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)          # (a^2/2)/(1-rho) over 1 + a + that
    assert erlang_c(200, 190.0) < 1.0 and erlang_c(3, 3.0) == 1.0 and erlang_c(3, 0.0) == 0.0


@pytest.mark.parametrize("c,rho,q", [(1, 0.5, 0.9), (2, 0.8, 0.5), (4, 0.9, 0.99), (16, 0.7, 0.95)])
def test_mmc_waiting_quantile_is_exact(c: int, rho: float, q: float):
    """Exponential service: the Allen-Cunneen form is M/M/c itself, P(W > t) = C exp(-(c mu - lambda) t)."""
    lam, s = rho * c, 1.0
    pw = erlang_c(c, lam * s)
    exact = math.log(pw / (1 - q)) / (c / s - lam) if pw > 1 - q else 0.0
    assert ttft_quantile(mgc_wait(c, lam, s, 1.0), np.zeros(1), q) == pytest.approx(exact, rel=1e-6, abs=1e-9)


def _simulate(c: int, lam: float, service: np.ndarray, seed: int = 1) -> np.ndarray:
    """FIFO M/G/c: waiting time + service of each arrival (the first tenth dropped: the empty start)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / lam, len(service)))
    free = [0.0] * c
    total = np.empty(len(service))
    for i, (t, s) in enumerate(zip(arrivals, service)):
        start = max(t, heapq.heappop(free))
        heapq.heappush(free, start + s)
        total[i] = start - t + s
    return total[len(service) // 10:]


@pytest.mark.parametrize("kind,scv", [("deterministic", 0.0), ("exponential", 1.0)])
@pytest.mark.parametrize("c,rho", [(1, 0.5), (1, 0.85), (2, 0.7), (4, 0.85)])
def test_mgc_ttft_percentiles_against_a_simulation(kind: str, scv: float, c: int, rho: float):
    """p50 and p90 of wait + service within 10% of a 40,000-arrival simulation (the plan's TTFT percentiles: the
    largest error in docs/plan.md's table is 11% at p50, M/D/1 at rho 0.7)."""
    rng = np.random.default_rng(7)
    service = np.ones(40_000) if kind == "deterministic" else rng.exponential(1.0, 40_000)
    sim = _simulate(c, rho * c, service)
    wait = mgc_wait(c, rho * c, 1.0, scv)
    for q in (0.5, 0.9):
        model = ttft_quantile(wait, service[:4000], q)
        assert model == pytest.approx(float(np.quantile(sim, q)), rel=0.12), (q, model)


def test_unstable_queue_has_no_percentile():
    assert mgc_wait(2, 2.0, 1.0, 0.0) is None and ttft_quantile(None, np.ones(3), 0.5) == math.inf
    split = mgc_wait(4, 2.0, 1.0, 0.0, shared=False)       # 4 queues at 0.5 each: M/G/1 at rho 0.5
    assert split is not None and split.p_wait == pytest.approx(0.5) and split.rho == pytest.approx(0.5)
    assert ttft_quantile(split, np.ones(3), 0.9) > ttft_quantile(mgc_wait(4, 2.0, 1.0, 0.0), np.ones(3), 0.9)


def test_decode_occupancy_quantile_against_a_compound_poisson_draw():
    """Streams at two contexts, one taking 1/8 and one 1/2 of an instance: the normal approximation of the
    instances busy at p90 is within 5% of a direct draw, and the capacity inverts it."""
    rng = np.random.default_rng(3)
    lam, dur = 20.0, 2.0                                  # 40 streams in flight on average
    weights = np.array([1 / 8, 1 / 2]), np.array([0.8, 0.2])
    counts = rng.poisson(lam * dur * weights[1][:, None], size=(2, 200_000))
    busy = (weights[0][:, None] * counts).sum(axis=0)
    mean = lam * float((dur * weights[0] * weights[1]).sum())
    var = lam * float((dur * weights[0] ** 2 * weights[1]).sum())
    model = occupancy_quantile(mean, var, 0.9)
    assert model == pytest.approx(float(np.quantile(busy, 0.9)), rel=0.05)
    assert max_rate_for_occupancy(mean / lam, var / lam, 0.9, model) == pytest.approx(lam, rel=1e-9)


@pytest.mark.parametrize("c,rho", [(1, 0.5), (1, 0.85), (2, 0.85)])
def test_heavy_tailed_service_is_bounded_as_docs_plan_md_says(c: int, rho: float):
    """Log-normal service (C_s^2 1.7 asked, 1.63 drawn): p50 and p90 within 18% of the simulation; p99 under-stated
    at low load (the model's exponential tail, -13% at c = 1, rho 0.5) and over-stated near saturation, within 18%
    either way (docs/plan.md, "Queueing headroom")."""
    rng = np.random.default_rng(7)
    sigma = math.sqrt(math.log(1 + 1.7))
    service = rng.lognormal(-sigma ** 2 / 2, sigma, 40_000)
    sim = _simulate(c, rho * c, service)
    wait = mgc_wait(c, rho * c, 1.0, 1.7)
    err = {q: ttft_quantile(wait, service[:4000], q) / float(np.quantile(sim, q)) - 1 for q in (0.5, 0.9, 0.99)}
    assert all(abs(e) <= 0.18 for e in err.values()), err
    if rho < 0.7:
        assert err[0.99] < -0.05, err          # the under-stated tail a p99 SLO must plan around
