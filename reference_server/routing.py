"""Where a request's prefill runs: the two routing rules and the estimates the cost rule runs on.

Process-free on purpose (the router asks the workers, then calls these), so a rule can be tested on
its own and the supervision code around the router can move without touching it.

**threshold** (PrfaaS, NVIDIA Dynamo's legacy disaggregated router; ``--routing threshold``)::

    remote  iff  prompt - decode worker's hit > remote_prefill_threshold
            and  the least-loaded prefill worker has < prefill_queue_bound prefills outstanding

**cost** (default; ``--routing cost``): each candidate answers what it would really pay. The decode
worker and every prefill worker report their own prefix hit (local cache, then the host store's run
after it) and the engine's estimate of prefilling the rest (:class:`PrefillEstimator`). Then::

    local  = backlog(d) + prefill(d) * (1 + running(d))
    remote = backlog(p) + onboard(p) + prefill(p) + transfer(blocks the decode worker lacks)

and the prefill goes remote to the prefill worker with the lowest ``remote`` iff it is below
``local``. ``running(d)`` is the decode worker's running streams: a local prefill stalls each of
them for about its own duration (a chunked step carries the prefill chunk and every decode token),
so that time is paid once per stream. Picking the prefill worker by its own estimate is the
prefix-affine choice: the one that already holds the session's prefix prefills the least. The
threshold stays a floor (at most that many uncached tokens never go remote) and
``prefill_queue_bound = 0`` still disables remote prefill. Without an estimate (a real engine
that has not prefilled anything yet) the threshold rule decides.

``backlog`` is the router's own book of each worker's outstanding prefill estimates, drained at
one second per second while anything is outstanding (:class:`Backlog`): it needs no round trip
and counts work the worker has not received yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

Location = Literal["local", "remote"]


@dataclass(frozen=True, slots=True)
class Offer:
    """One worker's answer to a ``match`` query for one prompt."""

    worker: str
    hit: int                      # tokens its own prefix cache holds
    store_hit: int = 0            # tokens the host store holds right after ``hit`` (it would onboard them)
    prefill_s: float | None = None  # estimated engine time to prefill the rest; None: no estimate yet
    onboard_s: float = 0.0        # estimated store read time for ``store_hit``
    running: int = 0              # sequences decoding on it now
    inflight: int = 0             # router's count of its requests in flight
    asked: bool = True            # False: made up without a match round trip (nothing above is known)

    @property
    def total_hit(self) -> int:
        return self.hit + self.store_hit


@dataclass(frozen=True, slots=True)
class Decision:
    location: Location
    prefill: str | None           # the prefill worker for a remote prefill
    rule: str                     # "cost" or "threshold"
    reason: str                   # why: cheaper-remote, cheaper-local, below-threshold, queue-bound, ...
    local_s: float | None = None
    remote_s: float | None = None
    inputs: dict[str, Any] = field(default_factory=dict)

    def timings(self) -> dict[str, Any]:
        """The decision and its inputs as flat ``paasbench_timings`` fields (strings are counted,
        numbers averaged by the harness's summary)."""
        t: dict[str, Any] = {"routing": self.rule, "route_reason": self.reason}
        if self.prefill is not None:
            t["route_prefill_worker"] = self.prefill
        if self.local_s is not None:
            t["route_local_est_ms"] = 1e3 * self.local_s
        if self.remote_s is not None:
            t["route_remote_est_ms"] = 1e3 * self.remote_s
        t.update(self.inputs)
        return t


class Backlog:
    """Estimated seconds of prefill work a worker still has: the estimates of its outstanding
    prefills, minus the time it has been busy on them (FIFO: it works at one second per second)."""

    def __init__(self) -> None:
        self._est: dict[str, float] = {}
        self._since = 0.0

    def add(self, rid: str, seconds: float) -> None:
        if not self._est:
            self._since = time.monotonic()
        self._est[rid] = seconds

    def done(self, rid: str) -> None:
        if self._est.pop(rid, None) is not None and not self._est:
            self._since = 0.0

    def seconds(self) -> float:
        if not self._est:
            return 0.0
        return max(0.0, sum(self._est.values()) - (time.monotonic() - self._since))


def threshold_rule(prompt_tokens: int, decode: Offer, prefill: list[Offer], *, threshold: int,
                   queue_bound: int) -> Decision:
    inputs = {"route_decode_hit_tokens": decode.hit}
    if not prefill:
        return Decision("local", None, "threshold", "no-prefill-pool", inputs=inputs)
    if prompt_tokens - decode.hit <= threshold:
        return Decision("local", None, "threshold", "below-threshold", inputs=inputs)
    p = min(prefill, key=lambda o: o.inflight)
    if p.inflight >= queue_bound:
        return Decision("local", None, "threshold", "queue-bound", inputs=inputs)
    return Decision("remote", p.worker, "threshold", "above-threshold", inputs=inputs)


def cost_rule(prompt_tokens: int, decode: Offer, prefill: list[Offer], *, threshold: int, queue_bound: int,
              backlog: dict[str, float], block_size: int, block_nbytes: int, wire_bytes_per_s: float) -> Decision:
    """``backlog``: seconds per worker name; ``wire_bytes_per_s``: prefill → decode KV bandwidth."""
    inputs: dict[str, Any] = {"route_decode_hit_tokens": decode.total_hit, "route_running": decode.running,
                              "route_queue_local_ms": 1e3 * backlog.get(decode.worker, 0.0)}
    if not prefill or queue_bound <= 0:
        return Decision("local", None, "cost", "no-prefill-pool", inputs=inputs)
    if prompt_tokens - decode.total_hit <= threshold:
        return Decision("local", None, "cost", "below-threshold", inputs=inputs)
    if decode.prefill_s is None or any(o.prefill_s is None for o in prefill):
        d = threshold_rule(prompt_tokens, decode, prefill, threshold=threshold, queue_bound=queue_bound)
        return Decision(d.location, d.prefill, "cost", "no-estimate", inputs=inputs)
    local = backlog.get(decode.worker, 0.0) + decode.prefill_s * (1 + decode.running)
    # The decode worker keeps what it holds locally; blocks from there on cross the wire.
    wire = (-(-prompt_tokens // block_size) - decode.hit // block_size) * block_nbytes / wire_bytes_per_s

    def remote_s(o: Offer) -> float:
        return backlog.get(o.worker, 0.0) + o.onboard_s + float(o.prefill_s) + wire

    best = min(prefill, key=lambda o: (remote_s(o), o.inflight))
    remote = remote_s(best)
    inputs.update({"route_prefill_hit_tokens": best.hit, "route_store_hit_tokens": best.store_hit,
                   "route_queue_remote_ms": 1e3 * backlog.get(best.worker, 0.0),
                   "route_transfer_est_ms": 1e3 * wire, "route_onboard_est_ms": 1e3 * best.onboard_s})
    if remote < local:
        return Decision("remote", best.worker, "cost", "cheaper-remote", local, remote, inputs)
    return Decision("local", None, "cost", "cheaper-local", local, remote, inputs)


class PrefillEstimator:
    """A worker's estimate of prefilling ``n`` tokens after ``start`` cached ones, in real seconds.

    The sim engine asks its roofline for every chunk the scheduler would run, times
    ``sim_time_scale`` (as it sleeps), and learns nothing from the wall clock: its step sleeps absorb
    the worker's host time (:mod:`reference_server.engine.sim`), and an estimate learned from wall
    time would make two instances of the same twin drift apart and stay apart with the host's load
    (they route differently, so their modeled figures differ: docs/slo.md). A real engine has no
    model of itself, so its estimate is measured outright: an exponential average of seconds per
    prefilled token over its prefill steps (None until it has prefilled something)."""

    def __init__(self, engine: Any, chunk_tokens: int, time_scale: float = 1.0, alpha: float = 0.2) -> None:
        self.engine, self.chunk, self.scale, self.alpha = engine, max(1, chunk_tokens), time_scale, alpha
        self.per_token_s: float | None = None

    def observe(self, step_s: float, prefill_tokens: int) -> None:
        """One real engine step of ``step_s`` seconds that computed ``prefill_tokens`` prompt tokens (the
        sim engine's estimate is its model: it observes nothing)."""
        if prefill_tokens <= 0 or step_s <= 0 or getattr(self.engine, "cost", None) is not None:
            return
        x = step_s / prefill_tokens
        self.per_token_s = x if self.per_token_s is None else self.per_token_s + self.alpha * (x - self.per_token_s)

    def prefill_s(self, n: int, start: int) -> float | None:
        if n <= 0:
            return 0.0
        cost = getattr(self.engine, "cost", None)
        if cost is None:
            return None if self.per_token_s is None else n * self.per_token_s
        from reference_server.engine.base import SeqStep

        total, pos, end = 0.0, start, start + n
        while pos < end:
            k = min(self.chunk, end - pos)
            total += cost([SeqStep("est", range(k), pos, ())]).seconds
            pos += k
        return total * self.scale
