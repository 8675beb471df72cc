"""Scrape a target's Prometheus ``/metrics`` around a sweep step and keep the figures that explain it.

Request-level metrics (TTFT, TPOT) come from our own records; the server's view says *why* a step
looked the way it did: pools busy, KV cache full, prefix cache missing, requests queueing. We read
three naming families -- our reference server's ``paasbench_*``, vLLM's ``vllm:*`` and SGLang's
``sglang:*`` -- and normalise them into one small dict, so reports compare across servers.

Gauges are kept as seen at the window end, the load still on (and before the step, for context); counters
and histograms are turned into deltas between two scrapes taken with the engine idle, before the step's first
request and after its last (``Watch``: a counter that went down was reset, its new value is the delta). A scrape failure is
recorded in the result, never raised: server metrics are context, not the measurement.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

# The parser is shared with the reference server (which may not import the harness); re-exported here.
from paas_common.prometheus import ParseError, Sample, parse


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


# --------------------------------------------------------------------------------------------------
# Scraping.


def metrics_url(target: str) -> str:
    """``http://host:port/v1`` and ``http://host:port`` both scrape ``http://host:port/metrics``."""
    parts = urllib.parse.urlsplit(target)
    return urllib.parse.urlunsplit((parts.scheme or "http", parts.netloc, "/metrics", "", ""))


def scrape(target: str, *, headers: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> Scrape:
    """One read of the target's ``/metrics``; ``headers``: what every request to the target carries
    (``ClientConfig.target_headers``: the user's headers and the Bearer key)."""
    url = metrics_url(target)
    result = Scrape(url=url, at_s=time.time())
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read(32 * 1024 * 1024).decode("utf-8", errors="replace")
        result.samples = parse(body)
    except (OSError, urllib.error.URLError, ParseError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# --------------------------------------------------------------------------------------------------
# Normalisation: three naming families → one dict.

FAMILY_PREFIX = {"paasbench": "paasbench_", "vllm": "vllm:", "sglang": "sglang:"}

# Gauges read at the end of the measured window (the load still on). Each figure lists candidate series,
# first present wins; the family prefix tells whose each is.
_GAUGES: dict[str, tuple[str, ...]] = {
    "requests_running": ("paasbench_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs"),
    "requests_waiting": ("paasbench_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_cache_usage": ("paasbench_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                       "sglang:token_usage"),
    "prefix_hit_ratio_gauge": ("paasbench_prefix_cache_hit_ratio", "vllm:gpu_prefix_cache_hit_rate",
                               "sglang:cache_hit_rate"),
}
# Counters turned into deltas over the window.
_COUNTERS: dict[str, tuple[str, ...]] = {
    "prefix_cache_hits": ("paasbench_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                          "vllm:gpu_prefix_cache_hits_total", "sglang:cached_tokens_total"),
    "prefix_cache_queries": ("paasbench_prefix_cache_queries_total", "vllm:prefix_cache_queries_total",
                             "vllm:gpu_prefix_cache_queries_total", "sglang:prompt_tokens_total"),
    "prompt_tokens": ("paasbench_prompt_tokens_total", "vllm:prompt_tokens_total", "sglang:prompt_tokens_total"),
    "generation_tokens": ("paasbench_generation_tokens_total", "vllm:generation_tokens_total",
                          "sglang:generation_tokens_total"),
    "requests_finished": ("paasbench_requests_total", "vllm:request_success_total", "sglang:num_requests_total"),
    "kv_evictions": ("paasbench_kv_evictions_total",),
    # vLLM preempts (recomputes) a running request when KV blocks run out; SGLang calls it a retraction
    "preemptions": ("vllm:num_preemptions_total", "sglang:num_retracted_requests_total"),
    "kv_transfer_checksum_failures": ("paasbench_kv_transfer_checksum_failures_total",),
}
# Histograms (``NAME_sum`` / ``NAME_count``, seconds): their mean over the window, in ms. Each family's own
# clock: vLLM and SGLang time a request from its arrival at the API server, the reference server from its
# arrival at the router.
_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("paasbench_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
             "sglang:time_to_first_token_seconds"),
    "e2e": ("paasbench_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
            "sglang:e2e_request_latency_seconds"),
    "queue": ("vllm:request_queue_time_seconds", "sglang:queue_time_seconds"),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
    # per output token after the first: vLLM V1's name, V0's, SGLang's (its _sum is of intervals, its
    # _count of tokens, so the mean is per token too)
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
            "sglang:inter_token_latency_seconds"),
}
# Gauges whose value is averaged over label sets rather than summed (ratios).
_MEAN_GAUGES = {"kv_cache_usage", "prefix_hit_ratio_gauge"}


def family(scrape_: Scrape) -> str | None:
    """Whose /metrics this is: the first family with a series under its prefix (paasbench, vLLM, SGLang)."""
    names = {s.name for s in scrape_.samples}
    for fam, prefix in FAMILY_PREFIX.items():
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


def _hist_mean_ms(before: Scrape, after: Scrape, name: str) -> float | None:
    """Mean of a histogram's observations between two scrapes (Δsum / Δcount), in ms; None without any."""
    count = _delta(before, after, name + "_count")
    total = _delta(before, after, name + "_sum")
    if not count or total is None:
        return None
    if (after.total(name + "_count") or 0.0) < (before.total(name + "_count") or 0.0):
        total = after.total(name + "_sum")           # reset: both count from zero
    return 1000.0 * (total or 0.0) / count


def step_figures(before: Scrape, after: Scrape, at: Scrape | None = None) -> dict:
    """Figures kept with a step or a run: counter deltas and histogram means (ms, with their observation
    counts) between ``before`` and ``after``, gauges as ``at`` saw them (default ``after``; the ``before`` value as ``*_before``), per-pool
    utilization / KV usage, per-stage mean seconds, and the prefix-hit ratio of the window's own traffic
    (hits delta / queries delta), which a lifetime gauge cannot give."""
    at = at if at is not None and not at.error else after
    out: dict = {"url": after.url, "family": family(after) or family(before),
                 "scrape_errors": [e for e in (before.error, after.error) if e]}
    if after.error:
        return out
    gauges: dict[str, float] = {}
    for key, names in _GAUGES.items():
        hit = _first(at, names, mean=key in _MEAN_GAUGES)
        if hit:
            gauges[key] = hit[1]
            prev = None if before.error else _first(before, (hit[0],), mean=key in _MEAN_GAUGES)
            if prev:
                gauges[key + "_before"] = prev[1]
    out["gauges"] = gauges
    deltas: dict[str, float] = {}
    means: dict[str, float] = {}
    observations: dict[str, float] = {}
    if not before.error:
        for key, names in _COUNTERS.items():
            d = next((d for d in (_delta(before, after, n) for n in names) if d is not None), None)
            if d is not None:
                deltas[key] = d
        for key, names in _HISTOGRAMS.items():
            for name in names:
                m = _hist_mean_ms(before, after, name)
                if m is not None:
                    means[key] = m
                    observations[key] = _delta(before, after, name + "_count") or 0.0
                    break
    out["deltas"] = deltas
    out["means_ms"] = means
    out["observations"] = observations    # how many requests each mean is over (Δ``_count``)
    if deltas.get("prefix_cache_queries"):
        out["prefix_hit_ratio"] = deltas.get("prefix_cache_hits", 0.0) / deltas["prefix_cache_queries"]
    elif "prefix_hit_ratio_gauge" in gauges:
        out["prefix_hit_ratio"] = gauges["prefix_hit_ratio_gauge"]
    out["pools"] = _per_label(at, {"utilization": "paasbench_pool_utilization",
                                   "kv_cache_usage": "paasbench_kv_cache_usage_ratio"}, "pool")
    if not before.error:
        out["stage_mean_ms"] = _stage_means(before, after)
        _step_busy(before, after, out["pools"])
    return out


def _step_busy(before: Scrape, after: Scrape, pools: dict[str, dict[str, float]]) -> None:
    """Busy fraction of each pool over exactly this step (busy-seconds delta / wall / workers); the
    ``utilization`` gauge averages over the server's own window, which need not match the step. On the sim
    twin also ``host_bound_share``: the part of those busy seconds by which its steps ran past their modeled
    length because the worker's host time did (docs/metrics.md)."""
    wall = after.at_s - before.at_s
    if wall <= 0:
        return
    workers = {s.label("pool"): s.value for s in after.values("paasbench_pool_workers")}
    busy = _pool_deltas(before, after, "paasbench_pool_busy_seconds_total")
    for pool, delta in busy.items():
        pools.setdefault(pool, {})["step_utilization"] = delta / wall / max(1.0, workers.get(pool, 1.0))
    for pool, delta in _pool_deltas(before, after, "paasbench_pool_host_bound_seconds_total").items():
        if busy.get(pool):
            pools.setdefault(pool, {})["host_bound_share"] = delta / busy[pool]


def _pool_deltas(before: Scrape, after: Scrape, name: str) -> dict[str, float]:
    """Per-pool increase of counter ``name`` between two scrapes (a counter that went back: its new value)."""
    old = {s.label("pool"): s.value for s in before.values(name)}
    out: dict[str, float] = {}
    for s in after.values(name):
        delta = s.value - old.get(s.label("pool"), 0.0)
        out[s.label("pool") or "all"] = s.value if delta < 0 else delta
    return out


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


def busy(scrape_: Scrape) -> float | None:
    """Requests the target reports running plus waiting; None when its /metrics says neither (or failed)."""
    if scrape_.error:
        return None
    found = [_first(scrape_, _GAUGES[k]) for k in ("requests_running", "requests_waiting")]
    return None if all(f is None for f in found) else sum(f[1] for f in found if f is not None)


def settle(target: str, *, headers: Mapping[str, str] | None = None, timeout_s: float = 60.0, poll_s: float = 0.5,
           stop: Callable[[], bool] | None = None) -> tuple[Scrape, float, bool | None]:
    """Scrape until the target reports no running or waiting request, ``timeout_s`` has passed or ``stop()``
    says so: ``(the last scrape, seconds waited, idle)``; ``idle`` is None when the target does not say (no
    /metrics, or none of the known gauges), and then there is one scrape and no wait."""
    started = time.monotonic()
    while True:
        sc = scrape(target, headers=headers, timeout_s=min(5.0, max(0.5, timeout_s)))
        load = busy(sc)
        waited = time.monotonic() - started
        if load is None or load <= 0 or waited >= timeout_s or (stop is not None and stop()):
            return sc, waited, None if load is None else load <= 0
        time.sleep(poll_s)


def wait_idle(target: str, *, headers: Mapping[str, str] | None = None, timeout_s: float = 60.0, poll_s: float = 0.5) -> float | None:
    """Wait until the target reports no running or waiting request; return the seconds waited, or None
    when it does not say (no /metrics, or none of the known gauges).

    A step that ended in overload can leave the server working on requests the client gave up on; the
    next step must not start on a busy server, or a bisection step inherits its neighbour's backlog.
    """
    _, waited, idle = settle(target, headers=headers, timeout_s=timeout_s, poll_s=poll_s)
    return None if idle is None else waited


# --------------------------------------------------------------------------------------------------
# Scraping around a run.


@dataclass(slots=True)
class Watch:
    """Scrape ``/metrics`` around a run so that its counters cover a set of requests the client can name: every
    request the run sent. An engine's counters and histograms say nothing about which request an observation
    came from, and each counts at its own moment (vLLM its prefix-cache queries when it schedules a prompt, its
    TTFT at the first token, its finished requests at the end), so a scrape taken while requests are in flight
    splits them differently for each figure. Only a scrape with nothing in flight bounds one set of requests
    for all of them. So the counters are read twice with the engine idle: before anything is sent (a sweep
    step has waited for that: ``wait_idle``) and after the last response, once the engine reports no request
    running or waiting (``settle_s`` at most). Whether each edge was idle is recorded: when it was not, the
    counters also hold other requests (another client's, or ones the engine was still finishing), and the
    client-vs-engine comparison says so.

    The gauges (running, waiting, KV usage) are kept from the scrape at the window end, ``end_s`` on the run
    clock, while the load is still on; without a window end (``paasbench run``), from the first scrape after the
    last response. Scrapes run in a thread, off the event loop that sends requests. When the first scrape fails
    the target has no usable /metrics and nothing more is asked of it; the error is kept, never raised.
    """

    target: str
    headers: Mapping[str, str] = field(default_factory=dict)   # ClientConfig.target_headers
    end_s: float | None = None     # window end on the run clock: the gauges' scrape
    settle_s: float = 10.0         # the most it waits, after the last response, for the engine to be idle
    scrapes: dict[str, Scrape] = field(default_factory=dict)
    idle: dict[str, bool | None] = field(default_factory=dict)   # before / after: the engine idle at that edge
    settled_s: float = 0.0         # how long the closing scrape waited for idle
    _task: Any = None

    async def _scrape(self, mark: str) -> None:
        import asyncio

        self.scrapes[mark] = await asyncio.to_thread(scrape, self.target, headers=self.headers)

    @property
    def available(self) -> bool:
        first = self.scrapes.get("before")
        return first is not None and first.error is None

    async def begin(self) -> None:
        """The scrape before anything is sent."""
        await self._scrape("before")
        load = busy(self.scrapes["before"])
        self.idle["before"] = None if load is None else load <= 0

    def follow(self, t0: float) -> None:
        """Start the gauges' scrape at the window end on the run clock that starts at ``t0`` (``time.monotonic()``)."""
        import asyncio

        if self.available and self.end_s is not None:
            self._task = asyncio.create_task(self._window_end(t0, self.end_s))

    async def _window_end(self, t0: float, at: float) -> None:
        import asyncio

        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        await self._scrape("window_end")

    async def finish(self, stop: Callable[[], bool] | None = None) -> None:
        """After the last response: stop the window-end scrape if it has not come, then scrape until the engine
        is idle (at most ``settle_s``, or until ``stop()``: a Ctrl-C does not wait). The first of those scrapes
        gives the gauges when there was no window-end one; the last closes the counters."""
        import asyncio

        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if not self.available:
            return
        first = await asyncio.to_thread(scrape, self.target, headers=self.headers)
        self.scrapes["last_response"] = first
        load = busy(first)
        closing, idle = first, (None if load is None else load <= 0)
        if idle is False and not (stop is not None and stop()):
            closing, self.settled_s, idle = await asyncio.to_thread(
                settle, self.target, headers=self.headers, timeout_s=self.settle_s, poll_s=0.2, stop=stop)
        self.scrapes["end"] = closing
        self.idle["after"] = idle

    def figures(self) -> dict | None:
        """:func:`step_figures` between the two idle scrapes, with ``window`` saying how they were taken; None
        when nothing was scraped."""
        before = self.scrapes.get("before")
        if before is None:
            return None
        end = self.scrapes.get("end")
        if end is None:             # the target had no /metrics
            return step_figures(before, before) | {"window": None}
        gauges = self.scrapes.get("window_end")
        at_window_end = gauges is not None and not gauges.error
        out = step_figures(before, end, gauges if at_window_end else self.scrapes.get("last_response"))
        out["window"] = {"counters": "every request sent", "idle_before": self.idle.get("before"),
                         "idle_after": self.idle.get("after"), "settle_s": round(self.settled_s, 3),
                         "gauges_at": "window end" if at_window_end else "last response"}
        return out
