"""Scrape a target's Prometheus ``/metrics`` around a sweep step and keep the figures that explain it.

Request-level metrics (TTFT, TPOT) come from our own records; the server's view says *why* a step
looked the way it did: pools busy, KV cache full, prefix cache missing, requests queueing. We read
three naming families -- our reference server's ``paasbench_*``, vLLM's ``vllm:*`` and SGLang's
``sglang:*`` -- and normalise them into one small dict, so reports compare across servers.

Gauges are kept as seen *after* the step (and before, for context); counters are turned into deltas
over the step (a counter that went down was reset: its new value is the delta). A scrape failure is
recorded in the result, never raised: server metrics are context, not the measurement.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Iterable

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Labels
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


@dataclass(slots=True)
class Scrape:
    """One read of /metrics: its samples, or why there are none."""

    url: str
    at_s: float                       # time.time() of the scrape
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None

    def values(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]

    def total(self, name: str) -> float | None:
        """Sum over label sets (several engines/models/pools) -- None when the series is absent."""
        found = self.values(name)
        return sum(s.value for s in found) if found else None


class ParseError(ValueError):
    pass


# --------------------------------------------------------------------------------------------------
# Text exposition format parser (Prometheus 0.0.4, and the OpenMetrics subset servers actually emit).


def parse(text: str) -> list[Sample]:
    """Parse Prometheus text format. Comments/HELP/TYPE/EOF lines are skipped; a malformed sample line
    raises :class:`ParseError` naming the line, so a broken exporter is not silently read as zeros."""
    out: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(_parse_line(line))
        except (ValueError, IndexError) as exc:
            raise ParseError(f"/metrics line {lineno}: {exc}: {raw[:120]!r}") from None
    return out


def _parse_line(line: str) -> Sample:
    i, n = 0, len(line)
    while i < n and (line[i].isalnum() or line[i] in "_:"):
        i += 1
    name = line[:i]
    if not name or name[0].isdigit():
        raise ValueError("bad metric name")
    labels: list[tuple[str, str]] = []
    if i < n and line[i] == "{":
        i, labels = _parse_labels(line, i + 1)
    rest = line[i:].split()
    if not rest:
        raise ValueError("missing value")
    # rest[1], if any, is a timestamp (ms); we stamp scrapes ourselves, so it is ignored.
    return Sample(name, tuple(sorted(labels)), _parse_value(rest[0]))


def _parse_labels(line: str, i: int) -> tuple[int, list[tuple[str, str]]]:
    labels: list[tuple[str, str]] = []
    n = len(line)
    while True:
        while i < n and line[i] in " ,":
            i += 1
        if i >= n:
            raise ValueError("unterminated label set")
        if line[i] == "}":
            return i + 1, labels
        eq = line.index("=", i)
        key = line[i:eq].strip()
        i = eq + 1
        if line[i] != '"':
            raise ValueError(f"label {key!r} value is not quoted")
        i += 1
        buf: list[str] = []
        while line[i] != '"':
            ch = line[i]
            if ch == "\\":
                nxt = line[i + 1]
                buf.append({"n": "\n", "\\": "\\", '"': '"'}.get(nxt, "\\" + nxt))
                i += 2
            else:
                buf.append(ch)
                i += 1
        labels.append((key, "".join(buf)))
        i += 1


def _parse_value(token: str) -> float:
    low = token.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    if low == "nan":
        return math.nan
    return float(token)


# --------------------------------------------------------------------------------------------------
# Scraping.


def metrics_url(target: str) -> str:
    """``http://host:port/v1`` and ``http://host:port`` both scrape ``http://host:port/metrics``."""
    parts = urllib.parse.urlsplit(target)
    return urllib.parse.urlunsplit((parts.scheme or "http", parts.netloc, "/metrics", "", ""))


def scrape(target: str, *, api_key: str | None = None, timeout_s: float = 5.0) -> Scrape:
    url = metrics_url(target)
    result = Scrape(url=url, at_s=time.time())
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read(32 * 1024 * 1024).decode("utf-8", errors="replace")
        result.samples = parse(body)
    except (OSError, urllib.error.URLError, ParseError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# --------------------------------------------------------------------------------------------------
# Normalisation: three naming families → one dict.

# Gauges read after the step. Each figure lists candidate series, first present wins.
_GAUGES: dict[str, tuple[str, ...]] = {
    "requests_running": ("paasbench_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs"),
    "requests_waiting": ("paasbench_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_cache_usage": ("paasbench_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                       "sglang:token_usage"),
    "prefix_hit_ratio_gauge": ("paasbench_prefix_cache_hit_ratio", "vllm:gpu_prefix_cache_hit_rate",
                               "sglang:cache_hit_rate"),
}
# Counters turned into deltas over the step.
_COUNTERS: dict[str, tuple[str, ...]] = {
    "prefix_cache_hits": ("paasbench_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                          "vllm:gpu_prefix_cache_hits_total", "sglang:cached_tokens_total"),
    "prefix_cache_queries": ("paasbench_prefix_cache_queries_total", "vllm:prefix_cache_queries_total",
                             "vllm:gpu_prefix_cache_queries_total", "sglang:prompt_tokens_total"),
    "prompt_tokens": ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total"),
    "generation_tokens": ("vllm:generation_tokens_total", "sglang:generation_tokens_total"),
    "kv_evictions": ("paasbench_kv_evictions_total",),
    "preemptions": ("vllm:num_preemptions_total",),
    "kv_transfer_checksum_failures": ("paasbench_kv_transfer_checksum_failures_total",),
}
# Gauges whose value is averaged over label sets rather than summed (ratios).
_MEAN_GAUGES = {"kv_cache_usage", "prefix_hit_ratio_gauge"}


def family(scrape_: Scrape) -> str | None:
    names = {s.name for s in scrape_.samples}
    for fam, prefix in (("paasbench", "paasbench_"), ("vllm", "vllm:"), ("sglang", "sglang:")):
        if any(n.startswith(prefix) for n in names):
            return fam
    return None


def _first(scrape_: Scrape, names: Iterable[str], *, mean: bool = False) -> tuple[str, float] | None:
    for name in names:
        found = scrape_.values(name)
        if found:
            vals = [s.value for s in found]
            return name, (sum(vals) / len(vals) if mean else sum(vals))
    return None


def _delta(before: Scrape, after: Scrape, name: str) -> float | None:
    a = after.total(name)
    if a is None:
        return None
    b = before.total(name)
    if b is None or a < b:  # absent before (server just started) or reset: the counter counts from 0
        return a
    return a - b


def step_figures(before: Scrape, after: Scrape) -> dict:
    """Figures kept with a step: gauges after the step (and their value before it), counter deltas over
    it, per-pool utilization / KV usage, per-stage mean seconds, and the prefix-hit ratio of the step's
    own traffic (hits delta / queries delta), which a lifetime gauge cannot give."""
    out: dict = {"url": after.url, "family": family(after) or family(before),
                 "scrape_errors": [e for e in (before.error, after.error) if e]}
    if after.error:
        return out
    gauges: dict[str, float] = {}
    for key, names in _GAUGES.items():
        hit = _first(after, names, mean=key in _MEAN_GAUGES)
        if hit:
            gauges[key] = hit[1]
            prev = None if before.error else _first(before, (hit[0],), mean=key in _MEAN_GAUGES)
            if prev:
                gauges[key + "_before"] = prev[1]
    out["gauges"] = gauges
    deltas: dict[str, float] = {}
    for key, names in _COUNTERS.items():
        for name in names:
            d = _delta(before, after, name) if not before.error else None
            if d is not None:
                deltas[key] = d
                break
    out["deltas"] = deltas
    if deltas.get("prefix_cache_queries"):
        out["prefix_hit_ratio"] = deltas.get("prefix_cache_hits", 0.0) / deltas["prefix_cache_queries"]
    elif "prefix_hit_ratio_gauge" in gauges:
        out["prefix_hit_ratio"] = gauges["prefix_hit_ratio_gauge"]
    out["pools"] = _per_label(after, {"utilization": "paasbench_pool_utilization",
                                      "kv_cache_usage": "paasbench_kv_cache_usage_ratio"}, "pool")
    if not before.error:
        out["stage_mean_ms"] = _stage_means(before, after)
        _step_busy(before, after, out["pools"])
    return out


def _step_busy(before: Scrape, after: Scrape, pools: dict[str, dict[str, float]]) -> None:
    """Busy fraction of each pool over exactly this step (busy-seconds delta / wall / workers); the
    ``utilization`` gauge averages over the server's own window, which need not match the step."""
    wall = after.at_s - before.at_s
    if wall <= 0:
        return
    busy_b = {s.label("pool"): s.value for s in before.values("paasbench_pool_busy_seconds_total")}
    workers = {s.label("pool"): s.value for s in after.values("paasbench_pool_workers")}
    for s in after.values("paasbench_pool_busy_seconds_total"):
        pool = s.label("pool") or "all"
        delta = s.value - busy_b.get(pool, 0.0)
        if delta < 0:
            delta = s.value
        pools.setdefault(pool, {})["step_utilization"] = delta / wall / max(1.0, workers.get(pool, 1.0))


def _per_label(scrape_: Scrape, series: dict[str, str], label: str) -> dict[str, dict[str, float]]:
    pools: dict[str, dict[str, float]] = {}
    for key, name in series.items():
        for s in scrape_.values(name):
            pools.setdefault(s.label(label) or "all", {})[key] = s.value
    return pools


def _stage_means(before: Scrape, after: Scrape) -> dict[str, float]:
    def by_stage(sc: Scrape, name: str) -> dict[str, float]:
        return {s.label("stage") or "": s.value for s in sc.values(name)}

    s_a, c_a = by_stage(after, "paasbench_stage_seconds_sum"), by_stage(after, "paasbench_stage_seconds_count")
    s_b, c_b = by_stage(before, "paasbench_stage_seconds_sum"), by_stage(before, "paasbench_stage_seconds_count")
    means: dict[str, float] = {}
    for stage, count in c_a.items():
        dc = count - c_b.get(stage, 0.0)
        ds = s_a.get(stage, 0.0) - s_b.get(stage, 0.0)
        if dc < 0:  # reset
            dc, ds = count, s_a.get(stage, 0.0)
        if dc > 0:
            means[stage] = 1000.0 * ds / dc
    return means


def wait_idle(target: str, *, api_key: str | None = None, timeout_s: float = 60.0, poll_s: float = 0.5) -> float | None:
    """Wait until the target reports no running or waiting request; return the seconds waited, or None
    when it does not say (no /metrics, or none of the known gauges).

    A step that ended in overload can leave the server working on requests the client gave up on; the
    next step must not start on a busy server, or a bisection step inherits its neighbour's backlog.
    """
    started = time.monotonic()
    while True:
        sc = scrape(target, api_key=api_key, timeout_s=min(5.0, timeout_s))
        if sc.error:
            return None
        busy = [_first(sc, _GAUGES[k]) for k in ("requests_running", "requests_waiting")]
        if all(b is None for b in busy):
            return None
        waited = time.monotonic() - started
        if sum(b[1] for b in busy if b is not None) <= 0 or waited >= timeout_s:
            return waited
        time.sleep(poll_s)
