"""Arrival modes → absolute intended send times (seconds after the run's start ``t0``).

Why absolute: every latency is measured from the intended send time (wrk2-style), so the schedule must be a
fact fixed before the request exists, not "sleep a gap after the last send" (relative sleeps drift, and a
slow client would silently stretch the schedule — SGLang #21104). Open-loop modes are precomputed arrays;
closed-loop modes (``concurrency``, ``sessions``) derive each intended time from an event that already
happened (a slot freeing, the previous turn ending), which the runner supplies.

Modes (``LoadConfig.mode``):

* ``trace``       the trace's ``arrival_ms`` (shifted to start at 0) × ``time_scale`` (0.5 = twice as fast)
* ``constant``    request ``i`` at ``i / rate``
* ``poisson``     exponential gaps, mean ``1/rate``; first request at 0
* ``gamma``       gamma gaps, shape ``burstiness``, mean ``1/rate`` (burstiness 1 = Poisson, < 1 burstier)
* ``concurrency`` closed loop: ``concurrency`` slots; a request's intended time is when its slot freed
* ``sessions``    a session's first turn at its trace time × ``time_scale`` (or, with ``rate``, at Poisson/gamma
                  session starts); turn N+1 intended at turn N's end + the turn's ``think_ms`` (generated
                  traces), or, for recorded traces, at the later of turn N's end and turn N's intended time +
                  the trace's arrival gap (which already holds the original response time); pauses and gaps
                  × ``think_time_scale``

``max_concurrency`` caps in-flight requests in any mode without moving intended times, so waiting for a slot
shows up as schedule lag and in every latency.

**A turn is never sent before the turn it follows has ended.** In an open-loop mode the times are send *slots*;
which request takes a slot is decided when it comes (:class:`Turns`): the first planned request whose session has
no turn in flight. A slot whose planned turn still waits for its session's previous turn goes to the next planned
request that can go, and only when none can does it wait, its intended time unchanged (schedule lag, inside every
latency, as with ``max_concurrency``; the record's ``turn_wait_s`` says how much of it). So a slot is never lost
and never moved: the window offers the nominal load, and what a slow server does to a session shows where it would
for a real agent, which cannot send its next turn before it has the answer that turn carries. Sent by their times
instead, turns left before their previous turn's prefill had ended and missed the prefix it was writing: on the
white paper's twin plan at 0.7246 req/s the hit fell from 90% to 79.5% and the prefill pool collapsed
(reports/plan/white-paper-twin/). Only a session's own turns wait for each other: a request without a session, or
a session's first turn, can go at any slot, so a trace without sessions is sent exactly at its times. The run's
end (``duration_s``) cuts the slots, not the plan: a request planned at or after it is a *spare*, taken only by a
slot whose planned turns all wait (a sweep step plans two per session in flight,
:func:`paasbench.sweep.step.conditioned_poisson`), so the last slots of a finite plan do not queue behind the turns
of its busiest sessions.

A run spread over several load workers (``run --workers N``, ``--ray``) splits this one schedule, never
re-derives it: every worker computes the same plan from the same trace and seed, keeps its :class:`Shard`
of it and sends on the same ``t0``. Open-loop sessions go round-robin in order of first appearance (a session's
turns stay on one worker, which alone knows when the previous one ended), each send time with the worker whose
request was planned at it, and requests without a session round-robin in send order; closed-loop slots
(with the requests they would take) and whole sessions go round-robin too. With one worker the shard is the
whole plan.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import time
from dataclasses import dataclass, field
from typing import Hashable, TypeVar

import numpy as np

from paas_common.errors import InputError
from paasbench.trace.model import TraceRequest

T = TypeVar("T")

MODES = ("trace", "constant", "poisson", "gamma", "concurrency", "sessions")
OPEN_LOOP = ("trace", "constant", "poisson", "gamma")


@dataclass(slots=True)
class LoadConfig:
    mode: str = "trace"
    rate: float | None = None                # requests/s (sessions mode: session starts/s)
    burstiness: float = 1.0                  # gamma shape
    concurrency: int | None = None           # closed-loop slots
    max_concurrency: int | None = None       # in-flight cap for any mode; intended times unchanged
    time_scale: float = 1.0                  # multiplies trace timestamps
    duration_s: float | None = None          # no request is intended at or after this time
    max_requests: int | None = None          # at most this many requests are sent
    warmup_s: float = 0.0                    # requests intended before this are excluded from the summary
    seed: int = 0                            # poisson/gamma draws
    think_time_scale: float = 1.0            # sessions: multiplies the trace's inter-turn gaps
    spin_ms: float = 1.0                     # pacing: last stretch before a send is a cooperative spin

    def validate(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}", field="mode")
        if self.mode in ("constant", "poisson", "gamma") and not (self.rate and self.rate > 0):
            raise InputError(f"mode '{self.mode}' needs a request rate > 0", field="rate")
        if self.rate is not None and not self.rate > 0:
            raise InputError(f"must be > 0, got {self.rate}", field="rate")
        if self.mode == "concurrency" and not (self.concurrency and self.concurrency >= 1):
            raise InputError("mode 'concurrency' needs concurrency >= 1", field="concurrency")
        for name in ("burstiness", "time_scale"):
            if not getattr(self, name) > 0:
                raise InputError(f"must be > 0, got {getattr(self, name)}", field=name)
        for name in ("think_time_scale", "warmup_s", "spin_ms"):
            if getattr(self, name) < 0:
                raise InputError(f"must be >= 0, got {getattr(self, name)}", field=name)
        if self.seed < 0:  # numpy's generator would raise a bare ValueError mid-run
            raise InputError(f"must be an integer >= 0, got {self.seed}", field="seed")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InputError("must be >= 1", field="max_concurrency")
        if self.max_requests is not None and self.max_requests < 1:
            raise InputError("must be >= 1", field="max_requests")
        if self.duration_s is not None and not self.duration_s > 0:
            raise InputError("must be > 0", field="duration_s")


@dataclass(frozen=True, slots=True)
class Shard:
    """Worker ``index`` of ``count``: which part of the run's one schedule it sends."""

    index: int = 0
    count: int = 1

    def take(self, items: list[T]) -> list[T]:
        """Its share of a sequence in schedule order (session plans): round-robin."""
        return items[self.index::self.count]

    def slots(self, concurrency: int) -> int:
        """Its closed-loop slots: slot ``s`` belongs to worker ``s % count``."""
        return len(range(self.index, concurrency, self.count))

    def closed_loop_requests(self, n: int, concurrency: int) -> list[int]:
        """The requests its slots take: request ``i`` to slot ``i % concurrency``, as with one worker when
        every request takes as long (the slots then free in turn)."""
        return [i for i in range(n) if (i % concurrency) % self.count == self.index]

    def by_session(self, order: list[int], sessions: list[Hashable | None]) -> list[int]:
        """Its share of open-loop requests ``order`` (send order) of ``sessions``: whole sessions round-robin by first
        appearance, a request without one by its position. Its send times are those of its requests, so each worker
        has one for each request it plans to send."""
        if self.count == 1:
            return order
        seen: dict[Hashable, int] = {}
        mine = []
        for pos, (i, key) in enumerate(zip(order, sessions)):
            n = pos if key is None else seen.setdefault(key, len(seen))
            if n % self.count == self.index:
                mine.append(i)
        return mine

    def budget(self, total: int) -> int:
        """Its share of a request budget that the schedule cannot place in advance (sessions' turns)."""
        return total // self.count + (self.index < total % self.count)


def gaps(n: int, rate: float, mode: str, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` inter-arrival gaps (s) with mean ``1/rate``."""
    if mode == "constant":
        return np.full(n, 1.0 / rate)
    if mode == "poisson":
        return rng.exponential(1.0 / rate, n)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), n)


def arrivals(n: int, rate: float, mode: str, burstiness: float, seed: int) -> np.ndarray:
    """Start times of ``n`` arrivals: the first at 0, then cumulative gaps."""
    if n <= 0:
        return np.zeros(0)
    g = gaps(n - 1, rate, mode, burstiness, np.random.default_rng(seed))
    return np.concatenate([[0.0], np.cumsum(g)])


def open_loop_times(requests: list[TraceRequest], load: LoadConfig) -> np.ndarray:
    """Intended send time of each request, in trace order, cut by ``max_requests`` and ``duration_s``."""
    n = len(requests) if load.max_requests is None else min(len(requests), load.max_requests)
    if load.mode == "trace":
        ms = np.fromiter((r.arrival_ms for r in requests[:n]), dtype=np.float64, count=n)
        t = (ms - (ms.min() if n else 0.0)) / 1e3 * load.time_scale
    else:
        assert load.rate is not None
        t = arrivals(n, load.rate, load.mode, load.burstiness, load.seed)
    if load.duration_s is not None:
        t = t[t < load.duration_s]
    return t


def check_warmup(requests: list[TraceRequest], load: LoadConfig) -> None:
    """An open-loop schedule is known before the run: a warm-up that outlasts every intended send would
    measure nothing (closed-loop and session schedules are judged after the run, by nothing_measured)."""
    if not load.warmup_s or load.mode not in OPEN_LOOP:
        return
    times = open_loop_times(requests, load)
    if len(times) and float(times.max()) < load.warmup_s:
        raise InputError(f"every request is intended before the warm-up ends (the last at {float(times.max()):.3g} s, "
                         f"--warmup {load.warmup_s:g} s): nothing would be measured", field="--warmup")


class Turns:
    """Which planned request an open-loop slot takes (module docstring): the first, in planned order, whose session
    has no turn in flight. ``planned`` is ``(request index, session or None)`` in send order. Only a session's next
    turn can go, so those that can are a heap of session heads by planned position."""

    def __init__(self, planned: list[tuple[int, Hashable | None]]) -> None:
        self._queue: dict[Hashable, collections.deque[tuple[int, int]]] = {}
        self._free: list[tuple[int, int, Hashable | None]] = []
        self._key: dict[int, Hashable | None] = {}
        for pos, (i, key) in enumerate(planned):
            self._key[i] = key
            if key is None:
                self._free.append((pos, i, None))
            else:
                self._queue.setdefault(key, collections.deque()).append((pos, i))
        for key, queue in self._queue.items():
            self._free.append((*queue.popleft(), key))
        heapq.heapify(self._free)
        self._busy = 0
        self._ended = asyncio.Event()

    def take_now(self) -> int | None:
        """The request the slot takes now; None when every session with turns left has one in flight (or none is
        left)."""
        if not self._free:
            return None
        _, i, key = heapq.heappop(self._free)
        self._busy += key is not None
        return i

    async def take(self) -> int | None:
        """The request the slot takes, waiting for a turn to end if none can go; None when nothing is left to send."""
        i = self.take_now()
        while i is None and self._busy:
            self._ended.clear()
            await self._ended.wait()
            i = self.take_now()
        return i

    def left(self) -> list[int]:
        """The requests not taken yet, in planned order."""
        queued = [(pos, i) for queue in self._queue.values() for pos, i in queue]
        return [i for _, i in sorted([(pos, i) for pos, i, _ in self._free] + queued)]

    def ended(self, i: int) -> None:
        """Request ``i`` has ended (answered, failed or cancelled): its session's next turn can go."""
        key = self._key[i]
        if key is None:
            return
        self._busy -= 1
        queue = self._queue[key]
        if queue:
            heapq.heappush(self._free, (*queue.popleft(), key))
        self._ended.set()


@dataclass(slots=True)
class SessionPlan:
    start_s: float                                      # intended time of the first turn
    turns: list[int] = field(default_factory=list)      # trace indices, in turn order
    think_s: list[float] = field(default_factory=list)  # pause after the previous turn's end (0 for the first)
    gap_s: list[float] = field(default_factory=list)    # least time after the previous turn's intended send

    def intended(self, k: int, prev_intended: float, prev_end: float) -> float:
        """Intended time of turn ``k`` (>= 1), once turn ``k - 1`` has ended: never before that end (the user
        reads the answer first), plus the think time; never before the recorded arrival gap has passed."""
        return max(prev_end + self.think_s[k], prev_intended + self.gap_s[k])


def _pause(turn: TraceRequest, prev_ms: float, this_ms: float) -> tuple[float, float]:
    """(think, gap) in ms before ``turn``. A generated trace says the user's pause itself (``think_ms``; its
    arrival gaps also include a modelled response time, which replay measures for real). A recorded trace
    (Mooncake, HF) only has the arrival gap, which already holds the original response time: adding a think
    time after the replayed response would count that time twice and offer too little load, so the gap is
    kept from the previous turn's send instead, and the think time is what is left of it after the response."""
    think = turn.extra.get("think_ms")
    if isinstance(think, (int, float)) and not isinstance(think, bool) and think >= 0:
        return float(think), 0.0
    return 0.0, max(0.0, this_ms - prev_ms)


def session_plans(requests: list[TraceRequest], load: LoadConfig) -> list[SessionPlan]:
    """Group requests by session (requests without one are single-turn sessions), ordered by start."""
    groups: dict[object, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.session_id if r.session_id is not None else ("#", i), []).append(i)
    plans = []
    base = min((r.arrival_ms for r in requests), default=0.0)
    for idx in groups.values():
        idx.sort(key=lambda i: (requests[i].turn if requests[i].turn is not None else 0, requests[i].arrival_ms))
        ms = [requests[i].arrival_ms for i in idx]
        pauses = [(0.0, 0.0)] + [_pause(requests[i], a, b) for i, a, b in zip(idx[1:], ms, ms[1:])]
        scale = load.think_time_scale / 1e3
        plans.append(SessionPlan((ms[0] - base) / 1e3 * load.time_scale, idx,
                                 [t * scale for t, _ in pauses], [g * scale for _, g in pauses]))
    plans.sort(key=lambda p: p.start_s)
    if load.rate is not None:
        starts = arrivals(len(plans), load.rate, "poisson" if load.burstiness == 1.0 else "gamma",
                          load.burstiness, load.seed)
        for p, s in zip(plans, starts):
            p.start_s = float(s)
    return plans


async def sleep_until(deadline: float, spin_s: float = 0.001) -> None:
    """Sleep until the absolute ``time.monotonic()`` deadline.

    The event loop's timers fire up to 1 ms late (epoll rounds timeouts up to whole ms), so the last
    ``spin_s`` is spent yielding to the loop (``sleep(0)``) — other streams keep being read — rather than in
    one long timer.
    """
    delay = deadline - time.monotonic() - spin_s
    if delay > 0:
        await asyncio.sleep(delay)
    while time.monotonic() < deadline:
        await asyncio.sleep(0)
