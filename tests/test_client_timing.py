"""Acceptance: measured TTFT and per-token ITL agree with the test server's timing, at concurrency 1 and 32,
with one and several tokens per chunk: against the server's own writes on the shared monotonic clock within
1 ms at concurrency 1; at concurrency 32, where a loaded box makes the CPU-bound client read every chunk tens of
ms late, within the exact bound the run's own per-request client-minus-wire errors allow — never a wide constant.

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
from paasbench.load.runner import LoadConfig, run_load_sync
from paasbench.metrics.records import read_records
from paasbench.metrics.summary import token_itls_ms
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
    # TTFT: the client's figure is the wire truth (at concurrency 32 the truth includes the single-threaded
    # server queueing 32 simultaneous requests; the client must report that, not hide it). Idle at concurrency 1
    # the client reads the first token within 1 ms of its write: a clock defect (timing it from the response
    # headers: -30 ms) fails there, and a first token stamped at a later chunk fails on every record below.
    # CPU-bound reading 32 streams on a box at load 15 it reads every chunk 5-90 ms late (and at times the first
    # tokens earlier than the rest): no constant separates that from a defect, so there its figures are held to
    # the exact bound their own per-request errors allow (the summary's figures, below). The median is monotone:
    # with every request within [min, max] of its own client-minus-wire error, the client's median lies within
    # the wire's median shifted by those extremes — a p90 or a mean taken for the median falls outside it.
    def within_own_error(client: np.ndarray, truth: np.ndarray, value: float) -> bool:
        err = client - truth
        return float(np.median(truth) + err.min()) - 1e-6 <= value <= float(np.median(truth) + err.max()) + 1e-6

    if concurrency == 1:
        assert abs(np.median(ttft - wire)) < 1.0, detail
    assert all(r.first_token_s == r.chunk_times_s[0] for r in all_recs)
    # the instrument itself: the configured TTFT is a floor for the server's first write (never early); how
    # late it wakes up on top is the machine's load, which the wire truth already carries
    assert server_late.min() > -0.01, detail
    assert TTFT_MS <= np.median(ttft), detail
    # per-token ITL against the server's own writes on the same clock, idle (at concurrency 32 a client starved
    # of CPU reads two chunks in one go, gaps 0 and 16 ms for two 8 ms ones; its TPOT is judged below): the mean
    # telescopes to first-to-last write, which checks the per-token attribution (per-chunk would be 16-32 ms),
    # the median against the same split of the server's chunk writes (write_clocks).
    if concurrency == 1:
        wire_tok = np.concatenate([token_itls_ms(t["write_clocks"], r.chunk_tokens) for r, t in zip(recs, T)])
        assert abs(itl.mean() - wire_itl.mean()) < 1.0, detail
        assert abs(np.median(itl) - np.median(wire_tok)) < 1.0, (float(np.median(wire_tok)), detail)
    # the summary's figures against the truth, over every request of the run, by the same rules
    assert s["itl_ms"]["count"] == sum(_out(i) - 1 for i in range(n))
    ttft_all = np.array([(r.first_token_s - r.intended_send_s) * 1e3 for r in all_recs])
    assert within_own_error(ttft_all, np.array([wire_ttft_ms(r, t0) for r in all_recs]), s["ttft_ms"]["p50"]), detail
    if concurrency == 1:
        wire_tok_all = np.concatenate([token_itls_ms(r.server_timings["write_clocks"], r.chunk_tokens)
                                       for r in all_recs])
        assert abs(s["itl_ms"]["p50"] - float(np.median(wire_tok_all))) < 1.0, detail
    # TPOT per request is (last - first token) / (tokens - 1), held to the same gap measured by the server's own
    # writes, per request, on the same clock: within 1 ms idle, within its own per-request errors under load
    wire_tpot = np.array([(r.server_timings["last_write_clock"] - r.server_timings["first_write_clock"]) * 1e3
                          / (r.completion_tokens - 1) for r in all_recs])
    client_tpot = np.array([(r.chunk_times_s[-1] - r.first_token_s) * 1e3 / (r.completion_tokens - 1) for r in all_recs])
    assert within_own_error(client_tpot, wire_tpot, s["tpot_ms"]["p50"]), detail
    if concurrency == 1:
        assert abs(s["tpot_ms"]["p50"] - float(np.median(wire_tpot))) < 1.0, detail
