"""The same workload mix at every load: which requests a rate-axis step sends, and in what order.

A step at ``r`` req/s sends ``n = r * (warm-up + duration)`` requests. Taking the first ``n`` of the
trace (as the sweep once did) changes the workload with the load: the head of an agent trace is the
*start* of its sessions, where contexts are short and each session's first turn misses, so on ci-small
the traffic-side hit of the measured window went from 61% at 0.5 req/s to 89% at 8 req/s -- a sweep
comparing loads was comparing workloads.

A server that has been serving a session workload for a while sees it in steady state: many sessions
in flight, each at some point of its life, each turn following the previous one of its session. This
module builds that state at every load:

* **lanes** -- ``L = rate x turn gap`` sessions are in flight at once (Little's law; the turn gap is the
  trace's own mean gap between consecutive turns of a session), more where the target's measured E2E keeps more
  of them busy (:func:`lanes_wanted`), at most one per warm-up request. Each
  lane plays whole sessions back to back (in trace order) and enters its first session at a random
  turn, as a server joining the workload mid-way would find it: the session a random request falls in
  (length-weighted), at a uniform turn of it.
* **priming** -- each lane's first request goes into the warm-up, so every measured turn follows its
  predecessor (a turn hits the previous turn's prefix, which holds the whole history before it).
* **interleave** -- the lanes' remaining requests are merged in random order, each lane's order kept,
  and take the step's conditioned-Poisson times in that order. That order is the plan: the runner sends a
  session's turn only once the turn it follows has ended, giving a send time whose planned turn still waits to
  the next planned request that can go (:class:`paasbench.load.schedule.Turns`). A turn never misses a prefix
  its predecessor had not yet written.

In expectation the measured window then holds the workload's own mix. A window of 7 requests (0.5 req/s
over 15 s), or of 180 (a white-paper 64K step), is still a small sample, so among several draws of the lane entry
points (all from the step seed; 16 for steps of tens of thousands of requests, up to 512 for small ones) the first
whose window is within tolerance of the workload on two figures, else the closest, is used: a stratified sample,
the same for the same seed. The two figures:

* the traffic-side hit, within half a point of the whole trace's (`trace inspect`'s definition,
  :func:`paasbench.metrics.verify.traffic_hit`): what the prefill side computes;
* the mean output tokens, within 2% of the workload's (its spec's distribution, ``output_tokens_expected`` in a
  generated trace's meta; else the trace's own mean): what the decode side streams. Drawn for the hit alone, the
  windows of a white-paper 64K step at 3 req/s held 459-538 mean output tokens on seeds 1-12 (the spec's mean is
  about 500), and the twin's roofline bound over those windows spanned 2.89-3.40 req/s: each seed's sweep measured
  a different workload, against a truth of 2.95-3.0 held 30 minutes.

Both are measured on the window and on its first half and three quarters (those of 15 requests or more), the
distance being the largest: a certified step stops at a look, so what it is judged on is a prefix of the window
(fitted to the whole window only, the half a white-paper 256K step passes on held 82.2% of a 90% workload).

Traces without session ids (Mooncake, single-prompt files) carry no turn structure to keep and are replayed from
their head, as before.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from paasbench.metrics.verify import traffic_hit
from paasbench.trace.model import Trace, TraceRequest

CANDIDATE_WORK = 1 << 18  # lane entry draws tried per step: about this many requests in all, 16 to 512 draws
CANDIDATES = (16, 512)
TOLERANCE = 0.005      # stop drawing once the window's hit (each of its PREFIXES') is this close to the trace's ...
OUTPUT_TOLERANCE = 0.02  # ... and its mean output tokens this close (relative) to the workload's
PREFIXES = (0.5, 0.75)   # besides the whole window, its prefixes (as parts of it) whose hit is drawn to the trace's ...
PREFIX_REQUESTS = 15     # ... those of this many requests at least (a certified step's first look: sequential.py)
ENTRY_POOL = 2         # sessions a step's trace holds for each lane's entry (sessions_needed)
LANE_WARMUP = 1.25     # warm-up, in turn gaps, that holds a priming arrival for every lane (lane_warmup_s)


@dataclass(frozen=True, slots=True)
class Mix:
    requests: list[TraceRequest]     # in send order
    lanes: int                       # sessions in flight (0: a trace without sessions, replayed from its head)
    target_hit: float | None         # the token-weighted hit (traffic_hit) over the whole trace, the window's aim
    target_output: float | None = None   # the workload's mean output tokens (output_target)


def sessions_of(trace: Trace) -> list[list[TraceRequest]]:
    """The trace's sessions in order of first appearance, each in turn order; a request without a
    session is a session of its own."""
    groups: dict[object, list[TraceRequest]] = {}
    for i, r in enumerate(trace.requests):
        groups.setdefault(r.session_id if r.session_id is not None else ("solo", i), []).append(r)
    return [sorted(g, key=lambda r: (r.turn if r.turn is not None else 0)) for g in groups.values()]


def turn_gap_s(sessions: Sequence[Sequence[TraceRequest]]) -> float:
    """Mean time between consecutive turns of a session in the trace (1 s if no session has two)."""
    gaps = [b.arrival_ms - a.arrival_ms for s in sessions for a, b in zip(s, s[1:])]
    return max(1e-3, float(np.mean(gaps)) / 1e3) if gaps else 1.0


def session_gap_s(trace: Trace) -> float | None:
    """The trace's mean turn gap (:func:`turn_gap_s`); None for a trace without sessions."""
    if not any(r.session_id is not None for r in trace.requests):
        return None
    return turn_gap_s(sessions_of(trace))


def lanes_wanted(trace: Trace, rate: float, response_s: float = 0.0) -> int:
    """Sessions in flight at ``rate`` arrivals/s, at least one; 0 for a trace without sessions. What a step's mix
    plays (:func:`steady_mix`), its trace must hold entries for (:func:`sessions_needed`) and it plans spares for
    (:func:`paasbench.sweep.step.conditioned_poisson`).

    By Little's law on the trace, ``rate x turn gap``, rounded up. But a session cannot send its next turn before
    the last one has ended, and the trace's gap holds an assumed answer time (white-paper-agent: 12 s, and 3 s of
    think on average), not the target's. With ``response_s``, the target's mean E2E near this load as an earlier
    step measured it, the sessions busy with a turn are, by Little's law again, ``b = rate x response_s`` on
    average, their count Poisson-distributed (arrivals are Poisson, each holds its session for its E2E: M/G/inf);
    a send time finds a session free only if more are in flight than busy, so at least ``b + 2 sqrt(b)``, where
    all are busy about 2% of the time. When every session is busy the runner gives the send time the first turn of
    a session planned later (:class:`paasbench.load.schedule.Turns`), and near the plan's end none is left: on the
    white-paper twin at 64K, with lanes from the trace's 15 s gap where the twin answered in 16-21 s, a 420 s run at
    2.884 req/s sent on time for 400 s, then its sends waited for their sessions by a median of 0.9, 5.5 and 11.4 s
    in its last three 20 s, and a 60 s sweep step at 2.76 req/s, its last third in that tail, failed as saturated
    ("schedule lag grew by 924 ms") at a load the 420 s run held."""
    gap = session_gap_s(trace)
    if gap is None:
        return 0
    busy = rate * max(0.0, response_s)
    return max(1, math.ceil(rate * gap), math.ceil(busy + 2 * math.sqrt(busy)))


def sessions_needed(trace: Trace, rate: float, response_s: float = 0.0) -> int:
    """Sessions a trace needs for a step at ``rate`` arrivals/s (in the trace's own time): the lanes enter from
    the second half of its sessions (:func:`_draw`), and that half holds ``ENTRY_POOL`` sessions per lane. The
    entries are drawn without replacement, so a pool no larger than the lanes is drawn whole, short sessions as
    often as long ones. ci-small at 7.8 req/s, 3 s + 10 s, 21 lanes, 30 draws on each of 12 seeds' traces: the
    window's hit sat 0.86 +- 0.22 points under the trace's with 42 sessions (a pool of 21), within 0.1 +- 0.2 with
    64 or more; on seed 0's trace no draw of 80 came within 2 points of its 90%. 0 for a trace without sessions."""
    return 2 * ENTRY_POOL * lanes_wanted(trace, rate, response_s)


def lane_warmup_s(trace: Trace) -> float:
    """The shortest warm-up (in the trace's time) whose arrivals can prime every lane at any rate: ``rate x turn
    gap`` lanes against ``rate x warm-up`` warm-up arrivals, with a margin for Poisson counts. A step with less
    caps its lanes at its warm-up arrivals (:func:`steady_mix`), and fewer lanes at the same rate send each
    session's turns closer together than the trace does: a plan verification at 3 s warm-up on a twin 5x slow
    (21 lanes of 57 at 39 device req/s) sent them 2.7x closer; then, with turns sent at their planned times, more
    of them came before their predecessor's prefill had finished and the hit fell with the load (now such turns
    wait instead, paasbench.load.schedule.Turns, and the wait is lag). 0 for a trace without sessions."""
    gap = session_gap_s(trace)
    return 0.0 if gap is None else LANE_WARMUP * gap


def steady_mix(trace: Trace, n: int, rate: float, times_s: np.ndarray, window: tuple[float, float],
               seed: int, response_s: float = 0.0) -> Mix:
    """``n`` requests of ``trace`` in steady-state session order (module docstring), to be sent at
    ``times_s`` (sorted); fewer when the trace runs out. ``response_s``: :func:`lanes_wanted`."""
    if not any(r.session_id is not None for r in trace.requests):
        return Mix(trace.requests[:n], 0, None)
    sends = np.asarray(times_s[:n], dtype=np.float64)
    in_window = (sends >= window[0]) & (sends < window[1])
    sessions = sessions_of(trace)
    target = traffic_hit(trace.requests, [True] * len(trace), trace.block_size)
    output = output_target(trace)
    warm = int((sends < window[0]).sum())
    lanes = int(min(lanes_wanted(trace, rate, response_s), max(1, warm), n))
    # the prefixes of the window a step may be judged on (a certified step stops at a look): its first half and
    # three quarters where they hold enough requests to be looked at, and all of it
    length = window[1] - window[0]
    parts = [(sends >= window[0]) & (sends < window[0] + f * length) for f in PREFIXES]
    masks = [w for w in parts if w.sum() >= PREFIX_REQUESTS] + [in_window]
    rng = np.random.default_rng(seed)
    best: tuple[float, Mix] | None = None
    for _ in range(max(CANDIDATES[0], min(CANDIDATES[1], CANDIDATE_WORK // max(1, n)))):
        reqs = _draw(sessions, n, lanes, rng)
        # distances in tolerances, the largest over the window's prefixes; the output's first, as it is cheap and
        # a draw it already puts behind the best need not have its hits computed
        outs = np.array([r.output_length for r in reqs], dtype=np.float64)
        means = [outs[w[:len(reqs)]].mean() for w in masks if w[:len(reqs)].any()]
        off = max((abs(m / output - 1) for m in means), default=0.0) / OUTPUT_TOLERANCE
        if best is None or off < best[0]:
            hits = [traffic_hit(reqs, w[:len(reqs)], trace.block_size) for w in masks]
            distance = max(off, max((abs(h - target) for h in hits if h is not None), default=0.0) / TOLERANCE)
            if best is None or distance < best[0]:
                best = (distance, Mix(reqs, lanes, target, output))
        if len(reqs) < n or best[0] <= 1.0:   # a short trace: every draw is as short
            break
    assert best is not None
    return best[1]


def output_target(trace: Trace) -> float:
    """The mean output tokens a step's window is drawn to hold: the workload's, where the trace was generated from
    a spec (``output_tokens_expected``: its distribution's mean, which a trace of a few hundred sessions misses by
    a few percent: 485-524 on white-paper 64K seeds 1-12 for a spec mean of about 500), else the trace's own."""
    expected = trace.meta.get("output_tokens_expected")
    if expected:
        return float(expected)
    return max(1.0, float(np.mean([r.output_length for r in trace.requests]))) if len(trace) else 1.0


def _draw(sessions: list[list[TraceRequest]], n: int, lanes: int, rng: np.random.Generator) -> list[TraceRequest]:
    """One candidate order. The session a lane joins mid-way is the one a random *request* falls in:
    drawn with probability proportional to its length, at a uniform turn. Entries come from the second
    half of the trace's sessions and the lanes continue with the first half in order, so picking long
    sessions for entries does not leave the continuations short (more first turns, less hit). A trace too
    short for that draws entries and continuations from one queue."""
    quota = [n // lanes + (1 if i < n % lanes else 0) for i in range(lanes)]
    half = len(sessions) // 2
    split = sum(len(s) for s in sessions[:half]) >= n and len(sessions) - half >= lanes
    pool = list(sessions[half:]) if split else []
    queue = collections.deque(sessions[:half] if split else sessions)
    chains: list[list[TraceRequest]] = []
    for q in quota:
        chain: list[TraceRequest] = []
        if pool:
            lens = np.array([len(s) for s in pool], dtype=np.float64)
            first = pool.pop(int(rng.choice(len(pool), p=lens / lens.sum())))
        else:
            first = queue.popleft() if queue else []
        if first:
            start = int(rng.integers(len(first)))
            chain.extend(first[start:start + q])
        while len(chain) < q and queue:
            s = queue.popleft()
            chain.extend(s[:q - len(chain)])
        chains.append(chain)
    chains = [c for c in chains if c]
    # each lane's first request primes it (sent first, in the warm-up); the rest interleave at random
    order = [i for i, c in enumerate(chains) for _ in c[1:]]
    rng.shuffle(order)
    nxt = [1] * len(chains)
    out = [c[0] for c in chains]
    for i in order:
        out.append(chains[i][nxt[i]])
        nxt[i] += 1
    return out


def with_times(requests: Sequence[TraceRequest], times_s: np.ndarray) -> list[TraceRequest]:
    return [dataclasses.replace(r, arrival_ms=float(t) * 1e3) for r, t in zip(requests, times_s)]
