"""The engine's own view: what the target's ``/metrics`` said over each step (or run), in its own terms.

A sweep step or a run keeps ``server_metrics`` (:mod:`paasbench.metrics.prometheus`): gauges, counter deltas and
histogram means, normalised across the reference server (``paasbench_*``), vLLM (``vllm:*``) and SGLang
(``sglang:*``). Here they become two tables:

* **engine figures** -- one column per figure the detected family exposes (a column no step has is left out,
  so a vLLM report shows preemptions and per-phase times, not the reference server's pool columns), headed
  in that engine's own words (SGLang's "retractions", "token usage");
* **client vs engine** -- the client's TTFT mean and prefix hit beside the engine's TTFT histogram mean and
  its prefix-cache counters over the same window, with the TTFT difference (client − engine: network,
  HTTP, tokenization and the client's schedule lag).

Each table's title names the window its figures cover, so two hit ratios on one page can be reconciled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from paasbench.report import svg
from paasbench.report.tables import Table, big, num, pct

FAMILY_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "paasbench": "paasbench reference server"}


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    block: str                              # gauges | deltas | means_ms
    key: str
    fmt: Callable[[Any], str]
    headers: tuple[tuple[str, str], ...] = ()  # (family, its own name for the figure)

    def value(self, m: dict[str, Any]) -> Any:
        return (m.get(self.block) or {}).get(self.key)

    def title(self, fam: str | None) -> str:
        return dict(self.headers).get(fam or "", self.header)


def _ms(v: Any) -> str:
    return num(v, 1)


def _count(v: Any) -> str:
    return num(v, 0)


COLUMNS = [
    Column("running", "gauges", "requests_running", _count),
    Column("waiting", "gauges", "requests_waiting", _count),
    Column("KV cache usage", "gauges", "kv_cache_usage", lambda v: pct(v, 0), (("sglang", "token usage"),)),
    Column("finished requests", "deltas", "requests_finished", _count),
    Column("prompt tokens", "deltas", "prompt_tokens", big),
    Column("generation tokens", "deltas", "generation_tokens", big),
    Column("prefix-cache hit tokens", "deltas", "prefix_cache_hits", big, (("sglang", "cached tokens"),)),
    Column("prefix-cache query tokens", "deltas", "prefix_cache_queries", big, (("sglang", "prompt tokens (hit base)"),)),
    Column("preemptions", "deltas", "preemptions", _count, (("sglang", "retractions"),)),
    Column("KV evictions", "deltas", "kv_evictions", _count),
    Column("KV checksum failures", "deltas", "kv_transfer_checksum_failures", _count),
    Column("queue mean (ms)", "means_ms", "queue", _ms),
    Column("prefill mean (ms)", "means_ms", "prefill", _ms),
    Column("decode mean (ms)", "means_ms", "decode", _ms),
    Column("ITL mean (ms)", "means_ms", "itl", _ms),
    Column("E2E mean (ms)", "means_ms", "e2e", _ms),
]


@dataclass(slots=True)
class Row:
    """One step (or the run): its name, load label, summary (client figures) and ``server_metrics``."""

    name: str
    load: str
    summary: dict[str, Any]
    metrics: dict[str, Any]
    entry: dict[str, Any]                   # the sweep.json step entry ({} for a run)


def window_text(rows: list[Row]) -> str:
    """What the counters' window was, as recorded (steps recorded before windowed scrapes: the whole step)."""
    seen = []
    for r in rows:
        w = r.metrics.get("window")
        text = (f"counters and histogram means from the {w['from']} to the {w['to']}; gauges at the {w['gauges_at']}"
                if isinstance(w, dict) else "counters over the whole step, warm-up included (scraped before and after it)")
        if text not in seen:
            seen.append(text)
    return "; ".join(seen)


def engine_section(rows: list[Row], axis: str) -> dict[str, Any] | None:
    """The engine-figures table, the client-vs-engine table and the pool chart; None when nothing was scraped."""
    rows = [r for r in rows if r.metrics.get("gauges") or r.metrics.get("deltas") or r.entry.get("saturation")]
    if not rows:
        return None
    fams = [r.metrics.get("family") for r in rows if r.metrics.get("family")]
    fam = fams[0] if fams else None
    cols = [c for c in COLUMNS if any(c.value(r.metrics) is not None for r in rows)]
    pools = sorted({p for r in rows for p in (r.metrics.get("pools") or {})})
    sweep = any(r.entry for r in rows)
    remote = any(r.entry.get("remote_prefill_share") is not None for r in rows)
    figures = Table(["step" if sweep else "run", axis] + [c.title(fam) for c in cols] + [f"{p} util" for p in pools]
                    + (["remote prefill"] if remote else []) + (["saturated"] if sweep else []))
    for r in rows:
        m, sat = r.metrics, r.entry.get("saturation") or {}
        reasons = "; ".join(sat.get("reasons") or [])
        row = ([r.name, r.load] + [c.fmt(c.value(m)) for c in cols]
               + [pct(((m.get("pools") or {}).get(p) or {}).get("utilization"), 0) for p in pools]
               + ([pct(r.entry.get("remote_prefill_share"), 0)] if remote else [])
               + ([("yes: " + reasons if reasons else "yes") if sat.get("saturated") else "no"] if sweep else []))
        classes = [""] * len(row)
        for i, c in enumerate(cols, 2):
            if c.key == "kv_transfer_checksum_failures" and c.value(m):
                classes[i] = "bad"
        if sweep and sat.get("saturated"):
            classes[-1] = "bad"
        figures.add(row, classes)
    versus = Table(["step" if sweep else "run", axis, "client TTFT mean (ms)", "engine TTFT mean (ms)",
                    "client − engine (ms)", "client prefix hit (usage)", "engine prefix hit (counters)"])
    for r in rows:
        client = (r.summary.get("ttft_ms") or {}).get("mean")
        server = (r.metrics.get("means_ms") or {}).get("ttft")
        gap = client - server if client is not None and server is not None else None
        versus.add([r.name, r.load, _ms(client), _ms(server), "—" if gap is None else f"{gap:+,.1f}",
                    pct(r.summary.get("prefix_hit_ratio"), 1), pct(r.metrics.get("prefix_hit_ratio"), 1)])
    chart = None
    if pools and sweep:
        xs = [r.entry.get("load", {}).get("value") for r in rows]
        chart = svg.line_chart(svg.Chart("pool utilization vs load", axis, "busy fraction",
                                         [svg.Series(p, xs, [((r.metrics.get("pools") or {}).get(p) or {})
                                                             .get("utilization") for r in rows]) for p in pools],
                                         y_min=0.0, y_max=1.0))
    return {"family": FAMILY_NAMES.get(fam or "", fam or "unknown /metrics"), "window": window_text(rows),
            "table": figures, "versus": versus, "chart": chart}
