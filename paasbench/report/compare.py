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
from paasbench.report.noise import latency_noise
from paasbench.report.sections import cost_rows_for, gates_for, inputs_for, section
from paasbench.report.tables import Table, metric_value, cost_tables


def compare_context(results: list[Result], gates: list[slo.Gate] | None, inputs: CostInputs | None) -> dict[str, Any]:
    """Side by side: the first result is the baseline; deltas are relative to it, coloured by direction."""
    names = [r.name for r in results]
    values = [headline_values(r) for r in results]
    heads = [(r.name, headline(r)) for r in results]
    floors = [isinstance(r, SweepResult) and r.capacity_is_floor for r in results]
    t = Table(["metric"] + [names[0] + " (baseline)"] + [f"{n} (Δ vs baseline)" for n in names[1:]])
    for m in CATALOG:
        if all(v[m.path] is None for v in values):
            continue
        capacity = m.path == "max_input_tpm"
        row = [m.label, _shown(m.path, values[0][m.path], capacity and floors[0])]
        cls = ["", ""]
        for k, v in enumerate(values[1:], 1):
            cur = v[m.path]
            w = worse_by(m, values[0][m.path], cur)
            delta, decided = "" if w is None else _signed_pct(w, m.higher_is_better), w is not None and abs(w) >= 0.005
            if capacity and w is not None and (floors[0] or floors[k]):
                decided = decided and _decided_with_floors(w, floors[0], floors[k])
                delta += "" if decided else "; a lower bound: not comparable"
            base_run, cur_run = heads[0][1], heads[k][1]
            noise = latency_noise(base_run, cur_run, m.path) if w is not None and base_run and cur_run else None
            if noise is not None and noise.holds_zero:
                delta += (f"; within noise ({noise.n_base} vs {noise.n_cur} requests)" if noise.bounded else
                          f"; too few requests to tell ({noise.n_base} vs {noise.n_cur})")
                decided = False
            row.append(_shown(m.path, cur, capacity and floors[k]) + (f" ({delta})" if delta else ""))
            cls.append("" if not decided else ("bad" if w > 0 else "good"))
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



def _shown(path: str, value: float | None, floor: bool) -> str:
    """A value as the table prints it; a capacity that is a lower bound (every load tried passed) with "≥"."""
    return ("≥ " if floor and value is not None else "") + metric_value(path, value) + (
        " (lower bound)" if floor and value is not None else "")


def _decided_with_floors(worse: float, base_floor: bool, cur_floor: bool) -> bool:
    """Whether a capacity change is known in its direction when a side is only a lower bound: a current floor
    above the baseline's true figure is better, a current figure under a baseline floor is worse; else not."""
    if base_floor and cur_floor:
        return False
    return worse < 0 if cur_floor else worse > 0


def _signed_pct(worse: float, higher_is_better: bool) -> str:
    change = -worse if higher_is_better else worse
    if math.isinf(change):
        return "new" if change > 0 else "gone"
    return f"{change * 100:+.1f}%"
