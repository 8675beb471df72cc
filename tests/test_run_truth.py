"""`paasbench run` against a server whose truth is known: output-token counts, per-token ITL, schedule timing.

The fake server (tests/sse_server.py) streams exactly ``output_length`` tokens on an absolute schedule (first
token after ``ttft_ms``, then one every ``itl_ms``), so the right count, the right per-token gap and the right
intended send times are facts, whatever the server leaves out of its stream (usage), where it puts it (on the
last content event), or how long it keeps a finished body open.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from sse_server import SSEServer

from paas_common.tokenizer import encode
from paasbench.cli import main
from paasbench.metrics.records import read_records
from paasbench.metrics.summary import token_itls_ms

ITL_MS = 10.0
CJK = ("的鑫是淼在犇人骉大" * 5)[:45]  # 45 one-token events; cl100k splits the rare characters: 80 tokens


@pytest.fixture(scope="module")
def server():
    with SSEServer(ttft_ms=20, itl_ms=ITL_MS) as srv:
        yield srv


def _run(server, tmp_path: Path, prompts: list[tuple[str, int]] | list[dict], *args: str) -> tuple[dict, list]:
    """Run a trace of (prompt, output tokens) 400 ms apart, or of whole trace lines."""
    lines = [p if isinstance(p, dict) else {"timestamp": 400 * i, "input_length": 4, "output_length": p[1],
                                            "hash_ids": [i], "prompt": p[0]} for i, p in enumerate(prompts)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--target", server.url, "--trace", str(trace), "--out", str(out),
                                    "--no-live", *args])
    assert res.exit_code == 0, res.output
    recs = sorted(read_records(out / "records.jsonl"), key=lambda r: r.index)
    return json.loads((out / "summary.json").read_text()), recs


def test_no_usage_one_token_per_event_counts_events_not_client_tokens(server, tmp_path):
    assert len(encode(CJK)) == 80  # what the client tokenizer would say: 78% too many
    s, recs = _run(server, tmp_path, [(f"[[sse usage=0 texts={CJK}]] cjk", 45),
                                      ("[[sse usage=0 tokens_per_chunk=4]] packed", 21)])
    cjk, packed = recs
    assert cjk.ok and cjk.completion_tokens == 45 and cjk.chunk_tokens == [1] * 45
    assert cjk.output_tokens_method == "events"
    # TPOT follows: 44 gaps of ~10 ms, not (E2E - TTFT) / 79
    assert cjk.completion_tokens and abs(((cjk.end_s - cjk.first_token_s) * 1e3) / 44 - ITL_MS) < 3
    # several tokens per event and no usage: only then the tokenizer counts (" tok" is one cl100k token)
    assert packed.ok and packed.completion_tokens == 21 and packed.output_tokens_method == "tokenizer"
    assert packed.chunk_tokens == [1, 4, 4, 4, 4, 4]
    assert s["output_tokens_method"] == {"events": 1, "tokenizer": 1}
    assert s["output_tokens"] == 66


def test_totals_on_the_last_content_event_are_spread_over_the_events(server, tmp_path):
    # 4 tokens every 40 ms, the usage totals on the last content event, no separate usage chunk
    s, (rec,) = _run(server, tmp_path, [("[[sse tokens_per_chunk=4 usage_on_last=1]] packed", 21)])
    assert rec.ok and rec.completion_tokens == 21 and rec.output_tokens_method == "usage"
    assert rec.chunk_tokens == [1, 4, 4, 4, 4, 4]  # not [1, 1, 1, 1, 1, 16]
    itl = token_itls_ms(rec.chunk_times_s, rec.chunk_tokens)
    assert abs(float(np.median(itl)) - ITL_MS) < 2.0, itl
    assert abs(s["itl_ms"]["p50"] - ITL_MS) < 2.0, s["itl_ms"]


def test_closed_loop_lag_excludes_the_wait_for_the_body_end_after_done(server, tmp_path):
    # the server keeps each body open 1.5 s after [DONE]: the request is over at [DONE], so the slot's next
    # request is intended then and must go out then, not after the client gave up waiting for the body's end
    prompts = [("[[sse hold_after_done_ms=1500]] held", 4)] * 4
    s, recs = _run(server, tmp_path, prompts, "--concurrency", "1")
    assert all(r.ok for r in recs)
    # waiting for the body's end would put the 1.5 s hold into the lag and the next TTFT; the bounds are far
    # below that and far above a loaded 2-core box's wake-up lateness (a max over 4 requests, not a median)
    assert s["schedule_lag_ms"]["max"] < 500, s["schedule_lag_ms"]
    assert s["ttft_ms"]["max"] < 500, s["ttft_ms"]


def test_sessions_on_a_recorded_trace_do_not_add_the_response_time_to_the_arrival_gap(server, tmp_path):
    # a recorded (Mooncake-style) trace: turn 2 arrived 1 s after turn 1, and that gap already holds turn 1's
    # response time. Session a's turn 1 takes ~0.4 s (20 + 39 x 10 ms): turn 2 is due at 1.0 s, not 1.4 s.
    # Session b's turn 1 takes ~0.8 s, longer than its 0.5 s gap: turn 2 goes when turn 1 ends.
    def turn(t_ms: int, session: str, k: int, out: int) -> dict:
        return {"timestamp": t_ms, "input_length": 4, "output_length": out, "hash_ids": [t_ms],
                "session_id": session, "turn": k, "prompt": "turn"}

    s, recs = _run(server, tmp_path, [turn(0, "a", 0, 40), turn(100, "b", 0, 80), turn(600, "b", 1, 2),
                                      turn(1000, "a", 1, 2)], "--mode", "sessions")
    by = {(r.session_id, r.turn): r for r in recs}
    assert all(r.ok for r in recs)
    assert by["a", 1].intended_send_s == pytest.approx(1.0, abs=1e-6)
    assert by["b", 1].intended_send_s == pytest.approx(by["b", 0].end_s, abs=1e-6)


def test_records_carry_the_wall_clock_and_when_the_request_was_written(server, tmp_path):
    # a 4 MB prompt: the kernel takes its last byte milliseconds after its first, as the server reads it
    big = "[[sse timings=1]] " + "w " * 2_000_000
    s, recs = _run(server, tmp_path, [(big, 4), ("[[sse timings=1]] small", 4)])
    t0 = s["meta"]["t0_monotonic"]
    for r in recs:
        T = r.server_timings
        assert r.ok and r.request_write_start_s is not None and r.request_write_end_s is not None
        # written before the server had read it all; the server cannot finish reading before the last byte
        # (5 ms: on a loaded 2-core box the client can be descheduled between the send and its stamp)
        assert r.actual_send_s <= r.request_write_start_s <= r.request_write_end_s <= T["recv_clock"] - t0 + 0.005
        # TTFT from the last byte written holds the server's own TTFT (from its read of the last byte; the
        # server stamps its first write just after making it, so on a loaded box a few ms late) and is within
        # what intended-send TTFT holds
        server_ttft_ms = (T["first_write_clock"] - T["recv_clock"]) * 1e3
        assert server_ttft_ms - 5.0 <= (r.first_token_s - r.request_write_end_s) * 1e3
        assert r.first_token_s - r.request_write_end_s <= r.first_token_s - r.intended_send_s
        # wall clock, checked against the server's own clocks: it read time.time_ns() beside time.monotonic() when it
        # wrote the first token, so the wall-clock gap from its write to our first token must equal the monotonic
        # gap (same machine clock) — to the few ms a descheduling between two adjacent clock reads can cost here
        wall_gap_ns = r.first_token_ns - T["first_write_wall_ns"]
        mono_gap_ns = (r.first_token_s + t0 - T["first_write_clock"]) * 1e9
        assert abs(wall_gap_ns - mono_gap_ns) < 5e6, (wall_gap_ns, mono_gap_ns)
        assert r.intended_send_ns < T["first_write_wall_ns"] < r.first_token_ns + 5e6 and r.end_ns >= r.first_token_ns
    exported = pd.read_parquet(tmp_path / "out" / "records.parquet").sort_values("index")
    assert exported["first_token_ns"].tolist() == [r.first_token_ns for r in recs]  # exact, not float-rounded
    big_rec = recs[0]
    assert big_rec.request_write_end_s - big_rec.request_write_start_s > 0
    assert s["ttft_from_write_start_ms"]["count"] == s["ttft_from_write_end_ms"]["count"] == 2
    assert s["meta"]["t0_epoch_ns"] > 0
