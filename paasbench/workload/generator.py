"""Agent-session trace generator.

Model (docs/traces.md has the long form). Every session starts with the same ``shared_prefix_tokens``
(system prompt + tool definitions; an ``extended_prefix_share`` of the sessions with one shared block more),
then session-specific context up to ``start_tokens`` at turn 0.
Each later turn appends the previous answer (its ``output_length``) plus a tool output, so the context
grows until ``cap_tokens``; a session at the cap ends. ``turns`` mixes short and long sessions. A
``cold_fraction`` of requests share nothing with anything. Turn ``t`` is sent ``response_time_s`` +
think time after turn ``t-1`` (the think time is also kept per request as ``extra["think_ms"]`` for
session-mode replay).

Hash ids follow the prefix-chaining rule: a full block keeps its id for the rest of the session; a
partial last block gets a fresh id each turn (its content changes as text is appended), exactly as a
real block cache sees it.

Hitting a target ratio: under the infinite-cache definition of ``trace.inspect``, a turn ``t >= 1``
hits exactly the full blocks of turn ``t-1`` and a turn 0 hits the shared prefix's full blocks (except
the very first session request). That gives the ratio in closed form from the session contexts,
independent of arrival order. All random draws are made once; the tool-output sizes are multiplied by a
scale found by bisection so the closed form meets the target, then the trace is built, measured with
``inspect_trace`` itself, and the target is corrected and re-solved if the measurement is off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from paas_common.errors import InputError
from paasbench.trace.inspect import inspect_trace
from paasbench.trace.model import Trace, TraceRequest
from paasbench.workload.spec import WorkloadSpec

_BISECT_STEPS = 60
_CORRECTIONS = 4


@dataclass
class _Draws:
    """Every random number the trace depends on, drawn once so that solving never re-rolls them.
    Per-turn draws are (sessions x max turns) arrays; cells past a session's turn count are unused."""

    start: np.ndarray                 # per session: turn-0 context
    turns: np.ndarray                 # per session: requested number of turns
    tool: np.ndarray                  # tool output sizes (unscaled) appended at each turn
    out: np.ndarray                   # output lengths
    think: np.ndarray                 # think time (s) before each turn
    cold_len: np.ndarray              # pool of cold-request lengths (enough for any scale)
    cold_out: np.ndarray              # their output lengths
    gaps: np.ndarray                  # unit-rate inter-start gaps, one per start slot
    slot_perm: np.ndarray             # shuffles which start slots go to cold requests


def _pad(rows: list[np.ndarray], width: int, dtype: type) -> np.ndarray:
    out = np.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def _draw(spec: WorkloadSpec, rng: np.random.Generator) -> _Draws:
    n = spec.sessions
    start = np.rint(spec.start_tokens.sample(rng, n)).astype(np.int64)
    turns = np.maximum(1, np.rint(spec.turns.sample(rng, n))).astype(np.int64)
    width = int(turns.max())
    tool = _pad([np.maximum(0.0, spec.tool_output_tokens.sample(rng, int(t))) for t in turns], width, np.float64)
    out = _pad([np.maximum(1, np.rint(spec.output_tokens.sample(rng, int(t)))) for t in turns], width, np.int64)
    think = _pad([np.maximum(0.0, spec.think_time_s.sample(rng, int(t))) for t in turns], width, np.float64)
    f = spec.cold_fraction
    max_cold = math.ceil(f / (1 - f) * int(turns.sum())) + 1 if f > 0 else 0
    cold_dist = spec.cold_tokens or spec.start_tokens
    cold_len = np.clip(np.rint(cold_dist.sample(rng, max_cold)), 1, spec.cap_tokens).astype(np.int64)
    cold_out = np.maximum(1, np.rint(spec.output_tokens.sample(rng, max_cold))).astype(np.int64)
    slots = n + max_cold
    a = spec.arrivals
    shape = a.burstiness if a.process == "gamma" else 1.0
    gaps = rng.gamma(shape, 1.0 / shape, slots)  # mean 1; scaled to the real rate later
    return _Draws(start, turns, tool, out, think, cold_len, cold_out, gaps, rng.permutation(slots))


def _contexts(spec: WorkloadSpec, d: _Draws, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(context of every turn, which turns exist), both (sessions x max turns), for tool outputs
    scaled by ``scale``. Turn t exists if t < the session's turns and turn t-1 was below the cap."""
    grow = np.maximum(1, d.out[:, :-1] + np.rint(scale * d.tool[:, 1:]).astype(np.int64))
    ctx = np.empty_like(d.out)
    ctx[:, 0] = d.start
    np.cumsum(grow, axis=1, out=ctx[:, 1:])
    ctx[:, 1:] += d.start[:, None]
    np.minimum(ctx, spec.cap_tokens, out=ctx)
    valid = np.arange(ctx.shape[1])[None, :] < d.turns[:, None]
    valid[:, 1:] &= ctx[:, :-1] < spec.cap_tokens
    return ctx, valid


def _n_cold(spec: WorkloadSpec, n_session_requests: int) -> int:
    f = spec.cold_fraction
    return int(round(f / (1 - f) * n_session_requests)) if f > 0 else 0


def extended_sessions(spec: WorkloadSpec) -> np.ndarray:
    """Which sessions carry the extended shared prefix (one block more): ``round(extended_prefix_share *
    sessions)`` of them, spread evenly by index (the arrival order is drawn apart from it)."""
    n = spec.sessions
    m = int(round(spec.extended_prefix_share * n))
    k = np.arange(n)
    return (k + 1) * m // n > k * m // n


def _predicted_hit(spec: WorkloadSpec, d: _Draws, scale: float) -> float:
    """The token-weighted infinite-cache hit ratio the built trace will have (see module docstring)."""
    ctx, valid = _contexts(spec, d, scale)
    bs = spec.block_size
    shared = (spec.shared_prefix_tokens // bs) * bs
    extended = int(extended_sessions(spec).sum())   # the first of them misses its extra block, later ones hit it
    hit = max(0, spec.sessions - 1) * shared + max(0, extended - 1) * bs + \
        int(((ctx[:, :-1] // bs) * bs)[valid[:, 1:]].sum())
    n_cold = _n_cold(spec, int(valid.sum()))
    total = int(ctx[valid].sum()) + int(d.cold_len[:n_cold].sum())
    return hit / total if total else 0.0


def _solve_scale(spec: WorkloadSpec, d: _Draws, target: float) -> float:
    """Smallest-error tool-output scale: hit falls as tool outputs grow, so bisect on the scale."""
    lo, hi = 0.0, 1.0
    while _predicted_hit(spec, d, hi) > target and hi < 1e9:
        hi *= 2
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        if _predicted_hit(spec, d, mid) > target:
            lo = mid
        else:
            hi = mid
    return min((lo, hi), key=lambda x: abs(_predicted_hit(spec, d, x) - target))


def _build(spec: WorkloadSpec, d: _Draws, ctxs: list[np.ndarray], seed: int) -> Trace:
    bs = spec.block_size
    n_shared = spec.shared_prefix_tokens // bs
    extended = extended_sessions(spec)
    # ids 0..n_shared-1 are the shared prefix blocks, n_shared the extended prefix's one more block
    next_id = n_shared + int(extended.any())
    n_cold = _n_cold(spec, sum(len(c) for c in ctxs))

    # Start offsets (s): unit-rate gaps, scaled to the configured rate; slot 0 starts at 0.
    slots = spec.sessions + n_cold
    starts = np.concatenate([[0.0], np.cumsum(d.gaps[1:slots])])
    order = d.slot_perm[d.slot_perm < slots]
    session_slot, cold_slot = order[:spec.sessions], order[spec.sessions:]
    offsets = []  # per session: turn offsets from its start (s)
    for s, ctx in enumerate(ctxs):
        think = d.think[s][:len(ctx)].copy()
        think[0] = 0.0
        step = np.where(np.arange(len(ctx)) > 0, spec.response_time_s, 0.0) + think
        offsets.append(np.cumsum(step))
    a = spec.arrivals
    if a.process == "rate":
        unit = _rate_scale(starts, session_slot, cold_slot, offsets, a.request_rate)
    else:
        unit = 1.0 / a.session_rate

    rows: list[tuple[float, int, int, TraceRequest]] = []
    for s, ctx in enumerate(ctxs):
        sid = f"s{s:05d}"
        blocks: list[int] = list(range(n_shared + int(extended[s])))  # this session's full blocks so far
        t0 = float(starts[session_slot[s]]) * unit
        for t, n_in in enumerate(ctx):
            full = int(n_in) // bs
            while len(blocks) < full:
                blocks.append(next_id)
                next_id += 1
            ids = blocks[:full]
            if n_in % bs:
                ids = ids + [next_id]  # partial tail: new content every turn
                next_id += 1
            think_ms = 0.0 if t == 0 else float(d.think[s][t]) * 1000.0
            req = TraceRequest(arrival_ms=0.0, input_length=int(n_in), output_length=int(d.out[s][t]),
                               hash_ids=ids, session_id=sid, turn=t,
                               extra={"think_ms": round(think_ms, 3)})
            rows.append((t0 + float(offsets[s][t]), s, t, req))
    for i, slot in enumerate(cold_slot):
        n_in = int(d.cold_len[i])
        n_blocks = math.ceil(n_in / bs)
        ids = list(range(next_id, next_id + n_blocks))
        next_id += n_blocks
        req = TraceRequest(arrival_ms=0.0, input_length=n_in, output_length=int(d.cold_out[i]),
                           hash_ids=ids, extra={"cold": True})
        rows.append((float(starts[slot]) * unit, spec.sessions + i, 0, req))
    rows.sort(key=lambda r: (round(r[0] * 1000.0), r[1], r[2]))
    for at_s, _, _, req in rows:
        req.arrival_ms = float(round(at_s * 1000.0))
    return Trace(requests=[r[3] for r in rows], block_size=bs, source=spec.source,
                 meta={"format": "generated", "workload": spec.name, "seed": seed})


def _rate_scale(starts: np.ndarray, session_slot: np.ndarray, cold_slot: np.ndarray,
                offsets: list[np.ndarray], rate: float) -> float:
    """Seconds per unit of start time so that requests / (last arrival - first) == rate."""
    n = sum(len(o) for o in offsets) + len(cold_slot)

    def span(unit: float) -> float:
        ends = [starts[session_slot[s]] * unit + o[-1] for s, o in enumerate(offsets)]
        ends += [starts[c] * unit for c in cold_slot]
        return max(ends)  # the first arrival is slot 0 at time 0

    want = n / rate
    if span(0.0) >= want or span(1.0) == span(0.0):
        # sessions alone already take longer, or every start is slot 0 (one session, no cold requests) so
        # no time scale can stretch the trace: start them all at once (doubling below would never end)
        return 0.0
    lo, hi = 0.0, 1.0
    while span(hi) < want:
        hi *= 2
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < want else (lo, mid)
    return hi


def generate_trace(spec: WorkloadSpec, seed: int | None = None) -> Trace:
    """The trace of ``spec`` (same spec and seed → same trace, byte for byte)."""
    seed = spec.seed if seed is None else seed
    if seed < 0:  # numpy's generator would raise a bare ValueError
        raise InputError(f"must be an integer >= 0, got {seed}", field="seed")
    d = _draw(spec, np.random.default_rng(seed))
    target = spec.target_hit_ratio
    scale, aim = 1.0, target
    for _ in range(_CORRECTIONS if target is not None else 1):
        if target is not None:
            scale = _solve_scale(spec, d, aim)
        ctx, valid = _contexts(spec, d, scale)
        trace = _build(spec, d, [c[v] for c, v in zip(ctx, valid)], seed)
        stats = inspect_trace(trace)
        if target is None or abs(stats["hit_ratio_tokens"] - target) <= spec.hit_tolerance / 2:
            break
        aim += target - stats["hit_ratio_tokens"]  # model and measurement disagree: correct and retry
    hit = stats["hit_ratio_tokens"]
    if target is not None and abs(hit - target) > spec.hit_tolerance:
        lo = _predicted_hit(spec, d, 1e9)
        hi = _predicted_hit(spec, d, 0.0)
        raise InputError(
            f"cannot reach target_hit_ratio {target} ± {spec.hit_tolerance} (got {hit:.4f}); with these "
            f"sessions the reachable range is about [{lo:.3f}, {hi:.3f}] - change turns, start_tokens, "
            "shared_prefix_tokens or cold_fraction", file=spec.source, field="target_hit_ratio")
    trace.meta.update({"tool_output_scale": scale, "target_hit_ratio": target, "hit_ratio_tokens": hit,
                       "output_tokens_expected": expected_output_tokens(spec), "spec": spec.to_dict()})
    return trace


def expected_output_tokens(spec: WorkloadSpec) -> float:
    """The mean output length of the spec's requests, as :func:`_draw` makes them (its distribution, rounded, at
    least 1), from 65,536 draws of a fixed seed: a standard error of about 0.3% for a lognormal of sigma 0.7. A
    trace of a few hundred sessions misses it by a few percent; what a sweep step's window is drawn to hold
    (paasbench.sweep.mix)."""
    draws = spec.output_tokens.sample(np.random.default_rng(0), 1 << 16)
    return round(float(np.maximum(1, np.rint(draws)).mean()), 2)
