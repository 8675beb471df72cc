"""The host KV store inside the disaggregated server (cpu engine: real KV bytes): a prefill worker
onboards blocks that only a decode worker computed, generated tokens' blocks are stored too, and the
answer is the same as when everything is computed. And the cost rule's decision and inputs as the
server reports them (sim engine, modeled times not slept)."""

from __future__ import annotations

import random
import time
from typing import Callable

from reference_server.launcher import EmbeddedServer
from server_client import get, metric, stream

BS = 64


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 90000) for _ in range(n)]


def _wait_metric(url: str, name: str, at_least: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        v = metric(get(url, "/metrics")[1], name)
        if v >= at_least or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


ONBOARD_ARGS = ["--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", "--block-size", str(BS),
                "--prefill-chunk-tokens", "2048", "--routing", "threshold", "--remote-prefill-threshold", "1000",
                "--kv-store-gb", "0.05", "--trust-tenant-header"]


def test_prefill_worker_onboards_blocks_only_the_decode_worker_computed():
    check_onboarding(ONBOARD_ARGS)


def check_onboarding(args: list[str], join: Callable[[EmbeddedServer], None] | None = None) -> None:
    """Exact store hits and the same greedy answer as computing it all; shared with the Mooncake backend
    (tests/test_server_mooncake.py), where ``join`` adds a worker from another host before the requests."""
    p1 = _ids(600, 1)
    p2 = p1 + _ids(1500, 2)
    # workers that join later may include the only decode worker: until then /health says unavailable (503)
    with EmbeddedServer(args, startup_timeout_s=90, until="serving" if join is None else "answering") as s:
        if join is not None:
            join(s)
        # 1: 600 uncached tokens <= threshold: prefilled on the decode worker; 600 + 59 output tokens
        # with KV fill 10 blocks of 64 (the 10th holds generated tokens), and the decode worker puts them.
        r1 = stream(s.url, {"prompt": p1, "max_tokens": 60, "ignore_eos": True})
        assert r1.timings["prefill_location"] == "local"
        assert _wait_metric(s.url, "paasbench_kv_store_put_blocks_total", 10) == 10
        # 2: p1 + 1500 new tokens goes to the prefill worker, which never saw p1: it onboards p1's 9 full
        # blocks from the store (the 10th differs: p2 continues p1 with new tokens, not the output).
        r2 = stream(s.url, {"prompt": p2, "max_tokens": 8, "ignore_eos": True})
        # 3: the same prompt for another tenant: nothing cached anywhere, all computed.
        r3 = stream(s.url, {"prompt": p2, "max_tokens": 8, "ignore_eos": True}, headers={"x-tenant": "other"})
        _, text = get(s.url, "/metrics")
    assert r2.status == r3.status == 200
    assert r2.timings["prefill_location"] == "remote"
    assert (r1.timings["routing"], r1.timings["route_reason"]) == ("threshold", "below-threshold")
    assert r2.timings["route_reason"] == "above-threshold" and r2.timings["route_prefill_worker"] == "prefill-0"
    assert r2.timings["store_hit_tokens"] == 9 * BS
    assert r2.usage["prompt_tokens_details"]["cached_tokens"] == 9 * BS
    assert r3.usage["prompt_tokens_details"]["cached_tokens"] == 0 and r3.timings["store_hit_tokens"] == 0
    assert r2.text == r3.text                     # onboarded real KV gives the same greedy tokens
    assert metric(text, "paasbench_kv_store_hit_tokens_total") == 9 * BS
    assert metric(text, "paasbench_kv_store_get_blocks_total") == 9
    assert metric(text, "paasbench_kv_store_get_bytes_total") == 9 * metric(text, "paasbench_kv_store_block_bytes")
    assert metric(text, "paasbench_kv_store_corrupt_total") == 0


def test_cost_routing_reports_its_decision_and_inputs():
    args = ["--engine", "sim", "--model-profile", "glm-5.2-fp8", "--device-profile", "mtt-s5000",
            "--sim-time-scale", "0", "--prefill-workers", "2", "--decode-workers", "1"]
    a = _ids(64 * 1024, 5)
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        cold = stream(s.url, {"prompt": a, "max_tokens": 4, "ignore_eos": True})
        near = stream(s.url, {"prompt": a + _ids(600, 6), "max_tokens": 4, "ignore_eos": True})
        turn = stream(s.url, {"prompt": a + _ids(20_000, 7), "max_tokens": 4, "ignore_eos": True})
    c, t = cold.timings, turn.timings
    assert c["routing"] == "cost" and c["route_reason"] == "cheaper-remote" and c["prefill_location"] == "remote"
    # cold 64K: the decode worker's 512-token chunks cost more than the prefill worker's compute-bound ones
    assert c["route_remote_est_ms"] < c["route_local_est_ms"]
    assert c["route_decode_hit_tokens"] == 0 and c["route_prefill_hit_tokens"] == 0
    assert near.timings["route_reason"] == "below-threshold"
    # the next turn: prefix-affine, to the prefill worker that holds the 64K (the other one could only
    # onboard it from the store), and it reports what each side held
    assert t["route_prefill_worker"] == c["route_prefill_worker"]
    assert t["route_prefill_hit_tokens"] == 64 * 1024 and t["route_decode_hit_tokens"] >= 64 * 1024
    assert (t["prefill_location"] == "remote") == (t["route_remote_est_ms"] < t["route_local_est_ms"])
    assert turn.usage["prompt_tokens_details"]["cached_tokens"] == 64 * 1024


def test_cost_routing_leaves_out_a_prefill_worker_that_cannot_answer():
    import json
    import os
    import signal

    args = ["--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", "--block-size", str(BS),
            "--heartbeat-interval", "0.2", "--heartbeat-timeout", "30"]
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        pid = json.loads(get(s.url, "/health")[1])["workers"]["prefill-0"]["pid"]
        os.kill(pid, signal.SIGSTOP)              # alive, answers nothing; not declared down for 30 s
        try:
            t0 = time.monotonic()
            r = stream(s.url, {"prompt": _ids(3000, 8), "max_tokens": 2, "ignore_eos": True})
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
    assert r.status == 200 and r.timings["prefill_location"] == "local"
    assert r.timings["route_reason"] == "no-prefill-pool"    # its match timed out: not a candidate
    assert took < 10.0                                        # one match timeout, not the heartbeat's 30 s
