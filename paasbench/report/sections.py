"""Results -> report sections: a run's or a sweep's tables (``tables``) and SVG figures (``svg``, ``curves``).

The templates only lay these out, so the HTML and the Markdown report can never show different figures.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paasbench.cost.table import CostInputs, CostRow, cost_row
from paasbench.metrics import slo, verify
from paasbench.report import svg
from paasbench.report.engine import Row, engine_section
from paasbench.report.pareto import pareto_chart, pareto_points, pareto_table
from paasbench.report.curves import _knee_of, _tl_points, cdf_charts, primary_latency_gate
from paasbench.report.best import best_step, capacity_text, headline_cards, priced_at_text, split_warnings
from paasbench.report.load import Result, RunResult, SweepResult, shown_path
from paasbench.report.tables import (Table, big, claim_tables, context_label, cost_tables, errors_table, hit_table, hit_target,
                                     latency_table, load_label, meta_table, num, param_table, pct, probe_table, server_timings, stage_table,
                                     throughput_table, verdict_table)

WHITE_PAPER_ROW = {"label": "white paper (hand-entered)", "max_input_tpm": 5.8e6, "hit_ratio": 0.9,
                   "context_tokens": 65536, "cards": 8, "machines": 1}


def gates_for(result: Result, gates: list[slo.Gate] | None) -> list[slo.Gate]:
    """The gates to judge by: given ones, else the ones the sweep/run recorded (``slo`` strings)."""
    if gates:
        return gates
    recorded = result.slo if isinstance(result, SweepResult) else (result.meta.get("slo") or [])
    return slo.parse_gates(recorded) if recorded else []



def cost_rows_for(result: Result, inputs: CostInputs) -> list[CostRow]:
    rows = []
    if isinstance(result, SweepResult):
        hw = result.meta.get("hardware") or {}
        best = result.best
        hit_default = best.summary.get("prefix_hit_ratio") if best else None
        for b in result.data.get("buckets") or []:
            tpm = b.get("max_input_tpm")
            hit = b.get("hit_ratio", b.get("prefix_hit_ratio", hit_default))
            if tpm is None or hit is None:
                continue
            ctx = b.get("context_tokens")
            rows.append(cost_row(tpm, hit, b.get("output_tpm") or 0.0, inputs,
                                 f"{result.name} @ {context_label(ctx)} ctx" if ctx else result.name,
                                 context_tokens=ctx, cards=b.get("cards", hw.get("cards")),
                                 machines=b.get("machines", hw.get("machines"))))
        if not rows and best is not None and result.max_input_tpm is not None and hit_default is not None:
            rows.append(cost_row(result.max_input_tpm, hit_default, best.summary.get("output_tpm") or 0.0, inputs,
                                 f"{result.name} (best step)", cards=hw.get("cards"), machines=hw.get("machines")))
    else:
        s = result.summary
        if s.get("input_tpm") is not None and s.get("prefix_hit_ratio") is not None:
            rows.append(cost_row(s["input_tpm"], s["prefix_hit_ratio"], s.get("output_tpm") or 0.0, inputs,
                                 f"{result.name} (measured load, not max under SLO)"))
    wp = WHITE_PAPER_ROW
    rows.append(dataclasses.replace(cost_row(wp["max_input_tpm"], wp["hit_ratio"], 0.0, inputs, wp["label"],
                                             context_tokens=wp["context_tokens"], cards=wp["cards"],
                                             machines=wp["machines"]), hardware_source="published"))
    return rows



def inputs_for(result: Result, explicit: CostInputs | None) -> CostInputs:
    """Explicit cost inputs, else the ones a sweep recorded, else the defaults."""
    if explicit is not None:
        return explicit
    recorded = result.data.get("cost_inputs") if isinstance(result, SweepResult) else None
    if isinstance(recorded, dict):
        known = {k: v for k, v in recorded.items() if k in CostInputs.__dataclass_fields__}
        return CostInputs(**known)
    return CostInputs()



def run_section(run: RunResult, gates: list[slo.Gate], inputs: CostInputs, *, with_meta: bool = True,
                with_cost: bool = True) -> dict[str, Any]:
    s = run.summary
    verdict = slo.evaluate(gates, s) if gates else None
    stages = {k: v for k, v in server_timings(s)
              if isinstance(v, (int, float)) and not isinstance(v, bool) and k.endswith("_ms")}
    ttft = s.get("ttft_ms") or {}
    key = [("SLO", "—" if verdict is None else ("PASS" if verdict.passed else "FAIL")),
           ("p50 / p90 TTFT", f"{num(ttft.get('p50'), 0)} / {num(ttft.get('p90'), 0)} ms"),
           ("input TPM", big(s.get("input_tpm"))), ("prefix hit", pct(s.get("prefix_hit_ratio"))),
           ("error rate", pct(s.get("error_rate"), 2)),
           ("prompt lengths", verify.length_text(s.get("prompt_lengths")))]
    return {
        "kind": "run", "name": run.name, "path": shown_path(run.path), "key": key,
        "warnings": verify.warnings(s),
        "meta": meta_table(run.meta, [("duration (s)", num(s.get("duration_s"), 2))]) if with_meta else None,
        "verdict": verdict_table(verdict) if verdict else None,
        "passed": verdict.passed if verdict else None,
        "latency": latency_table(s), "throughput": throughput_table(s), "errors": errors_table(s),
        "stages": stage_table(s),
        "stage_chart": svg.bar_chart("server per-stage mean (ms)", list(stages), {"mean ms": list(stages.values())},
                                     unit="ms") if stages else None,
        "hit": hit_table(s, run.meta, gates),
        "engine": engine_section([Row(run.name, run_load_text(run.meta), s, s.get("server_metrics") or {}, {})],
                                 "load")
        if with_meta else None,
        "cdfs": cdf_charts([(run.name, run)]),
        "cost": cost_tables(cost_rows_for(run, inputs), inputs) if with_cost else None,
    }



def run_load_text(meta: dict[str, Any]) -> str:
    """A run's load as its command named it: "poisson 4 req/s", "concurrency 8", "trace"."""
    load = meta.get("load") or {}
    mode = str(load.get("mode") or "—")
    if load.get("concurrency") is not None and mode == "concurrency":
        return f"concurrency {load['concurrency']}"
    return f"{mode} {num(load['rate'], 3)} req/s" if load.get("rate") is not None else mode



def group_label(step: dict[str, Any]) -> str:
    parts = []
    if step.get("bucket"):
        parts.append(context_label(step["bucket"]))
    sp = step.get("server_param")
    if isinstance(sp, dict) and sp.get("name"):
        parts.append(f"{sp['name']}={sp.get('value')}")
    return " ".join(parts)



def step_failure(entry: dict[str, Any]) -> str:
    """Why a step failed, as the verdict column says it: the SLO, saturation, an exhausted trace."""
    why = [w for w, bad in (("SLO", entry.get("slo_passed") is False),
                            ("saturated", (entry.get("saturation") or {}).get("saturated")),
                            ("trace ran out", entry.get("trace_exhausted"))) if bad]
    return f"FAIL ({'; '.join(why)})" if why else "FAIL"



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
    rows = cost_rows_for(sweep, inputs)
    best_at = best_step(sweep, rows[:-1])
    found = split_warnings(sweep, best_at)   # another step's findings: a note in its row, not a banner on top
    steps = Table(["step"] + (["group"] if grouped else []) + ["phase", axis, "offered req/s", "input TPM",
                  "SLO-attaining TPM", "req/s", "goodput", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "errors",
                  "traffic hit", "server hit (usage)", "verdict", "notes"])
    for label, idx in groups.items():
        for i in idx:
            st, s = sweep.steps[i], sweep.steps[i].summary
            entry = raw[i] if i < len(raw) and isinstance(raw[i], dict) else {}
            passed = sweep.step_passed[i]
            if passed is None and gates:
                passed = slo.evaluate(gates, s).passed
            verdict = "—" if passed is None else "PASS" if passed else step_failure(entry)
            ttft, tpot = s.get("ttft_ms") or {}, s.get("tpot_ms") or {}
            row = [st.name] + ([label] if grouped else []) + [
                str(entry.get("phase", "")), num(sweep.step_loads[i].get("value"), 3), num(entry.get("offered_rps"), 3),
                big(s.get("input_tpm")),
                big(s.get("good_input_tpm")), num(s.get("request_throughput_rps"), 3), num(s.get("goodput_rps"), 3),
                num(ttft.get("p50")), num(ttft.get("p90")), num(tpot.get("p50")), num(tpot.get("p90")),
                pct(s.get("error_rate"), 2), pct(entry.get("traffic_hit_ratio"), 1), pct(s.get("prefix_hit_ratio"), 1),
                verdict, "; ".join(f.short for f in found.beside.get(i, []))]
            steps.add(row, [""] * (len(row) - 2) + ["" if passed is None else ("good" if passed else "bad"), ""])

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
        series = [x for stat in stats
                  for x in series_by_group(lambda s, b=block, q=stat: (s.get(b) or {}).get(q), stat)]
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
    # the traffic's offered hit is drawn first, wide and pale, and the achieved hit over it, narrow: where the
    # server achieved what the traffic offered the two coincide, and both still show
    traffic = [svg.Series(" ".join(x for x in (label, "offered by the traffic") if x),
                          [sweep.step_loads[i].get("value") for i in idx],
                          [(raw[i] if i < len(raw) and isinstance(raw[i], dict) else {}).get("traffic_hit_ratio")
                           for i in idx], color=svg.PALETTE[k % len(svg.PALETTE)], width=7.0, opacity=0.35,
                          markers=False)
               for k, (label, idx) in enumerate(groups.items())]
    achieved = series_by_group(lambda s: s.get("prefix_hit_ratio"), "achieved (server)")
    for k, se in enumerate(achieved):
        se.color = svg.PALETTE[k % len(svg.PALETTE)]
    hit_chart = svg.line_chart(svg.Chart("prefix hit achieved vs load", axis, "hit ratio",
                                         [t for t in traffic if any(y is not None for y in t.ys)] + achieved,
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
             ("max input TPM under SLO", capacity_text(sweep, gates)),
             ("best step", best.name if best else "none passed")]
    hw = hardware_text(sweep.meta.get("hardware"))
    if hw:
        extra.append(("hardware", hw))
    notes = [f.text for i in sorted(found.beside) for f in found.beside[i]]
    pareto = pareto_points(sweep, labels)
    return {
        "kind": "sweep", "name": sweep.name, "path": shown_path(sweep.path),
        "key": headline_cards(sweep, best_at, gates, inputs, hw), "warnings": found.top, "step_notes": notes,
        "meta": meta_table({k: v for k, v in sweep.meta.items() if k not in ("config", "hardware")}, extra),
        "steps": steps,
        "config": meta_table(sweep.meta.get("config") or {}) if sweep.meta.get("config") else None,
        "passed": best is not None, "max_input_tpm": capacity_text(sweep, gates),
        "charts": charts, "tl_chart": tl_chart, "knee": "; ".join(knees) or None,
        "goodput_chart": goodput, "hit_chart": hit_chart, "cdfs": cdf_charts(runs),
        "pareto_chart": pareto_chart(pareto), "pareto": pareto_table(pareto),
        "param": param_table(sweep.data.get("server_param")),
        "probe": probe_table(sweep.data.get("probes")),
        "server": server_metrics_section(sweep, [i for idx in groups.values() for i in idx], axis),
        "best": run_section(best, gates, inputs, with_meta=False, with_cost=False) if best else None,
        "cost": cost_tables(rows, inputs, priced_at_text(sweep)),
        "claim": claim_tables(sweep.data.get("claim")),
    }



def hardware_text(hw: dict[str, Any] | None) -> str | None:
    """"32 cards (2 workers x 16) on 4 machines of mtt-s5000": what the embedded server occupied."""
    if not isinstance(hw, dict) or not hw.get("cards"):
        return None
    workers = sum((hw.get("workers") or {}).values())
    device = (hw.get("device") or {}).get("name", "")
    return (f"{hw['cards']} cards ({workers} workers x {hw.get('cards_per_worker')}) on {hw.get('machines')} "
            f"machine{'s' if hw.get('machines') != 1 else ''}" + (f" of {device}" if device else ""))


def server_metrics_section(sweep: SweepResult, order: list[int], axis: str) -> dict[str, Any] | None:
    """What the target's /metrics said during each step (:mod:`paasbench.report.engine`), and saturation signals."""
    raw = sweep.data.get("steps") or []
    rows = [Row(sweep.steps[i].name, num(sweep.step_loads[i].get("value"), 3), sweep.steps[i].summary,
                raw[i].get("server_metrics") or {}, raw[i])
            for i in order if i < len(raw) and isinstance(raw[i], dict)]
    return engine_section(rows, axis)



def section(result: Result, gates: list[slo.Gate] | None, inputs: CostInputs | None = None) -> dict[str, Any]:
    g, ci = gates_for(result, gates), inputs_for(result, inputs)
    if isinstance(result, SweepResult):
        return sweep_section(result, g, ci)
    return run_section(result, g, ci)
