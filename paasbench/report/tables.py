"""Report tables: every figure formatted once, as strings, so the HTML and the Markdown report show the same."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from paasbench.cost.table import FORMULAS, CostInputs, CostRow
from paasbench.metrics import slo

LAT_BLOCKS = [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"),
              ("schedule_lag_ms", "schedule lag")]
LAT_STATS = [("mean", "mean"), ("p50", "p50"), ("p90", "p90"), ("p95", "p95"), ("p99", "p99"), ("p999", "p99.9"),
             ("max", "max")]


@dataclass(slots=True)
class Table:
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    classes: list[list[str]] = field(default_factory=list)   # per-cell CSS class: "good", "bad", ""
    text: bool = False          # a text table (left-aligned), not a numeric one

    def add(self, row: list[str], classes: list[str] | None = None) -> None:
        self.rows.append(row)
        self.classes.append(classes or [""] * len(row))



def num(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return f"{v:,.{digits}f}"



def big(v: float | None) -> str:
    """Large counts readably: 5.80M, 657.8K; below a thousand a whole number prints whole (467, not 467.00)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= div:
            return f"{v / div:,.2f}{suffix}"
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.2f}"


def load_label(load: dict[str, Any], offered_rps: float | None) -> str:
    """A step named by the load it offered: a Poisson step's realized rate over its window (its nominal
    rate after it), a closed loop's streams with the request rate they made."""
    value, unit, kind = load.get("value"), load.get("unit", ""), load.get("kind", "")
    nominal = f"{num(value, 3)} {unit}".strip()
    if offered_rps is None:          # recorded before offered_rps existed
        return nominal
    if kind == "rate":
        return f"{num(offered_rps, 3)} req/s offered (nominal {nominal})"
    return f"{nominal} ({num(offered_rps, 3)} req/s offered)"



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



# Run bookkeeping a reader has no use for (clock anchors, schema tags): kept in the JSON, not shown.
META_HIDDEN = {"t0_monotonic", "t0_epoch_ns", "schema"}


def figure(v: float) -> str:
    """A recorded float as people read it: 4 significant digits, thousands separated, no binary tail
    (0.007309819999999995 -> 0.00731, 1800.0 -> 1,800)."""
    if not math.isfinite(v):
        return "—"
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,}"
    digits = max(0, 3 - math.floor(math.log10(abs(v))))
    return f"{v:,.{digits}f}".rstrip("0").rstrip(".")


def meta_value(key: str, v: Any) -> str:
    """One metadata value for people: no JSON. A mapping reads "name value, name value" (empty entries left
    out), a list comma-separated; a few records have their own words (a tokenizer, the machine, the pre-flight)."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return figure(v)
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, list):
        return ", ".join(meta_value(key, x) for x in v) or "none"
    if not isinstance(v, dict):
        return str(v)
    if key == "tokenizer" and set(v) <= {"name", "sha256"}:
        return f"{v.get('name')}" + (f" (sha256 {str(v['sha256'])[:12]}…)" if v.get("sha256") else "")
    if key == "machine" and "cpu_model" in v:
        speed = v.get("seconds_per_iter")
        return (f"{v.get('cpu_model')}, {v.get('usable_cpus')} of {v.get('logical_cpus')} CPUs usable"
                + (f"; fingerprint {speed * 1e3:.2f} ms per iteration (median block {v.get('spread', 0):.0%} "
                   "slower than the fastest)" if isinstance(speed, (int, float)) else ""))
    if key == "prompt_preflight" and "status" in v:
        return f"{v['status']}: {v['detail']}" if v.get("detail") else str(v["status"])
    if key == "versions":
        return ", ".join(f"{k} {x}" for k, x in v.items())
    parts = [_named(k, meta_value(k, x)) for k, x in v.items() if x not in (None, "", {}, []) and k not in META_HIDDEN]
    return ", ".join(parts) or "—"


def _named(key: str, value: str) -> str:
    """``step_duration_s`` 15 -> "step duration 15 s": a unit suffix of the field's name goes after its value."""
    for suffix, unit in (("_ms", " ms"), ("_s", " s"), ("_mb", " MB")):
        if key.endswith(suffix):
            return f"{key[: -len(suffix)].replace('_', ' ')} {value}{unit}"
    return f"{key.replace('_', ' ')} {value}"


def meta_table(meta: dict[str, Any], extra: Iterable[tuple[str, str]] = ()) -> Table:
    t = Table(["field", "value"], text=True)
    order = ["target", "model", "workload", "seed", "load", "server", "versions"]
    for key in order + sorted(k for k in meta if k not in order):
        if key in meta and meta[key] not in (None, "", {}) and key not in META_HIDDEN:
            t.add([key, meta_value(key, meta[key])])
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
    t = Table(["error kind", "count", "share of requests", "commonest message"])
    total = (summary.get("requests") or {}).get("total") or 0
    said = summary.get("error_messages") or {}
    for kind, count in sorted((summary.get("errors") or {}).items(), key=lambda kv: -kv[1]):
        message = f"{said[kind]['message']} ({num(said[kind]['count'])})" if kind in said else "-"
        t.add([kind, num(count), pct(count / total if total else None), message], ["bad", "", "", ""])
    return t



# The reference server's stages in pipeline order; other servers' fields follow in their own order.
STAGE_ORDER = ["queue_ms", "prefill_ms", "kv_write_ms", "kv_transfer_ms", "first_decode_ms", "decode_step_mean_ms"]


def server_timings(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    timings = summary.get("server_timings_ms") or {}
    rank = {k: i for i, k in enumerate(STAGE_ORDER)}
    return sorted(timings.items(), key=lambda kv: rank.get(kv[0], len(rank)))


def stage_table(summary: dict[str, Any]) -> Table:
    t = Table(["server stage", "mean"])
    for stage, value in server_timings(summary):
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):  # only *_ms fields are times (decode_steps, transfer_bytes are not)
            t.add([stage, num(value, 2) + " ms" if stage.endswith("_ms") else big(value)])
        elif isinstance(value, dict):  # a label the server reported per request, e.g. prefill_location counts
            t.add([stage, ", ".join(f"{k}: {v}" for k, v in sorted(value.items()))])
    return t



def cost_tables(rows: list[CostRow], inputs: CostInputs, priced_at: Sequence[str] = ()) -> dict[str, Any]:
    """The cost table, its formulas and inputs, and ``priced_at``: for a certified sweep, the pass each row is
    priced at and the certified interval around it (``report.best.priced_at_text``), printed under the table."""
    c = inputs.currency
    t = Table(["row", "context", "max input TPM", "cards", "machines", "TPM / card", "TPM / machine", "hit",
               f"blended {c}/M", f"revenue {c}/min", f"revenue {c}/day", f"revenue {c}/year", f"cost {c}/day",
               f"cost {c}/M tokens", "gross margin", "payback (months)", "size"])
    for r in rows:
        assumed = " (assumed)" if r.hardware_source == "assumed" else ""
        unsized = r.hardware_source == "assumed"   # its cost side is a placeholder: not coloured as a verdict
        t.add([r.label, context_label(r.context_tokens), big(r.max_input_tpm),
               ("no cards" if r.cards is None else num(r.cards) + assumed),
               num(r.machines) + assumed, big(r.tpm_per_card), big(r.tpm_per_machine), pct(r.hit_ratio, 0),
               num(r.blended_price_per_m, 2), num(r.revenue_per_minute, 2), num(r.revenue_per_day, 1),
               num(r.revenue_per_year, 0), num(r.cost_per_day, 1), num(r.cost_per_m_tokens, 4),
               pct(r.gross_margin), num(r.payback_months, 1), r.size_text],
              [""] * 14 + ["" if unsized else "good" if (r.gross_margin or 0) > 0 else "bad", "", ""])
    formulas = Table(["quantity", "formula"], [[a, b] for a, b in FORMULAS], [["", ""] for _ in FORMULAS], True)
    ins = Table(["cost input", "value"], text=True)
    for name in ("currency", "price_input_per_m", "price_cached_input_per_m", "price_output_per_m",
                 "cards_per_machine", "target_cards", "machine_price", "amortization_years", "power_kw", "electricity_per_kwh",
                 "network_per_day", "hours_per_day"):
        ins.add([name, meta_value(name, getattr(inputs, name))])
    return {"rows": t, "formulas": formulas, "inputs": ins, "priced_at": list(priced_at)}



def claim_tables(claim: dict[str, Any] | None) -> dict[str, Any] | None:
    """The reproduction of a published claim (``sweep.json``'s ``claim``, :mod:`paasbench.cost.claim`), side by side."""
    if not isinstance(claim, dict) or not claim.get("rows"):
        return None
    src = (claim.get("claim") or {}).get("source", "claim")
    subject = claim.get("measured_by", "this twin")   # sweeps before it was recorded measured the twin
    t = Table(["figure", str(src), subject, "note"], text=True)
    for r in claim["rows"]:
        t.add([r.get("figure", ""), r.get("claim", ""), r.get("twin", ""), r.get("note", "")])
    a = Table(["assumption", "value", "change with"], text=True)
    for r in claim.get("assumptions") or []:
        a.add([r.get("assumption", ""), r.get("value", ""), r.get("change", "")])
    fit = claim.get("feasibility") or {}
    return {"source": src, "subject": subject, "table": t, "assumptions": a if a.rows else None, "fit": fit.get("text"),
            "fits": fit.get("fits"), "measured": claim.get("measured") is not None}


def hit_target(meta: dict[str, Any]) -> float | None:
    """The prefix-hit ratio the workload aimed at: recorded in the meta (synthetic load: its ``--prefix-hit``,
    else the hit its ``--prefix-tokens`` trace offers), else from the named workload's spec."""
    workload = meta.get("workload")
    synthetic = meta.get("synthetic") if isinstance(meta.get("synthetic"), dict) else None
    if synthetic is not None:   # its workload is a description ("synthetic isl=..."), not a spec to look up
        v = synthetic.get("prefix_hit")
        v = meta.get("hit_ratio_tokens") if v is None else v
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
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
    best_value = param.get("best_value")
    return {"name": param.get("name"), "best": "none met the SLO" if best_value is None else best_value,
            "rule": param.get("rule", ""), "table": t}


def probe_table(probes: dict[str, Any] | None) -> Table | None:
    """The throughput probe that placed a certified rate search (``paasbench/sweep/probe.py``): per bucket, each
    closed-loop level it ran and the peak the search started below. Its levels are step-seconds the sweep spent, so
    the report shows them beside the steps."""
    if not isinstance(probes, dict) or not probes:
        return None
    t = Table(["bucket", "streams", "served req/s", "TTFT p50", "requests", "window s", "wall s", "peak"])
    for bucket, p in probes.items():
        if not isinstance(p, dict):
            continue
        for lv in p.get("levels") or []:
            peak = lv.get("streams") == p.get("peak_streams")
            t.add(["—" if bucket in ("None", "") else str(bucket), str(lv.get("streams")), num(lv.get("served_rps"), 3),
                   num(lv.get("ttft_p50_ms")), str(lv.get("requests")), num(lv.get("window_s"), 1),
                   num(lv.get("wall_s"), 1), "★" if peak else ""], ["good" if peak else ""] + [""] * 7)
    return t if t.rows else None

