"""The rate axis' schedule: Poisson arrivals conditioned on the step's exact count, carrying the same
workload mix at every load."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paasbench.sweep.source import Source
from paasbench.sweep.step import StepPlan, conditioned_poisson


def test_conditioned_poisson_offers_exactly_the_nominal_load():
    trace = Source.from_workload("ci-small", 0).trace_for(None, requests=3000)
    before = [r.arrival_ms for r in trace.requests[:5]]
    ids = {(r.session_id, r.turn): r for r in trace.requests}
    for rate, total in ((0.5, 18.0), (3.25, 18.0), (100.0, 20.0)):
        t = conditioned_poisson(trace, rate, total, seed=0)
        assert all(ids[(r.session_id, r.turn)].hash_ids == r.hash_ids for r in t.requests if r.session_id)
        every = np.array([r.arrival_ms for r in t.requests])
        ms = every[every < total * 1e3]                           # the send times; after them, the spares
        assert len(ms) == round(rate * total) == t.meta["planned"]
        assert ms[0] == 0 and np.all(np.diff(every) >= 0)
        lanes = max(1, int(np.ceil(rate * 1.51)))                 # ci-small's turn gap: 1.51 s
        assert 0 < len(every) - len(ms) <= 2 * lanes              # SPARE_PER_LANE per lane, as the trace holds
        sent = [id(r) for r in t.requests]
        assert len(set(sent)) == len(sent)                        # distinct requests of the trace
    gaps = np.diff(ms)
    assert 0.9 < gaps.std() / gaps.mean() < 1.1                   # exponential-like gaps: Poisson burstiness
    assert [r.arrival_ms for r in trace.requests[:5]] == before   # the cached trace is not modified


@pytest.mark.parametrize("seed", range(8))
def test_every_prefix_of_a_step_offers_its_nominal_load(seed):
    """A certified step stops at a look, so its window is a prefix of the step. Conditioned on the whole step's
    count only, seed 0 put 8-11% fewer arrivals than nominal into a white-paper 64K step's first 71 s of window at
    1.57, 2.22 and 3.14 req/s alike (common random numbers repeat the lull at every load), and the sweep named loads
    it had not offered. Every prefix of 60+ expected arrivals is now within 6% of nominal, whatever the seed."""
    from paasbench.sweep.step import conditioned_times

    warmup = 30.0
    for rate in (1.57, 2.22032, 3.14):
        times = conditioned_times(rate, 150.0, seed)
        assert len(times) == round(rate * 150.0)
        for end in (60.0, 70.88, 85.0, 100.88, 120.0, 150.0):
            expected = rate * (end - warmup)
            if expected < 60:
                continue
            got = int(((times >= warmup) & (times < end)).sum())
            assert abs(got / expected - 1) <= 0.06, (rate, end, got, expected)


@pytest.mark.parametrize("rate", [0.5, 1, 2, 4, 8, 16, 32])
def test_every_load_offers_the_workloads_mix(rate):
    """Issue #7 item 3: replaying the trace's first n requests gave a traffic-side hit of 61% at 0.5 req/s
    and 88-90% from 4 req/s on (ci-small, target 90%). Every load must be within 2 points of the target,
    and every measured turn must follow its session's previous turn."""
    from paasbench.sweep.mix import traffic_hit
    from paasbench.sweep.source import fresh_prefixes

    plan = StepPlan("rate", warmup_s=3, duration_s=15)
    trace = fresh_prefixes(Source.from_workload("ci-small", None).trace_for(None, requests=int(rate * 18 * 3) + 64), 2)
    sent, _ = plan.schedule(trace, rate)
    assert sum(r.arrival_ms < 18e3 for r in sent.requests) == round(rate * 18) and sent.meta["lanes"] >= 1
    window = [3 <= r.arrival_ms / 1e3 < 18 for r in sent.requests]
    assert abs(traffic_hit(sent.requests, window, sent.block_size) - 0.90) <= 0.02
    seen: dict[str, int] = {}
    for r, measured in zip(sent.requests, window):
        if measured and r.session_id in seen and r.turn:
            assert seen[r.session_id] == r.turn - 1                   # in order, none skipped
        seen[r.session_id] = r.turn


def test_rate_plan_uses_the_trace_schedule():
    trace = Source.from_workload("ci-small", 0).trace_for(None, requests=100)
    sent, load = StepPlan("rate", warmup_s=3, duration_s=15).schedule(trace, 2.0)
    assert load.mode == "trace" and load.duration_s == 18 and load.warmup_s == 3 and sent.meta["planned"] == 36
    _, conc = StepPlan("concurrency", warmup_s=1, duration_s=5).schedule(trace, 4.0)
    assert conc.mode == "concurrency" and conc.concurrency == 4
    _, sess = StepPlan("session-rate", warmup_s=1, duration_s=5).schedule(trace, 0.5)
    assert sess.mode == "sessions" and sess.rate == 0.5


def test_sample_hit_ratio_counts_only_what_the_step_sent():
    from paasbench.metrics.records import RequestRecord
    from paasbench.metrics.verify import sent_traffic_hit
    from paasbench.trace.model import Trace, TraceRequest

    # a session of three turns, 100-token blocks: turn 1 reuses turn 0's 2 blocks, turn 2 reuses 3
    trace = Trace([TraceRequest(0, 200, 1, [1, 2]), TraceRequest(1, 300, 1, [1, 2, 3]),
                   TraceRequest(2, 400, 1, [1, 2, 3, 4])], block_size=100)

    def sent(i, t):
        return RequestRecord(index=i, request_id=str(i), session_id="s", turn=i, intended_send_s=t,
                             actual_send_s=t, first_token_s=None, end_s=t + 1)

    recs = [sent(0, 0.5), sent(1, 2.0), sent(2, 3.0)]
    assert sent_traffic_hit(trace, recs, (1.0, 10.0)) == (200 + 300) / (300 + 400)  # turn 0 warmed the cache
    assert sent_traffic_hit(trace, recs[1:], (1.0, 10.0)) == 300 / 700                # turn 0 never sent
    assert sent_traffic_hit(trace, [], (1.0, 10.0)) is None


@pytest.mark.parametrize("device_rate", [39.18, 41.14])
def test_a_steps_trace_holds_the_sessions_its_lanes_enter(device_rate):
    """A plan's verification of ci-small on a twin 5x slow (3 s warm-up, 10 s window) gave its steps a trace of 42
    sessions; 21 lanes entered from a pool of 21, drawn whole, and the best of 80 draws sent a window whose hit was
    87.7% (39.18 req/s) and 87.9% (41.14) against the trace's 90.0%: the capacity was judged on 28% more prefill
    work than the traffic has. The step's trace now holds the sessions its lanes draw from."""
    from paasbench.plan.verify import stretched
    from paasbench.sweep.mix import sessions_needed, sessions_of, traffic_hit

    source, wall = Source.from_workload("ci-small", None), device_rate / 5
    plan = StepPlan("rate", warmup_s=3, duration_s=10).for_load(wall)
    trace = plan.trace(source, None, plan.trace_size(wall), device_rate)
    assert len(sessions_of(trace)) >= sessions_needed(trace, device_rate) > 42
    sent, _ = plan.schedule(stretched(trace, 5), wall)
    window = [3 <= r.arrival_ms / 1e3 < 13 for r in sent.requests]
    assert abs(traffic_hit(sent.requests, window, sent.block_size) - sent.meta["target_hit_ratio"]) <= 0.01


def test_a_plan_verification_warms_up_a_lane_per_session_in_flight(tmp_path):
    """The same verification's steps capped their lanes at the warm-up's 21 arrivals where 57 sessions are in flight
    at 39 device req/s (1.5 s turn gap): each session's turns came 2.7x closer than the traffic's, more of them before
    their predecessor's prefill had ended, and the hit fell with the load. The verifier now warms up long enough."""
    from paasbench.metrics.slo import parse_gates
    from paasbench.plan.verify import TwinVerifier, VerifySettings, stretched
    from paasbench.sweep.mix import turn_gap_s, sessions_of

    source, said = Source.from_workload("ci-small", None), []
    v = TwinVerifier(source, parse_gates(["p90(ttft) <= 300ms"]), VerifySettings(warmup_s=3, duration_s=10), 5.0,
                     tmp_path, log=said.append)
    gap = turn_gap_s(sessions_of(source.trace_for(None)))
    assert v.plan.warmup_s >= 1.2 * 5 * gap and "warm-up" in said[0]
    wall = 39.18 / 5
    plan = v.plan.for_load(wall)
    trace = plan.trace(source, None, plan.trace_size(wall), 39.18)
    sent, _ = plan.schedule(stretched(trace, 5), wall)
    # each in flight has its lane: rate x turn gap, rounded up (mix.lanes_wanted)
    assert sent.meta["lanes"] == math.ceil(39.18 * turn_gap_s(sessions_of(trace))) > 50


@pytest.mark.parametrize("bucket, rate", [(65536, 1.57), (262144, 0.28)])
def test_the_window_a_certified_step_stops_at_holds_the_workloads_hit(bucket, rate):
    """A certified step passes at a look once its configured window is covered: the first half of its stretched
    window. The steady mix was drawn for the hit of the whole window only, and the half a white-paper step passed
    on held 92.4% (64K, 1.57 req/s) or 82.2% (256K, 0.28 req/s) of a 90% workload. Every prefix a step may be
    judged on (half, three quarters, all) is now within 2 points of the trace's hit."""
    import dataclasses

    from paasbench.metrics.verify import traffic_hit
    from paasbench.sweep.source import fresh_prefixes

    source = Source.from_workload("white-paper-agent", 0)
    plan = StepPlan("rate", 30, 120, seed=0, window_requests=40).for_load(rate)
    plan = dataclasses.replace(plan, duration_s=plan.duration_s * 2)       # the sweep's certified stretch
    sent, _ = plan.schedule(fresh_prefixes(plan.trace(source, bucket, plan.trace_size(rate), rate), 1), rate)
    target = sent.meta["target_hit_ratio"]
    for part in (0.5, 0.75, 1.0):
        end = plan.warmup_s + part * plan.duration_s
        window = [plan.warmup_s <= r.arrival_ms / 1e3 < end for r in sent.requests]
        assert abs(traffic_hit(sent.requests, window, sent.block_size) - target) <= 0.02, part


def test_a_rate_step_primes_the_sessions_it_joins_mid_way(tmp_path):
    """A rate step's lanes enter their first session at a random turn (mix.py). Before, the sweep's step sent those
    turns cold: on a white-paper 64K step at 2.19 req/s the 33 entries put 2M uncached tokens into the 30 s warm-up,
    the lanes' turns then took 15-30 s, and the window's sends waited for them 4-8 s; the step failed as saturated
    where a 420 s run at 2.449 req/s held. Only the plan's verification primed its steps. Now every rate step first
    sends the previous turn of each session it joins mid-way (max_tokens 1, before anything measured), and says so."""
    from sse_server import SSEServer

    from paasbench.client import ClientConfig
    from paasbench.metrics.slo import parse_gates
    from paasbench.sweep.source import fresh_prefixes
    from paasbench.sweep.step import run_step

    rate = 8.0
    plan = StepPlan("rate", warmup_s=1.0, duration_s=2.0, seed=0)
    trace = fresh_prefixes(Source.from_workload("ci-small", 0).trace_for(None, requests=plan.trace_size(rate)), 1)
    sent, _ = plan.schedule(trace, rate)
    first = {}
    for r in sent.requests:
        first.setdefault(r.session_id, r)
    joined = [r for r in first.values() if r.session_id is not None and (r.turn or 0) > 0]
    assert joined                                   # the mix enters sessions mid-way
    with SSEServer(record=tmp_path / "bodies.jsonl", ttft_ms=5, itl_ms=1) as srv:
        client = ClientConfig(target=srv.url, model="sse-test", prompt_format="token-ids")
        entry = run_step(trace, plan, rate, client, tmp_path / "step", gates=parse_gates(["p50(ttft) <= 2s"]),
                         meta={})
        bodies = srv.take_bodies()
    primers = [b for b in bodies if b["max_tokens"] == 1]
    assert entry["primed"]["requests"] == len(primers) == len(joined)
    assert all(b["max_tokens"] == 1 for b in bodies[:len(primers)])     # sent before the step's first request
    assert entry["primed"]["ok"] == len(joined)


def test_a_rate_steps_sessions_in_flight_follow_the_targets_measured_answer_time(tmp_path):
    """A rate step plays ``rate x turn gap`` sessions (mix.py), each turn sent only once the one before it ended. Where
    the target answers slower than the trace's turn gap, those sessions cannot carry the rate: the runner gives the
    send times to sessions planned later, and near the plan's end none is left free, so the sends wait. On the
    white-paper twin at 64K the trace's 15 s gap against the twin's 20-23 s answers made a 420 s run at 2.884 req/s
    wait 1-13 s in its last 50 s, and a 60 s step at 2.76 req/s, its last third in that tail, fail as saturated on
    schedule lag, at a load the 420 s run held. Here ci-small's 1.5 s gap against a target answering in about 3 s:
    with the lanes from the gap the last third waits for its sessions; with the answer time an earlier step measured
    (``StepPlan.response_s``) the step plays enough sessions that one is free at a send time (``b + 2 sqrt(b)``,
    ``b = rate x E2E`` of them busy) and sends on time."""
    from sse_server import SSEServer

    from paasbench.client import ClientConfig
    from paasbench.metrics.records import read_records
    from paasbench.metrics.slo import parse_gates
    from paasbench.sweep.mix import lanes_wanted
    from paasbench.sweep.source import fresh_prefixes
    from paasbench.sweep.step import run_step

    rate, answer_s = 8.0, 3.0
    source = Source.from_workload("ci-small", 0)
    waited = {}
    # the answer takes 50 ms + its tokens at 122 ms (ci-small asks 24 on average: about 3 s); a primer asks 1
    with SSEServer(ttft_ms=50, itl_ms=(answer_s * 1e3 - 50) / 24) as srv:
        client = ClientConfig(target=srv.url, model="sse-test", prompt_format="token-ids")
        for response_s in (0.0, answer_s):
            plan = StepPlan("rate", warmup_s=5.0, duration_s=6.0, seed=0, response_s=response_s)
            trace = fresh_prefixes(plan.trace(source, None, plan.trace_size(rate), rate), int(response_s) + 1)
            step_dir = tmp_path / f"step-{response_s:g}"
            entry = run_step(trace, plan, rate, client, step_dir, gates=parse_gates(["p50(ttft) <= 2s"]), meta={})
            assert entry["lanes"] == min(lanes_wanted(trace, rate, response_s), round(rate * plan.warmup_s))
            assert entry["response_s"] == response_s
            # what the window asked of the decode side, beside the workload's (mix.py draws it within 2%)
            assert abs(entry["window_output_tokens"] / entry["target_output_tokens"] - 1) <= 0.02, entry
            last = [r for r in read_records(step_dir / "records.jsonl") if 9.0 <= r.intended_send_s < 11.0]
            waited[response_s] = sum((r.turn_wait_s or 0) > 0.25 for r in last) / len(last)
    assert lanes_wanted(trace, rate, answer_s) > 1.9 * lanes_wanted(trace, rate)   # the target is the slower one
    assert waited[0.0] >= 0.3, waited             # from the trace's gap: the plan's end waits for its sessions
    assert waited[answer_s] <= 0.1, waited        # from the measured answer: on time


def test_a_plan_verifications_runs_size_their_sessions_from_the_run_below(tmp_path, monkeypatch):
    """The plan's verification runs the sweep's step (paasbench/plan/verify.py), and its sessions in flight follow
    the target's answer time the same way: each run on a server plays the sessions its run at the closest load below
    measured (``StepPlan.response_s``), the first the trace's gap. Before, every run played the trace's gap."""
    import paasbench.sweep.step as step_mod
    from paasbench.metrics.slo import parse_gates
    from paasbench.plan.verify import TwinVerifier, VerifySettings

    planned: list[tuple[float, float]] = []

    def run_step(trace, plan, value, client, step_dir, **_):
        planned.append((value, plan.response_s))
        summary = {"e2e_ms": {"mean": 4000.0 * value}, "ttft_ms": {"p50": 100.0}, "requests": {"total": 10}}
        return {"summary": summary, "passed": True, "slo_passed": True, "saturation": {"saturated": False},
                "verdict": {"gates": [{"passed": True}]}}

    monkeypatch.setattr(step_mod, "run_step", run_step)
    v = TwinVerifier(Source.from_workload("ci-small", None), parse_gates(["p90(ttft) <= 300ms"]),
                     VerifySettings(warmup_s=3, duration_s=10), 5.0, tmp_path, log=lambda _: None)
    for rps in (10.0, 20.0, 15.0):
        v._run("decode", "http://127.0.0.1:9", rps)
    assert planned == [(2.0, 0.0), (4.0, 8.0), (3.0, 8.0)]     # wall req/s (scale 5), E2E s of the run below


def test_every_seeds_window_offers_the_workloads_decode_work():
    """Drawn for the hit alone, the window of a white-paper 64K step at 3 req/s held 459-538 mean output tokens on
    seeds 1-12 (the spec's mean: about 500), and the twin's roofline bound over those windows spanned 2.89-3.40
    req/s, against a truth of 2.95-3.0 held 30 minutes: each seed's sweep measured another workload (a certified
    seed-6 sweep failed its verification at 2.92, seed 7 verified 3.02). Each prefix a certified step may stop at
    now holds the spec's mean output within 2%, and the bounds over seeds 1-6's windows (a certified stretch, 240 s)
    lie within 2% of their median: 3.07-3.13 req/s, where they were 2.98-3.18."""
    import dataclasses

    from paasbench.sweep.embedded import server_args
    from paasbench.sweep.mix import OUTPUT_TOLERANCE
    from paasbench.sweep.source import fresh_prefixes
    from paasbench.trace.inspect import prefix_hits
    from paasbench.trace.model import Trace
    from reference_server.options import parse_flags, server_config
    from reference_server.sim.capacity import RequestWork, estimate_capacity

    rate, bounds = 3.0, []
    for seed in range(1, 7):
        source = Source.from_workload("white-paper-agent", seed)
        cfg = server_config(parse_flags(server_args(source.server)))
        plan = StepPlan("rate", 30, 120, seed=seed, window_requests=40).for_load(rate)
        plan = dataclasses.replace(plan, duration_s=plan.duration_s * 2, response_s=5.0)  # a certified stretch
        sent, _ = plan.schedule(fresh_prefixes(plan.trace(source, 65536, plan.trace_size(rate), rate), 1), rate)
        expected = sent.meta["target_output_tokens"]
        assert expected == source.trace_for(65536, requests=1).meta["output_tokens_expected"]
        assert 480 < expected < 520                                    # lognormal mean 500, rounded, clipped
        for part in (0.5, 0.75, 1.0):
            end = plan.warmup_s + part * plan.duration_s
            outs = [r.output_length for r in sent.requests if plan.warmup_s <= r.arrival_ms / 1e3 < end]
            assert abs(np.mean(outs) / expected - 1) <= OUTPUT_TOLERANCE, (seed, part, np.mean(outs))
        hits, _ = prefix_hits(Trace(sent.requests, block_size=sent.block_size))
        work = [RequestWork(r.input_length, int(h), r.output_length) for r, h in zip(sent.requests, hits)
                if plan.warmup_s <= r.arrival_ms / 1e3 < plan.total_s]
        bounds.append(estimate_capacity(cfg, work).rps)
    mid = float(np.median(bounds))
    assert all(abs(b / mid - 1) <= 0.02 for b in bounds), bounds


def test_a_certified_step_over_capacity_stops_on_the_first_tokens_it_has_not_had(tmp_path):
    """The run tells the certified step each first token as it comes (runner -> fleet -> Sequential.first_token), so a
    request still without one past the SLO's bound is a known miss. A server with a 0.25 s FIFO stage (4 req/s) at
    8 req/s, p50(ttft) <= 1 s, a 2 s warm-up: the window's first 4 s end at 6 s, and the request sent then has its first
    token after 12 s; the step stopped then when it waited for it. It now stops about 1 s after 6 s."""
    from sse_server import SSEServer

    from paasbench.client import ClientConfig
    from paasbench.metrics.records import read_records
    from paasbench.metrics.slo import parse_gates
    from paasbench.sweep.sequential import CertifyConfig
    from paasbench.sweep.source import fresh_prefixes
    from paasbench.sweep.step import run_step

    rate, source = 8.0, Source.from_workload("ci-small", 0)
    with SSEServer(serial_ms=250, ttft_ms=5, itl_ms=1) as srv:
        client = ClientConfig(target=srv.url, model="sse-test", prompt_format="token-ids")
        plan = StepPlan("rate", warmup_s=2.0, duration_s=10.0, seed=0)
        trace = fresh_prefixes(plan.trace(source, None, plan.trace_size(rate), rate), 1)
        entry = run_step(trace, plan, rate, client, tmp_path / "step",
                         gates=parse_gates(["p50(ttft) <= 1s", "error_rate <= 1%"]),   # a sweep's SLO
                         meta={}, certify=CertifyConfig(), prime_concurrency=0)
    cert = entry["certified"]
    assert cert["verdict"] == "fail" and cert["stopped_early"], cert
    assert cert["looked"][-1]["late"] > 0 and 4.0 <= cert["window_s"] < 5.0, cert["looked"]
    stopped = max(r.end_s for r in read_records(tmp_path / "step" / "records.jsonl"))
    assert stopped < 2.0 + 5.0 + 1.0 + 1.5, stopped      # the warm-up, the window judged, the bound, a margin
