"""Verifying a plan: run the planned deployment at the planned traffic, and the deployments one machine smaller.

On the twin (curves made with ``--twin``) the embedded reference server is started as planned -- ``P`` prefill
workers on the prefill card, ``D`` decode workers on the decode card (``--prefill-device-profile`` when they
differ), every prefill routed to the prefill pool -- and the workload runs at the planned rate as a sweep step
does (:func:`paasbench.sweep.step.run_step`: the steady-state mix, Poisson arrivals, a warm-up, the window, the drain,
the SLO and saturation judged the same way). Then:

* **the plan** at the traffic must pass;
* **one prefill machine fewer** and **one decode machine fewer** (the instances ``machines - 1`` hold) at the same
  traffic must fail: otherwise the plan bought a machine it did not need (a pool that would be left with no
  instance fails by construction: there is no such deployment);
* **the capacity**: loads around the plan's predicted capacity (``SearchConfig``: a start below it, steps of
  ``--verify-factor``, one bisection) bracket the verified capacity, the geometric middle of the highest passing and
  the lowest failing load; the prediction should be within 10% of it;
* with ``--verify-alternatives``, the colocated and chunked deployments at the same traffic.

For a real target nothing can be started here: :func:`deployment_commands` prints the commands that start the
planned deployment with the reference server's router in front of vLLM instances, and the ``paasbench run`` that
verifies it at the planned rate with the plan's SLO.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from paasbench.metrics.slo import LATENCY_METRICS, Gate
from paasbench.plan.twin import Card, disaggregated_section, mixed_section, scaled_limits
from paasbench.sweep.search import Outcome, SearchConfig, run_search


@dataclass(frozen=True, slots=True)
class VerifySettings:
    warmup_s: float = 30.0
    duration_s: float = 120.0
    window_requests: int = 0
    capacity: bool = True
    factor: float = 1.1               # the capacity search's step
    capacity_steps: int = 3           # at most, beyond the planned run
    alternatives: bool = False
    seed: int = 0


def stretched(trace: Any, scale: float) -> Any:
    """``trace`` with its timestamps ``scale`` times apart: on a twin ``scale`` times slower, a session's turns must
    come ``scale`` times further apart too, or every turn would arrive before the one it follows has finished, find
    none of it cached, and the step would measure another workload (its sessions in flight, ``rate x turn gap``, are
    then the device traffic's: :mod:`paasbench.sweep.mix`)."""
    from paasbench.trace.model import Trace

    if scale == 1:
        return trace
    return Trace([dataclasses.replace(r, arrival_ms=r.arrival_ms * scale) for r in trace.requests],
                 block_size=trace.block_size, source=trace.source, meta={**trace.meta, "time_stretch": scale})


def scaled_gates(gates: Sequence[Gate], scale: float) -> list[Gate]:
    """The gates on a twin at ``--sim-time-scale scale``: latency thresholds in its (scaled) wall seconds."""
    latency = set(LATENCY_METRICS.values())
    return [dataclasses.replace(g, threshold=g.threshold * scale) if g.key in latency else g for g in gates]


class TwinVerifier:
    """Runs deployments of the plan's cards at device-rate loads, each step into its own directory."""

    def __init__(self, source: Any, gates: Sequence[Gate], settings: VerifySettings, scale: float, out: Path,
                 log: Callable[[str], None] = print) -> None:
        import secrets

        from paasbench.client import ClientConfig
        from paasbench.sweep.mix import LANE_WARMUP, lane_warmup_s
        from paasbench.sweep.step import PRIME_CONCURRENCY, StepPlan

        self.source, self.settings, self.scale, self.out, self.log = source, settings, scale, Path(out), log
        self.gates = scaled_gates(gates, scale)
        self.sources = list(gates)
        # the lanes (sessions in flight) need a warm-up arrival each, or the step sends their turns closer together
        # than the traffic does (paasbench.sweep.mix.lane_warmup_s); on the twin every gap is ``scale`` times longer
        needed = lane_warmup_s(source.trace_for(None))      # device seconds
        warmup = max(settings.warmup_s, round(needed * scale, 1))
        if warmup > settings.warmup_s:
            log(f"verification warm-up {warmup:g} s, not {settings.warmup_s:g}: one warm-up arrival per session in "
                f"flight (the turn gap is {needed / LANE_WARMUP:.3g} s of device time)")
        self.plan = StepPlan(axis="rate", warmup_s=warmup, duration_s=settings.duration_s,
                             seed=settings.seed, window_requests=settings.window_requests)
        self.client = ClientConfig(target="http://unset", prompt_format="token-ids", prompt_salt=secrets.randbits(64))
        self._index = 0
        self.prime_concurrency = PRIME_CONCURRENCY   # runs() sets the server's own
        self._answered: list[tuple[float, float]] = []   # (wall req/s, mean E2E s) of the runs on this server

    def runs(self, name: str, section: dict[str, Any], loads: Callable[[Callable[[float], dict[str, Any]]], Any]) -> Any:
        """Start ``section``'s server once and hand ``loads`` a function that runs one device-rate load on it."""
        from paasbench.sweep.embedded import embedded_server, prime_concurrency

        self.prime_concurrency = prime_concurrency(section)
        self._answered = []
        shown = " ".join(f"{k}={v}" for k, v in section.items())
        self.log(f"{name}: starting the twin: {shown}")
        with embedded_server(section) as server:
            return loads(lambda rps: self._run(name, server.url, rps))

    def _run(self, name: str, url: str, rps: float) -> dict[str, Any]:
        from paasbench.sweep.source import fresh_prefixes
        from paasbench.sweep.step import mean_e2e_s, response_near, run_step, step_timeouts

        self._index += 1
        wall = rps / self.scale
        # its sessions in flight follow the E2E of this server's run at the closest load below, as a sweep's steps
        # do (docs/sweep.md, "Sessions in flight follow the target's answer time")
        plan = dataclasses.replace(self.plan.for_load(wall), response_s=response_near(self._answered, wall))
        trace = stretched(fresh_prefixes(plan.trace(self.source, None, plan.trace_size(wall), rps), self._index), self.scale)
        step_dir = self.out / f"{self._index:03d}-{name}-{rps:.4g}"
        client = dataclasses.replace(self.client, target=url, **step_timeouts(plan.total_s))
        began = time.monotonic()
        entry = run_step(trace, plan, wall, client, step_dir, gates=self.gates, meta={"plan_verify": name},
                         saturation_limits=scaled_limits(self.scale, verify=True), prime_concurrency=self.prime_concurrency)
        summ = entry["summary"]
        self._answered.append((wall, mean_e2e_s(summ)))
        ttft, tpot = summ.get("ttft_ms") or {}, summ.get("tpot_ms") or {}
        brief = {"name": name, "rps": rps, "wall_rps": wall, "passed": entry["passed"], "slo_passed": entry["slo_passed"],
                 "saturated": bool(entry["saturation"].get("saturated")), "reasons": entry["saturation"].get("reasons"),
                 # the gates as the plan states them (device seconds), not as scaled for the twin's wall clock
                 "failed_gates": [src.source for src, g in zip(self.sources, entry["verdict"]["gates"]) if not g["passed"]],
                 "dir": str(step_dir), "input_tpm": (summ.get("input_tpm") or 0.0) * self.scale,
                 "offered_rps": entry.get("offered_rps", 0.0) * self.scale,
                 "ttft_p50_s": _s(ttft.get("p50"), self.scale), "ttft_p90_s": _s(ttft.get("p90"), self.scale),
                 "ttft_p99_s": _s(ttft.get("p99"), self.scale), "tpot_p50_s": _s(tpot.get("p50"), self.scale),
                 "tpot_p90_s": _s(tpot.get("p90"), self.scale), "requests": (summ.get("requests") or {}).get("total"),
                 "errors": summ.get("errors") or {}, "traffic_hit": entry.get("traffic_hit_ratio"),
                 "server_hit": summ.get("prefix_hit_ratio"), "host_bound_share": summ.get("host_bound_share"),
                 "remote_prefill_share": entry.get("remote_prefill_share"), "wall_s": time.monotonic() - began}
        brief["primed"] = entry.get("primed")
        why = "; ".join(brief["failed_gates"] + list(brief["reasons"] or []))
        self.log(f"  {name} at {rps:.4g} req/s: p50 TTFT {_ms(brief['ttft_p50_s'])}, p90 {_ms(brief['ttft_p90_s'])}, "
                 f"p50 TPOT {_ms(brief['tpot_p50_s'])}, hit {brief['server_hit'] or 0:.1%}  "
                 f"{'PASS' if brief['passed'] else 'FAIL'}" + (f" ({why})" if why else ""))
        return brief


def verify_on_twin(plan: dict[str, Any], cards: dict[str, Card], source: Any, gates: Sequence[Gate],
                   settings: VerifySettings, out: Path, log: Callable[[str], None] = print,
                   smaller: Callable[[int, int], float] | None = None,
                   mixed_capacity: Callable[[str, int], float] | None = None) -> dict[str, Any]:
    """The verification of ``plan`` (plan.json's ``plan`` and ``alternatives``) on the twin of ``cards`` (role ->
    card). ``smaller(P, D)``: the model's capacity of P + D instances, recorded beside each smaller run."""
    scale = cards["decode"].sim_time_scale
    v = TwinVerifier(source, gates, settings, scale, out, log)
    pools = {p["role"]: p for p in plan["pools"]}
    pre, dec = pools["prefill"], pools["decode"]
    rps = plan["traffic_rps"]
    result: dict[str, Any] = {"sim_time_scale": scale, "settings": dataclasses.asdict(settings), "runs": []}
    started = time.monotonic()

    def deployment(p: int, d: int) -> dict[str, Any]:
        return disaggregated_section(cards["prefill"], cards["decode"], p, d)

    # the plan at the traffic, then its capacity on the same server
    def planned(run: Callable[[float], dict[str, Any]]) -> None:
        first = run(rps)
        first["role"] = "planned"
        result["runs"].append(first)
        if settings.capacity:
            result["capacity"] = _capacity(run, plan["capacity_rps"], settings, result)

    v.runs("planned", deployment(pre["instances"], dec["instances"]), planned)
    for role, pool in (("prefill", pre), ("decode", dec)):
        inst = pool["instance"]
        fewer = int((pool["machines"] - 1) * inst["cards_per_machine"] // inst["cards_per_instance"])
        name = f"{role}-1"
        p, d = (fewer, dec["instances"]) if role == "prefill" else (pre["instances"], fewer)
        entry = {"name": name, "role": f"one {role} machine fewer", "machines_removed": role,
                 "instances": {"prefill": p, "decode": d}, "model_capacity_rps": smaller(p, d) if smaller else None}
        if fewer <= 0:
            entry.update(passed=False, skipped=f"{pool['machines'] - 1} {role} machines hold no instance: no such "
                                               "deployment (it fails by construction)")
            log(f"  {name}: {entry['skipped']}")
            result["runs"].append(entry)
            continue
        entry.update(v.runs(name, deployment(p, d), lambda run: run(rps)))
        entry["role"] = f"one {role} machine fewer"
        result["runs"].append(entry)
    if settings.alternatives:
        for alt in plan.get("alternatives") or []:
            mode, n = alt["name"], alt["pools"][0]["instances"]
            entry = v.runs(mode, mixed_section(cards.get("mixed", cards["decode"]), mode, n), lambda run: run(rps))
            entry.update(role=f"{mode} alternative", instances={"mixed": n})
            result["runs"].append(entry)
    result["wall_s"] = time.monotonic() - started
    planned_run = next(r for r in result["runs"] if r.get("role") == "planned")
    fewer_runs = [r for r in result["runs"] if r.get("machines_removed")]
    result["plan_passes"] = bool(planned_run["passed"])
    result["fewer_fail"] = all(not r["passed"] for r in fewer_runs)
    cap = result.get("capacity") or {}
    result["capacity_error"] = cap.get("error")
    return result


def _capacity(run: Callable[[float], dict[str, Any]], predicted: float, settings: VerifySettings,
              result: dict[str, Any]) -> dict[str, Any]:
    """Bracket the planned deployment's capacity around ``predicted`` (device req/s)."""
    trials: list[dict[str, Any]] = []

    def measure(phase: str, load: float) -> Outcome:
        brief = run(load)
        brief.update(role="capacity", phase=phase)
        trials.append(brief)
        result["runs"].append(brief)
        return Outcome(brief["slo_passed"], brief["input_tpm"], brief["saturated"], False)

    n = max(1, settings.capacity_steps)
    res = run_search(SearchConfig(start=predicted / settings.factor ** 0.5, factor=settings.factor, max_steps=n,
                                  descend_steps=n, bisect_steps=1, rel_tol=0.02), measure)
    out: dict[str, Any] = {"predicted_rps": predicted, "bracket": res.bracket,
                           "best_rps": res.best.load if res.best else None}
    if res.bracket:
        lo, hi = res.bracket
        out["verified_rps"] = math.sqrt(lo * hi)
        out["error"] = predicted / out["verified_rps"] - 1.0
        out["within"] = max(hi / lo - 1.0, 0.0) / 2 ** 0.5
    elif res.best is not None:
        out["verified_rps"] = None
        out["lower_bound_rps"] = res.best.load
    return out


def deployment_commands(plan: dict[str, Any], traffic: dict[str, Any], slo: Sequence[str], workload: str,
                        model: str | None, target: str | None) -> list[str]:
    """For a real target: the reference server's router in front of vLLM instances, as planned (one router host with
    its own prefill instance, the others joining it), and the run that verifies the deployment at the traffic."""
    pools = {p["role"]: p for p in plan["pools"]}
    pre, dec = pools.get("prefill"), pools.get("decode")
    m = shlex.quote(model or "MODEL_DIR")
    lines = ["# the planned deployment: a router host, then one `serve --join` per further instance (docs/reference_server.md)",
             "openssl rand -hex 32 > internal.token   # copy it to every host"]
    if pre and dec:
        lines.append(f"paasbench serve --engine vllm --model {m} --mode disaggregated --prefill-workers 1 "
                     f"--decode-workers 1 --host ROUTER_HOST --port 8000 --join-port 8100 --kv-transport tcp "
                     "--internal-token-file internal.token")
        for role, pool in (("prefill", pre), ("decode", dec)):
            extra = pool["instances"] - 1
            if extra > 0:
                lines.append(f"# {extra} more {role} instance(s) ({pool['instance']['cards_per_instance']} x "
                             f"{pool['instance']['machine_type']} each), one per host:")
                lines.append(f"paasbench serve --join ROUTER_HOST:8100 --role {role} --host THIS_HOST "
                             "--internal-token-file internal.token")
    else:
        mixed = plan["pools"][0]
        lines.append(f"paasbench serve --engine vllm --model {m} --mode {plan['name']} --workers {mixed['instances']} "
                     "--host ROUTER_HOST --port 8000")
    gates = " ".join(f"--slo {shlex.quote(g)}" for g in slo)
    lines.append("# the run that verifies it: the planned traffic, the plan's SLO (exit 99 on a breach)")
    lines.append(f"paasbench run --target {shlex.quote(target or 'http://ROUTER_HOST:8000')} --workload "
                 f"{shlex.quote(workload)} --mode poisson --rate {traffic['rps']:.4g} --duration 600 --warmup 60 {gates} "
                 "--out runs/plan-verify")
    return lines


def _s(ms: float | None, scale: float) -> float | None:
    return None if ms is None else ms / 1e3 / scale


def _ms(s: float | None) -> str:
    return "—" if s is None or not math.isfinite(s) else f"{s * 1e3:,.0f} ms"
