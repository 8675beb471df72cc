"""Reference server, disaggregated 1 prefill + 1 decode worker on the cpu engine, over real HTTP:
SSE format, routing rule, prefix cache (repeat, 90% shared, other tenant), /metrics, chat, errors."""

from __future__ import annotations

import random

import pytest

from reference_server.launcher import EmbeddedServer
from server_client import get, metric, post, stream

BS = 512


@pytest.fixture(scope="module")
def server():
    args = ["--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", "--block-size", str(BS),
            "--prefill-chunk-tokens", "2048", "--remote-prefill-threshold", "1000", "--model-name", "ref",
            "--trust-tenant-header"]
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        yield s


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 90000) for _ in range(n)]


def test_streams_completion_with_usage_and_timings(server):
    r = stream(server.url, {"model": "ref", "prompt": "The capital of France is", "max_tokens": 7, "ignore_eos": True},
               headers={"x-request-id": "req-42"})
    assert r.status == 200 and r.done
    assert r.headers["x-request-id"] == "req-42"
    assert len(r.times) == 7                                   # one chunk per token (tokens_per_chunk=1)
    assert all(e["object"] == "text_completion" and e["id"] == "cmpl-req-42" for e in r.events)
    assert r.events[-1]["choices"] == [] and r.events[-2]["choices"][0]["finish_reason"] == "length"
    assert r.usage["completion_tokens"] == 7 and r.usage["prompt_tokens"] == 5
    assert r.usage["prompt_tokens_details"]["cached_tokens"] == 0
    t = r.timings
    for key in ("ttft_ms", "queue_ms", "prefill_ms", "kv_write_ms", "first_decode_ms", "decode_step_mean_ms",
                "prefill_location"):
        assert key in t, key
    assert t["prefill_location"] == "local"                  # 5 tokens: under the threshold
    # no transfer, so no transfer figures (a 0.0 would be averaged into the transfers' stage mean)
    assert "kv_transfer_ms" not in t and "transfer_bytes" not in t
    assert t["prefill_ms"] > 0 and t["decode_step_mean_ms"] > 0 and 0 < t["ttft_ms"] <= 1e3 * r.ttft


def test_prefix_cache_repeat_and_90_percent_shared(server):
    prompt = _ids(8000, 1)
    first = stream(server.url, {"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
    assert first.status == 200, first.body
    assert first.timings["prefill_location"] == "remote"      # 8000 uncached > 1000
    assert first.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert first.timings["transfer_bytes"] > 0 and first.timings["kv_recomputed"] is False
    assert first.timings["kv_transfer_ms"] > 0

    second = stream(server.url, {"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
    full_blocks = (8000 - 1) // BS * BS                       # 15 blocks: at least one token is computed
    assert second.usage["prompt_tokens_details"]["cached_tokens"] == full_blocks == 7680
    assert second.timings["prefill_location"] == "local"      # 320 uncached <= threshold
    assert second.timings["prefill_ms"] < first.timings["prefill_ms"] / 3
    assert second.text == first.text                          # reused KV gives the same greedy tokens

    shared = prompt[:7200] + _ids(800, 2)                     # 90% shared
    third = stream(server.url, {"prompt": shared, "max_tokens": 2, "ignore_eos": True})
    assert third.usage["prompt_tokens_details"]["cached_tokens"] == 7200 // BS * BS == 7168


def test_other_tenant_gets_no_hit(server):
    prompt = _ids(1600, 3)
    a1 = stream(server.url, {"prompt": prompt, "max_tokens": 2}, headers={"x-tenant": "alice"})
    a2 = stream(server.url, {"prompt": prompt, "max_tokens": 2}, headers={"x-tenant": "alice"})
    b = stream(server.url, {"prompt": prompt, "max_tokens": 2}, headers={"x-tenant": "bob"})
    assert a1.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert a2.usage["prompt_tokens_details"]["cached_tokens"] == 1536
    assert b.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert b.timings["prefill_location"] == "remote"          # no hit for bob: 1600 > threshold


def test_metrics_after_traffic(server):
    status, text = get(server.url, "/metrics")
    assert status == 200
    assert metric(text, "paasbench_kv_transfer_checksum_failures_total") == 0
    assert metric(text, "paasbench_kv_transfers_total") >= 3
    assert metric(text, "paasbench_prefix_cache_hits_total") >= 7680 + 7168 + 1536
    q = metric(text, "paasbench_prefix_cache_queries_total")
    assert metric(text, "paasbench_prefix_cache_hit_ratio") == pytest.approx(
        metric(text, "paasbench_prefix_cache_hits_total") / q)
    for pool in ("prefill", "decode"):
        assert 0 <= metric(text, "paasbench_pool_utilization", f'pool="{pool}"') <= 1
        assert metric(text, "paasbench_pool_busy_seconds_total", f'pool="{pool}"') > 0
        assert 0 <= metric(text, "paasbench_kv_cache_usage_ratio", f'pool="{pool}"') <= 1
    assert metric(text, "paasbench_stage_seconds_count", 'stage="kv_transfer"') >= 1
    assert metric(text, "paasbench_requests_running") == 0 and metric(text, "paasbench_requests_waiting") == 0
    assert metric(text, "paasbench_requests_routed_total", 'location="remote"') >= 2


def test_chat_and_non_streaming(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    r = stream(server.url, {"messages": msgs, "max_tokens": 5, "ignore_eos": True}, path="/v1/chat/completions")
    assert r.status == 200 and r.done
    assert r.events[0]["object"] == "chat.completion.chunk" and r.events[0]["choices"][0]["delta"]["role"] == "assistant"
    status, body, _ = post(server.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "ignore_eos": True})
    assert status == 200 and body["choices"][0]["message"]["content"] == r.text
    assert body["usage"]["completion_tokens"] == 5 and "paasbench_timings" in body
    status, body, _ = post(server.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_bad_requests(server):
    assert post(server.url, "/v1/completions", {"prompt": "x", "model": "nope"})[0] == 404
    assert post(server.url, "/v1/completions", {"prompt": {"a": 1}})[0] == 400
    assert post(server.url, "/v1/completions", {"prompt": [1, 2, 10**9]})[0] == 400
    assert post(server.url, "/v1/completions", {"prompt": "x", "max_tokens": 0})[0] == 400
    assert post(server.url, "/v1/chat/completions", {"messages": []})[0] == 400
    status, models = get(server.url, "/v1/models")
    assert status == 200 and '"ref"' in models


def test_continuous_usage_and_context_limit(server):
    r = stream(server.url, {"prompt": "count", "max_tokens": 4, "ignore_eos": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    per_chunk = [e["usage"]["completion_tokens"] for e in r.events if e.get("choices") and e["choices"][0]["finish_reason"] is None]
    assert per_chunk == [1, 2, 3, 4]
    _, models = get(server.url, "/v1/models")
    limit = __import__("json").loads(models)["data"][0]["max_model_len"]
    assert limit == 256 * 2**20 // (1024 * BS) * BS          # the decode worker's whole KV pool
    # its KV block size, so synthetic load sizes a shared prefix in whole blocks (paasbench.workload.target)
    from paasbench.client import ClientConfig
    from paasbench.workload.target import target_block_size

    assert __import__("json").loads(models)["data"][0]["block_size"] == BS
    assert target_block_size(ClientConfig(target=server.url)) == (BS, "its /v1/models")
    status, body, _ = post(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": limit})
    assert status == 400 and "context" in body["error"]["message"]


def test_sweep_scraper_reads_our_metrics(server):
    """The harness' Prometheus scraper (paasbench.sweep) understands this server's /metrics."""
    from paasbench.metrics.prometheus import scrape, step_figures

    before = scrape(server.url)
    prompt = _ids(1200, 9)
    for _ in range(2):
        stream(server.url, {"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    fig = step_figures(before, scrape(server.url))
    assert fig["family"] == "paasbench" and not fig["scrape_errors"]
    assert fig["prefix_hit_ratio"] == pytest.approx(1024 / 2400)      # second request: 2 of its blocks cached
    assert set(fig["pools"]) == {"prefill", "decode"}
    assert fig["stage_mean_ms"]["prefill"] > 0
    # the router's own TTFT and E2E histograms (acceptance -> first / last token), one observation a request
    assert fig["deltas"]["requests_finished"] == 2
    assert 0 < fig["means_ms"]["ttft"] <= fig["means_ms"]["e2e"]
    assert fig["means_ms"]["ttft"] >= fig["stage_mean_ms"]["prefill"]
