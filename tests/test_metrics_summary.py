"""Metric definitions on hand-built records, checked against numbers worked out by hand (docs/metrics.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paas_common.errors import InputError
from paasbench.metrics.records import RequestRecord
from paasbench.metrics.summary import latency_block, summarize, token_itls_ms


def rec(i, intended, actual, times, counts, end, *, kind=None, prompt=100, cached=None, timings=None):
    return RequestRecord(index=i, request_id=str(i), session_id=None, turn=None, intended_send_s=intended,
                         actual_send_s=actual, first_token_s=times[0] if times else None, end_s=end,
                         chunk_times_s=times, chunk_tokens=counts, input_tokens_sent=prompt, max_tokens=8,
                         prompt_tokens=prompt if kind is None else None,
                         completion_tokens=sum(counts) if kind is None else None, cached_tokens=cached,
                         error_kind=kind, server_timings=timings)


RECORDS = [
    # TTFT 101 ms (1 ms of it schedule lag), 4 tokens: ITL 10, then a 2-token chunk 20 ms later -> 10, 10
    rec(0, 0.0, 0.001, [0.101, 0.111, 0.131], [1, 1, 2], 0.131, cached=80,
        timings={"prefill_ms": 40.0, "prefill_location": "remote"}),
    # TTFT 50 ms, first chunk carries 2 tokens (ITL 0 for the second), then 10 ms
    rec(1, 1.0, 1.0, [1.05, 1.06], [2, 1], 1.07, cached=0, timings={"prefill_ms": 20.0, "prefill_location": "local"}),
    rec(2, 2.0, 2.0, [], [], 2.01, kind="http_status"),
    rec(3, 2.5, 2.6, [2.7], [1], 2.8, kind="idle_timeout"),
]


def test_per_token_itl_splits_chunk_gaps():
    assert token_itls_ms([0.101, 0.111, 0.131], [1, 1, 2]).tolist() == pytest.approx([10, 10, 10])
    assert token_itls_ms([1.05, 1.06], [2, 1]).tolist() == pytest.approx([0, 10])
    assert token_itls_ms([], []).size == 0


def test_summary_numbers():
    s = summarize(RECORDS, goodput_limits={"ttft_ms": 100.0})
    assert s["schema"] == "paasbench.summary/1"
    assert s["requests"]["total"] == 4 and s["requests"]["ok"] == 2 and s["requests"]["failed"] == 2
    assert s["ttft_ms"]["count"] == 2 and s["ttft_ms"]["mean"] == pytest.approx(75.5)
    assert s["ttft_ms"]["max"] == pytest.approx(101.0) and s["ttft_ms"]["p50"] == pytest.approx(75.5)
    assert s["e2e_ms"]["mean"] == pytest.approx((131 + 70) / 2)
    assert s["tpot_ms"]["mean"] == pytest.approx(10.0)  # (131-101)/3 and (70-50)/2
    assert s["itl_ms"]["count"] == 5 and s["itl_ms"]["mean"] == pytest.approx(8.0)  # 10,10,10,0,10
    assert s["schedule_lag_ms"]["count"] == 4 and s["schedule_lag_ms"]["max"] == pytest.approx(100.0)
    assert s["ttft_from_send_ms"]["max"] == pytest.approx(100.0)
    assert s["duration_s"] == pytest.approx(2.8)  # first intended send (0) -> last end (2.8)
    assert s["request_throughput_rps"] == pytest.approx(2 / 2.8)
    assert s["input_tokens"] == 200 and s["output_tokens"] == 7
    assert s["cached_tokens"] == 80 and s["uncached_tokens"] == 120
    assert s["prefix_hit_ratio"] == pytest.approx(0.4)
    assert s["input_tpm"] == pytest.approx(200 / 2.8 * 60) and s["output_tokens_per_s"] == pytest.approx(7 / 2.8)
    # goodput: request 0 misses TTFT 100 ms, failures are never good
    assert s["goodput_rps"] == pytest.approx(1 / 2.8) and s["goodput_ratio"] == pytest.approx(0.25)
    assert s["errors"] == {"http_status": 1, "idle_timeout": 1} and s["error_rate"] == pytest.approx(0.5)
    assert s["server_timings_ms"] == {"prefill_ms": 30.0, "prefill_location": {"local": 1, "remote": 1}}


def test_window_selects_by_intended_time_and_rates_by_completion():
    s = summarize(RECORDS, window=(0.5, 3.0))
    assert s["requests"]["total"] == 3 and s["requests"]["ok"] == 1  # intended 1.0, 2.0, 2.5
    assert s["ttft_ms"]["count"] == 1 and s["ttft_ms"]["p50"] == pytest.approx(50.0)
    assert s["duration_s"] == pytest.approx(2.5)
    assert s["request_throughput_rps"] == pytest.approx(1 / 2.5)  # only request 1 completed ok in [0.5, 3)


def test_goodput_limits_are_checked():
    with pytest.raises(InputError):
        summarize(RECORDS, goodput_limits={"ttft": 100.0})  # a misspelled metric must not pass silently
    s = summarize(RECORDS, goodput_limits={"tpot_ms": 9.0})
    assert s["goodput_ratio"] == 0.0


def test_empty_and_all_failed():
    s = summarize([])
    assert s["requests"]["total"] == 0 and s["ttft_ms"]["p50"] is None and s["error_rate"] is None
    s = summarize(RECORDS[2:])
    assert s["requests"]["ok"] == 0 and s["error_rate"] == 1.0 and s["prefix_hit_ratio"] is None


def test_latency_block_percentiles():
    b = latency_block(list(range(1, 1001)))
    assert b["p50"] == pytest.approx(500.5) and b["p99"] == pytest.approx(990.01)
    assert b["p999"] == pytest.approx(999.001) and b["count"] == 1000 and b["max"] == 1000


def test_window_rates_count_the_served_requests_of_the_window():
    """Issue #7 item 1: a window request is served when its first token comes by window end + drain, and
    then counts whole however late it ends; a warm-up request ending inside the window does not count."""
    recs = [
        rec(0, -1.0, -1.0, [1.0, 4.0], [1, 9], 5.0, prompt=500),      # warm-up: sent before the window
        rec(1, 2.0, 2.0, [5.0, 8.0], [1, 9], 8.0, prompt=100),        # inside, done inside, TTFT 3 s
        rec(2, 9.0, 9.0, [11.0, 20.0], [1, 9], 20.0, prompt=200),     # prefill done in the drain, ends late
        rec(3, 9.5, 9.5, [12.5, 13.0], [1, 9], 13.0, prompt=400),     # first token after the deadline
    ]
    s = summarize(recs, window=(0.0, 10.0), drain_s=2.0, goodput_limits={"ttft_ms": 2500.0})
    assert s["requests"]["total"] == 3 and s["duration_s"] == 10.0
    assert s["requests"]["ok"] == 3 and s["requests"]["served"] == 2       # request 3 succeeded, too late
    assert s["input_tokens"] == 300 and s["output_tokens"] == 20           # requests 1 and 2, whole
    assert s["input_tpm"] == pytest.approx(300 / 10 * 60)
    assert s["offered_input_tpm"] == pytest.approx(700 / 10 * 60)         # 1, 2 and 3 were asked for
    assert s["request_throughput_rps"] == pytest.approx(0.2)
    assert s["good_input_tpm"] == pytest.approx(200 / 10 * 60)            # request 1 missed the 2.5 s TTFT limit
    assert s["window"]["drain_s"] == 2.0
    assert summarize(recs, window=(0.0, 10.0), drain_s=4.0)["input_tokens"] == 700



def test_arrival_clock_is_what_the_records_say_and_unknown_where_they_do_not():
    # an old run's records (no count) are not credited with the kernel's stamps; a failed request that never
    # streamed counts neither way
    def seen(*counts):
        it = iter(counts)
        return summarize([replace(r, loop_stamped_reads=next(it)) if r.chunk_times_s else r
                          for r in RECORDS])["arrival_clock"]

    assert seen(None, None, None) == {"clock": None, "requests": 3, "requests_loop_stamped": 0,
                                      "loop_stamped_reads": 0}
    assert seen(0, 0, 0)["clock"] == "kernel receive timestamp"
    assert seen(0, 2, 0) == {"clock": "mixed", "requests": 3, "requests_loop_stamped": 1, "loop_stamped_reads": 2}
    assert seen(1, 1, 3)["clock"] == "event-loop read"
    assert seen(0, None, 0)["clock"] is None


def test_the_export_streams_in_batches_and_writes_what_a_frame_of_every_record_would(tmp_path):
    """records.parquet and records.csv, written a batch at a time (here 3 records), hold what they held when
    every record and its timelines were loaded at once: the same rows, columns, values and list columns."""
    import json

    import pandas as pd

    from paasbench.metrics.records import RecordWriter, read_records
    from paasbench.metrics.summary import export_tables, records_frame

    recs = [rec(i, i * 0.1, i * 0.1 + 0.001, [i * 0.1 + 0.05 + 0.01 * k for k in range(i % 4)], [1] * (i % 4),
                i * 0.1 + 0.2, kind="http_status" if i == 4 else None, timings={"ttft_ms": 1.5} if i % 3 else None)
            for i in range(10)]
    for r in recs:
        r.stamp_wall_clock(1_700_000_000_123_456_789)
    with RecordWriter(tmp_path / "records.jsonl") as w:
        for r in recs:
            w.write(r)
    export_tables(tmp_path / "records.jsonl", tmp_path, batch=3)
    back = list(read_records(tmp_path / "records.jsonl"))
    want = records_frame(back)
    got = pd.read_parquet(tmp_path / "records.parquet")
    assert list(got.columns) == [*want.columns, "intended_send_ns", "first_token_ns", "end_ns", "chunk_times_s",
                                 "chunk_tokens", "server_timings"]
    pd.testing.assert_frame_equal(got[list(want.columns)], want, check_dtype=False)
    assert [list(x) for x in got["chunk_times_s"]] == [r.chunk_times_s for r in back]
    assert [list(x) for x in got["chunk_tokens"]] == [r.chunk_tokens for r in back]
    assert list(got["end_ns"]) == [r.end_ns for r in back]          # epoch ns exact, not rounded
    assert [None if pd.isna(x) else json.loads(x) for x in got["server_timings"]] == [r.server_timings for r in back]
    csv = pd.read_csv(tmp_path / "records.csv")
    assert len(csv) == 10 and [json.loads(x) for x in csv["chunk_times_s"]] == [r.chunk_times_s for r in back]
    assert list(csv["intended_send_ns"]) == [r.intended_send_ns for r in back]


def test_prefix_hits_by_a_byte_per_id_agree_with_a_set():
    """The cache of ids seen is a byte per id where ids are small integers (it was a set of every id: +110 MB
    for a second at 1.6M ids); the hits are the set's, duplicates and out-of-order ids included."""
    import random

    import numpy as np

    from paasbench.trace.inspect import prefix_hits
    from paasbench.trace.model import Trace, TraceRequest

    def with_a_set(trace):
        seen, out = set(), []
        for r in trace.requests:
            k = 0
            for h in r.hash_ids:
                if h not in seen:
                    break
                k += 1
            out.append(k)
            seen.update(r.hash_ids[k:])
        return out

    rng = random.Random(3)
    for high in (40, 2**62):     # dense ids (the byte map), sparse ones (the set)
        for _ in range(50):
            reqs = [TraceRequest(arrival_ms=float(i), input_length=64, output_length=1,
                                 hash_ids=[rng.randrange(high) for _ in range(rng.randrange(6))]) for i in range(40)]
            trace = Trace(reqs, block_size=16)
            tokens, blocks = prefix_hits(trace)
            assert blocks.tolist() == with_a_set(trace)
            assert np.array_equal(tokens, np.minimum(blocks * 16, 64))
