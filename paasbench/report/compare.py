"""``paasbench compare`` content: results side by side, deltas against the first, coloured by direction."""

from __future__ import annotations

import math
from typing import Any

from paasbench.cost.table import CostInputs
from paasbench.metrics import slo
from paasbench.report import svg
from paasbench.report.curves import _tl_points, cdf_charts, primary_latency_gate
from paasbench.report.headline import CATALOG, headline_values, worse_by
from paasbench.report.load import Result, SweepResult, headline
from paasbench.report.sections import cost_rows_for, gates_for, inputs_for, section
from paasbench.report.tables import Table, metric_value, cost_tables


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
        elif g:  # a sweep with no passing step: a failure to show, not a row to leave out
            verdicts.add([r.name, "FAIL", "no step met the SLO"], ["", "bad", ""])
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
