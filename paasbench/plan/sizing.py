"""Sizing: the fewest prefill and decode instances whose SLO holds for a traffic, from the pools' curves.

**Prefill pool.** Each request of the traffic's mix costs its prefill instance ``S_i = u_i * s(k_i + u_i / 2)``
instance-seconds -- its ``u_i`` uncached tokens (after ``k_i`` cached: prefix reuse) at the prefill curve's
seconds per uncached token at their mean position -- and, with nothing queued, its TTFT is ``base_i = S_i + f(x_i)``,
the fixed part of the curve at its context ``x_i``. A turn is sent only once its session's previous turn has ended
(:class:`paasbench.load.schedule.Turns`), so the prefix that turn wrote is in the cache when it comes: the work does
not depend on the load. The pool is M/G/c (:mod:`paasbench.plan.queueing`): ``E[S]`` and
``C_s^2`` are the mix's, arrivals Poisson at the traffic's rate. ``P`` is the fewest instances whose TTFT
percentile (the SLO's, over the mix) is within the SLO; its **capacity** is the highest rate at which ``P`` still
holds it (bisection), and the **headroom** is ``1 - rho`` there.

**Decode pool.** A request decodes ``o_i - 1`` tokens after its first at context ``c_i = x_i + o_i / 2``; at the
operating point of the decode curve (``B*(c)`` streams per instance, TPOT ``t(c)``) it holds ``1 / B*(c_i)`` of an
instance for ``d_i = (o_i - 1) t(c_i)``. The instances busy are compound Poisson (M/G/infinity): mean ``lambda
E[d / B*]``, variance ``lambda E[(d / B*)^2]``, and their quantile at the SLO's TPOT percentile must fit ``D``: past
``B*`` streams an instance still decodes, only slower. A stream it cannot admit at all (its KV, its batch cap:
``A(c) >= B*`` streams) waits for its first token, so the same occupancy counted in admission places, ``d / A``, must
fit ``D`` at the TTFT percentile. ``D`` is the fewest instances meeting both; capacity: the rate at which the tighter
one's quantile is ``D`` (a quadratic).

**Machines.** An instance spans ``cards_per_instance`` cards; a machine has ``cards_per_machine``. A pool buys
``ceil(instances x cards_per_instance / cards_per_machine)`` machines and runs every instance they hold; the
deployment's capacity is the smaller of its two pools' capacities.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from paas_common.errors import InputError
from paasbench.plan.curves import Instance, PoolCurve
from paasbench.plan.queueing import Wait, max_rate_for_occupancy, mgc_wait, occupancy_quantile, ttft_quantile
from paasbench.plan.traffic import Traffic

MAX_INSTANCES = 4096
STAT_Q = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99, "p999": 0.999}


@dataclass(frozen=True, slots=True)
class PlanSLO:
    ttft_q: float | None          # percentile of TTFT the SLO bounds (0.5 for p50), None: no TTFT gate
    ttft_s: float | None
    tpot_q: float | None
    tpot_s: float | None
    gates: tuple[str, ...] = ()
    # not a gate: the planning bound on a prefill instance's utilization. Near rho = 1 a loose TTFT percentile (p50
    # <= 6 s on a 0.2 s prompt) holds up to 97% busy in steady state, but the queue then takes S / (1 - rho)^2
    # (minutes) to settle: any window a user or a sweep judges it by sees it grow, and a burst outlasts the hour
    max_utilization: float = 0.9

    @property
    def decode_q(self) -> float:
        """The quantile of decode batch places (streams within the TPOT SLO) the pool is sized at: TPOT's."""
        return self.tpot_q or 0.5

    @property
    def admit_q(self) -> float:
        """The quantile of admitted streams (KV, batch cap) the pool is sized at: TTFT's (a stream not admitted
        waits for its first token)."""
        return self.ttft_q or 0.5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_slo(gates: Sequence[Any], max_utilization: float = 0.9) -> PlanSLO:
    """The TTFT and TPOT bounds of ``gates`` (:class:`paasbench.metrics.slo.Gate`); other gates (error rate, hit)
    are judged by the verification, not sized for. A TTFT or TPOT gate must bound a percentile (``p50(ttft) <= 6s``):
    a mean or a max has no quantile for the queueing model to meet."""
    found: dict[str, tuple[float, float]] = {}
    for g in gates:
        if g.key not in ("ttft_ms", "tpot_ms"):
            continue
        if g.stat not in STAT_Q or not g.lower_is_better:
            raise InputError(f"{g.source!r}: a plan sizes for an upper bound on a percentile of TTFT or TPOT "
                             "(e.g. 'p50(ttft) <= 6000ms')", field="--slo")
        name = g.key[:-3]
        q, limit = STAT_Q[g.stat], g.threshold / 1e3
        if name in found and found[name] != (q, limit):
            raise InputError(f"{g.source!r}: one {name} gate per plan", field="--slo")
        found[name] = (q, limit)
    if not found:
        raise InputError("the SLO bounds neither TTFT nor TPOT: nothing to size for", field="--slo")
    ttft, tpot = found.get("ttft"), found.get("tpot")
    if not 0 < max_utilization <= 1:
        raise InputError(f"must be in (0, 1], got {max_utilization}", field="--max-utilization")
    return PlanSLO(ttft[0] if ttft else None, ttft[1] if ttft else None, tpot[0] if tpot else None,
                   tpot[1] if tpot else None, tuple(g.source for g in gates), max_utilization)


# ------------------------------------------------------------------------------------------------- prefill


@dataclass(frozen=True, slots=True)
class PrefillWork:
    service_s: np.ndarray         # instance-seconds per request of the mix
    base_s: np.ndarray            # TTFT with nothing queued

    @property
    def mean_s(self) -> float:
        return float(self.service_s.mean())

    @property
    def scv(self) -> float:
        m = self.mean_s
        return float(self.service_s.var() / (m * m)) if m > 0 else 0.0


def prefill_work(traffic: Traffic, curve: PoolCurve) -> PrefillWork:
    a = traffic.arrays
    s = curve.service_s(a["cached"], a["uncached"])
    return PrefillWork(s, s + curve.fixed_s(a["input"]))


def _wait(work: PrefillWork, instances: int, rps: float, shared: bool) -> Wait | None:
    return mgc_wait(instances, rps, work.mean_s, work.scv, shared=shared)


def ttft_at(work: PrefillWork, instances: int, rps: float, q: float, shared: bool = True) -> float:
    """The ``q`` quantile of TTFT (s) with ``instances`` prefill instances at ``rps``."""
    return ttft_quantile(_wait(work, instances, rps, shared), work.base_s, q)


def prefill_capacity(work: PrefillWork, instances: int, slo: PlanSLO, shared: bool = True) -> float:
    """The highest rate (req/s) at which ``instances`` meet the TTFT SLO, each under ``slo.max_utilization`` busy; 0
    when even an idle pool does not meet it."""
    if instances <= 0:
        return 0.0
    q = slo.ttft_q or 0.5

    def holds(rps: float) -> bool:
        wait = _wait(work, instances, rps, shared)
        if wait is None or rps * work.mean_s / instances > slo.max_utilization:
            return False
        return slo.ttft_s is None or ttft_quantile(wait, work.base_s, q) <= slo.ttft_s

    busiest = slo.max_utilization * instances / work.mean_s
    if not holds(busiest * 1e-9):
        return 0.0
    if holds(busiest):
        return busiest
    lo, hi = 0.0, busiest
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


@dataclass(frozen=True, slots=True)
class PoolSize:
    role: str                     # prefill | decode | mixed
    instances_needed: int         # the fewest instances the SLO allows at the traffic
    instances: int                # what the machines bought hold (>= needed)
    machines: int
    cards: int
    instance: Instance
    capacity_rps: float           # the highest rate these instances hold the SLO at
    utilization: float            # at the traffic: busy share of each instance (prefill: rho; decode: occupancy)
    predicted: dict[str, Any]     # the model's figures at the traffic (TTFT quantile, occupancy ...)

    @property
    def headroom(self) -> float:
        return 1.0 - self.utilization

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("role", "instances_needed", "instances", "machines", "cards",
                                            "capacity_rps", "utilization", "predicted")}
        d["instance"] = asdict(self.instance)
        d["headroom"] = self.headroom
        return d


def _bought(role: str, needed: int, inst: Instance) -> tuple[int, int, int]:
    machines = inst.machines(needed)
    held = max(needed, inst.held(machines))
    return held, machines, held * inst.cards_per_instance


def size_prefill(traffic: Traffic, curve: PoolCurve, slo: PlanSLO, *, shared: bool = True) -> PoolSize:
    work = prefill_work(traffic, curve)
    q = slo.ttft_q or 0.5
    if slo.ttft_s is not None and ttft_at(work, MAX_INSTANCES, 1e-9, q, shared) > slo.ttft_s:
        raise InputError(f"no prefill pool meets the TTFT SLO: with nothing queued the mix's p{q * 100:g} TTFT is "
                         f"{ttft_at(work, MAX_INSTANCES, 1e-9, q, shared):.2f} s, over its {slo.ttft_s:g} s",
                         field="--slo")
    need = max(1, math.ceil(traffic.rps * work.mean_s - 1e-12))
    while prefill_capacity(work, need, slo, shared) < traffic.rps:
        need += 1
        if need > MAX_INSTANCES:
            raise InputError(f"more than {MAX_INSTANCES} prefill instances", field="--traffic")
    held, machines, cards = _bought("prefill", need, curve.instance)
    wait = _wait(work, held, traffic.rps, shared)
    predicted = {"mean_service_s": work.mean_s, "service_scv": work.scv, "rho": wait.rho if wait else None,
                 "p_wait": wait.p_wait if wait else None, "mean_wait_s": (wait.p_wait * wait.mean_s) if wait else None,
                 "ttft_q": q, "ttft_s": ttft_quantile(wait, work.base_s, q),
                 "ttft_p50_s": ttft_quantile(wait, work.base_s, 0.5), "dispatch": "shared" if shared else "split",
                 "hit": traffic.hit}
    return PoolSize("prefill", need, held, machines, cards, curve.instance, prefill_capacity(work, held, slo, shared),
                    traffic.rps * work.mean_s / held, predicted)


# -------------------------------------------------------------------------------------------------- decode


@dataclass(frozen=True, slots=True)
class DecodeWork:
    per_rate_mean: float          # instances' batch places (within the TPOT SLO) busy per unit of arrival rate
    per_rate_var: float
    admit_mean: float             # the same in admission places (KV, batch cap)
    admit_var: float
    mean_active: float            # streams decoding per unit of arrival rate
    tpot_s: float                 # the mix's mean TPOT at the operating point

    def instances(self, rps: float, slo: PlanSLO) -> float:
        """Instances the streams need at ``rps``: the larger of the batch places at TPOT's quantile and the admission
        places at TTFT's."""
        return max(occupancy_quantile(rps * self.per_rate_mean, rps * self.per_rate_var, slo.decode_q),
                   occupancy_quantile(rps * self.admit_mean, rps * self.admit_var, slo.admit_q))

    def capacity(self, instances: int, slo: PlanSLO) -> float:
        return min(max_rate_for_occupancy(self.per_rate_mean, self.per_rate_var, slo.decode_q, instances),
                   max_rate_for_occupancy(self.admit_mean, self.admit_var, slo.admit_q, instances))


def decode_work(traffic: Traffic, curve: PoolCurve, slowdown: float = 1.0) -> DecodeWork:
    """Occupancy per unit rate; ``slowdown`` stretches every TPOT (a mixed instance shares its time with prefills).
    A stream's duration is its tokens after the first at the TPOT of the operating point (the SLO's edge: an upper
    bound on what it takes)."""
    a = traffic.arrays
    ctx = a["input"] + a["output"] / 2
    b = curve.max_active(ctx)
    if (b < 1.0).any():
        worst = float(ctx[b < 1.0].max())
        raise InputError(f"a decode instance holds no stream at context {worst:,.0f} within the SLO", field="--slo")
    admit = np.maximum(curve.admits(ctx), b)
    t = curve.tpot_s(ctx) * slowdown
    d = np.maximum(0, a["output"] - 1) * t
    occ, adm = d / b, d / admit
    return DecodeWork(float(occ.mean()), float((occ ** 2).mean()), float(adm.mean()), float((adm ** 2).mean()),
                      float(d.mean()), float(t.mean()))


def size_decode(traffic: Traffic, curve: PoolCurve, slo: PlanSLO) -> PoolSize:
    work = decode_work(traffic, curve)
    rps = traffic.rps
    need = max(1, math.ceil(work.instances(rps, slo) - 1e-9))
    held, machines, cards = _bought("decode", need, curve.instance)
    mean = rps * work.per_rate_mean
    predicted = {"occupancy_mean": mean, "occupancy_sd": math.sqrt(rps * work.per_rate_var),
                 "occupancy_q": slo.decode_q, "occupancy_at_q": occupancy_quantile(mean, rps * work.per_rate_var, slo.decode_q),
                 "admitted_at_q": occupancy_quantile(rps * work.admit_mean, rps * work.admit_var, slo.admit_q),
                 "admitted_q": slo.admit_q, "streams_mean": rps * work.mean_active, "tpot_s": work.tpot_s}
    return PoolSize("decode", need, held, machines, cards, curve.instance, work.capacity(held, slo), mean / held, predicted)


@dataclass(frozen=True, slots=True)
class Deployment:
    name: str                     # "disaggregated", "colocated", "chunked"
    pools: tuple[PoolSize, ...]
    capacity_rps: float
    traffic: Traffic
    notes: tuple[str, ...] = ()

    @property
    def machines(self) -> int:
        return sum(p.machines for p in self.pools)

    @property
    def cards(self) -> int:
        return sum(p.cards for p in self.pools)

    @property
    def capacity_tpm(self) -> float:
        return self.capacity_rps * self.traffic.mean_input * 60.0

    def pool(self, role: str) -> PoolSize:
        return next(p for p in self.pools if p.role == role)

    @property
    def ratio(self) -> str:
        """P:D in instances (disaggregated only)."""
        roles = {p.role: p for p in self.pools}
        if "prefill" not in roles or "decode" not in roles:
            return "—"
        p, d = roles["prefill"].instances, roles["decode"].instances
        g = math.gcd(p, d)
        return f"{p // g}:{d // g}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "pools": [p.to_dict() for p in self.pools], "capacity_rps": self.capacity_rps,
                "capacity_tpm": self.capacity_tpm, "machines": self.machines, "cards": self.cards,
                "ratio": self.ratio, "notes": list(self.notes)}


def size_disaggregated(traffic: Traffic, prefill: PoolCurve, decode: PoolCurve, slo: PlanSLO,
                       shared: bool = True) -> Deployment:
    p = size_prefill(traffic, prefill, slo, shared=shared)
    d = size_decode(traffic, decode, slo)
    return Deployment("disaggregated", (p, d), min(p.capacity_rps, d.capacity_rps), traffic)


def with_instances(traffic: Traffic, prefill_curve: PoolCurve, decode_curve: PoolCurve, slo: PlanSLO,
                   prefill: int, decode: int, shared: bool = True) -> float:
    """The capacity (req/s) the model gives ``prefill`` + ``decode`` instances (the verification's smaller plans)."""
    work = prefill_work(traffic, prefill_curve)
    p = prefill_capacity(work, prefill, slo, shared)
    d = decode_work(traffic, decode_curve).capacity(decode, slo) if decode else 0.0
    return min(p, d)
