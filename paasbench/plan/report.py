"""The plan report: ``OUT/plan.html`` (one self-contained file, its charts inline SVG, opens offline) and
``OUT/plan.md``, from plan.json -- the plan table, the alternatives and what each costs, the curves the plan was
sized from, the verification runs, and every assumption with where it came from.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from paasbench.plan.curves import load as load_curves
from paasbench.report.svg import Chart, RefLine, Series, line_chart
from paasbench.report.tables import Table


def _f(v: Any, fmt: str = "{:,.3g}") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return fmt.format(v)


def _ms(s: Any) -> str:
    return _f(None if s is None else s * 1e3, "{:,.0f} ms")


def _deployments(data: dict[str, Any]) -> Table:
    t = Table(["deployment", "pools", "instances (needed)", "machines", "cards", "P:D", "capacity (input TPM)",
               "utilization at the traffic", "cost / day", "cost / M input tokens"], text=True)
    cur = data["plan"]["cost"]["currency"]
    for d in [data["plan"]] + data["alternatives"]:
        pools = ", ".join(f"{p['role']}: {p['instance']['cards_per_instance']} x {p['instance']['machine_type']}"
                          for p in d["pools"])
        t.add([d["name"], pools, ", ".join(f"{p['instances']} ({p['instances_needed']})" for p in d["pools"]),
               str(d["machines"]), str(d["cards"]), d["ratio"], _f(d["capacity_tpm"] / 1e6, "{:.3g}M"),
               ", ".join(_f(p["utilization"], "{:.0%}") for p in d["pools"]),
               _f(d["cost"]["cost_per_day"], "{:,.0f} " + cur), _f(d["cost"]["cost_per_m_input_tokens"], "{:.3f} " + cur)])
    return t


def _pool_figures(data: dict[str, Any]) -> Table:
    t = Table(["deployment", "pool", "figure", "value"], text=True)
    for d in [data["plan"]] + data["alternatives"]:
        for p in d["pools"]:
            for k, v in p["predicted"].items():
                t.add([d["name"], p["role"], k, _f(v, "{:.4g}") if isinstance(v, (int, float)) else str(v)])
            t.add([d["name"], p["role"], "capacity (req/s)", _f(p["capacity_rps"], "{:.4g}")])
    return t


def _costs(data: dict[str, Any]) -> Table:
    t = Table(["deployment", "pool", "machine type", "machines", "price (source)", "hardware / day", "power / day",
               "network / day", "cost / day"], text=True)
    for d in [data["plan"]] + data["alternatives"]:
        for r in d["cost"]["pools"]:
            t.add([d["name"], r["role"], r["machine_type"], str(r["machines"]),
                   f"{r['machine_price']:,.0f} ({r['price_source']})", _f(r["hardware_per_day"], "{:,.0f}"),
                   _f(r["power_per_day"], "{:,.0f}"), _f(r["network_per_day"], "{:,.0f}"), _f(r["cost_per_day"], "{:,.0f}")])
    return t


def _verify(v: dict[str, Any] | None) -> Table | None:
    if not v:
        return None
    t = Table(["run", "deployment", "load (req/s)", "offered", "p50 TTFT", "p90 TTFT", "p50 TPOT", "server hit",
               "host-bound", "verdict", "why"], text=True)
    for r in v["runs"]:
        inst = r.get("instances")
        dep = ", ".join(f"{n} {k}" for k, n in inst.items()) if inst else "as planned"
        if r.get("skipped"):
            t.add([r["role"], dep, "—", "—", "—", "—", "—", "—", "—", "FAIL", r["skipped"]])
            continue
        why = "; ".join((r.get("failed_gates") or []) + list(r.get("reasons") or []))
        t.add([r["role"] + (f" ({r['phase']})" if r.get("phase") else ""), dep, _f(r["rps"], "{:.4g}"),
               _f(r.get("offered_rps"), "{:.4g}"), _ms(r.get("ttft_p50_s")), _ms(r.get("ttft_p90_s")),
               _ms(r.get("tpot_p50_s")), _f(r.get("server_hit"), "{:.1%}"), _f(r.get("host_bound_share"), "{:.0%}"),
               "PASS" if r["passed"] else "FAIL", why])
    return t


def _charts(data: dict[str, Any], base: Path) -> list[str]:
    """The prefill curve (seconds per uncached token against position), the single-instance TTFT under load
    (measured beside the model), and TPOT against the streams decoding at once, per curves file."""
    out: list[str] = []
    seen: set[str] = set()
    for role, src in data["curves"].items():
        path = Path(src["file"])
        if not path.is_absolute() and not path.exists():
            path = base / path
        if str(path) in seen or not path.exists():
            continue
        seen.add(str(path))
        curves = load_curves(path)
        for name, pool in curves.pools.items():
            label = f"{name} pool, {pool.instance.machine_type} ({src['mode']})"
            if pool.prefill:
                pts = sorted(pool.prefill, key=lambda p: p.position)
                out.append(line_chart(Chart(f"{label}: prefill cost", "mean position of the uncached tokens",
                                            "µs per uncached token",
                                            [Series("measured" if src["mode"] != "rapid" else "roofline",
                                                    [p.position for p in pts], [p.seconds_per_token * 1e6 for p in pts])])))
                series = []
                for p in pool.prefill:
                    steps = [s for s in p.steps if s.get("device_rps")]
                    if steps:
                        series.append(Series(f"{p.context:,} measured", [s["device_rps"] for s in steps],
                                             [s["ttft_q_s"] * 1e3 for s in steps]))
                        series.append(Series(f"{p.context:,} model", [s["device_rps"] for s in steps],
                                             [s["model_ttft_s"] * 1e3 for s in steps], dashed=True))
                if series:
                    q = data["slo"].get("ttft_q") or 0.5
                    lim = data["slo"].get("ttft_s")
                    out.append(line_chart(Chart(f"{label}: one instance under load", "req/s",
                                                f"p{q * 100:g} TTFT (ms)", series,
                                                lines=[RefLine(lim * 1e3, "SLO")] if lim else [])))
            if pool.decode:
                series = [Series(f"{d.context:,} tokens", [b for b, _ in d.table], [t * 1e3 for _, t in d.table])
                          for d in pool.decode if d.table]
                lim = data["slo"].get("tpot_s")
                if series:
                    out.append(line_chart(Chart(f"{label}: decode", "streams decoding at once", "TPOT (ms)", series,
                                                lines=[RefLine(lim * 1e3, "SLO")] if lim else [])))
    return out


def _table(rows: list[dict[str, str]]) -> Table:
    t = Table(["what", "value", "from"], text=True)
    for r in rows:
        t.add([r["what"], r["value"], r["source"]])
    return t


def render_plan(data: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    from paasbench.report.render import render_pages

    out = Path(out)
    tr = data["traffic"]
    v = data.get("verify")
    cap = (v or {}).get("capacity") or {}
    ctx = {
        "d": data, "traffic": tr,
        "deployments": _deployments(data), "figures": _pool_figures(data), "costs": _costs(data),
        "verify": _verify(v), "verify_data": v, "capacity": cap,
        "assumptions": _table(data["assumptions"]), "queueing": data["queueing"],
        "charts": _charts(data, out), "commands": data.get("commands") or [],
        "skipped": data.get("alternatives_skipped") or {},
    }
    title = (f"paasbench plan: {tr['input_tpm'] / 1e6:.3g}M input TPM of {tr['name']} under "
             f"{', '.join(data['slo']['gates'])}")
    return render_pages("plan", title, ctx, out, "plan")
