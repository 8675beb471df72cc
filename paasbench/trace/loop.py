"""``run --duration D --loop``: repeat a trace until D is filled, and say so when a trace is shorter than D.

Each loop gets **fresh prefixes**: loop ``k`` shifts every hash id by ``k`` times the trace's id range, so its
prompts share nothing with loop ``k-1``'s while keeping the trace's own prefix structure, and so its own hit
ratio (``trace inspect`` of one loop is the trace's). Replaying the same prompts would instead let loop 2
find loop 1's whole prompts in the server's prefix cache: the hit ratio and TTFT would be the cache's, not
the workload's. (A workload whose prompts *should* recur across loops is a longer trace, not a loop.) The
shift includes a shared system prompt, so each loop's first request misses it, as the trace's first did.
Literal prompts (prompt files) cannot be shifted; their loops repeat the same text, and ``run`` warns.

In ``trace`` mode loop ``k`` arrives ``k`` periods later; a period is the trace's span plus its mean gap, so the
rate is kept across the seam. Session ids get a ``~k`` suffix (sessions stay separate). Loops are built on
access (:class:`Looped` is a lazy sequence), so a closed-loop run, whose request count is not known in
advance, costs nothing per loop it never reaches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import overload

from paas_common.errors import InputError
from paasbench.load.schedule import OPEN_LOOP, LoadConfig, arrivals, open_loop_times, session_plans
from paasbench.trace.model import Trace, TraceRequest

CLOSED_LOOP_CEILING_RPS = 2000.0  # above what one client process completes (~940 req/s, zero-latency target)
_MAX_REQUESTS = 50_000_000


def id_span(requests: Sequence[TraceRequest]) -> int:
    """One more than the largest hash id: shifting every id by a multiple of this shares nothing."""
    return 1 + max((max(r.hash_ids) for r in requests if r.hash_ids), default=0)


def shift(req: TraceRequest, offset: int) -> TraceRequest:
    """``req`` with every hash id moved by ``offset`` (literal prompts are kept as they are)."""
    if req.prompt is not None or not offset:
        return req
    return dataclasses.replace(req, hash_ids=[h + offset for h in req.hash_ids])


class Looped(Sequence[TraceRequest]):
    """``copies`` loops of ``base``, each request made when it is read."""

    def __init__(self, base: list[TraceRequest], copies: int, period_ms: float) -> None:
        self.base, self.copies, self.period_ms = base, copies, period_ms
        self.span = id_span(base)

    def __len__(self) -> int:
        return len(self.base) * self.copies

    @overload
    def __getitem__(self, i: int) -> TraceRequest: ...

    @overload
    def __getitem__(self, i: slice) -> list[TraceRequest]: ...

    def __getitem__(self, i: int | slice) -> TraceRequest | list[TraceRequest]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        k, j = divmod(i, len(self.base))
        r = self.base[j]
        if k == 0:
            return r
        r = shift(r, k * self.span)
        return dataclasses.replace(r, arrival_ms=r.arrival_ms + k * self.period_ms,
                                   session_id=f"{r.session_id}~{k}" if r.session_id is not None else None)


def period_ms(trace: Trace) -> float:
    """A loop's length on the trace clock: first to last arrival, plus the mean gap between arrivals."""
    ms = [r.arrival_ms for r in trace.requests]
    if not ms:
        return 0.0
    span = max(ms) - min(ms)
    return span + span / (len(ms) - 1) if len(ms) > 1 else 0.0


def loops_needed(trace: Trace, load: LoadConfig) -> int:
    """Loops of ``trace`` that fill ``load.duration_s`` under ``load``'s arrival mode."""
    assert load.duration_s is not None
    n, dur = len(trace), load.duration_s
    if load.mode == "concurrency":  # closed loop: bounded by what a client process can complete
        return max(1, math.ceil(dur * CLOSED_LOOP_CEILING_RPS / n))
    rate = load.rate
    if load.mode == "sessions" and rate is not None:  # session starts at Poisson/gamma times
        per_loop = len(session_plans(trace.requests, load))
    elif load.mode in OPEN_LOOP and load.mode != "trace":
        per_loop = n
    else:  # trace times (trace mode, or sessions at their trace start times)
        period = period_ms(trace) / 1e3 * load.time_scale
        if period <= 0:
            raise InputError("every request of this trace arrives at the same time, so a loop has no length: "
                             "give --rate or --concurrency to loop it", field="--loop")
        return max(1, math.ceil(dur / period))
    assert rate is not None
    copies = max(1, math.ceil(dur * rate / per_loop))
    mode = load.mode if load.mode != "sessions" else ("poisson" if load.burstiness == 1.0 else "gamma")
    while copies * n < _MAX_REQUESTS:  # the draws are seeded: check the real schedule reaches the duration
        if arrivals(per_loop * copies, rate, mode, load.burstiness, load.seed)[-1] >= dur:
            return copies
        copies = math.ceil(copies * 1.25) + 1
    return copies


def loop_trace(trace: Trace, load: LoadConfig) -> Trace:
    """``trace`` repeated with fresh prefixes until ``load.duration_s`` is filled (see the module docstring)."""
    copies = loops_needed(trace, load) if len(trace) else 1
    reqs = Looped(trace.requests, copies, period_ms(trace))
    return Trace(reqs, block_size=trace.block_size, source=trace.source,  # type: ignore[arg-type]
                 meta={**trace.meta, "loops": copies, "loop_requests": len(trace)})


def fit_duration(trace: Trace, load: LoadConfig, *, loop: bool) -> tuple[Trace, str | None]:
    """The trace to run for ``load.duration_s``: looped when ``loop``, else as it is; and a warning, when it
    is too short (not looped) or its loops must repeat literal prompts."""
    if not loop:
        return trace, duration_shortfall(trace, load)
    literal = bool(len(trace)) and trace.requests[0].prompt is not None
    return loop_trace(trace, load), ("--loop repeats literal prompts as they are (a prompt file's text cannot be "
                                     "given fresh prefixes): later loops may hit the server's prefix cache"
                                     if literal else None)


def duration_shortfall(trace: Trace, load: LoadConfig) -> str | None:
    """A warning when an open-loop schedule of ``trace`` ends before ``load.duration_s`` (None otherwise, and
    for closed loops and sessions, whose end is only known after the run)."""
    if load.duration_s is None or load.mode not in OPEN_LOOP or not len(trace):
        return None
    if load.max_requests is not None and load.max_requests < len(trace):
        return None  # the user capped the count; the trace is not what runs out
    last = float(open_loop_times(trace.requests, dataclasses.replace(load, duration_s=None)).max())
    if last >= load.duration_s:
        return None
    return (f"--duration {load.duration_s:g} s is longer than the trace: its last request is intended at "
            f"{last:.1f} s ({len(trace)} requests), so the run ends early; --loop repeats it to fill the duration")


def ran_out(trace: Trace, load: LoadConfig, summary: dict) -> str | None:  # type: ignore[type-arg]
    """After a closed-loop or sessions run: a warning when the trace was used up before ``--duration``."""
    meta = summary.get("meta") or {}
    if load.duration_s is None or meta.get("interrupted") or meta.get("aborted"):
        return None
    budget = len(trace) if load.max_requests is None else min(len(trace), load.max_requests)
    took = summary.get("duration_s") or 0.0
    if budget < len(trace) or (meta.get("sent") or 0) < budget or took >= load.duration_s:
        return None
    return (f"the trace ran out: all {len(trace)} requests were sent and the run ended after {took:.1f} s of the "
            f"--duration {load.duration_s:g} s; --loop repeats it to fill the duration")
