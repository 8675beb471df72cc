"""The host KV store inside the disaggregated server (cpu engine: real KV bytes): a prefill worker
onboards blocks that only a decode worker computed, generated tokens' blocks are stored too, and the
answer is the same as when everything is computed."""

from __future__ import annotations

import random
import time

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


def test_prefill_worker_onboards_blocks_only_the_decode_worker_computed():
    args = ["--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", "--block-size", str(BS),
            "--prefill-chunk-tokens", "2048", "--routing", "threshold", "--remote-prefill-threshold", "1000",
            "--kv-store-gb", "0.05", "--trust-tenant-header"]
    p1 = _ids(600, 1)
    p2 = p1 + _ids(1500, 2)
    with EmbeddedServer(args, startup_timeout_s=90) as s:
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
    assert r2.timings["store_hit_tokens"] == 9 * BS
    assert r2.usage["prompt_tokens_details"]["cached_tokens"] == 9 * BS
    assert r3.usage["prompt_tokens_details"]["cached_tokens"] == 0 and r3.timings["store_hit_tokens"] == 0
    assert r2.text == r3.text                     # onboarded real KV gives the same greedy tokens
    assert metric(text, "paasbench_kv_store_hit_tokens_total") == 9 * BS
    assert metric(text, "paasbench_kv_store_get_blocks_total") == 9
    assert metric(text, "paasbench_kv_store_get_bytes_total") == 9 * metric(text, "paasbench_kv_store_block_bytes")
    assert metric(text, "paasbench_kv_store_corrupt_total") == 0
