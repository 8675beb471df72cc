"""`paasbench run --slo`: the verdict decides the exit code (0 / 99 / 2), and --abort-on-fail stops a run once a
gate is breached for good, keeping everything measured so far."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from sse_server import SSEServer

from paasbench.cli import main
from paasbench.load.abort import AbortMonitor
from paasbench.metrics.records import RequestRecord, read_records
from paasbench.metrics.slo import parse_gates


def _trace(path: Path, n: int, gap_ms: int) -> Path:
    lines = [json.dumps({"timestamp": i * gap_ms, "input_length": 2, "output_length": 4, "hash_ids": [i],
                         "prompt": "hello world"}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def server():
    with SSEServer(ttft_ms=30, itl_ms=1) as srv:
        yield srv


def _run(server, tmp_path: Path, n: int, *args: str):
    out = tmp_path / "out"
    trace = _trace(tmp_path / "t.jsonl", n, 20)
    res = CliRunner().invoke(main, ["run", "--target", server.url, "--trace", str(trace), "--out", str(out),
                                    "--no-live", *args])
    return res, out


def test_met_slo_exits_0_and_records_the_verdict(server, tmp_path):
    res, out = _run(server, tmp_path, 6, "--slo", "p50(ttft) <= 5s", "--slo", "error_rate <= 0%")
    assert res.exit_code == 0, res.output
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["passed"] and [g["passed"] for g in verdict["gates"]] == [True, True]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["slo"] == ["p50(ttft) <= 5s", "error_rate <= 0%"]  # the report judges by these
    assert summary["goodput_limits"] == {"ttft_ms": 5000.0}  # implied by the gate


@pytest.mark.parametrize("goodput,limit", [("ttft:100000", 5000.0), ("ttft:10", 10.0)])
def test_goodput_limits_tighten_the_slo_limits_never_loosen_them(server, tmp_path, goodput, limit):
    res, out = _run(server, tmp_path, 4, "--slo", "p50(ttft) <= 5s", "--goodput", goodput)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["goodput_limits"] == {"ttft_ms": limit}
    assert summary["goodput_ratio"] == (1.0 if limit > 1000 else 0.0)  # TTFT here is ~30 ms


def test_impossible_slo_exits_99(server, tmp_path):
    res, out = _run(server, tmp_path, 4, "--slo", "p50(ttft) <= 1ms")
    assert res.exit_code == 99, res.output
    verdict = json.loads((out / "verdict.json").read_text())
    assert not verdict["passed"] and verdict["gates"][0]["measured"] >= 30
    assert len(list(read_records(out / "records.jsonl"))) == 4  # judged after the full run


def test_malformed_slo_exits_2_before_sending(server, tmp_path):
    res, out = _run(server, tmp_path, 4, "--slo", "p50(ttfx) <= 1ms")
    assert res.exit_code == 2 and "ttfx" in res.output
    assert not (out / "records.jsonl").exists()


def test_abort_on_fail_stops_early_and_keeps_what_finished(server, tmp_path):
    res, out = _run(server, tmp_path, 60, "--slo", "max(ttft) <= 10ms", "--abort-on-fail")
    assert res.exit_code == 99, res.output
    recs = list(read_records(out / "records.jsonl"))
    assert 1 <= len(recs) < 30  # 60 planned over 1.2 s; the first 30 ms TTFT breaches the bound for good
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["aborted"].startswith("SLO breached for good: max(ttft)")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["aborted"] == verdict["aborted"] and not summary["meta"]["interrupted"]


def test_abort_on_fail_needs_gates(server, tmp_path):
    res, _ = _run(server, tmp_path, 2, "--abort-on-fail")
    assert res.exit_code == 2 and "--slo" in res.output


def _rec(i: int, *, ok: bool = True, ttft_s: float = 0.01) -> RequestRecord:
    return RequestRecord(index=i, request_id=str(i), session_id=None, turn=None, intended_send_s=1.0 + i,
                         actual_send_s=1.0 + i, first_token_s=1.0 + i + ttft_s, end_s=1.0 + i + 0.1,
                         chunk_times_s=[1.0 + i + ttft_s, 1.0 + i + 0.1], chunk_tokens=[1, 1],
                         completion_tokens=2, error_kind=None if ok else "http_status")


def test_monitor_error_rate_is_judged_against_the_planned_count():
    monitor = AbortMonitor(parse_gates("error_rate <= 10%"), planned_requests=20)
    assert monitor(_rec(0, ok=False)) is None  # 1/20 = 5%: more successes could still keep it under 10%
    assert monitor(_rec(1, ok=False)) is None  # 2/20 = 10%: not yet over
    assert monitor(_rec(2, ok=False)) is not None  # 3/20 = 15%: no later success can repair that


def test_monitor_does_not_judge_recoverable_stats_or_warmup():
    monitor = AbortMonitor(parse_gates("p50(ttft) <= 1ms, mean(e2e) <= 1ms"), planned_requests=None)
    assert all(monitor(_rec(i, ttft_s=0.5)) is None for i in range(5))  # percentiles/means can recover
    warm = AbortMonitor(parse_gates("max(ttft) <= 100ms"), planned_requests=None, warmup_s=3.0)
    assert warm(_rec(0, ttft_s=0.5)) is None  # intended at 1.0 s, inside the warm-up
    assert warm(_rec(5, ttft_s=0.5)) is not None
