"""Report curves: per-request latency CDFs, the knee of the throughput–latency curve, and which gate it is drawn
against."""

from __future__ import annotations

from typing import Any

from paasbench.metrics import slo
from paasbench.metrics.records import read_records
from paasbench.metrics.summary import records_frame
from paasbench.report import svg
from paasbench.report.load import RunResult


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
