"""The twin's own capacity estimate: the request rate a server configuration could sustain on a set of
requests if its busiest pool were busy all the time -- the roofline's bottleneck bound, with no queueing.

Why it exists: a load search that starts far from a target's capacity spends its steps climbing (a white-paper
step lasts 2.5 minutes). The sim engine's step times *are* the roofline (:mod:`reference_server.sim.roofline`),
so the same arithmetic, summed over the requests of a workload, says where the capacity lies before anything
runs: a search starts there and brackets it in a step or two (paasbench's ``sweep``, docs/sweep.md).

Per request, in modeled engine seconds:

* **prefill**: its uncached tokens (``input - cached``, at least one) in chunks at their real positions
  -- the attention term grows with the context they attend, which is what makes long contexts dear;
* **decode**: ``output`` decode steps, each the request's share of a step carrying ``B`` such sequences,
  ``B = min(max_num_seqs, KV tokens per worker // context)`` -- the largest batch its KV allows, the
  roofline's best case.

Colocated and chunked: every worker does both, ``workers / (prefill + decode)``. Disaggregated: decode runs
on the decode pool only, ``decode workers / decode``, while a prefill may run on either pool (the default cost
rule prefills on the decode worker when the prefill pool is backed up), so all workers together bound the
total, ``workers / (prefill + decode)``; the rate is the smaller. Nothing here queues, waits for a hand-off or
leaves room for a TTFT limit, so this is an upper bound, not the capacity: a search starts below it and
measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from reference_server.config import ServerConfig


@dataclass(frozen=True, slots=True)
class RequestWork:
    input_tokens: int
    cached_tokens: int        # of them, already in a prefix cache (traffic-side: an infinite cache)
    output_tokens: int


@dataclass(frozen=True, slots=True)
class CapacityEstimate:
    rps: float                # requests/s in real time: the bottleneck pool's, over sim_time_scale
    bottleneck: str           # "decode" (the decode pool) | "prefill + decode" (every worker)
    prefill_s: float          # mean modeled engine seconds per request
    decode_s: float
    workers: dict[str, int]

    def to_dict(self) -> dict[str, object]:
        return {"rps": self.rps, "bottleneck": self.bottleneck, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "workers": dict(self.workers)}


def estimate_capacity(cfg: ServerConfig, requests: Sequence[RequestWork]) -> CapacityEstimate | None:
    """The bottleneck bound (module docstring) of ``cfg`` serving ``requests`` in their proportions; None for
    a real engine, a time scale of 0 (nothing sleeps: no real-time capacity) or no requests."""
    if cfg.engine != "sim" or cfg.sim_time_scale <= 0 or not requests:
        return None
    from reference_server.hardware import prefill_chunk, sim_profiles
    from reference_server.sim.roofline import instance_cards, kv_capacity_tokens, step_seconds

    model, device = sim_profiles(cfg)
    cards = instance_cards(model, device, cfg.cards_per_worker)
    pools = dict(cfg.pools())
    disaggregated = cfg.mode == "disaggregated"
    chunk = prefill_chunk(cfg, model, device, cards) if disaggregated else cfg.prefill_chunk_tokens
    kv_tokens = (int(cfg.kv_budget_mb * 1e6 // model.kv_bytes_per_token()) if cfg.kv_budget_mb
                 else kv_capacity_tokens(model, device, cards))

    prefill = decode = 0.0
    for r in requests:
        start = min(max(0, r.cached_tokens), max(0, r.input_tokens - 1))     # the last token is always computed
        prefill += sum(step_seconds(model, device, [(min(chunk, r.input_tokens - s), s)], cards)
                       for s in range(start, r.input_tokens, chunk))
        if r.output_tokens > 1:
            context = r.input_tokens + r.output_tokens // 2                  # mean context while it decodes
            batch = max(1, min(cfg.max_num_seqs, kv_tokens // max(1, r.input_tokens + r.output_tokens)))
            decode += (r.output_tokens - 1) * step_seconds(model, device, [(1, context)] * batch, cards) / batch
    prefill /= len(requests)
    decode /= len(requests)
    if disaggregated:
        # decode runs only on the decode pool; a prefill may run on either (the cost rule prefills locally
        # when the prefill pool is backed up), so all workers together bound the total work
        d_rps = pools["decode"] / decode if decode else float("inf")
        all_rps = (pools["prefill"] + pools["decode"]) / (prefill + decode)
        rps, bottleneck = (d_rps, "decode") if d_rps <= all_rps else (all_rps, "prefill + decode")
    else:
        rps, bottleneck = pools["mixed"] / (prefill + decode), "prefill + decode"
    return CapacityEstimate(rps / cfg.sim_time_scale, bottleneck, prefill, decode, pools)
