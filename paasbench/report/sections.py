"""Results -> report sections: tables (as strings, ready for HTML and Markdown alike) and SVG figures.

The templates only lay these out; every number is formatted here once, so the HTML and the Markdown report can
never show different figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from paasbench import slo
from paasbench.cost import FORMULAS, CostInputs, CostRow, cost_row
from paasbench.metrics import records_frame
from paasbench.records import read_records
from paasbench.report import svg
from paasbench.report.headline import BY_PATH, CATALOG, headline_values, worse_by
from paasbench.report.load import Result, RunResult, SweepResult, headline

LAT_BLOCKS = [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"),
              ("schedule_lag_ms", "schedule lag")]
LAT_STATS = [("mean", "mean"), ("p50", "p50"), ("p90", "p90"), ("p95", "p95"), ("p99", "p99"), ("p999", "p99.9"),
             ("max", "max")]
WHITE_PAPER_ROW = {"label": "white paper (hand-entered)", "max_input_tpm": 5.8e6, "hit_ratio": 0.9,
                   "context_tokens": 65536}


@dataclass(slots=True)
class Table:
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    classes: list[list[str]] = field(default_factory=list)   # per-cell CSS class: "good", "bad", ""
    text: bool = False          # a text table (left-aligned), not a numeric one

    def add(self, row: list[str], classes: list[str] | None = None) -> None:
        self.rows.append(row)
        self.classes.append(classes or [""] * len(row))


# ------------------------------------------------------------------------------------------ formatting


def num(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return f"{v:,.{digits}f}"


def big(v: float | None) -> str:
    """Large counts readably: 5.80M, 657.8K."""
    if v is None:
        return "—"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= div:
            return f"{v / div:,.2f}{suffix}"
    return f"{v:,.2f}"


def pct(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v * 100:.{digits}f}%"


def metric_value(path: str, v: float | None) -> str:
    if path.endswith("_ratio") or path == "error_rate":
        return pct(v, 2)
    if "_ms" in path:
        return num(v, 1)
    if path.endswith("tpm"):
        return big(v)
    return num(v, 3)


def context_label(tokens: int | None) -> str:
    """64K for 65536: context buckets are powers of two in KiB-tokens."""
    if not tokens:
        return "—"
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else big(tokens)


def compact(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(", ", ": "), sort_keys=True)
    return str(v)


# -------------------------------------------------------------------------------------------- tables


def meta_table(meta: dict[str, Any], extra: Iterable[tuple[str, str]] = ()) -> Table:
    t = Table(["field", "value"], text=True)
    order = ["target", "model", "workload", "seed", "load", "server", "versions"]
    for key in order + sorted(k for k in meta if k not in order):
        if key in meta and meta[key] not in (None, "", {}):
            t.add([key, compact(meta[key])])
    for k, v in extra:
        t.add([k, v])
    return t


def verdict_table(verdict: slo.Verdict) -> Table:
    t = Table(["gate", "measured", "threshold", "margin", "margin %", "result"])
    for r in verdict.results:
        g = r.gate
        t.add([g.label, slo.format_value(g.key, r.measured), slo.format_value(g.key, g.threshold),
               slo.format_value(g.key, r.margin) if r.margin is not None else "—",
               pct(r.margin_rel) if r.margin_rel is not None else "—",
               "PASS" if r.passed else ("FAIL (" + r.reason + ")" if r.reason != "breached" else "FAIL")],
              ["", "", "", "", "", "good" if r.passed else "bad"])
    return t


def latency_table(summary: dict[str, Any]) -> Table:
    t = Table(["metric (ms)", "count"] + [label for _, label in LAT_STATS])
    for key, label in LAT_BLOCKS:
        block = summary.get(key)
        if isinstance(block, dict):
            t.add([label, num(block.get("count"))] + [num(block.get(s)) for s, _ in LAT_STATS])
    return t


def throughput_table(summary: dict[str, Any]) -> Table:
    req = summary.get("requests") or {}
    t = Table(["figure", "value"])
    for label, value in [
        ("requests ok / failed / total", f"{num(req.get('ok'))} / {num(req.get('failed'))} / {num(req.get('total'))}"),
        ("duration (s)", num(summary.get("duration_s"), 2)),
        ("request throughput (req/s)", num(summary.get("request_throughput_rps"), 3)),
        ("goodput (req/s)", num(summary.get("goodput_rps"), 3)),
        ("input TPM", big(summary.get("input_tpm"))),
        ("output TPM", big(summary.get("output_tpm"))),
        ("input tokens/s", num(summary.get("input_tokens_per_s"), 0)),
        ("output tokens/s", num(summary.get("output_tokens_per_s"), 1)),
        ("input / cached / uncached tokens", " / ".join(big(summary.get(k)) for k in
                                                         ("input_tokens", "cached_tokens", "uncached_tokens"))),
        ("output tokens", big(summary.get("output_tokens"))),
        ("prefix hit ratio (server-reported)", pct(summary.get("prefix_hit_ratio"), 2)),
        ("error rate", pct(summary.get("error_rate"), 2)),
    ]:
        t.add([label, value])
    return t


def errors_table(summary: dict[str, Any]) -> Table:
    t = Table(["error kind", "count", "share of requests"])
    total = (summary.get("requests") or {}).get("total") or 0
    for kind, count in sorted((summary.get("errors") or {}).items(), key=lambda kv: -kv[1]):
        t.add([kind, num(count), pct(count / total if total else None)], ["bad", "", ""])
    return t


def stage_table(summary: dict[str, Any]) -> Table:
    t = Table(["server stage", "mean"])
    for stage, value in (summary.get("server_timings_ms") or {}).items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            t.add([stage, big(value) if "bytes" in stage else num(value, 2) + " ms"])
        elif isinstance(value, dict):  # a label the server reported per request, e.g. prefill_location counts
            t.add([stage, ", ".join(f"{k}: {v}" for k, v in sorted(value.items()))])
    return t


def cost_tables(rows: list[CostRow], inputs: CostInputs) -> dict[str, Table]:
    c = inputs.currency
    t = Table(["row", "context", "max input TPM", "hit", f"blended {c}/M", f"revenue {c}/min", f"revenue {c}/day",
               f"revenue {c}/year", f"cost {c}/day", f"cost {c}/M tokens", "gross margin", "payback (months)"])
    for r in rows:
        t.add([r.label, context_label(r.context_tokens), big(r.max_input_tpm), pct(r.hit_ratio, 0),
               num(r.blended_price_per_m, 2), num(r.revenue_per_minute, 2), num(r.revenue_per_day, 1),
               num(r.revenue_per_year, 0), num(r.cost_per_day, 1), num(r.cost_per_m_tokens, 4),
               pct(r.gross_margin), num(r.payback_months, 1)],
              [""] * 10 + ["good" if (r.gross_margin or 0) > 0 else "bad", ""])
    formulas = Table(["quantity", "formula"], [[a, b] for a, b in FORMULAS], [["", ""] for _ in FORMULAS], True)
    ins = Table(["cost input", "value"], text=True)
    for name in ("currency", "price_input_per_m", "price_cached_input_per_m", "price_output_per_m",
                 "cards_per_machine", "machine_price", "amortization_years", "power_kw", "electricity_per_kwh",
                 "network_per_day", "hours_per_day"):
        ins.add([name, compact(getattr(inputs, name))])
    return {"rows": t, "formulas": formulas, "inputs": ins}


# ----------------------------------------------------------------------------------------- records


def measurement_window(meta: dict[str, Any]) -> tuple[float, float] | None:
    """The [warm-up, warm-up + duration) window a sweep step's summary was computed over, if recorded."""
    load = meta.get("load") if isinstance(meta.get("load"), dict) else {}
    warm, dur = load.get("warmup_s"), load.get("duration_s")
    if isinstance(warm, (int, float)) and isinstance(dur, (int, float)) and dur > 0:
        return (float(warm), float(warm) + float(dur))
    return None


def request_latencies(records_path, window: tuple[float, float] | None = None) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and E2E (ms) of successful requests, from the intended send time — the very
    per-request values summary.json's percentiles are taken over (``metrics.records_frame``). With a ``window``,
    only requests whose intended send time falls in it count, as in the summary."""
    out: dict[str, list[float]] = {"ttft_ms": [], "tpot_ms": [], "e2e_ms": []}
    if records_path is None:
        return out
    df = records_frame(read_records(records_path))
    if df.empty:
        return out
    keep = df["ok"]
    if window is not None:
        keep &= (df["intended_send_s"] >= window[0]) & (df["intended_send_s"] < window[1])
    for key in out:
        out[key] = df.loc[keep, key].dropna().tolist()
    return out


def cdf_charts(runs: list[tuple[str, RunResult]], width: int = 420) -> list[str]:
    """One CDF chart per latency metric, one curve per run (from its records.jsonl)."""
    lat = [(name, request_latencies(run.records_path, measurement_window(run.meta)))
           for name, run in runs if run.records_path]
    if not lat:
        return []
    charts = []
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        series = []
        for i, (name, values) in enumerate(lat):
            xs, ys = svg.cdf_points(values[key])
            if xs:
                series.append(svg.Series(name, xs, ys, step=True, markers=False))
        log = svg.wide([x for se in series for x in se.xs])
        charts.append(svg.line_chart(svg.Chart(f"{label} CDF", f"{label} (ms{', log scale' if log else ''})",
                                               "fraction of requests", series, y_min=0.0, y_max=1.0, width=width,
                                               height=300, legend="br", x_log=log)))
    return charts


# ----------------------------------------------------------------------------------------- sections


def gates_for(result: Result, gates: list[slo.Gate] | None) -> list[slo.Gate]:
    """The gates to judge by: given ones, else the ones the sweep/run recorded (``slo`` strings)."""
    if gates:
        return gates
    recorded = result.slo if isinstance(result, SweepResult) else (result.meta.get("slo") or [])
    return slo.parse_gates(recorded) if recorded else []


def primary_latency_gate(gates: list[slo.Gate]) -> tuple[str, str, float | None]:
    """(block, stat, threshold) of the first latency gate; TTFT p50 with no line when none is set."""
    for g in gates:
        if g.stat is not None:
            return g.key, g.stat, g.threshold
    return "ttft_ms", "p50", None


def knee_index(xs: list[float], ys: list[float]) -> int | None:
    """Kneedle-style knee of an increasing, convex latency-vs-throughput curve: the point farthest below the
    chord from the first to the last point (both axes normalized). None with fewer than 3 points, when latency
    does not climb (small-sample noise at light load can make it fall), or with no bend."""
    if len(xs) < 3 or ys[-1] <= ys[0] * 1.2:  # latency must actually climb for there to be a knee
        return None
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0 or y1 == y0:
        return None
    nx = [(x - x0) / (x1 - x0) for x in xs]
    ny = [(y - y0) / (y1 - y0) for y in ys]
    slope = (ny[-1] - ny[0]) / (nx[-1] - nx[0]) if nx[-1] != nx[0] else 0.0
    dist = [ny[0] + slope * (x - nx[0]) - y for x, y in zip(nx, ny)]
    best = max(range(len(dist)), key=dist.__getitem__)
    return best if dist[best] > 0.05 else None


def cost_rows_for(result: Result, inputs: CostInputs) -> list[CostRow]:
    rows = []
    if isinstance(result, SweepResult):
        best = result.best
        hit_default = best.summary.get("prefix_hit_ratio") if best else None
        for b in result.data.get("buckets") or []:
            tpm = b.get("max_input_tpm")
            hit = b.get("hit_ratio", b.get("prefix_hit_ratio", hit_default))
            if tpm is None or hit is None:
                continue
            ctx = b.get("context_tokens")
            rows.append(cost_row(tpm, hit, b.get("output_tpm") or 0.0, inputs,
                                 f"{result.name} @ {context_label(ctx)} ctx" if ctx else result.name, context_tokens=ctx))
        if not rows and best is not None and result.max_input_tpm is not None and hit_default is not None:
            rows.append(cost_row(result.max_input_tpm, hit_default, best.summary.get("output_tpm") or 0.0, inputs,
                                 f"{result.name} (best step)"))
    else:
        s = result.summary
        if s.get("input_tpm") is not None and s.get("prefix_hit_ratio") is not None:
            rows.append(cost_row(s["input_tpm"], s["prefix_hit_ratio"], s.get("output_tpm") or 0.0, inputs,
                                 f"{result.name} (measured load, not max under SLO)"))
    wp = WHITE_PAPER_ROW
    rows.append(cost_row(wp["max_input_tpm"], wp["hit_ratio"], 0.0, inputs, wp["label"],
                         context_tokens=wp["context_tokens"]))
    return rows


def hit_target(meta: dict[str, Any]) -> float | None:
    """The prefix-hit ratio the workload aimed at: recorded in the meta, else from the named workload's spec."""
    workload = meta.get("workload")
    for source in (meta, workload if isinstance(workload, dict) else {}):
        for key in ("target_hit_ratio", "prefix_hit_target", "prefix_hit_ratio"):
            v = source.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
    if isinstance(workload, str) and workload:
        try:
            from paasbench.workload import load_workload

            return load_workload(workload).target_hit_ratio
        except Exception:  # noqa: BLE001 - a renamed or removed workload only loses the target line
            return None
    return None


def hit_table(summary: dict[str, Any], meta: dict[str, Any], gates: list[slo.Gate]) -> Table:
    t = Table(["prefix hit", "value"])
    achieved, target = summary.get("prefix_hit_ratio"), hit_target(meta)
    t.add(["achieved (server-reported cached / prompt tokens)", pct(achieved, 2)])
    t.add(["workload target", pct(target, 2)])
    if achieved is not None and target is not None:
        t.add(["achieved − target", f"{(achieved - target) * 100:+.2f} pts"],
              ["", "bad" if achieved < target - 0.02 else "good"])
    for g in gates:
        if g.key == "prefix_hit_ratio":
            t.add([f"gate {g.label}", "PASS" if slo.evaluate([g], summary).passed else "FAIL"])
    return t


def run_section(run: RunResult, gates: list[slo.Gate], inputs: CostInputs, *, with_meta: bool = True,
                with_cost: bool = True) -> dict[str, Any]:
    s = run.summary
    verdict = slo.evaluate(gates, s) if gates else None
    stages = {k: v for k, v in (s.get("server_timings_ms") or {}).items()
              if isinstance(v, (int, float)) and not isinstance(v, bool) and "bytes" not in k}
    return {
        "kind": "run", "name": run.name, "path": str(run.path),
        "meta": meta_table(run.meta, [("duration (s)", num(s.get("duration_s"), 2))]) if with_meta else None,
        "verdict": verdict_table(verdict) if verdict else None,
        "passed": verdict.passed if verdict else None,
        "latency": latency_table(s), "throughput": throughput_table(s), "errors": errors_table(s),
        "stages": stage_table(s),
        "stage_chart": svg.bar_chart("server per-stage mean (ms)", list(stages), {"mean ms": list(stages.values())},
                                     unit="ms") if stages else None,
        "hit": hit_table(s, run.meta, gates),
        "cdfs": cdf_charts([(run.name, run)]),
        "cost": cost_tables(cost_rows_for(run, inputs), inputs) if with_cost else None,
    }


def group_label(step: dict[str, Any]) -> str:
    parts = []
    if step.get("bucket"):
        parts.append(context_label(step["bucket"]))
    sp = step.get("server_param")
    if isinstance(sp, dict) and sp.get("name"):
        parts.append(f"{sp['name']}={sp.get('value')}")
    return " ".join(parts)


def _tl_points(runs: list[RunResult], block: str, stat: str) -> tuple[list[float], list[float]]:
    """(achieved input TPM, latency) per run, in the order given (offered load): past saturation the achieved
    throughput falls while latency climbs, and the curve must show that curl, not hide it by sorting on TPM."""
    pts = [(r.summary.get("input_tpm"), (r.summary.get(block) or {}).get(stat)) for r in runs]
    pts = [p for p in pts if p[0] is not None and p[1] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _knee_of(xs: list[float], ys: list[float]) -> int | None:
    """Knee over the rising part of the curve (up to the highest achieved throughput)."""
    if not xs:
        return None
    peak = max(range(len(xs)), key=xs.__getitem__)
    return knee_index(xs[:peak + 1], ys[:peak + 1])


def sweep_section(sweep: SweepResult, gates: list[slo.Gate], inputs: CostInputs) -> dict[str, Any]:
    raw = sweep.data.get("steps") or []
    labels = [group_label(raw[i]) if i < len(raw) and isinstance(raw[i], dict) else "" for i in range(len(sweep.steps))]
    groups: dict[str, list[int]] = {}
    for i in sorted(range(len(sweep.steps)), key=lambda i: (labels[i], sweep.step_loads[i].get("value") or 0)):
        groups.setdefault(labels[i], []).append(i)
    kind = next((l.get("kind") for l in sweep.step_loads if l.get("kind")), "load")
    unit = next((l.get("unit") for l in sweep.step_loads if l.get("unit")), "")
    axis = f"{kind} ({unit})" if unit else kind
    grouped = len(groups) > 1
    steps = Table(["step"] + (["group"] if grouped else []) + ["phase", axis, "input TPM", "req/s", "goodput",
                  "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "errors", "prefix hit", "verdict"])
    for label, idx in groups.items():
        for i in idx:
            st, s = sweep.steps[i], sweep.steps[i].summary
            entry = raw[i] if i < len(raw) and isinstance(raw[i], dict) else {}
            passed = sweep.step_passed[i]
            if passed is None and gates:
                passed = slo.evaluate(gates, s).passed
            sat = (entry.get("saturation") or {}).get("saturated")
            verdict = "—" if passed is None else ("PASS" if passed else
                                                  "FAIL (saturated)" if sat and entry.get("slo_passed") else "FAIL")
            ttft, tpot = s.get("ttft_ms") or {}, s.get("tpot_ms") or {}
            row = [st.name] + ([label] if grouped else []) + [
                str(entry.get("phase", "")), num(sweep.step_loads[i].get("value"), 3), big(s.get("input_tpm")),
                num(s.get("request_throughput_rps"), 3), num(s.get("goodput_rps"), 3), num(ttft.get("p50")),
                num(ttft.get("p90")), num(tpot.get("p50")), num(tpot.get("p90")), pct(s.get("error_rate"), 2),
                pct(s.get("prefix_hit_ratio"), 1), verdict]
            steps.add(row, [""] * (len(row) - 1) + ["" if passed is None else ("good" if passed else "bad")])

    def series_by_group(getter, name: str = "") -> list[svg.Series]:
        out = []
        for label, idx in groups.items():
            xs = [sweep.step_loads[i].get("value") for i in idx]
            out.append(svg.Series(" ".join(x for x in (label, name) if x) or "steps", xs,
                                  [getter(sweep.steps[i].summary) for i in idx]))
        return out

    charts = []
    stats = ("p50", "p90") if grouped else ("p50", "p90", "p99")
    for block, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        series = [x for stat in stats for x in series_by_group(lambda s, b=block, q=stat: (s.get(b) or {}).get(q), stat)]
        lines = [svg.RefLine(g.threshold, f"SLO {g.label}") for g in gates if g.key == block]
        log = svg.wide([y for se in series for y in se.ys])
        charts.append(svg.line_chart(svg.Chart(f"{label} percentiles vs load", axis,
                                               f"{label} (ms{', log scale' if log else ''})", series, lines=lines,
                                               y_log=log)))
    # throughput–latency curve: each step at its achieved input TPM, one curve per group
    block, stat, threshold = primary_latency_gate(gates)
    tl_series, marks, knees = [], [], []
    for label, idx in groups.items():
        xs, ys = _tl_points([sweep.steps[i] for i in idx], block, stat)
        tl_series.append(svg.Series(label or "steps", xs, ys))
        k = _knee_of(xs, ys)
        if k is not None:
            marks.append(svg.Mark(xs[k], ys[k], f"knee {label}".strip(), "#9467bd"))
            knees.append(f"{big(xs[k])} input TPM" + (f" ({label})" if label else ""))
    best = sweep.best
    if best is not None and best.summary.get("input_tpm") is not None:
        by = (best.summary.get(block) or {}).get(stat)
        if by is not None:
            marks.append(svg.Mark(best.summary["input_tpm"], by, "best under SLO", "#2ca02c"))
    metric = block.removesuffix("_ms")
    lines = [svg.RefLine(threshold, f"SLO {stat}({metric}) = {num(threshold, 0)} ms")] if threshold is not None else []
    log = svg.wide([y for se in tl_series for y in se.ys])
    tl_chart = svg.line_chart(svg.Chart(f"throughput vs latency: {stat} {metric.upper()}", "achieved input TPM",
                                        f"{stat} {metric} (ms{', log scale' if log else ''})", tl_series, marks, lines,
                                        width=760, height=360, y_log=log))
    goodput = svg.line_chart(svg.Chart("throughput and goodput vs load", axis, "req/s",
                                       series_by_group(lambda s: s.get("request_throughput_rps"), "req/s (ok)")
                                       + series_by_group(lambda s: s.get("goodput_rps"), "goodput")))
    target = hit_target(sweep.meta) or (best and hit_target(best.meta))
    hit_lines = [svg.RefLine(target, f"target {pct(target)}")] if target is not None else []
    hit_lines += [svg.RefLine(g.threshold, f"gate {g.label}", color="#ff7f0e") for g in gates
                  if g.key == "prefix_hit_ratio"]
    hit_chart = svg.line_chart(svg.Chart("prefix hit achieved vs load", axis, "hit ratio",
                                         series_by_group(lambda s: s.get("prefix_hit_ratio"), "achieved"),
                                         lines=hit_lines, y_min=0.0, y_max=1.0))
    if grouped:  # one CDF curve per group: its best (else highest-load) step
        picks = [max(idx, key=lambda i: (bool(sweep.step_passed[i]), sweep.step_loads[i].get("value") or 0))
                 for idx in groups.values()]
    else:
        idx = next(iter(groups.values()), [])
        picks = idx if len(idx) <= 8 else [idx[round(k * (len(idx) - 1) / 7)] for k in range(8)]
    runs = [(f"{sweep.steps[i].name} ({labels[i] + ' ' if grouped else ''}{num(sweep.step_loads[i].get('value'), 2)})",
             sweep.steps[i]) for i in picks]
    extra = [("SLO", "; ".join(g.label for g in gates) or "—"), ("steps", str(len(sweep.steps))),
             ("status", str(sweep.data.get("status", "—"))),
             ("max input TPM under SLO", big(sweep.max_input_tpm)), ("best step", best.name if best else "none passed")]
    return {
        "kind": "sweep", "name": sweep.name, "path": str(sweep.path),
        "meta": meta_table({k: v for k, v in sweep.meta.items() if k != "config"}, extra), "steps": steps,
        "config": meta_table(sweep.meta.get("config") or {}) if sweep.meta.get("config") else None,
        "passed": best is not None, "max_input_tpm": big(sweep.max_input_tpm),
        "charts": charts, "tl_chart": tl_chart, "knee": "; ".join(knees) or None,
        "goodput_chart": goodput, "hit_chart": hit_chart, "cdfs": cdf_charts(runs),
        "param": param_table(sweep.data.get("server_param")),
        "server": server_metrics_section(sweep, [i for idx in groups.values() for i in idx], axis),
        "best": run_section(best, gates, inputs, with_meta=False, with_cost=False) if best else None,
        "cost": cost_tables(cost_rows_for(sweep, inputs), inputs),
    }


def server_metrics_section(sweep: SweepResult, order: list[int], axis: str) -> dict[str, Any] | None:
    """What the target's /metrics said during each step (scraped before and after it), and saturation signals."""
    raw = sweep.data.get("steps") or []
    entries = [(i, raw[i]) for i in order if i < len(raw) and isinstance(raw[i], dict)]
    if not any(e.get("server_metrics") or e.get("saturation") for _, e in entries):
        return None
    pools = sorted({p for _, e in entries for p in ((e.get("server_metrics") or {}).get("pools") or {})})
    t = Table(["step", axis, "server prefix hit"] + [f"{p} util" for p in pools] +
              ["KV evictions", "checksum failures", "remote prefill", "saturated"])
    util: dict[str, list[float | None]] = {p: [] for p in pools}
    loads = []
    for i, e in entries:
        m = e.get("server_metrics") or {}
        deltas, sat = m.get("deltas") or {}, e.get("saturation") or {}
        row_pools = m.get("pools") or {}
        for p in pools:
            util[p].append((row_pools.get(p) or {}).get("utilization"))
        loads.append(sweep.step_loads[i].get("value"))
        reasons = "; ".join(sat.get("reasons") or [])
        t.add([sweep.steps[i].name, num(sweep.step_loads[i].get("value"), 3), pct(m.get("prefix_hit_ratio"), 1)]
              + [pct((row_pools.get(p) or {}).get("utilization"), 0) for p in pools]
              + [num(deltas.get("kv_evictions"), 0), num(deltas.get("kv_transfer_checksum_failures"), 0),
                 pct(e.get("remote_prefill_share"), 0),
                 ("yes: " + reasons if reasons else "yes") if sat.get("saturated") else "no"],
              [""] * (4 + len(pools)) + ["bad" if deltas.get("kv_transfer_checksum_failures") else "", "",
                                          "bad" if sat.get("saturated") else ""])
    chart = svg.line_chart(svg.Chart("pool utilization vs load", axis, "busy fraction",
                                     [svg.Series(p, loads, util[p]) for p in pools], y_min=0.0, y_max=1.0)) \
        if pools else None
    return {"table": t, "chart": chart}


def param_table(param: dict[str, Any] | None) -> dict[str, Any] | None:
    """The server-parameter sweep (e.g. the remote-prefill threshold crossover), when the sweep varied one."""
    if not isinstance(param, dict) or not param.get("rows"):
        return None
    t = Table([str(param.get("name")), "input TPM", "goodput", "TTFT p50", "TTFT p90", "TPOT p50",
               "remote prefill share", "SLO"])
    for r in param["rows"]:
        best = r.get("value") == param.get("best_value")
        t.add([str(r.get("value")) + (" ★" if best else ""), big(r.get("input_tpm")), num(r.get("goodput_rps"), 3),
               num(r.get("ttft_p50_ms")), num(r.get("ttft_p90_ms")), num(r.get("tpot_p50_ms")),
               pct(r.get("remote_prefill_share")), "PASS" if r.get("passed") else "FAIL"],
              ["good" if best else ""] + [""] * 6 + ["good" if r.get("passed") else "bad"])
    return {"name": param.get("name"), "best": param.get("best_value"), "rule": param.get("rule", ""), "table": t}


def inputs_for(result: Result, explicit: CostInputs | None) -> CostInputs:
    """Explicit cost inputs, else the ones a sweep recorded, else the defaults."""
    if explicit is not None:
        return explicit
    recorded = result.data.get("cost_inputs") if isinstance(result, SweepResult) else None
    if isinstance(recorded, dict):
        known = {k: v for k, v in recorded.items() if k in CostInputs.__dataclass_fields__}
        return CostInputs(**known)
    return CostInputs()


def section(result: Result, gates: list[slo.Gate] | None, inputs: CostInputs | None = None) -> dict[str, Any]:
    g, ci = gates_for(result, gates), inputs_for(result, inputs)
    if isinstance(result, SweepResult):
        return sweep_section(result, g, ci)
    return run_section(result, g, ci)


# ------------------------------------------------------------------------------------------ compare


def compare_context(results: list[Result], gates: list[slo.Gate] | None, inputs: CostInputs | None) -> dict[str, Any]:
    """Side by side: the first result is the baseline; deltas are relative to it, coloured by direction."""
    names = [r.name for r in results]
    values = [headline_values(r) for r in results]
    t = Table(["metric"] + [names[0] + " (baseline)"] + [f"{n} (Δ vs baseline)" for n in names[1:]])
    for m in CATALOG:
        if all(v[m.path] is None for v in values):
            continue
        row, cls = [m.label, metric_value(m.path, values[0][m.path])], ["", ""]
        for v in values[1:]:
            cur = v[m.path]
            w = worse_by(m, values[0][m.path], cur)
            delta = "" if w is None else f" ({_signed_pct(w, m.higher_is_better)})"
            row.append(metric_value(m.path, cur) + delta)
            cls.append("" if w is None or abs(w) < 0.005 else ("bad" if w > 0 else "good"))
        t.add(row, cls)
    verdicts = Table(["result", "SLO", "gates"])
    for r in results:
        g = gates_for(r, gates)
        run = headline(r)
        if g and run is not None:
            v = slo.evaluate(g, run.summary)
            verdicts.add([r.name, "PASS" if v.passed else "FAIL",
                          "; ".join(f"{x.gate.label}: {slo.format_value(x.gate.key, x.measured)}" for x in v.results)],
                         ["", "good" if v.passed else "bad", ""])
    heads = [(r.name, headline(r)) for r in results]
    bars = []
    for block, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        groups = {name: [(run.summary.get(block) or {}).get(s) if run else None for s in ("p50", "p90", "p99")]
                  for name, run in heads}
        bars.append(svg.bar_chart(f"{label} percentiles (ms)", ["p50", "p90", "p99"], groups, unit="ms"))
    curves = []
    for r in results:
        if isinstance(r, SweepResult):
            block, stat, _ = primary_latency_gate(gates_for(r, gates))
            order = sorted(range(len(r.steps)), key=lambda i: r.step_loads[i].get("value") or 0)
            xs, ys = _tl_points([r.steps[i] for i in order], block, stat)
            curves.append(svg.Series(f"{r.name} ({stat} {block.removesuffix('_ms')})", xs, ys))
    log = svg.wide([y for c in curves for y in c.ys])
    tl = svg.line_chart(svg.Chart("throughput vs latency", "achieved input TPM",
                                  f"latency (ms{', log scale' if log else ''})", curves, width=760, height=360,
                                  y_log=log)) if curves else None
    inputs = inputs_for(results[0], inputs)
    costs = [row for r in results for row in cost_rows_for(r, inputs)[:-1]]
    wp = cost_rows_for(results[0], inputs)[-1]
    return {"names": names, "table": t, "verdicts": verdicts if verdicts.rows else None, "bars": bars, "tl_chart": tl,
            "cdfs": cdf_charts([(n, run) for n, run in heads if run is not None]),
            "cost": cost_tables(costs + [wp], inputs),
            "sections": [section(r, gates, inputs) for r in results]}


def _signed_pct(worse: float, higher_is_better: bool) -> str:
    change = -worse if higher_is_better else worse
    if math.isinf(change):
        return "new" if change > 0 else "gone"
    return f"{change * 100:+.1f}%"
