"""The routing rules (threshold and cost, on the twin's estimates) and the mode budget, without processes."""

from __future__ import annotations

import pytest

from reference_server.config import ServerConfig
from reference_server.engine import create_engine
from reference_server.routing import Backlog, Offer, PrefillEstimator, cost_rule, threshold_rule

BS = 512


def _threshold(prompt: int, hit: int, loads: list[int], threshold: int = 1000, bound: int = 2):
    prefill = [Offer(f"prefill-{i}", 0, inflight=n) for i, n in enumerate(loads)]
    return threshold_rule(prompt, Offer("decode-0", hit), prefill, threshold=threshold, queue_bound=bound)


def test_threshold_rule_remote_iff_uncached_exceeds_threshold():
    assert _threshold(1000, 0, [0, 0]).location == "local"          # exactly the threshold: local
    assert _threshold(1001, 0, [0, 0]).prefill == "prefill-0"        # above: remote
    assert _threshold(8000, 7680, [0, 0]).location == "local"       # 320 uncached after the prefix hit
    assert _threshold(8000, 6000, [0, 0]).location == "remote"      # 2000 uncached


def test_threshold_rule_queue_bound_and_least_loaded():
    assert _threshold(5000, 0, [2, 1]).prefill == "prefill-1"        # least loaded
    d = _threshold(5000, 0, [2, 2])
    assert (d.location, d.reason) == ("local", "queue-bound")       # every prefill queue full
    assert _threshold(5000, 0, [0], bound=0).location == "local"    # bound 0 disables remote prefill
    assert _threshold(10**6, 0, []).reason == "no-prefill-pool"


@pytest.fixture(scope="module")
def glm():
    """Estimates from the twin's roofline: GLM-5.2-FP8 on MTT S5000, 16K-token prefill chunks, real time."""
    eng = create_engine("sim", block_size=BS, num_blocks=1, model_profile="glm-5.2-fp8", device_profile="mtt-s5000")
    est = PrefillEstimator(eng, 16384)
    bw = eng.device.network_gbps * 1e9
    return est, BS * eng.shape.kv_bytes_per_token(), bw


def _cost(prompt: int, decode: Offer, prefill: list[Offer], glm, backlog=None):
    _, block_nbytes, bw = glm
    return cost_rule(prompt, decode, prefill, threshold=1000, queue_bound=2, backlog=backlog or {},
                     block_size=BS, block_nbytes=block_nbytes, wire_bytes_per_s=bw)


def test_398k_context_2k_turn_goes_to_the_cheaper_place(glm):
    """The issue's turn: 398K of context the decode worker holds, 2K new tokens, and a prefill worker
    that holds only 100K of it. The threshold rule sends it remote (1,664 uncached > 1000) to recompute
    ~298K tokens; the cost rule keeps it local. With the host store holding the context, the prefill
    worker would onboard it, and remote wins once local prefill would stall running streams."""
    est, block_nbytes, bw = glm
    n, d_hit, p_hit = 400_000, 778 * BS, 200 * BS
    d = Offer("decode-0", d_hit, prefill_s=est.prefill_s(n - d_hit, d_hit), running=0)
    p_cold = Offer("prefill-0", p_hit, prefill_s=est.prefill_s(n - p_hit, p_hit))
    assert _threshold(n, d_hit, [0]).location == "remote"
    c = _cost(n, d, [p_cold], glm)
    assert (c.location, c.reason) == ("local", "cheaper-local")
    assert c.local_s < 1.0 < 10.0 < c.remote_s                       # ~0.2 s here vs tens of seconds there
    assert c.timings()["route_local_est_ms"] == pytest.approx(1e3 * c.local_s)
    # The store holds the context: the prefill worker onboards [100K, 398K) and computes the same 1,664.
    onboard = (d_hit - p_hit) * block_nbytes / BS / bw
    p_store = Offer("prefill-0", p_hit, d_hit - p_hit, prefill_s=est.prefill_s(n - d_hit, d_hit), onboard_s=onboard)
    idle = _cost(n, d, [p_store], glm)
    assert idle.location == "local" and idle.remote_s > idle.local_s    # nothing to protect: onboarding is extra
    busy = _cost(n, Offer("decode-0", d_hit, prefill_s=d.prefill_s, running=8), [p_store], glm)
    assert (busy.location, busy.prefill) == ("remote", "prefill-0")     # 8 streams would stall behind it
    assert busy.remote_s < busy.local_s


def test_cost_rule_is_prefix_affine_and_counts_the_queue(glm):
    est = glm[0]
    n = 64 * 1024
    d = Offer("decode-0", 0, prefill_s=est.prefill_s(n, 0), running=4)
    cold = Offer("prefill-0", 0, prefill_s=est.prefill_s(n, 0))
    warm = Offer("prefill-1", 60 * 1024, prefill_s=est.prefill_s(n - 60 * 1024, 60 * 1024), inflight=1)
    assert _cost(n, d, [cold, warm], glm).prefill == "prefill-1"      # holds the prefix: least to compute
    busy = {"prefill-1": 100.0}                                        # ...unless its queue outweighs it
    assert _cost(n, d, [cold, warm], glm, backlog=busy).prefill == "prefill-0"
    assert _cost(n, Offer("decode-0", n - 512, prefill_s=0.01), [cold], glm).reason == "below-threshold"
    no_est = Offer("prefill-0", 0, prefill_s=None)
    assert _cost(n, d, [no_est], glm).reason == "no-estimate"          # a real engine before its first prefill


def test_backlog_drains_while_outstanding():
    b = Backlog()
    assert b.seconds() == 0.0
    b.add("a", 5.0)
    b.add("b", 3.0)
    assert 7.9 < b.seconds() <= 8.0
    b.done("a")
    assert b.seconds() <= 3.0
    b.done("b")
    assert b.seconds() == 0.0


def test_measured_estimate_for_real_engines():
    e = PrefillEstimator(object(), 512)
    assert e.prefill_s(1000, 0) is None and e.prefill_s(0, 0) == 0.0
    e.observe(0.5, 1000)
    assert e.prefill_s(2000, 0) == pytest.approx(1.0)


def test_sim_estimate_is_the_model_scaled(glm):
    est = glm[0]
    e = PrefillEstimator(est.engine, 16384, time_scale=0.01)
    modeled = e.prefill_s(8192, 0)
    assert modeled == pytest.approx(0.01 * est.prefill_s(8192, 0))
    for _ in range(40):                       # steps that took 3x their scaled modeled time: not learned
        e.observe(3 * 0.01 * 0.5, 4096)
    assert e.prefill_s(8192, 0) == modeled


def test_same_worker_budget_across_modes():
    assert ServerConfig(mode="colocated", workers=4).pools() == {"mixed": 4}
    assert ServerConfig(mode="chunked", workers=4).pools() == {"mixed": 4}
    assert ServerConfig(mode="disaggregated", workers=4).pools() == {"prefill": 2, "decode": 2}
    assert ServerConfig(mode="disaggregated", workers=3).pools() == {"prefill": 1, "decode": 2}
    assert ServerConfig(mode="disaggregated", workers=4, prefill_workers=3).pools() == {"prefill": 3, "decode": 1}
    assert ServerConfig(mode="disaggregated", prefill_workers=1, decode_workers=3).pools() == {"prefill": 1, "decode": 3}


def test_unknown_model_or_profile_exits_2_before_spawning():
    from click.testing import CliRunner

    from reference_server.cli import serve

    r = CliRunner().invoke(serve, ["--model", "huge", "--port", "0"])
    assert r.exit_code == 2 and "unknown model 'huge'; built in: tiny, small" in r.output
    # before: "unknown cpu model '/missing/path'" under --device cuda; a path is named as a missing checkpoint
    r = CliRunner().invoke(serve, ["--model", "/missing/path", "--backend", "torch", "--device", "cuda",
                                   "--port", "0"])
    assert r.exit_code == 2 and "no checkpoint directory at '/missing/path'" in r.output and "cpu" not in r.output
    r = CliRunner().invoke(serve, ["--engine", "sim", "--device-profile", "nope", "--port", "0"])
    assert r.exit_code == 2 and "nope" in r.output
