"""inspect statistics against hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from paasbench.cli import main
from paasbench.trace.inspect import inspect_trace
from paasbench.trace.model import Trace, TraceRequest
from paasbench.trace.mooncake import read_trace

FIX = Path(__file__).parent / "fixtures" / "trace"


def test_small_fixture_by_hand() -> None:
    # block 4. hits: r1 0; r2 ids 1,2 seen -> 8; r3 id 1 seen -> 4; r4 0; r5 id 5 seen -> min(4, 3) = 3
    s = inspect_trace(read_trace(FIX / "small.jsonl", block_size=4))
    assert s["requests"] == 5
    assert s["duration_s"] == pytest.approx(4.0)
    assert s["rate_rps"] == pytest.approx(1.25)
    assert s["sessions"] == 1
    assert s["input_tokens_total"] == 30
    assert (s["input_tokens_p50"], s["input_tokens_max"], s["input_tokens_mean"]) == (6, 10, 6)
    assert s["input_tokens_p90"] == pytest.approx(9.2)   # numpy linear: 8 + 0.6 * (10 - 8)
    assert (s["output_tokens_p50"], s["output_tokens_mean"], s["output_tokens_max"]) == (6, 6, 10)
    assert s["hit_tokens_total"] == 15
    assert s["hit_ratio_tokens"] == pytest.approx(15 / 30)
    assert s["hit_ratio_request_mean"] == pytest.approx((0 + 0.8 + 4 / 6 + 0 + 1.0) / 5)
    assert s["hit_ratio_blocks"] == pytest.approx(4 / 9)
    assert s["cold_requests"] == 2
    assert s["share_ge_64k"] == 0.0


def test_long_context_shares_and_block_hits() -> None:
    bs = 512

    def req(t: float, n: int, first: int) -> TraceRequest:
        return TraceRequest(t, n, 1, list(range(first, first + -(-n // bs))))

    # three nested prefixes, one disjoint request just under 64K
    reqs = [req(0, 70_000, 0), req(1, 140_000, 0), req(2, 300_000, 0), req(3, 65_535, 10**6)]
    s = inspect_trace(Trace(reqs, block_size=bs))
    assert (s["share_ge_64k"], s["share_ge_128k"], s["share_ge_256k"]) == (0.75, 0.5, 0.25)
    # r2 hits r1's 136 full blocks + r1's partial id (ids are trusted as given): 137 blocks
    hit = 0 + min(137 * bs, 140_000) + min(274 * bs, 300_000) + 0
    assert s["hit_tokens_total"] == hit
    assert s["hit_ratio_tokens"] == pytest.approx(hit / sum(r.input_length for r in reqs))
    assert s["duration_s"] == pytest.approx(0.003)


def test_empty_and_single() -> None:
    s = inspect_trace(Trace([], block_size=4))
    assert s["requests"] == 0 and s["hit_ratio_tokens"] == 0.0 and s["rate_rps"] is None
    s = inspect_trace(Trace([TraceRequest(5, 3, 1, [7])], block_size=4))
    assert s["duration_s"] == 0.0 and s["rate_rps"] is None and s["hit_ratio_tokens"] == 0.0


def test_cli_json_and_table() -> None:
    res = CliRunner().invoke(main, ["trace", "inspect", str(FIX / "small.jsonl"), "--block-size", "4", "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    for key in ("requests", "duration_s", "hit_ratio_tokens", "hit_ratio_request_mean", "input_tokens_p50",
                "input_tokens_max", "rate_rps", "share_ge_256k"):
        assert key in s
    assert s["hit_ratio_tokens"] == pytest.approx(0.5)
    res = CliRunner().invoke(main, ["trace", "inspect", str(FIX / "small.jsonl"), "--block-size", "4"])
    assert res.exit_code == 0 and "50.0%" in res.output
