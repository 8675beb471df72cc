"""The headline metrics of a result, each with the direction that counts as better.

One catalogue serves ``paasbench compare`` (deltas coloured better/worse) and ``paasbench gate`` (a change in the
worse direction beyond the tolerance is a regression), so the two can never disagree on what "worse" means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from paasbench.metrics import slo
from paasbench.report.curves import _knee_of, _tl_points, primary_latency_gate
from paasbench.report.load import Result, RunResult, SweepResult, headline
from paasbench.report.tables import big


@dataclass(frozen=True, slots=True)
class Metric:
    path: str                 # "ttft_ms.p50" (block.stat) or "input_tpm"; "max_input_tpm" is a sweep's
    label: str
    higher_is_better: bool
    gated: bool = True        # part of the regression gate (client-side health figures are shown, not gated)


CATALOG: list[Metric] = [
    Metric("max_input_tpm", "max input TPM under SLO", True),
    Metric("ttft_ms.p50", "TTFT p50 (ms)", False),
    Metric("ttft_ms.p90", "TTFT p90 (ms)", False),
    Metric("ttft_ms.p99", "TTFT p99 (ms)", False),
    Metric("tpot_ms.p50", "TPOT p50 (ms)", False),
    Metric("tpot_ms.p90", "TPOT p90 (ms)", False),
    Metric("itl_ms.p90", "ITL p90 (ms)", False),
    Metric("e2e_ms.p50", "E2E p50 (ms)", False),
    Metric("e2e_ms.p90", "E2E p90 (ms)", False),
    Metric("input_tpm", "input TPM", True),
    Metric("output_tpm", "output TPM", True),
    Metric("request_throughput_rps", "requests/s (ok)", True),
    Metric("goodput_rps", "goodput (req/s)", True),
    Metric("prefix_hit_ratio", "prefix hit ratio", True),
    Metric("error_rate", "error rate", False),
    Metric("schedule_lag_ms.p99", "schedule lag p99 (ms)", False, gated=False),
    # the server-clock family (paasbench.metrics.summary.server_clock_metrics): modeled time on the sim twin, engine CPU
    # per token on the cpu engine; absent (and skipped) for other servers
    Metric("modeled_ttft_ms.p50", "modeled TTFT p50 (ms)", False),
    Metric("modeled_ttft_ms.p90", "modeled TTFT p90 (ms)", False),
    Metric("modeled_tpot_ms.p50", "modeled TPOT p50 (ms)", False),
    Metric("modeled_e2e_ms.p50", "modeled E2E p50 (ms)", False),
    Metric("modeled_e2e_ms.p90", "modeled E2E p90 (ms)", False),
    Metric("cpu_us_per_prefill_token", "engine CPU per prefill token (µs)", False),
    Metric("cpu_us_per_decode_token", "engine CPU per decode token (µs)", False),
]
BY_PATH = {m.path: m for m in CATALOG}


def value_at(summary: dict[str, Any], path: str) -> float | None:
    """``"ttft_ms.p50"`` -> summary["ttft_ms"]["p50"]; None when absent, empty or not a number."""
    node: Any = summary
    for part in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    if isinstance(node, bool) or not isinstance(node, (int, float)) or math.isnan(node):
        return None  # NaN (json.dumps writes it) compares false both ways: it would pass any gate as "ok"
    return float(node)


def headline_values(result: Result, run: RunResult | None = None) -> dict[str, float | None]:
    """Every catalogue metric of a result: a run's own, or for a sweep its best step's plus max input TPM.

    ``run`` overrides which run's summary is read (the gate compares sweeps at a matched load step).
    """
    run = run or headline(result)
    values = {m.path: (value_at(run.summary, m.path) if run is not None else None) for m in CATALOG}
    values["max_input_tpm"] = result.max_input_tpm if isinstance(result, SweepResult) else None
    return values


# Below this share of its served input TPM within the SLO's per-request limits, a capacity figure says so beside it.
ATTAINING_FLOOR = 0.9


def capacity_caveats(sweep: SweepResult, gates: list[slo.Gate]) -> list[str]:
    """What a sweep's capacity figure must carry beside it, so it reads no stronger than its data: its best step
    lies past the knee of its own throughput–latency curve (same bucket and server setting, on the SLO's first
    latency gate), or well under all of its input TPM came from requests within the SLO's per-request limits
    (``good_input_tpm``). Empty when neither holds. The report's key figures and the sweep's console line use it."""
    best = sweep.best
    tpm = best.summary.get("input_tpm") if best is not None else None
    if best is None or tpm is None:
        return []
    raw = sweep.data.get("steps") or []

    def group(i: int) -> tuple[Any, Any]:
        entry = raw[i] if i < len(raw) and isinstance(raw[i], dict) else {}
        return entry.get("bucket"), repr(entry.get("server_param"))

    mine = group(sweep.steps.index(best))
    idx = sorted((i for i in range(len(sweep.steps)) if group(i) == mine),
                 key=lambda i: sweep.step_loads[i].get("value") or 0)
    block, stat, _ = primary_latency_gate(gates)
    xs, ys = _tl_points([sweep.steps[i] for i in idx], block, stat)
    out = []
    k = _knee_of(xs, ys)
    if k is not None and tpm > xs[k]:
        out.append(f"past the knee of its curve (knee at {big(xs[k])} input TPM; "
                   f"{stat} {block.removesuffix('_ms').upper()} there {ys[k]:,.0f} ms, here "
                   f"{(best.summary.get(block) or {}).get(stat) or 0:,.0f} ms)")
    good = best.summary.get("good_input_tpm")
    if good is not None and tpm > 0 and good < ATTAINING_FLOOR * tpm:
        out.append(f"only {big(good)} ({good / tpm:.0%}) of it from requests within the SLO's per-request limits")
    return out


def relative_change(base: float | None, cur: float | None) -> float | None:
    """(cur - base) / |base|; None when either is missing; ±inf when base is 0 and cur is not."""
    if base is None or cur is None:
        return None
    if base == 0:
        return 0.0 if cur == 0 else (float("inf") if cur > 0 else float("-inf"))
    return (cur - base) / abs(base)


def worse_by(metric: Metric, base: float | None, cur: float | None) -> float | None:
    """Relative change in the *worse* direction (positive = worse), or None when not comparable."""
    change = relative_change(base, cur)
    if change is None:
        return None
    return -change if metric.higher_is_better else change
