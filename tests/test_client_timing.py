"""Acceptance: measured TTFT and per-token ITL agree with the test server's configured values within 1 ms,
at concurrency 1 and 32, with one and several tokens per chunk.

The server runs in its own process; its timing model (tests/sse_server.py) makes the configured TTFT the
gap from receiving a request to its first token, and the configured ITL the gap between consecutive tokens
whatever the chunking. Medians (robust to a loaded machine's scheduling hiccups) and the ITL mean (which the
absolute server schedule makes exact) are compared; a client that attributed ITL per chunk instead of per
token, or measured from the wrong clock, is off by several ms and fails.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from sse_server import SSEServer, wire_ttft_ms

from paasbench.client import ClientConfig
from paasbench.metrics import summarize, token_itls_ms
from paasbench.records import read_records
from paasbench.runner import LoadConfig, run_load_sync
from paasbench.trace.model import Trace, TraceRequest

TTFT_MS, ITL_MS = 30.0, 8.0


def _out(i: int) -> int:
    """16..32 output tokens: closed-loop slots drift apart instead of streaming in lock-step."""
    return 16 + (i * 7) % 17


def _trace(n: int, prompt: str) -> Trace:
    return Trace([TraceRequest(arrival_ms=0.0, input_length=3, output_length=_out(i), hash_ids=[i], prompt=prompt)
                  for i in range(n)])


@pytest.fixture(scope="module")
def server():
    with SSEServer(ttft_ms=TTFT_MS, itl_ms=ITL_MS) as srv:
        yield srv


@pytest.mark.parametrize("concurrency,tokens_per_chunk,continuous", [
    (1, 1, False), (1, 4, False), (32, 1, False), (32, 3, True), (32, 4, False)])
def test_ttft_and_itl_agree_with_server(server, tmp_path, concurrency, tokens_per_chunk, continuous):
    n = 16 if concurrency == 1 else 128
    trace = _trace(n, f"[[sse tokens_per_chunk={tokens_per_chunk} timings=1]] measure me")
    load = LoadConfig(mode="concurrency", concurrency=concurrency, max_requests=n)
    client = ClientConfig(target=server.url, continuous_usage=continuous)
    result = run_load_sync(trace, load, client, tmp_path)
    recs = list(read_records(result.records_path))
    assert len(recs) == n and all(r.ok for r in recs), [r.error_message for r in recs if not r.ok]
    assert all(r.completion_tokens == _out(r.index) == sum(r.chunk_tokens) for r in recs)
    # the chunking really was what this case is about: 1 token first, then tokens_per_chunk per chunk
    assert recs[-1].chunk_tokens[:3] == [1, tokens_per_chunk, tokens_per_chunk]
    # exact counts come from cumulative usage; otherwise usage is apportioned by text length
    assert all(r.chunk_tokens_estimated == (tokens_per_chunk > 1 and not continuous) for r in recs)

    s = result.summary
    t0 = s["meta"]["t0_monotonic"]
    all_recs = recs
    # steady state: the first wave also opens its connections while 32 streams start at once
    recs = sorted(recs, key=lambda r: r.intended_send_s)[concurrency if concurrency > 1 else 0:]
    T = [r.server_timings for r in recs]
    ttft = np.array([(r.first_token_s - r.intended_send_s) * 1e3 for r in recs])
    # wire truth: from the intended send to the server writing the first token (shared monotonic clock);
    # on a loaded 2-core box the server itself wakes up late by up to ms, which is real latency, not the
    # client's error, so the client is judged against what the server actually did
    wire = np.array([wire_ttft_ms(r, t0) for r in recs])
    server_late = np.array([(t["first_write_clock"] - t["recv_clock"]) * 1e3 - TTFT_MS for t in T])
    itl = np.concatenate([token_itls_ms(r.chunk_times_s, r.chunk_tokens) for r in recs])
    wire_itl = np.array([(t["last_write_clock"] - t["first_write_clock"]) * 1e3 / (r.completion_tokens - 1)
                         for r, t in zip(recs, T)])
    detail = json.dumps({"ttft_p50": float(np.median(ttft)), "client_minus_wire_p50": float(np.median(ttft - wire)),
                         "server_late_p50": float(np.median(server_late)), "itl_p50": float(np.median(itl)),
                         "itl_mean": float(itl.mean()), "wire_itl_mean": float(wire_itl.mean()),
                         "lag": s["schedule_lag_ms"]})
    # TTFT: the client's figure is the wire truth within 1 ms (at concurrency 32 the truth includes the
    # single-threaded server queueing 32 simultaneous requests; the client must report that, not hide it)
    assert abs(np.median(ttft - wire)) < 1.0, detail
    # the instrument itself: the server's first write lags its configured TTFT only by its own wake-up on
    # a busy box (a few ms at worst); the client then reports configured + that, within 1 ms
    if concurrency == 1:
        assert np.median(server_late) < 5.0, detail
        assert abs(np.median(ttft) - (TTFT_MS + np.median(wire - TTFT_MS))) < 1.0, detail
    assert TTFT_MS <= np.median(ttft), detail
    # per-token ITL: configured gap (the server's schedule is absolute, so lateness does not accumulate)
    assert abs(np.median(itl) - ITL_MS) < 1.0, detail
    assert abs(itl.mean() - ITL_MS) < 1.0, detail
    assert abs(itl.mean() - wire_itl.mean()) < 1.0, detail
    # the summary's figures against the truth, not against its own formula: summarized over the steady-state
    # requests, its TTFT median is the wire median of the same requests (1.5 ms: a median of two distributions
    # moves more than the median of their pairwise gaps on a loaded box); its ITL and TPOT medians (over every
    # request) are the configured gap
    assert s["itl_ms"]["count"] == sum(_out(i) - 1 for i in range(n))
    steady = summarize(recs)
    assert abs(steady["ttft_ms"]["p50"] - float(np.median(wire))) < 1.5, (steady["ttft_ms"], detail)
    assert abs(s["itl_ms"]["p50"] - ITL_MS) < 1.0, detail
    assert abs(s["tpot_ms"]["p50"] - ITL_MS) < 1.0, detail
