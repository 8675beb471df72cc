"""A plan, put together: the disaggregated deployment the curves size for the traffic, the colocated and chunked ones
beside it, each priced, and every assumption the figures rest on with where it came from (``plan.json``, schema
``paasbench.plan/1``; the report renders it).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any, Mapping

from paas_common.errors import InputError
from paasbench.cost.table import CostInputs
from paasbench.plan.alternatives import MODES, mixed_curve, size_mixed
from paasbench.plan.curves import Curves, PoolCurve
from paasbench.plan.price import deployment_cost
from paasbench.plan.sizing import Deployment, PlanSLO, size_disaggregated
from paasbench.plan.traffic import Traffic

SCHEMA = "paasbench.plan/1"

QUEUEING = {
    "prefill": "M/G/c, one shared FIFO queue (least-work-left routing), Poisson arrivals: Erlang C for P(wait), the "
               "wait of those who wait exponential with the Allen-Cunneen mean (1 + Cs^2)/2 E[S]/(c (1 - rho)); TTFT = "
               "wait + the request's own no-queue TTFT, percentile over the traffic's mix",
    "prefill_split": "c separate M/G/1 queues at lambda / c (random or round-robin dispatch)",
    "decode": "M/G/infinity: streams decoding at once are Poisson (Little's law); each holds 1/B*(context) of an "
              "instance; instances = the quantile (the SLO's largest percentile) of that compound-Poisson occupancy, "
              "normal approximation",
    "mixed": "time sharing: prefill takes rho_p of each instance, TPOT stretched by 1/(1 - rho_p); chunked prompts "
             "also wait one decode step per chunk; no overlap of prefill and decode in a step is assumed",
}


def _pools_for_cost(dep: Deployment) -> list[tuple[str, str, int, int]]:
    return [(p.role, p.instance.machine_type, p.machines, p.cards) for p in dep.pools]


def _entry(dep: Deployment, traffic: Traffic, inputs: CostInputs, prices: Mapping[str, float],
           powers: Mapping[str, float]) -> dict[str, Any]:
    d = dep.to_dict()
    d["cost"] = deployment_cost(traffic.input_tpm, traffic.hit, traffic.output_tpm, _pools_for_cost(dep), inputs,
                                prices, powers)
    d["traffic_rps"] = traffic.rps
    return d


def curve_source(curves: Curves, path: str) -> dict[str, Any]:
    mb = curves.made_by
    return {"file": path, "mode": mb.get("mode"), "command": mb.get("command"), "when": mb.get("when"),
            "loadavg": mb.get("loadavg"), "twin": mb.get("twin"), "target": mb.get("target"),
            "sim_time_scale": (mb.get("twin") or {}).get("sim_time_scale"), "slo": curves.slo}


def make_plan(traffic: Traffic, slo: PlanSLO, prefill: PoolCurve, decode: PoolCurve, mixed: PoolCurve | None,
              sources: dict[str, dict[str, Any]], inputs: CostInputs, prices: Mapping[str, float],
              powers: Mapping[str, float], *, shared: bool = True, command: str | None = None,
              loadavg: Any = None) -> dict[str, Any]:
    dep = size_disaggregated(traffic, prefill, decode, slo, shared=shared)
    alternatives: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    if mixed is not None:
        full = mixed_curve(mixed, decode)
        for mode in MODES:
            try:
                alternatives.append(_entry(size_mixed(traffic, full, full, slo, mode), traffic, inputs, prices, powers))
            except InputError as exc:
                skipped[mode] = exc.reason
    plan = _entry(dep, traffic, inputs, prices, powers)
    return {
        "schema": SCHEMA,
        "made_by": {"command": command, "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "loadavg": loadavg},
        "traffic": traffic.to_dict(), "slo": slo.to_dict(), "curves": sources,
        "plan": plan, "alternatives": alternatives, "alternatives_skipped": skipped,
        "cost_inputs": dataclasses.asdict(inputs),
        "queueing": {"prefill": QUEUEING["prefill" if shared else "prefill_split"], "decode": QUEUEING["decode"],
                     "mixed": QUEUEING["mixed"]},
        "assumptions": assumptions(traffic, slo, sources, plan, alternatives, shared),
    }


def assumptions(traffic: Traffic, slo: PlanSLO, sources: dict[str, dict[str, Any]], plan: dict[str, Any],
                alternatives: list[dict[str, Any]], shared: bool) -> list[dict[str, str]]:
    """What each figure rests on and where it came from, one row each (the report's assumptions table)."""
    rows = [
        {"what": "traffic", "value": f"{traffic.input_tpm / 1e6:.3g}M input TPM = {traffic.rps:.4g} req/s of "
                                     f"{traffic.name}'s steady mix ({len(traffic.requests)} requests)",
         "source": f"--traffic {traffic.asked}; the mix as a sweep step sends it (sessions in flight, Poisson)"},
        {"what": "prefix reuse", "value": f"{traffic.hit:.1%} of input tokens cached (mean uncached "
                                          f"{traffic.to_dict()['mean_uncached']:,.0f} of {traffic.mean_input:,.0f})",
         "source": "an infinite cache fed by every request before (trace inspect's hit); the pools share a KV store, "
                   "so a prefill instance finds what any instance computed"},
        {"what": "arrivals", "value": "Poisson", "source": "many independent sessions; the verification sends the same"},
        {"what": "dispatch", "value": "shared queue (least work left)" if shared else "split (random / round robin)",
         "source": "--dispatch; the reference server's cost rule routes by the work each prefill instance has queued"},
        {"what": "SLO", "value": ", ".join(slo.gates), "source": "--slo / the workload's slo"},
        {"what": "prefill utilization bound", "value": f"{slo.max_utilization:.0%}",
         "source": "--max-utilization: beyond it a queue takes minutes to settle, and windows see it grow"},
    ]
    for role, src in sources.items():
        scale = src.get("sim_time_scale")
        rows.append({"what": f"{role} curve", "value": f"{src.get('mode')} ({src.get('file')})",
                     "source": (src.get("command") or "—") + (f"; twin at sim-time-scale {scale:g}, times divided by it"
                                                              if scale and scale != 1 else "")
                     + (f"; load average {src['loadavg'][0]}" if src.get("loadavg") and src["loadavg"][0] else "")})
    for p in plan["pools"] + [a["pools"][0] for a in alternatives]:
        i = p["instance"]
        rows.append({"what": f"{p['role']} instance", "value": f"{i['cards_per_instance']} x {i['machine_type']} "
                                                             f"({i['cards_per_machine']} cards per machine)",
                     "source": "the twin's sizing rule (weights + 20% KV floor)" if i.get("kv_tokens") else
                               "--cards-per-instance / --cards-per-machine"})
    for r in plan["cost"]["pools"]:
        rows.append({"what": f"{r['machine_type']} machine", "value": f"{r['machine_price']:,.0f} {plan['cost']['currency']}, "
                                                                    f"{r['power_kw']:g} kW", "source": r["price_source"]})
    return rows
