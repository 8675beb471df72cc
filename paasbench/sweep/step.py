"""One sweep step: wait for an idle server, run the load (scraping /metrics on its window), judge.

The measurement window is ``[warmup, warmup + duration)`` on the run's clock: only requests whose
*intended* send time falls inside it count, so cold caches and the ramp of the first seconds are not
averaged into the verdict. A window request is *served* when its first token came by the **drain**
deadline, as long after the window as the warm-up was before it (``metrics.summarize``); served requests
are followed to their end and count whole. At a sustained load every window request is served, while past
capacity the window's requests left for the drain balance the warm-up's that took window time, so the step
is credited about what the server can do. docs/sweep.md has the argument.

The target's ``/metrics`` is scraped with the target idle before the step's first request and after its last
(``prometheus.Watch``), so its counters (prefix hit, tokens, TTFT histogram) cover a set of requests the client
can name, every request the step sent, and at the window end for its gauges. ``metrics.versus`` puts the
client's figures beside the engine's over the same requests: the window's own where the server times each
request (the bundled server), else every request the step sent.

The summary is recomputed here from the records with that window and the SLO's per-request limits
(goodput), and written over the runner's ``summary.json``, so the file on disk is what was judged.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from paasbench.client import ClientConfig
from paasbench.metrics.records import read_records
from paasbench.metrics.slo import Gate, evaluate, per_request_limits
from paasbench.metrics.verify import sent_traffic_hit
from paasbench.metrics import prometheus
from paasbench.metrics.versus import compare
from paasbench.sweep.horizon import unseen_overload
from paasbench.sweep.mix import lanes_wanted, sessions_needed, steady_mix, with_times
from paasbench.sweep.saturation import SaturationLimits, detect
from paasbench.sweep.search import Outcome
from paasbench.sweep.sequential import CertifyConfig, Sequential
from paasbench.sweep.state import write_json_atomic
from paasbench.trace.model import Trace

AXIS_UNITS = {"rate": "req/s", "concurrency": "streams", "session-rate": "sessions/s"}
SENDS = {"rate": "schedule", "concurrency": "index", "session-rate": "end"}   # how a step's run orders its sends
IDLE_WAIT_S = 60.0           # the most a step waits for an idle target, before its first request and after its last
PRIME_CONCURRENCY = 4        # closed loops a rate step primes its sessions with, by default (prime)
SPARE_PER_LANE = 2           # requests planned after a rate step's end, per session in flight (conditioned_poisson)
STRATUM_ARRIVALS = 10        # a rate step's arrivals are conditioned on their count in strata of this many
MAX_TRACE_REQUESTS = 200_000   # the most requests a step's trace is made with (a closed loop that outruns it reruns)


@dataclass(frozen=True, slots=True)
class StepPlan:
    axis: str                 # rate | concurrency | session-rate
    warmup_s: float
    duration_s: float         # measured part, after the warm-up (the longest, with window_requests)
    seed: int = 0
    window_requests: int = 0  # rate axis: a window holds about this many arrivals, no more (0: fixed length)
    response_s: float = 0.0   # rate axis: the target's mean E2E near this load, measured (0: not; mix.lanes_wanted)

    def for_load(self, value: float) -> "StepPlan":
        """The plan of one step at ``value``. On the rate axis with ``window_requests``, the window is as long
        as that many arrivals take -- enough for the SLO percentile and for the saturation tests' thirds --
        but never shorter than twice the warm-up (past capacity the drain credits a step at most
        ``warmup / duration`` above what it served: docs/sweep.md) nor longer than ``duration_s``. A white-paper
        64K step at 1.6 req/s holds 190 requests in the spec's 120 s; 60 s hold 95 of them and save a minute a
        step, and a failing step's first-token timeout (the step's length) shrinks with it."""
        if self.axis != "rate" or self.window_requests <= 0 or not value > 0:
            return self
        duration = min(self.duration_s, max(self.window_requests / value, 2 * self.warmup_s))
        return dataclasses.replace(self, duration_s=round(duration, 1))

    @property
    def total_s(self) -> float:
        return self.warmup_s + self.duration_s

    @property
    def window(self) -> tuple[float, float]:
        return (self.warmup_s, self.total_s)

    @property
    def drain_s(self) -> float:
        """Credit deadline after the window end: as long as the warm-up (docs/sweep.md)."""
        return self.warmup_s

    def trace_size(self, value: float, per_stream: float = 10.0) -> int:
        """How many requests (sessions, on the session-rate axis) the step's trace is made with at ``value``, a
        margin over what the step sends: on the rate axis three times its arrivals (lanes enter their first
        session mid-way: mix.py) + 64; a closed loop ``per_stream`` requests per stream-second (the caller's
        guess from the last step) + 64; sessions 1.5 times + 8."""
        total = self.total_s
        if self.axis == "concurrency":
            return int(value * total * per_stream) + 64
        if self.axis == "rate":
            return int(value * total * 3) + 64
        return int(value * total * 1.5) + 8

    def trace(self, source: Any, bucket: int | None, size: int, rate: float | None = None) -> Trace:
        """The step's trace of ``size`` (:meth:`trace_size`) from ``source`` (a :class:`~paasbench.sweep.source.
        Source`), for context ``bucket``. On the rate axis at ``rate`` (arrivals/s in the trace's time), a workload's
        trace also holds the sessions the steady mix draws its lanes from (:func:`paasbench.sweep.mix.sessions_needed`)."""
        if self.axis == "session-rate":
            return source.trace_for(bucket, sessions=size)
        requests = min(size, MAX_TRACE_REQUESTS)
        trace = source.trace_for(bucket, requests=requests)
        if self.axis == "rate" and rate and source.spec is not None:
            want = sessions_needed(trace, rate, self.response_s)
            if want > len({r.session_id for r in trace.requests}):
                trace = source.trace_for(bucket, requests=requests, sessions=want)
        return trace

    def schedule(self, trace: Trace, value: float) -> tuple[Trace, Any]:
        """The trace to send and the runner's load config for one load level."""
        from paasbench.load.runner import LoadConfig

        total = self.total_s
        if self.axis == "concurrency":
            return trace, LoadConfig(mode="concurrency", concurrency=int(value), duration_s=total,
                                     warmup_s=self.warmup_s, seed=self.seed)
        if self.axis == "session-rate":
            return trace, LoadConfig(mode="sessions", rate=value, duration_s=total, warmup_s=self.warmup_s,
                                     seed=self.seed)
        return conditioned_poisson(trace, value, total, self.seed, self.window, self.response_s), LoadConfig(
            mode="trace", duration_s=total, warmup_s=self.warmup_s, seed=self.seed)


def mean_e2e_s(summary: dict[str, Any]) -> float:
    """A step's (or run's) mean E2E in seconds from its summary; 0 where none finished. What :func:`response_near`
    reads the target's answer time from."""
    return ((summary.get("e2e_ms") or {}).get("mean") or 0) / 1e3


def response_near(measured: Iterable[tuple[float, float | None]], load: float) -> float:
    """The target's mean E2E (s) near ``load`` from ``(load, mean E2E s)`` pairs measured at other loads: the one
    at the highest load not above it (E2E grows with the load, and a load past capacity inflates it with its queue);
    0 when none is below. What a rate step sizes its sessions in flight with (``StepPlan.response_s``)."""
    below = [(at, e2e) for at, e2e in measured if e2e and at <= load]
    return max(below)[1] if below else 0.0


def step_timeouts(step_s: float) -> dict[str, float]:
    """The client timeouts of a step lasting ``step_s`` (warm-up + window): a first token within
    ``max(30 s, step_s)`` -- a window request then has at least the drain to be served -- and the whole
    request within twice that. Each step's own length (``StepPlan.for_load``), so a short step that
    overloads the target is not held for a long step's timeouts."""
    bound = max(30.0, step_s)
    return {"first_byte_timeout_s": bound, "idle_timeout_s": min(60.0, bound), "total_timeout_s": 2 * bound}


def conditioned_times(rate: float, total_s: float, seed: int) -> np.ndarray:
    """The arrival times of :func:`conditioned_poisson`: ``n = max(1, round(rate * total_s))`` of them, the step cut
    into strata of about :data:`STRATUM_ARRIVALS` arrivals each, each stratum holding its share of ``n`` (the
    cumulative count at a stratum's end is ``n`` times its share of the step, rounded) at uniform times within it,
    sorted; the first at 0 (the runner starts the clock at the first arrival).

    Why strata: a certified step stops at a look (sequential.py), so its window is a *prefix* of the step, and
    the count of a prefix must be its nominal load too, not only the whole step's. Conditioned on the step's count
    alone, the uniform draws of one seed (every step's: common random numbers) put 8-11% fewer arrivals than
    nominal in a white-paper 64K step's first 71 s of window, at 1.57, 2.22 and 3.14 req/s alike (seed 0; seed 3:
    6-10% more), and the sweep named loads it had not offered. Within a stratum the arrivals are as bursty as
    Poisson; over any window the count is nominal within a stratum's fluctuation at either end."""
    n = max(1, round(rate * total_s))
    strata = max(1, round(n / STRATUM_ARRIVALS))
    edges = np.linspace(0.0, total_s, strata + 1)
    counts = np.diff(np.round(np.arange(strata + 1) * (n / strata)).astype(int))
    rng = np.random.default_rng(seed)
    times = np.concatenate([np.sort(rng.uniform(a, b, c)) for a, b, c in zip(edges[:-1], edges[1:], counts)])
    times[0] = 0.0
    return times


def conditioned_poisson(trace: Trace, rate: float, total_s: float, seed: int,
                        window: tuple[float, float] | None = None, response_s: float = 0.0) -> Trace:
    """``n = round(rate * total_s)`` requests at Poisson arrival times *conditioned on their count* in every
    stratum of about ten arrivals (:func:`conditioned_times`: the order statistics of a Poisson process given
    its count, stratum by stratum). Within a stratum the arrivals are as bursty as Poisson; over the step, and
    over any prefix of it a certified step may stop at, they are the nominal load. Plain Poisson over a short
    step can offer half or twice the nominal rate (a 15 s step at 1 req/s offers 15 ± 4 requests), and with one
    seed for every step that error repeats at every load; here the search compares the loads it names. Which
    requests, in which order: ``mix.steady_mix`` (the same workload mix at every load); fewer than ``n`` when the
    trace runs out. Its sessions in flight follow the target's measured ``response_s`` where that is longer than
    the trace assumed (``mix.lanes_wanted``).

    Behind them, ``SPARE_PER_LANE`` requests per session in flight are planned after the step's end: spares that a
    send time takes when every turn planned for it waits for its session's previous turn (the runner cuts the send
    times at the step's end, not the plan: :class:`paasbench.load.schedule.Turns`). Without them the plan's last
    requests are the turns of the sessions that were busiest, and near the end a send time found only those left:
    a white-paper 64K step at 1.55 req/s waited up to 16.8 s so in the last 10 s of its window (the server's queue
    6-27 ms) and failed as saturated. A server holding many agents in flight has another one ready."""
    times = conditioned_times(rate, total_s, seed)
    n = len(times)
    spare = SPARE_PER_LANE * lanes_wanted(trace, rate, response_s)
    times = np.concatenate([times, total_s + np.arange(1, spare + 1) / rate])
    mix = steady_mix(trace, n + spare, rate, times, window or (0.0, total_s), seed, response_s)
    return Trace(with_times(mix.requests, times), block_size=trace.block_size, source=trace.source,
                 meta={**trace.meta, "schedule": f"poisson conditioned on {n} arrivals in {total_s:g} s, "
                                                   f"about {STRATUM_ARRIVALS} a stratum",
                       "planned": n, "lanes": mix.lanes, "target_hit_ratio": mix.target_hit,
                       "target_output_tokens": mix.target_output})


def prime(pool: Trace, sent: Trace, client: ClientConfig, out: Path, concurrency: int) -> dict[str, Any]:
    """Before a rate step: the previous turn of every session the step joins mid-way (``pool``: the trace the step
    was scheduled from; ``sent``: its schedule), as ``max_tokens`` 1 requests in a closed loop of ``concurrency``,
    not measured. The step's mix enters each of its lanes' first session at a random turn (:mod:`paasbench.sweep.mix`);
    a server that had been serving them would hold each one's previous prompt in its cache, and that is what its
    next turn's hit counts on. Without it every session in flight arrives cold at once. On a plan verification at
    30 device req/s of ci-small 45 mid-session prompts of up to 6K uncached tokens reached two prefill instances in
    the first seconds of the warm-up; the turns after them came before they were done, so they missed too, and the
    pool never left that backlog (hit 0%, 0 of 137 window requests served by the deadline). On a white-paper 64K
    sweep step at 2.19 req/s the 33 lane entries put 2M uncached tokens into its 30 s warm-up: requests queued 7-17
    s, those turns took 15-30 s, every lane was still busy with them well into the window, and its sends waited for
    them 4-8 s in the window's last two thirds; the step failed as saturated ("schedule lag grew by 4658 ms"), where a
    420 s run at 2.449 req/s held its p50 TTFT at 147 ms. That is a cold start, not the traffic the step is for."""
    from paasbench.load.runner import LoadConfig, run_load_sync

    by_turn = {(r.session_id, r.turn): r for r in pool.requests if r.session_id is not None}
    seen: set[Any] = set()
    primers = []
    for r in sent.requests:
        if r.session_id is None or r.session_id in seen:
            continue
        seen.add(r.session_id)
        prev = by_turn.get((r.session_id, (r.turn or 0) - 1))
        if prev is not None:
            primers.append(dataclasses.replace(prev, output_length=1, arrival_ms=0.0))
    if not primers:
        return {"requests": 0}
    began = time.monotonic()
    result = run_load_sync(Trace(primers, block_size=pool.block_size, source=pool.source),
                           LoadConfig(mode="concurrency", concurrency=concurrency, max_requests=len(primers),
                                      duration_s=3600.0), client, out)
    return {"requests": len(primers), "ok": (result.summary.get("requests") or {}).get("ok"),
            "wall_s": time.monotonic() - began}


def run_step(trace: Trace, plan: StepPlan, value: float, client: ClientConfig, step_dir: Path, *,
             gates: Sequence[Gate], meta: dict[str, Any], saturation_limits: SaturationLimits | None = None,
             certify: CertifyConfig | None = None, min_pass_s: float | None = None,
             prime_concurrency: int = PRIME_CONCURRENCY) -> dict[str, Any]:
    """Run one load level into ``step_dir``; return its sweep.json entry (without index/key). ``saturation_limits``: the
    saturation test's limits (default: :class:`SaturationLimits`'s; a slowed twin's plan scales their absolute
    amounts, paasbench/plan/verify.py).

    A rate step first primes the sessions it joins mid-way (:func:`prime`, into ``step_dir/primer``, in a closed
    loop of ``prime_concurrency``; 0: not), then waits for an idle target: the warm-up starts from the steady state
    the mix stands for, not from a cold start.

    With ``certify`` the step's verdict is a certified one (``sequential.py``): the step stops at the first look
    that decides it, and its window ends where that look cut it; a pass needs a window of ``min_pass_s`` at least
    (default: the whole window). Without it, the point verdict of old."""
    from paasbench.load.runner import run_load_sync
    from paasbench.metrics.summary import summarize

    started = time.monotonic()
    available = len(trace)
    pool = trace
    trace, load = plan.schedule(trace, value)
    primed = prime(pool, trace, client, step_dir / "primer", prime_concurrency) \
        if plan.axis == "rate" and prime_concurrency > 0 else None
    idle_wait_s = prometheus.wait_idle(client.target, headers=client.target_headers, timeout_s=IDLE_WAIT_S)
    # the counters between two idle scrapes (the wait above, and up to IDLE_WAIT_S after the last response)
    watch = prometheus.Watch(client.target, client.target_headers, end_s=plan.total_s, settle_s=IDLE_WAIT_S)
    sweep_meta = {**meta, "sweep_load": {"axis": plan.axis, "value": value, "warmup_s": plan.warmup_s,
                                         "duration_s": plan.duration_s}}
    limits = per_request_limits(gates)
    saturation_limits = saturation_limits or SaturationLimits()
    monitor = None if certify is None else Sequential(
        trace, plan.window, plan.drain_s, gates, certify, saturation_limits=saturation_limits,
        min_pass_s=plan.duration_s if min_pass_s is None else min_pass_s, sends=SENDS[plan.axis], first_tokens=True)
    result = run_load_sync(trace, load, client, step_dir, meta=sweep_meta, goodput_limits=limits, watch=watch,
                           stop_when=monitor)
    records = list(read_records(result.records_path))
    if monitor is not None and monitor.cut_s is not None:   # decided early: the judged window ends at the cut
        plan = dataclasses.replace(plan, duration_s=monitor.cut_s - plan.warmup_s)
    traffic = sent_traffic_hit(trace, records, plan.window)
    # the runner's meta (model, client settings, versions) plus ours; its window has no end, ours does
    summary = summarize(records, window=plan.window, drain_s=plan.drain_s, goodput_limits=limits,
                        meta=result.summary.get("meta"), offered_hit=traffic)
    write_json_atomic(step_dir / "summary.json", summary)
    verdict = evaluate(gates, summary)
    saturation = detect(records, plan.window, drain_s=plan.drain_s, limits=saturation_limits, gates=gates)
    exhausted = _exhausted(plan, trace, available, result.summary.get("meta") or {})
    certified = None
    if monitor is not None:
        early = monitor.decided is not None
        if early:
            decision, terms = monitor.decided, monitor.terms
        else:   # ran its whole length: the last look, on everything, point terms final
            decision, terms, _ = monitor.judge(records, plan.window[1], final=True)
        certified = monitor.record(terms, decision, plan.window[1], early)
        # the overload a window this long holds by chance (horizon.py): a passing answer's lower end
        certified["horizon"] = unseen_overload(records, plan.window, certify.confidence) \
            if plan.axis == "rate" else None
    located = [r.server_timings.get("prefill_location") for r in records
               if r.ok and r.server_timings and plan.window[0] <= r.intended_send_s < plan.window[1]]
    located = [x for x in located if x]
    return {
        "load": {"kind": plan.axis, "value": value, "unit": AXIS_UNITS[plan.axis]},
        "dir": step_dir.name,
        "summary": summary,
        "verdict": verdict.to_dict(),
        "slo_passed": verdict.passed,
        "saturation": saturation,
        # what the schedule actually offered in the window (Poisson: the realized, not the nominal rate)
        "offered_rps": saturation["requests"] / plan.duration_s,
        "offered_input_tpm": summary.get("offered_input_tpm"),
        # every request of the trace was sent: a closed loop or a short trace file ran dry early
        "trace_exhausted": exhausted,
        # a load that was not fully offered cannot be claimed, however good it looked
        "passed": Outcome(verdict.passed, summary.get("input_tpm") or 0.0, saturation["saturated"], exhausted,
                          certified["verdict"] if certified else None).passed,
        # the certified verdict, its terms, looks and counts (sequential.py); None: point verdicts
        "certified": certified,
        "window_s": plan.duration_s,
        "server_metrics": _engine_view(result.server_metrics, records, plan, idle_wait_s),
        # traffic-side hit of the window's requests (as `trace inspect` computes it) and the whole trace's:
        # every step of a sweep offers the same mix (mix.py)
        "traffic_hit_ratio": traffic,
        "target_hit_ratio": trace.meta.get("target_hit_ratio"),
        # the mean output tokens the window's requests asked for and the workload's (mix.py draws the one to the
        # other): the decode side's share of the step's work
        "window_output_tokens": _asked_output(trace, plan.window),
        "target_output_tokens": trace.meta.get("target_output_tokens"),
        "lanes": trace.meta.get("lanes"),
        # the target's mean E2E the lanes were sized with (StepPlan.response_s; 0: the trace's turn gap alone)
        "response_s": plan.response_s if plan.axis == "rate" else None,
        # share of the window's requests the router prefilled on the prefill pool (reference server only)
        "remote_prefill_share": (sum(x == "remote" for x in located) / len(located)) if located else None,
        # the sessions' previous turns sent before the step (prime): requests, answered, seconds; None: not primed
        "primed": primed,
        "wall_s": time.monotonic() - started,
    }


def _asked_output(trace: Trace, window: tuple[float, float]) -> float | None:
    """The mean ``output_length`` of the requests ``trace`` plans inside ``window`` (seconds); None when none."""
    outs = [r.output_length for r in trace.requests if window[0] <= r.arrival_ms / 1e3 < window[1]]
    return round(float(np.mean(outs)), 1) if outs else None


def _engine_view(figures: dict[str, Any] | None, records: list[Any], plan: StepPlan,
                 idle_wait_s: float | None) -> dict[str, Any]:
    """The step's ``server_metrics``: the run's, with client vs engine over the step's own window
    (``metrics.versus``: the window's requests where the server times each one, else every request sent)."""
    out = {**(figures or {}), "idle_wait_s": idle_wait_s}
    if figures:
        out["versus"] = compare(records, figures, window=plan.window, drain_s=plan.drain_s)
    return out


def _exhausted(plan: StepPlan, sent: Trace, available: int, run_meta: dict[str, Any]) -> bool:
    if plan.axis == "rate":
        return len(sent) < int(sent.meta.get("planned") or 0)
    return int(run_meta.get("sent") or 0) >= available
