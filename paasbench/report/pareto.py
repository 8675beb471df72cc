"""The Pareto view of a sweep: what the system delivers against what each user gets.

A buyer trades the two: more load raises the system's input TPM and lowers every user's decode speed. MLPerf
Endpoints reports this trade as a curve of system throughput against per-user throughput; a sweep already has the
points, one per decided step. A step is *decided* when its verdict is certified (pass or fail at the stated
confidence) or, for a sweep of point verdicts, when it has a verdict at all; an undecided step is left off, since
it says nothing about which side of the SLO its load is on. The frontier is drawn through the passing steps that
no other passing step beats on both axes: the loads worth buying, each the most throughput for its per-user speed.

Per-user output tokens/s is defined here, once: ``1000 / TPOT p50`` (ms), the decode speed the median request
saw after its first token (docs/metrics.md, "Per-user output tokens/s").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from paasbench.report import svg
from paasbench.report.load import SweepResult
from paasbench.report.tables import Table, big, num


def per_user_output_tps(summary: dict[str, Any]) -> float | None:
    """The median request's decode speed, output tokens/s after its first token: 1000 / TPOT p50 (ms). None
    where no request decoded two tokens (TPOT is undefined) or TPOT p50 is 0."""
    tpot = (summary.get("tpot_ms") or {}).get("p50")
    return 1000.0 / tpot if isinstance(tpot, (int, float)) and tpot > 0 else None


@dataclass(frozen=True, slots=True)
class ParetoPoint:
    """One decided step: where it sits on the two axes, and how it was judged."""

    step: str
    group: str
    load: float | None
    input_tpm: float
    per_user_tps: float
    ttft_p50_ms: float | None
    passed: bool
    certified: bool          # the verdict is a certified one (--confidence), not a point estimate
    on_frontier: bool = False


def step_verdict(entry: dict[str, Any], passed: bool | None) -> tuple[bool | None, bool]:
    """(pass/fail or None when undecided, whether certified) of one sweep.json step entry."""
    cert = entry.get("certified")
    if isinstance(cert, dict) and cert.get("verdict") in ("pass", "fail", "undecided"):
        return ({"pass": True, "fail": False}.get(cert["verdict"]), True)
    return passed, False


def frontier(points: list[ParetoPoint]) -> list[ParetoPoint]:
    """The passing points no other passing point dominates (at least as good on both axes, better on one),
    by per-user speed, fastest first."""
    ok = [p for p in points if p.passed]

    def beaten(p: ParetoPoint) -> bool:
        return any(q.input_tpm >= p.input_tpm and q.per_user_tps >= p.per_user_tps
                   and (q.input_tpm > p.input_tpm or q.per_user_tps > p.per_user_tps) for q in ok)

    return sorted((p for p in ok if not beaten(p)), key=lambda p: -p.per_user_tps)


def pareto_points(sweep: SweepResult, labels: list[str]) -> list[ParetoPoint]:
    """Every decided step with both figures, its group's frontier marked."""
    raw = sweep.data.get("steps") or []
    points = []
    for i, run in enumerate(sweep.steps):
        entry = raw[i] if i < len(raw) and isinstance(raw[i], dict) else {}
        passed, certified = step_verdict(entry, sweep.step_passed[i])
        tpm, speed = run.summary.get("input_tpm"), per_user_output_tps(run.summary)
        if passed is None or not isinstance(tpm, (int, float)) or speed is None:
            continue
        points.append(ParetoPoint(run.name, labels[i], sweep.step_loads[i].get("value"), float(tpm), speed,
                                  (run.summary.get("ttft_ms") or {}).get("p50"), passed, certified))
    best = {id(p) for group in dict.fromkeys(p.group for p in points)
            for p in frontier([q for q in points if q.group == group])}
    return [replace(p, on_frontier=id(p) in best) for p in points]


def pareto_chart(points: list[ParetoPoint]) -> str | None:
    """System input TPM against per-user output tokens/s: per group, its passes and fails as points and its
    frontier as a line. None when no step is decided."""
    if not points:
        return None
    certified = all(p.certified for p in points)
    word = "certified frontier" if certified else "frontier"
    series = []
    for k, group in enumerate(dict.fromkeys(p.group for p in points)):
        color = svg.PALETTE[k % len(svg.PALETTE)]
        mine = [p for p in points if p.group == group]
        front = sorted((p for p in mine if p.on_frontier), key=lambda p: p.per_user_tps)
        name = (group + " " if group else "")
        if front:
            series.append(svg.Series(name + word, [p.per_user_tps for p in front], [p.input_tpm for p in front],
                                     color=color))
        passes = [p for p in mine if p.passed and not p.on_frontier]
        if passes:
            series.append(svg.Series(name + "passed", [p.per_user_tps for p in passes],
                                     [p.input_tpm for p in passes], color=color, line=False))
        fails = [p for p in mine if not p.passed]
        if fails:
            series.append(svg.Series(name + "failed the SLO", [p.per_user_tps for p in fails],
                                     [p.input_tpm for p in fails], color="#d62728", line=False))
    return svg.line_chart(svg.Chart("Pareto: system throughput vs per-user speed",
                                    "per-user output tokens/s (1000 / TPOT p50)", "system input TPM", series,
                                    legend="tl", width=760, height=360, y_min=0.0))


def pareto_table(points: list[ParetoPoint]) -> Table | None:
    """The chart's points with TTFT p50 beside them, frontier first within each group (★)."""
    if not points:
        return None
    grouped = len({p.group for p in points}) > 1
    table = Table((["group"] if grouped else []) + ["step", "load", "verdict", "input TPM", "per-user output tok/s",
                                                   "TTFT p50 (ms)", "frontier"])
    for p in sorted(points, key=lambda p: (p.group, not p.on_frontier, -p.per_user_tps)):
        verdict = ("PASS" if p.passed else "FAIL") + (" (certified)" if p.certified else "")
        row = ([p.group] if grouped else []) + [p.step, num(p.load, 3), verdict, big(p.input_tpm),
                                                num(p.per_user_tps), num(p.ttft_p50_ms), "★" if p.on_frontier else ""]
        table.add(row, [""] * (len(row) - 5) + ["good" if p.passed else "bad"] + [""] * 4)
    return table
