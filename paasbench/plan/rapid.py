"""Rapid mode: pool curves from the model and device profiles alone, no runs (Dynamo's profiler has the same
idea: simulate the engine instead of deploying it; it takes ~30 s, this takes well under a second per card).

The numbers are the twin's own roofline (:mod:`reference_server.sim.roofline`), the same arithmetic the twin's
engine sleeps, summed the way its scheduler steps:

* **prefill**: a prompt of ``context`` tokens at hit ``h`` computes its ``(1 - h) context`` uncached tokens in
  chunks at their real positions (prefill-only workers: the smallest compute-bound chunk; mixed workers:
  ``--prefill-chunk-tokens``) -- ``service_s``; with nothing queued its TTFT adds the KV transfer of those tokens to
  the decode pool (disaggregated) -- ``base_ttft_s``;
* **decode**: a step of ``B`` streams at ``context`` is one roofline step of ``B`` one-token items; TPOT is that
  step's time, ``max_active`` the most streams whose step fits the TPOT SLO, within what the instance admits
  (``--max-num-seqs``, and the KV it holds for ``context + output`` tokens each).

What it leaves out is what the measured curves have: the router, HTTP, the host, queueing between steps, the
prefix cache's real hit. ``paasbench plan --verify`` on the twin runs the plan and says how far that moves it.
"""

from __future__ import annotations

import math
from typing import Sequence

from paasbench.plan.curves import DecodePoint, PoolCurve, PrefillPoint
from paasbench.plan.twin import Card

BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def prefill_point(card: Card, context: int, hit: float, *, mixed: bool) -> PrefillPoint:
    from reference_server.sim.roofline import compute_bound_chunk, kv_transfer_seconds, step_seconds

    model, device, cards = card.profiles()
    chunk = card.prefill_chunk_tokens if mixed else compute_bound_chunk(model, device, cards, card.block_size)
    cached = min(context - 1, int(context * hit) // card.block_size * card.block_size)
    service = sum(step_seconds(model, device, [(min(chunk, context - s), s)], cards) for s in range(cached, context, chunk))
    transfer = 0.0 if mixed else kv_transfer_seconds((context - cached) * model.kv_bytes_per_token(), device)
    return PrefillPoint(context=context, hit=cached / context, uncached=float(context - cached), service_s=service,
                        base_ttft_s=[service + transfer])


def decode_point(card: Card, context: int, output_tokens: int, tpot_limit_s: float | None) -> DecodePoint:
    from reference_server.sim.roofline import step_seconds

    model, device, cards = card.profiles()
    kv = card.instance().kv_tokens or 0
    admits = max(1, min(card.max_num_seqs, kv // max(1, context + output_tokens // 2)))
    table = [(float(b), step_seconds(model, device, [(1, context)] * b, cards))
             for b in sorted({b for b in BATCHES if b < admits} | {admits})]
    fits = [(b, t) for b, t in table if tpot_limit_s is None or t <= tpot_limit_s]
    if not fits:
        b, t = table[0]
        return DecodePoint(context, output_tokens, 1.0, t, "tpot", table, admits=float(admits))
    b, t = fits[-1]
    limit = "admission" if b == admits else "tpot"
    if limit == "tpot" and len(fits) < len(table):     # between the last fitting batch and the first that does not
        b1, t1 = table[len(fits)]
        b = b + (b1 - b) * (tpot_limit_s - t) / (t1 - t) if t1 > t else b   # type: ignore[operator]
        t = tpot_limit_s                                                    # type: ignore[assignment]
    return DecodePoint(context, output_tokens, float(b), float(t), limit, table, admits=float(admits))


def rapid_pool(card: Card, pool: str, contexts: Sequence[int], hit: float, decode_contexts: Sequence[int],
               output_tokens: int, tpot_limit_s: float | None) -> PoolCurve:
    """The curve of ``pool`` (prefill, decode or mixed) on ``card``: prefill points at ``contexts`` and ``hit``,
    decode points at ``decode_contexts`` (a mixed pool has both)."""
    pre = [prefill_point(card, c, hit, mixed=pool == "mixed") for c in contexts] if pool != "decode" else []
    dec = [decode_point(card, c, output_tokens, tpot_limit_s) for c in decode_contexts] if pool != "prefill" else []
    return PoolCurve(card.instance(), pre, dec)


def buckets_of(values: Sequence[float], block: int, n: int = 3) -> list[int]:
    """``n`` contexts spanning ``values`` (their 10th, 50th and 90th percentiles), on whole blocks."""
    import numpy as np

    qs = np.linspace(10, 90, n) if n > 1 else [50]
    out = sorted({max(block, int(math.ceil(float(np.percentile(values, q)) / block)) * block) for q in qs})
    return out
