"""Records → summary (``summary.json``, schema ``paasbench.summary/1``). Definitions: docs/metrics.md.

One set of requests: the **scheduled set**, whose *intended* send time lies in the window. Latency
distributions, request counts, errors and error rate describe it, and every rate (requests/s, TPM, tokens/s,
goodput) counts its **served** requests per second of the window: those that succeeded and got their first
token -- prefill done, the request admitted to decoding -- by the **deadline** (window end + drain). Each is
followed to its end, and its input and output tokens count whole. A healthy server is thus credited with the
whole offered load however long its answers take (a 10 s answer sent at the window's last second counts),
and a saturated one only with the requests it got to by the deadline.

(Rates once counted the requests that *ended* inside the window, whenever they were sent: a step of 10 s
answers then lost the last 10 s of its sends and gained the warm-up's, 132K input TPM for 240K offered.)

Without a window the scheduled set is every record and the window runs from the first intended send to the
last response end; an open window end (``--warmup``) becomes the last response end too.
"""

from __future__ import annotations

import json
import math
from array import array
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pandas as pd

from paas_common.errors import InputError
from paasbench.metrics.records import KERNEL_CLOCK, LOOP_CLOCK, RequestRecord
from paasbench.metrics.verify import hit_check, prompt_length_check

SCHEMA = "paasbench.summary/1"
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p999": 99.9}
GOODPUT_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "schedule_lag_ms")

_SCALARS = ("index", "request_id", "session_id", "turn", "intended_send_s", "actual_send_s", "first_token_s",
            "end_s", "request_write_start_s", "request_write_end_s", "input_tokens_sent", "max_tokens",
            "prompt_tokens", "completion_tokens", "cached_tokens",
            "output_tokens_method", "chunk_tokens_estimated", "loop_stamped_reads", "status", "error_kind",
            "error_message")


def token_itls_ms(times: list[float], counts: list[int]) -> np.ndarray:
    """Per-token inter-token latencies (ms) of one stream: ``sum(counts) - 1`` values.

    A chunk's gap since the previous chunk is split evenly over the tokens it carries; extra tokens that
    arrive in the first chunk get 0 (they arrived with the first token). The values sum to
    ``last chunk - first chunk``.
    """
    if not times:
        return np.empty(0)
    n = np.asarray(counts, dtype=np.int64)
    per = np.diff(np.asarray(times, dtype=np.float64)) * 1e3 / n[1:]
    return np.concatenate([np.zeros(max(0, int(n[0]) - 1)), np.repeat(per, n[1:])])


def latency_block(values: Any) -> dict[str, Any]:
    a = np.asarray(values, dtype=np.float64)
    a = a[~np.isnan(a)]
    block: dict[str, Any] = {"count": int(a.size)}
    if a.size == 0:
        block.update({k: None for k in ("mean", "min", "max", *PERCENTILES)})
        return block
    q = np.percentile(a, list(PERCENTILES.values()))
    block.update({"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())})
    block.update({k: float(v) for k, v in zip(PERCENTILES, q)})
    return block


def records_frame(records: Iterable[RequestRecord]) -> pd.DataFrame:
    """One row per request: the record's scalar fields plus derived per-request latencies (ms).

    ``ttft_ms``, ``e2e_ms`` and ``schedule_lag_ms`` are from the intended send time; ``tpot_ms`` needs at
    least 2 output tokens; ``itl_max_ms`` is the request's largest per-token ITL. Failed requests keep
    their partial timings (for diagnosis); summaries use only successful ones for latencies.
    """
    rows = []
    for r in records:
        row = [getattr(r, k) for k in _SCALARS]
        itl = token_itls_ms(r.chunk_times_s, r.chunk_tokens)
        row.append(float(itl.max()) if itl.size else math.nan)
        row.append(len(r.chunk_times_s))
        rows.append(row)
    df = pd.DataFrame(rows, columns=[*_SCALARS, "itl_max_ms", "chunks"])
    for col in ("intended_send_s", "actual_send_s", "first_token_s", "end_s", "request_write_start_s",
                "request_write_end_s"):
        df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    for col in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    df["ok"] = df["error_kind"].isna()
    df["ttft_ms"] = (df["first_token_s"] - df["intended_send_s"]) * 1e3
    df["ttft_from_send_ms"] = (df["first_token_s"] - df["actual_send_s"]) * 1e3
    df["ttft_from_write_start_ms"] = (df["first_token_s"] - df["request_write_start_s"]) * 1e3
    df["ttft_from_write_end_ms"] = (df["first_token_s"] - df["request_write_end_s"]) * 1e3
    df["e2e_ms"] = (df["end_s"] - df["intended_send_s"]) * 1e3
    df["schedule_lag_ms"] = (df["actual_send_s"] - df["intended_send_s"]) * 1e3
    out = df["completion_tokens"]
    df["tpot_ms"] = ((df["e2e_ms"] - df["ttft_ms"]) / (out - 1)).where(out >= 2)
    df["input_tokens"] = df["prompt_tokens"].fillna(df["input_tokens_sent"].astype("float64"))
    return df


def _goodness(df: pd.DataFrame, limits: dict[str, float] | None) -> pd.Series:
    good = df["ok"].copy()
    for key, limit in (limits or {}).items():
        if key not in GOODPUT_KEYS:
            raise InputError(f"unknown goodput metric {key!r}; known: {', '.join(GOODPUT_KEYS)}", field="goodput")
        col = df["itl_max_ms"] if key == "itl_ms" else df[key]
        good &= col.isna() | (col <= limit) if key in ("tpot_ms", "itl_ms") else (col <= limit)
    return good


def _timings(series: Iterable[Any]) -> dict[str, Any]:
    """Per-stage means of the servers' numeric timing fields; counts of their string fields."""
    sums: dict[str, float] = {}
    counts: Counter[str] = Counter()
    labels: dict[str, Counter[str]] = {}
    for t in series:
        if not isinstance(t, dict):
            continue
        for k, v in t.items():
            if isinstance(v, bool):
                continue
            if isinstance(v, (int, float)) and math.isfinite(v):
                sums[k] = sums.get(k, 0.0) + float(v)
                counts[k] += 1
            elif isinstance(v, str):
                labels.setdefault(k, Counter())[v] += 1
    out: dict[str, Any] = {k: sums[k] / counts[k] for k in sorted(sums)}
    out.update({k: dict(c) for k, c in sorted(labels.items())})
    return out


def server_clock_metrics(rows: Iterable[tuple[dict[str, Any], int | None]]) -> dict[str, Any]:
    """The server-clock family (docs/metrics.md): latencies in the sim twin's modeled time, and engine CPU per
    token, from the reference server's ``paasbench_timings`` of each successful request (with its output token
    count). Neither depends on how busy the machine was, which is what lets the gate hold them to 5%."""
    ttft, e2e, tpot = [], [], []
    cpu = {"prefill": [0.0, 0], "decode": [0.0, 0]}
    for t, out in rows:
        if "queue_modeled_ms" in t and "decode_modeled_ms" in t:
            first = t["queue_modeled_ms"] + t.get("prefill_modeled_ms", 0.0) + t.get("kv_transfer_modeled_ms", 0.0)
            ttft.append(first)
            e2e.append(first + t["decode_modeled_ms"])
            if out is not None and out >= 2:
                tpot.append(t["decode_modeled_ms"] / (out - 1))
        for phase, tokens in (("prefill", "prefill_tokens_computed"), ("decode", "decode_steps")):
            if f"{phase}_cpu_ms" in t and t.get(tokens):
                cpu[phase][0] += t[f"{phase}_cpu_ms"]
                cpu[phase][1] += int(t[tokens])
    return {
        "modeled_ttft_ms": latency_block(ttft),
        "modeled_tpot_ms": latency_block(tpot),
        "modeled_e2e_ms": latency_block(e2e),
        **{f"cpu_us_per_{phase}_token": (1e3 * ms / n if n else None) for phase, (ms, n) in cpu.items()},
    }


def summarize(records: Iterable[RequestRecord], *, window: tuple[float, float] | None = None, drain_s: float = 0.0,
              goodput_limits: dict[str, float] | None = None, meta: dict[str, Any] | None = None,
              offered_hit: float | None = None) -> dict[str, Any]:
    """The run summary. ``window=(start_s, end_s)`` (run clock) selects requests by intended send time; those
    whose first token came by ``end_s + drain_s`` are the served ones the rates count (module docstring).
    ``offered_hit``: the traffic's own prefix hit (``verify.sent_traffic_hit``), checked against the server's."""
    clock_rows: list[tuple[dict[str, Any], int | None]] = []
    itls = array("d")   # every window request's per-token ITLs, 8 bytes each (not an array object a request)
    w0, w1 = window if window is not None else (-math.inf, math.inf)
    deadline = w1 + drain_s if math.isfinite(w1) else math.inf

    def taken(rs: Iterable[RequestRecord]) -> Iterator[RequestRecord]:
        # one record at a time: what the summary needs of each is taken as it passes, so a run's records (and
        # their per-chunk timelines, ~4 kB each at 128 tokens) are never all held at once
        for r in rs:
            if r.error_kind is None and w0 <= r.intended_send_s < w1:
                itls.frombytes(token_itls_ms(r.chunk_times_s, r.chunk_tokens).tobytes())
                if r.server_timings:
                    clock_rows.append((r.server_timings, r.completion_tokens))
            yield r

    df = records_frame(taken(records))
    sched = df[(df["intended_send_s"] >= w0) & (df["intended_send_s"] < w1)]
    ok = sched[sched["ok"]]

    # the window's length (the rates' denominator) and what was done for the scheduled set by the deadline
    if window is None:
        start = float(df["intended_send_s"].min()) if len(df) else 0.0
        end = float(df["end_s"].max()) if len(df) else 0.0
    else:
        start = w0
        end = w1 if math.isfinite(w1) else float(df["end_s"].max()) if len(df) else w0
    duration = max(0.0, end - start) if math.isfinite(end) and math.isfinite(start) else 0.0
    served = ok[ok["first_token_s"] <= deadline]             # prefill done by the deadline
    good = _goodness(served, goodput_limits)

    def rate(x: float) -> float | None:
        return x / duration if duration > 0 else None

    input_tokens = float(served["input_tokens"].sum())
    output_tokens = float(served["completion_tokens"].fillna(0).sum())
    good_input = float(served["input_tokens"][good].sum())
    reported = int(served["cached_tokens"].notna().sum())
    cached = float(served["cached_tokens"].fillna(0).sum())
    errors = {str(k): int(v) for k, v in sorted(Counter(sched["error_kind"].dropna()).items())}
    error_messages = _commonest_messages(sched)
    total = int(len(sched))
    itl = np.frombuffer(itls, dtype=np.float64) if len(itls) else np.empty(0)
    hit = cached / input_tokens if reported and input_tokens > 0 else None
    preflight = (meta or {}).get("prompt_preflight") or {}
    summary: dict[str, Any] = {
        "schema": SCHEMA,
        "requests": {"total": total, "ok": int(len(ok)), "failed": total - int(len(ok)), "served": int(len(served)),
                     "completed_in_window": int((sched["end_s"] <= deadline).sum())},
        "window": {"start_s": start, "end_s": end, "drain_s": drain_s if math.isfinite(deadline) else None},
        "duration_s": duration,
        "ttft_ms": latency_block(ok["ttft_ms"]),
        "tpot_ms": latency_block(ok["tpot_ms"]),
        "itl_ms": latency_block(itl),
        "e2e_ms": latency_block(ok["e2e_ms"]),
        "schedule_lag_ms": latency_block(sched["schedule_lag_ms"]),
        "ttft_from_send_ms": latency_block(ok["ttft_from_send_ms"]),
        "ttft_from_write_start_ms": latency_block(ok["ttft_from_write_start_ms"]),
        "ttft_from_write_end_ms": latency_block(ok["ttft_from_write_end_ms"]),
        **server_clock_metrics(clock_rows),
        "request_throughput_rps": rate(len(served)),
        "input_tokens": int(input_tokens),
        "cached_tokens": int(cached),
        "uncached_tokens": int(input_tokens - cached),
        "output_tokens": int(output_tokens),
        "input_tpm": _per_min(rate(input_tokens)),
        "good_input_tpm": _per_min(rate(good_input)),
        "offered_input_tpm": _per_min(rate(float(sched["input_tokens"].sum()))),
        "output_tpm": _per_min(rate(output_tokens)),
        "input_tokens_per_s": rate(input_tokens),
        "output_tokens_per_s": rate(output_tokens),
        # one denominator, the input tokens above: a request that did not report its cached tokens counts
        # as uncached (a discount the server did not confirm is not priced), and how many did not is said
        "prefix_hit_ratio": hit,
        "cached_tokens_unreported": len(served) - reported,
        # did the server see the workload we meant (docs/metrics.md, "Workload verification")
        "prompt_lengths": prompt_length_check(sched["input_tokens_sent"].tolist(), sched["prompt_tokens"].tolist(),
                                              preflight.get("overhead_tokens")),
        "prefix_hit_check": hit_check(hit, offered_hit),
        "goodput_rps": rate(float(good.sum())),
        "goodput_ratio": float(_goodness(sched, goodput_limits).mean()) if total else None,
        "goodput_limits": dict(goodput_limits or {}),
        "error_rate": (total - len(ok)) / total if total else None,
        "errors": errors,
        "error_messages": error_messages,
        "output_tokens_method": {str(k): int(v) for k, v in sorted(Counter(ok["output_tokens_method"]).items())},
        "chunk_tokens_estimated": int(ok["chunk_tokens_estimated"].sum()),
        "arrival_clock": arrival_clock_seen(sched),
        "server_timings_ms": _timings(t for t, _ in clock_rows),
        "meta": dict(meta or {}),
    }
    # sim twin: the share of the wall E2E by which its steps ran past their modeled length because the worker's
    # host time did (docs/metrics.md, "Host-bound time"); None from servers that do not report it
    host_bound, e2e_mean = summary["server_timings_ms"].get("host_bound_ms"), summary["e2e_ms"]["mean"]
    summary["host_bound_share"] = host_bound / e2e_mean if host_bound is not None and e2e_mean else None
    return summary


CACHE_REPORT_FLAGS = "vLLM --enable-prompt-tokens-details, SGLang --enable-cache-report"


def cache_report_warning(summary: dict[str, Any]) -> str | None:
    """A warning when completed requests did not report ``cached_tokens``, naming the server flags that
    turn the report on; None when every one did."""
    missing = summary.get("cached_tokens_unreported") or 0
    if not missing:
        return None
    what = ("prefix_hit_ratio is unknown" if summary.get("prefix_hit_ratio") is None
            else "prefix_hit_ratio counts them as uncached")
    return (f"{missing} completed request(s) did not report cached tokens (usage.prompt_tokens_details."
            f"cached_tokens): {what}. Servers report them with {CACHE_REPORT_FLAGS}.")


def nothing_measured(summary: dict[str, Any]) -> str | None:
    """Why a summary measured nothing a verdict could rest on, or None: no request in its window, or none
    succeeded. Such a run failed (exit 1); judging it against an SLO would call an outage a breach, and
    a run whose window was empty would pass every gate it has no data for."""
    req = summary["requests"]
    if not req["total"]:
        warmup = ((summary.get("meta") or {}).get("load") or {}).get("warmup_s")
        why = f"no request was intended after the --warmup of {warmup:g} s" if warmup else "no request was sent"
        sent = (summary.get("meta") or {}).get("sent")
        return f"nothing measured: {why}" + (f" ({sent} sent)" if sent else "")
    if not req["ok"]:
        said = summary.get("error_messages") or {}
        errors = "; ".join(f"{k} {v}" + (f", {said[k]['count']} of them: {said[k]['message']}" if k in said else "")
                           for k, v in summary["errors"].items())
        return f"no request succeeded ({errors})"
    return None


def arrival_clock_seen(sched: pd.DataFrame) -> dict[str, Any]:
    """Which clock stamped the chunk arrivals of the requests that streamed, as observed on their reads (the
    run's ``meta.arrival_clock`` is what the platform and target should give): ``clock`` is the kernel's
    where no read of any stream was stamped by the event loop, the loop's where every stream's were, else
    ``mixed``; None where nothing streamed, or where a record does not say (written by a version that did not
    count: an old run's records are not credited with the kernel's stamps)."""
    streamed = sched[sched["chunks"] > 0]
    reads = pd.to_numeric(streamed["loop_stamped_reads"], errors="coerce")
    loop = streamed[reads > 0]
    clock = (None if streamed.empty or reads.isna().any() else KERNEL_CLOCK if loop.empty
             else LOOP_CLOCK if len(loop) == len(streamed) else "mixed")
    return {"clock": clock, "requests": int(len(streamed)), "requests_loop_stamped": int(len(loop)),
            "loop_stamped_reads": int(reads[reads > 0].sum())}


MESSAGE_CHARS = 240


def _commonest_messages(sched: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per error kind, the message most of its requests failed with and how many did: a count says that
    requests failed, the server's own words say why (``HTTP 503: no decode worker is up``)."""
    out: dict[str, dict[str, Any]] = {}
    failed = sched[sched["error_kind"].notna()]
    for kind, group in failed.groupby("error_kind"):
        messages = Counter(str(m)[:MESSAGE_CHARS] for m in group["error_message"].dropna())
        if messages:
            message, count = messages.most_common(1)[0]
            out[str(kind)] = {"message": message, "count": int(count)}
    return out


def _per_min(x: float | None) -> float | None:
    return None if x is None else x * 60.0


def export_tables(records_path: Path, out: Path, *, batch: int = 1024) -> None:
    """records.parquet (per-chunk timelines as list columns) and records.csv (lists as JSON text).

    Memory does not grow with the timelines: a first read of the records file makes the frame of their scalars
    (a few hundred bytes a request); a second one writes both files ``batch`` requests at a time, each batch's
    timelines, epoch-ns stamps and server timings taken from its records as they pass (one parquet row group a
    batch). Holding every record with its timelines as Python lists, then a frame of them, then a copy of that
    frame with the lists as JSON text made the export the peak of a whole ``paasbench run``: 416 MB at 256
    streams for 12 s against a zero-latency target (docs/performance.md, "Memory")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from paasbench.metrics.records import read_records

    df = records_frame(read_records(records_path))
    scalars = pa.Table.from_pandas(df, preserve_index=False)
    extra = [("intended_send_ns", pa.int64()), ("first_token_ns", pa.int64()), ("end_ns", pa.int64()),
             ("chunk_times_s", pa.list_(pa.float64())), ("chunk_tokens", pa.list_(pa.int64())),
             ("server_timings", pa.string())]
    schema = pa.schema([*scalars.schema, *(pa.field(n, t) for n, t in extra)], metadata=scalars.schema.metadata)
    records = read_records(records_path)
    with pq.ParquetWriter(out / "records.parquet", schema) as pw, \
            open(out / "records.csv", "w", encoding="utf-8", newline="") as fh:
        for a in range(0, max(len(df), 1), batch):
            recs = [r for _, r in zip(range(batch), records)]
            cols: dict[str, list[Any]] = {
                "intended_send_ns": [r.intended_send_ns for r in recs], "first_token_ns": [r.first_token_ns for r in recs],
                "end_ns": [r.end_ns for r in recs], "chunk_times_s": [r.chunk_times_s for r in recs],
                "chunk_tokens": [r.chunk_tokens for r in recs],
                "server_timings": [json.dumps(r.server_timings) if r.server_timings else None for r in recs]}
            part = scalars.slice(a, len(recs))
            for name, typ in extra:
                part = part.append_column(name, pa.array(cols[name], type=typ))
            pw.write_table(part.replace_schema_metadata(schema.metadata))
            flat = df.iloc[a:a + len(recs)].copy()
            for col in ("intended_send_ns", "first_token_ns", "end_ns"):   # epoch ns: Int64, not rounded floats
                flat[col] = pd.array(cols[col], dtype="Int64")
            for col in ("chunk_times_s", "chunk_tokens"):
                flat[col] = [json.dumps(x) for x in cols[col]]
            flat["server_timings"] = cols["server_timings"]
            flat.to_csv(fh, index=False, header=a == 0)