"""/metrics in Prometheus text format: router-side request counters and stage timings, plus what the
workers report (utilization, KV usage, cache counters).

Definitions (also in docs/reference_server.md):

* ``paasbench_prefix_cache_hits_total`` / ``_queries_total`` count *tokens*, per finished request, at the
  cache that served its prefill: hits = ``usage.prompt_tokens_details.cached_tokens``, queries =
  ``usage.prompt_tokens`` (vLLM's convention). Their ratio over a window is exactly the prefix hit
  ratio a client computes from usage, so harness and server agree by construction.
  ``paasbench_prefix_cache_hit_ratio`` is that ratio over the server's lifetime.
* Per-pool block-manager counters (every allocation on every worker, including the prefill pool's
  own cache) are ``paasbench_pool_prefix_cache_*_total{pool}``.
* ``paasbench_pool_utilization{pool}``: engine busy-time fraction over the last ``util_window_s``,
  mean over the pool's workers. ``paasbench_pool_busy_seconds_total{pool}``: the lifetime sum.
* ``paasbench_pool_host_bound_seconds_total{pool}`` (sim engine): the part of those busy seconds by which
  steps ran past their modeled length because the worker's own host time between two steps (bookkeeping,
  IPC, admission) was longer than the step it should have overlapped (reference_server/engine/sim.py):
  the twin ran slower than the device it models by that much.
* ``paasbench_requests_aborted_total{stage}``: requests the router aborted on their workers because the
  HTTP handler stopped waiting (client gone), by whether a first token had been sent;
  ``paasbench_pool_requests_aborted_total{pool,stage}``: what each pool's workers dropped, by the stage
  the request was in there (docs/faults.md, *Clients that leave*).
* ``paasbench_stage_seconds_sum{stage}`` / ``_count{stage}``: one observation per request and stage
  (``queue``, ``prefill``, ``kv_write``, ``kv_transfer``, ``first_decode``, ``decode_step``), from the
  same ``paasbench_timings`` the final SSE chunk carries.
* ``paasbench_time_to_first_token_seconds`` (histogram): from the router accepting a request to its first
  output token leaving the router, one observation per request that produced one -- the server's side of
  the client's TTFT, as vLLM's and SGLang's ``time_to_first_token_seconds``.
  ``paasbench_e2e_request_latency_seconds`` (histogram): acceptance to the last token, finished requests.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

ABORT_STAGES = ("waiting", "streaming")
WORKER_ABORT_STAGES = ("queued", "prefill", "transfer", "awaiting_kv", "decode")

# Histogram bucket bounds (seconds): 1 ms to 400 s, about x2.5 a step (vLLM's and SGLang's span).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
                     100.0, 200.0, 400.0)

STAGES = {"queue": "queue_ms", "prefill": "prefill_ms", "kv_write": "kv_write_ms", "kv_transfer": "kv_transfer_ms",
          "first_decode": "first_decode_ms", "decode_step": "decode_step_mean_ms"}


@dataclass
class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count of observations (seconds)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
                break

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """``(suffix, labels, value)`` lines: cumulative ``_bucket{le}`` (with +Inf), ``_sum``, ``_count``."""
        out, cum = [], 0
        for bound, n in zip(self.bounds, self.counts):
            cum += n
            out.append(("_bucket", {"le": repr(bound)}, float(cum)))
        out.append(("_bucket", {"le": "+Inf"}, float(self.count)))
        return out + [("_sum", {}, self.total), ("_count", {}, float(self.count))]


@dataclass
class RouterMetrics:
    requests: dict[str, int] = field(default_factory=lambda: defaultdict(int))   # by outcome
    routed: dict[str, int] = field(default_factory=lambda: defaultdict(int))     # by prefill location
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    store_hit_tokens: int = 0   # prompt tokens of finished requests onboarded from the host's KV store
    transfer_bytes: int = 0
    stage_sum_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    stage_count: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    aborted: dict[str, int] = field(default_factory=lambda: defaultdict(int))    # by stage: waiting, streaming
    running: int = 0      # requests that have produced a first token and not finished
    waiting: int = 0      # accepted requests still waiting for their first token
    ttft: Histogram = field(default_factory=Histogram)    # acceptance -> first token, seconds
    e2e: Histogram = field(default_factory=Histogram)     # acceptance -> last token, finished requests

    def observe(self, usage: dict[str, Any], timings: dict[str, Any]) -> None:
        self.requests["ok"] += 1
        self.prompt_tokens += usage["prompt_tokens"]
        self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
        self.completion_tokens += usage["completion_tokens"]
        self.transfer_bytes += int(timings.get("transfer_bytes") or 0)
        self.store_hit_tokens += int(timings.get("store_hit_tokens") or 0)
        self.routed[timings.get("prefill_location", "local")] += 1
        for stage, key in STAGES.items():
            v = timings.get(key)
            if v is not None:
                self.stage_sum_s[stage] += v / 1e3
                self.stage_count[stage] += 1


def _fmt(v: float) -> str:
    return repr(float(v)) if v == v else "NaN"


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self._sample(name, labels, value)

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} histogram")
        for suffix, labels, value in h.samples():
            self._sample(name + suffix, labels, value)

    def _sample(self, name: str, labels: dict[str, str], value: float) -> None:
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        self.lines.append(f"{name}{{{lab}}} {_fmt(value)}" if lab else f"{name} {_fmt(value)}")


def render(rm: RouterMetrics, workers: list[dict[str, Any]], store: Any = None) -> str:
    """``workers``: each worker's ``stats`` reply, plus ``pool`` (its role); ``store``: the host KV
    store's :class:`~reference_server.kv.store.StoreStats` (None without a store)."""
    o = _Out()
    pools: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for w in workers:
        pools[w["role"]].append(w)

    def per_pool(fn) -> list[tuple[dict[str, str], float]]:
        return [({"pool": p}, fn(ws)) for p, ws in sorted(pools.items())]

    def mean(key: str):
        return lambda ws: sum(w[key] for w in ws) / len(ws)

    def total(key: str, sub: str | None = None):
        return lambda ws: sum((w[sub][key] if sub else w[key]) for w in ws)

    o.metric("paasbench_pool_utilization", "gauge", "Engine busy-time fraction over the utilization window, pool mean.",
             per_pool(mean("utilization")))
    o.metric("paasbench_pool_busy_seconds_total", "counter", "Engine busy seconds, pool sum.", per_pool(total("busy_s")))
    if any("host_bound_s" in w for w in workers):
        o.metric("paasbench_pool_host_bound_seconds_total", "counter",
                 "Sim engine: seconds steps ran past their modeled length because the worker's own host time "
                 "between steps exceeded it (inside busy seconds), pool sum.",
                 per_pool(lambda ws: sum(w.get("host_bound_s", 0.0) for w in ws)))
    o.metric("paasbench_pool_workers", "gauge", "Worker processes in the pool.", per_pool(len))
    o.metric("paasbench_pool_sequences", "gauge",
             "Sequences the pool's workers hold: running (admitted), waiting (queued for admission, or for "
             "its KV to arrive on a decode worker / to leave a prefill worker).",
             [({"pool": p, "state": st}, sum(w[st] for w in ws)) for p, ws in sorted(pools.items())
              for st in ("running", "waiting")])
    o.metric("paasbench_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks referenced by running sequences, pool mean.",
             per_pool(mean("kv_usage")))
    ratio = rm.cached_tokens / rm.prompt_tokens if rm.prompt_tokens else 0.0
    o.metric("paasbench_prefix_cache_hit_ratio", "gauge", "Cached / prompt tokens over finished requests (lifetime).",
             [({}, ratio)])
    o.metric("paasbench_prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache (finished requests).",
             [({}, rm.cached_tokens)])
    o.metric("paasbench_prefix_cache_queries_total", "counter", "Prompt tokens of finished requests.",
             [({}, rm.prompt_tokens)])
    for key, help_ in (("hit_tokens", "Prompt tokens found in this pool's caches."),
                       ("query_tokens", "Prompt tokens looked up in this pool's caches."),
                       ("hits", "Allocations that reused at least one block."),
                       ("queries", "Allocations (one per prompt per worker).")):
        o.metric(f"paasbench_pool_prefix_cache_{key}_total", "counter", help_, per_pool(total(key, "cache")))
    o.metric("paasbench_kv_evictions_total", "counter", "Cached KV blocks evicted, all workers.",
             [({}, sum(w["cache"]["evictions"] for w in workers))])
    o.metric("paasbench_kv_transfer_checksum_failures_total", "counter",
             "KV transfers rejected on receipt (checksum, shape or dtype mismatch) and recomputed.",
             [({}, sum(w.get("kv_checksum_failures", 0) for w in workers))])
    o.metric("paasbench_kv_transfers_total", "counter", "KV transfers received.",
             [({}, sum(w.get("kv_transfers", 0) for w in workers))])
    o.metric("paasbench_kv_transfer_bytes_total", "counter", "KV bytes moved between workers (as counted on the wire).",
             [({}, rm.transfer_bytes)])
    if store is not None:
        _store_metrics(o, rm, store)
    o.metric("paasbench_requests_running", "gauge", "Requests streaming output.", [({}, rm.running)])
    o.metric("paasbench_requests_waiting", "gauge", "Accepted requests without a first token yet.", [({}, rm.waiting)])
    o.metric("paasbench_requests_total", "counter", "Requests by outcome.",
             [({"outcome": k}, v) for k, v in sorted(rm.requests.items())] or [({"outcome": "ok"}, 0)])
    o.metric("paasbench_requests_aborted_total", "counter",
             "Requests aborted because their HTTP handler stopped waiting (the client left, or an injected "
             "stream fault), by stage: before the first token (waiting) or while streaming.",
             [({"stage": k}, rm.aborted.get(k, 0)) for k in ABORT_STAGES])
    o.metric("paasbench_pool_requests_aborted_total", "counter",
             "Aborted requests dropped by the pool's workers, by the stage each was in there.",
             [({"pool": p, "stage": st}, sum(w.get("aborted", {}).get(st, 0) for w in ws))
              for p, ws in sorted(pools.items()) for st in WORKER_ABORT_STAGES])
    o.metric("paasbench_kv_transfers_discarded_total", "counter",
             "KV transfers that arrived for an aborted request and were freed unread.",
             [({}, sum(w.get("kv_discarded", 0) for w in workers))])
    o.metric("paasbench_requests_routed_total", "counter", "Finished requests by prefill location.",
             [({"location": k}, v) for k, v in sorted(rm.routed.items())] or [({"location": "local"}, 0)])
    o.metric("paasbench_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [({}, rm.prompt_tokens)])
    o.metric("paasbench_generation_tokens_total", "counter", "Output tokens of finished requests.",
             [({}, rm.completion_tokens)])
    o.histogram("paasbench_time_to_first_token_seconds",
                "Router acceptance to the first output token, per request that produced one.", rm.ttft)
    o.histogram("paasbench_e2e_request_latency_seconds", "Router acceptance to the last token, finished requests.",
                rm.e2e)
    o.metric("paasbench_stage_seconds_sum", "counter", "Per-request stage time, summed.",
             [({"stage": s}, rm.stage_sum_s.get(s, 0.0)) for s in STAGES])
    o.metric("paasbench_stage_seconds_count", "counter", "Requests observed per stage.",
             [({"stage": s}, rm.stage_count.get(s, 0)) for s in STAGES])
    return "\n".join(o.lines) + "\n"


def _store_metrics(o: _Out, rm: RouterMetrics, st: Any) -> None:
    o.metric("paasbench_kv_store_hit_tokens_total", "counter",
             "Prompt tokens of finished requests onboarded from the host KV store (part of the prefix hits).",
             [({}, rm.store_hit_tokens)])
    for name, value, help_ in (
            ("lookup_blocks", st.lookups, "Blocks asked of the store by onboarding reads."),
            ("hit_blocks", st.hits, "Blocks an onboarding read found in the store."),
            ("put_blocks", st.put_blocks, "Blocks published into the store."),
            ("put_bytes", st.put_bytes, "KV bytes written into the store (declared bytes for the sim)."),
            ("get_blocks", st.get_blocks, "Blocks read out of the store, checksum verified."),
            ("get_bytes", st.get_bytes, "KV bytes read out of the store (declared bytes for the sim)."),
            ("evictions", st.evictions, "Store blocks evicted (LRU) to make room."),
            ("corrupt", st.corrupt, "Store blocks whose checksum failed on read (dropped, recomputed)."),
            ("duplicates", st.duplicates, "Blocks a put found already stored (not written again), or lost to "
                                          "an identical block another writer published first."),
            ("errors", st.errors, "Store operations that failed (Mooncake: master or memory owner unreachable); "
                                  "each a miss, recomputed."),
            ("timeouts", st.timeouts, "Store calls a worker stopped waiting for (--kv-store-timeout), or did not "
                                      "make while one was unanswered; each a miss, recomputed.")):
        o.metric(f"paasbench_kv_store_{name}_total", "counter", help_, [({}, value)])
    o.metric("paasbench_kv_store_blocks", "gauge", "Blocks readable in the store now.", [({}, st.published)])
    o.metric("paasbench_kv_store_capacity_blocks", "gauge", "Store capacity in blocks.", [({}, st.capacity_blocks)])
    o.metric("paasbench_kv_store_block_bytes", "gauge", "Bytes per block.", [({}, st.block_nbytes)])
    o.metric("paasbench_kv_store_occupancy_ratio", "gauge", "Readable blocks / capacity.", [({}, st.occupancy)])
