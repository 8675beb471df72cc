"""The colocated and chunked deployments that meet the same SLO for the same traffic (article §6.2): ``N`` mixed
instances, each prefilling and decoding, as the reference server's ``colocated`` and ``chunked`` modes run them.

A mixed instance shares its time between the two kinds of work (time sharing: a step that carries a prefill chunk
is that much longer; no overlap of a compute-bound chunk with memory-bound decode is assumed, which on an
accelerator makes chunked look worse than it can be -- the twin's verification says by how much):

* prefill runs in the mixed pool's chunks (``--prefill-chunk-tokens``, 512 on the reference server: a MoE model
  streams every expert for each of them, which is why a prefill-only instance prefills several times faster);
  ``rho_p = lambda E[S_m] / N`` is the share of each instance's time it takes;
* **colocated**: a waiting prompt is prefilled to its end before decoding resumes, so TTFT queues on the prefill work
  alone (M/G/N on ``S_m``), and every stream's TPOT is stretched by ``1 / (1 - rho_p)``;
* **chunked**: every step carries the running decodes and one chunk, so a prompt of ``k`` chunks also waits ``k``
  decode steps (``S = S_m + k t(B)``), and TPOT is stretched as in colocated;
* decode holds batch places as in the decode pool (:mod:`paasbench.plan.sizing`), with ``B*`` read off the decode
  curve at the tighter TPOT ``SLO x (1 - rho_p)`` and the durations stretched.

``N`` is the fewest instances that meet all three at the traffic (``rho_p < 1``); the capacity is the highest rate
at which those ``N`` do.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from paas_common.errors import InputError
from paasbench.plan.curves import PoolCurve
from paasbench.plan.queueing import mgc_wait, occupancy_quantile, ttft_quantile
from paasbench.plan.sizing import MAX_INSTANCES, Deployment, PlanSLO, PoolSize, prefill_work
from paasbench.plan.traffic import Traffic

MODES = ("colocated", "chunked")


def _check(traffic: Traffic, mixed: PoolCurve, decode: PoolCurve, slo: PlanSLO, mode: str, n: int,
           rps: float) -> dict[str, float] | None:
    """The model's figures for ``n`` mixed instances at ``rps``; None when the SLO does not hold."""
    t = traffic.at_rps(rps)
    work = prefill_work(t, mixed)
    wait = mgc_wait(n, rps, work.mean_s, work.scv)
    rho_p = rps * work.mean_s / n
    if wait is None or rho_p >= slo.max_utilization:
        return None
    stretch = 1.0 / (1.0 - rho_p)
    limit = None if slo.tpot_s is None else slo.tpot_s * (1.0 - rho_p)
    chunk = mixed.instance.chunk_tokens or 512
    a = t.arrays
    ctx = a["input"] + a["output"] / 2
    b = decode.max_active(ctx, limit)
    if (b < 1.0).any():
        return None
    tpots = decode.tpot_s(ctx, b) * stretch
    dur = np.maximum(0, a["output"] - 1) * tpots
    occ_a, adm_a = dur / b, dur / np.maximum(decode.admits(ctx), b)
    occ_q = max(occupancy_quantile(rps * occ_a.mean(), rps * (occ_a ** 2).mean(), slo.decode_q),
                occupancy_quantile(rps * adm_a.mean(), rps * (adm_a ** 2).mean(), slo.admit_q))
    if occ_q > n:
        return None
    service, base = work.service_s, work.base_s
    if mode == "chunked":
        steps = np.ceil(a["uncached"] / chunk) * tpots / stretch
        service, base = service + steps, base + steps
    scv = float(service.var() / service.mean() ** 2) if service.mean() > 0 else 0.0
    q = slo.ttft_q or 0.5
    ttft = ttft_quantile(mgc_wait(n, rps, float(service.mean()), scv), base, q)
    if slo.ttft_s is not None and ttft > slo.ttft_s:
        return None
    return {"rho_prefill": rho_p, "tpot_stretch": stretch, "ttft_q": q, "ttft_s": ttft, "occupancy_at_q": occ_q,
            "occupancy_mean": rps * float(occ_a.mean()), "mean_service_s": float(service.mean()), "service_scv": scv,
            "tpot_s": float(np.mean(tpots))}


def _capacity(traffic: Traffic, mixed: PoolCurve, decode: PoolCurve, slo: PlanSLO, mode: str, n: int) -> float:
    hi = n / prefill_work(traffic, mixed).mean_s
    if _check(traffic, mixed, decode, slo, mode, n, hi * 1e-6) is None:
        return 0.0
    lo = 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if _check(traffic, mixed, decode, slo, mode, n, mid) is None:
            hi = mid
        else:
            lo = mid
    return lo


def size_mixed(traffic: Traffic, mixed: PoolCurve, decode: PoolCurve, slo: PlanSLO, mode: str) -> Deployment:
    """The fewest ``mode`` (colocated | chunked) instances meeting ``slo`` for ``traffic``."""
    if mode not in MODES:
        raise ValueError(mode)
    if _check(traffic, mixed, decode, slo, mode, MAX_INSTANCES, traffic.rps * 1e-6) is None:
        raise InputError(f"no {mode} pool meets the SLO even idle", field="--slo")
    n = max(1, math.ceil(traffic.rps * prefill_work(traffic, mixed).mean_s))
    lo = n
    while _check(traffic, mixed, decode, slo, mode, n, traffic.rps) is None:   # doubling, then back to the fewest
        lo, n = n, n * 2
        if n > MAX_INSTANCES:
            raise InputError(f"more than {MAX_INSTANCES} {mode} instances", field="--traffic")
    while lo < n:
        mid = (lo + n) // 2
        if _check(traffic, mixed, decode, slo, mode, mid, traffic.rps) is None:
            lo = mid + 1
        else:
            n = mid
    inst = mixed.instance
    machines = inst.machines(n)
    held = max(n, inst.held(machines))
    figures = _check(traffic, mixed, decode, slo, mode, held, traffic.rps) or {}
    pool = PoolSize("mixed", n, held, machines, held * inst.cards_per_instance, inst,
                    _capacity(traffic, mixed, decode, slo, mode, held),
                    max(figures.get("rho_prefill", 0.0), figures.get("occupancy_mean", 0.0) / held), figures)
    return Deployment(mode, (pool,), pool.capacity_rps, traffic)


def mixed_capacity(traffic: Traffic, mixed: PoolCurve, decode: PoolCurve, slo: PlanSLO, mode: str, n: int) -> float:
    """The capacity (req/s) the model gives ``n`` ``mode`` instances."""
    return _capacity(traffic, mixed, decode, slo, mode, n) if n > 0 else 0.0


def mixed_curve(mixed: PoolCurve, decode: PoolCurve) -> PoolCurve:
    """The mixed pool's curve with the decode curve filled in from the decode pool's (the same card: a decode worker
    decodes as a mixed one does) where it has none of its own."""
    if mixed.decode:
        return mixed
    if decode.instance.machine_type != mixed.instance.machine_type:
        raise InputError(f"the mixed pool ({mixed.instance.machine_type}) has no decode curve and the decode pool's is "
                         f"another card ({decode.instance.machine_type}): measure --pools mixed,decode on one card",
                         field="--mixed-curves")
    return replace(mixed, decode=list(decode.decode))
