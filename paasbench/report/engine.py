"""The engine's own view: what the target's ``/metrics`` said over each step (or run), in its own terms.

A sweep step or a run keeps ``server_metrics`` (:mod:`paasbench.metrics.prometheus`): gauges, counter deltas and
histogram means, normalised across the reference server (``paasbench_*``), vLLM (``vllm:*``) and SGLang
(``sglang:*``). Here they become two tables:

* **engine figures** -- one column per figure the detected family exposes (a column no step has is left out,
  so a vLLM report shows preemptions and per-phase times, not the reference server's pool columns), headed
  in that engine's own words (SGLang's "retractions", "token usage");
* **client vs engine** -- the client's TTFT mean and prefix hit beside the engine's over the same requests
  (``server_metrics.versus``, :mod:`paasbench.metrics.versus`), both request counts, and the TTFT difference
  (client − engine: network, HTTP, tokenization and the client's schedule lag), with a note wherever the two
  sides may not hold the same requests.

Each table's caption says, once, which requests its figures cover, so two hit ratios on one page can be
reconciled.
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


def counters_text(rows: list[Row], what: str) -> str:
    """Which requests the counters and histogram means cover, and when the gauges were read: one sentence for
    the rows shown (``what``: "step" or "run"), each exception named after it."""
    new = [r for r in rows if isinstance(r.metrics.get("window"), dict) and "counters" in r.metrics["window"]]
    text = ""
    if new:
        at = {r.metrics["window"].get("gauges_at") for r in new}
        gauges = ("at the window end, the load still on" if at == {"window end"} else
                  "after the last response" if at == {"last response"} else
                  "at the window end, or after the last response where that came first")
        text = (f"Counters and histogram means cover every request the {what} sent, warm-up included: /metrics "
                f"read with the engine idle before the {what}'s first request and after its last. Gauges "
                f"{gauges}.")
        busy = [r.name for r in new if r.metrics["window"].get("idle_before") is False
                or r.metrics["window"].get("idle_after") is False]
        if busy:
            text += f" Not idle at an edge, so their counters hold other requests too: {', '.join(busy)}."
    old: dict[str, list[str]] = {}
    for r in rows:
        if r not in new:
            old.setdefault(_old_counters(r.metrics), []).append(r.name)
    for how, names in old.items():
        text += (" " if text else "") + f"Recorded by an earlier paasbench ({', '.join(names)}): counters {how}."
    return text


def _old_counters(metrics: dict[str, Any]) -> str:
    """What the counters of a step or run recorded by an earlier paasbench (no ``window.counters``) covered."""
    w = metrics.get("window")
    if not isinstance(w, dict):
        return "over the whole step, warm-up included (scraped before and after it)"
    if w.get("from") == "window start":
        return f"from the window start to the {w.get('to', 'last response')}, warm-up requests still queued there included"
    return f"from before the first request to the {w.get('to', 'last response')}"


def versus_text(rows: list[Row], what: str) -> str:
    """What the client-vs-engine table compares: one definition per kind of row it holds."""
    kinds = {((r.metrics.get("versus") or {}).get("covers")) for r in rows}
    parts = []
    if "window" in kinds:
        parts.append(f"Both sides cover the window's requests, those the {what}'s summary measures: the client's "
                     "TTFT from the intended send, the engine's from the router's acceptance of the request to its "
                     "first token (each response's paasbench_timings.ttft_ms, the observation its TTFT histogram "
                     "got); both prefix hits are cached / prompt tokens of the requests' usage, which the router's "
                     "counters count.")
    if "every request sent" in kinds:
        parts.append(f"Both sides cover every request the {what} sent, warm-up included (the engine's counters "
                     "cannot tell the window's from the warm-up's): the client's TTFT from the intended send, over "
                     "the requests that got a first token; the engine's TTFT histogram mean, from the request's "
                     "arrival at its API server, and its prefix-cache counters, between the idle scrapes above.")
    if None in kinds:
        parts.append("Rows noted \"recorded before both sides were matched\" come from an earlier paasbench: the "
                     "client's figures there are the window's, the engine's counters cover what the note says.")
    parts.append("With the same requests on both sides, client − engine is the network, HTTP, tokenization and "
                 "the client's schedule lag, never negative; a row where it might not be says why.")
    return " ".join(parts)


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
               + ([("yes: " + reasons if reasons else "yes") if sat.get("saturated") else
                   "no" + "".join(f" (swing: {w})" for w in sat.get("swings") or [])] if sweep else []))
        classes = [""] * len(row)
        for i, c in enumerate(cols, 2):
            if c.key == "kv_transfer_checksum_failures" and c.value(m):
                classes[i] = "bad"
        if sweep and sat.get("saturated"):
            classes[-1] = "bad"
        figures.add(row, classes)
    lines = [_versus_row(r) for r in rows]
    noted = any(row[-1] for row, _ in lines)       # a note column only where some row needs one
    versus = Table(["step" if sweep else "run", axis, "requests (client / engine)", "client TTFT mean (ms)",
                    "engine TTFT mean (ms)", "client − engine (ms)", "client prefix hit", "engine prefix hit"]
                   + (["note"] if noted else []))
    for row, classes in lines:
        versus.add(row if noted else row[:-1], classes if noted else classes[:-1])
    chart = None
    if pools and sweep:
        xs = [r.entry.get("load", {}).get("value") for r in rows]
        chart = svg.line_chart(svg.Chart("pool utilization vs load", axis, "busy fraction",
                                         [svg.Series(p, xs, [((r.metrics.get("pools") or {}).get(p) or {})
                                                             .get("utilization") for r in rows]) for p in pools],
                                         y_min=0.0, y_max=1.0))
    what = "step" if sweep else "run"
    return {"family": FAMILY_NAMES.get(fam or "", fam or "unknown /metrics"), "counters": counters_text(rows, what),
            "table": figures, "versus": versus, "versus_text": versus_text(rows, what), "chart": chart}


def _versus_row(r: Row) -> tuple[list[str], list[str]]:
    """One row of client vs engine: ``server_metrics.versus`` (``metrics.versus``), or for a step recorded before
    it, the window's client figures beside the engine's counters as they were, with a note."""
    v = r.metrics.get("versus")
    if v:
        c, e, gap, note = v["client"], v["engine"], v.get("gap_ms"), v.get("note") or ""
        counts = f"{num(c['requests'], 0)} / {num(e['requests'], 0)}"
        cells = [_ms(c["ttft_mean_ms"]), _ms(e["ttft_mean_ms"]), pct(c["prefix_hit"], 1), pct(e["prefix_hit"], 1)]
    else:
        client = (r.summary.get("ttft_ms") or {}).get("mean")
        server = (r.metrics.get("means_ms") or {}).get("ttft")
        gap = client - server if client is not None and server is not None else None
        counts = f"{num((r.summary.get('ttft_ms') or {}).get('count'), 0)} / —"
        cells = [_ms(client), _ms(server), pct(r.summary.get("prefix_hit_ratio"), 1), pct(r.metrics.get("prefix_hit_ratio"), 1)]
        note = f"recorded before both sides were matched: the engine's counters {_old_counters(r.metrics)}"
    row = [r.name, r.load, counts, cells[0], cells[1], "—" if gap is None else f"{gap:+,.1f}", cells[2], cells[3], note]
    classes = [""] * len(row)
    if note and gap is not None and gap < 0:
        classes[5] = "bad"
    return row, classes
