"""`--duration` longer than the trace: a warning naming both figures, and `--loop` to fill the duration with
fresh prefixes per loop (loop k shares nothing with loop k-1; each loop keeps the trace's own sharing)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sse_server import SSEServer

from paasbench.cli import main
from paasbench.load.schedule import LoadConfig
from paasbench.metrics.records import read_records
from paasbench.trace.inspect import inspect_trace
from paasbench.trace.loop import loop_trace
from paasbench.trace.model import Trace
from paasbench.workload.synthetic import Synthetic, synthetic_trace


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with SSEServer(record=tmp_path_factory.mktemp("srv") / "bodies.jsonl", ttft_ms=1, itl_ms=0.5) as srv:
        yield srv


def _trace(path, n: int = 10, gap_ms: int = 100) -> str:
    """``n`` requests ``gap_ms`` apart (a 0.9 s trace); all share their first 16-token block."""
    path.write_text("".join(json.dumps({"timestamp": i * gap_ms, "input_length": 40, "output_length": 2,
                                        "hash_ids": [0, 1 + 2 * i, 2 + 2 * i]}) + "\n" for i in range(n)))
    return str(path)


def _run(server, tmp_path, *args: str):
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--target", server.url, "--out", str(out), "--no-live",
                                    "--block-size", "16", *args])
    return res, out


def test_duration_longer_than_the_trace_warns_with_both_figures(server, tmp_path):
    res, out = _run(server, tmp_path, "--trace", _trace(tmp_path / "t.jsonl"), "--duration", "3")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # the console wraps lines
    assert "--duration 3 s is longer than the trace" in text and "intended at 0.9 s" in text
    assert json.loads((out / "summary.json").read_text())["requests"]["total"] == 10


def test_closed_loop_that_runs_out_says_so_after_the_run(server, tmp_path):
    res, _ = _run(server, tmp_path, "--trace", _trace(tmp_path / "t.jsonl"), "--concurrency", "2",
                  "--duration", "2")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "the trace ran out: all 10 requests were sent" in text and "of the --duration 2 s" in text


def test_loop_fills_the_duration_with_fresh_prefixes(server, tmp_path):
    server.take_bodies()
    res, out = _run(server, tmp_path, "--trace", _trace(tmp_path / "t.jsonl"), "--duration", "2.5", "--loop")
    assert res.exit_code == 0, res.output
    assert "longer than the trace" not in res.output
    recs = sorted(read_records(out / "records.jsonl"), key=lambda r: r.intended_send_s)
    assert len(recs) == 25  # 1 s per loop (0.9 s span + the 0.1 s mean gap), cut at 2.5 s
    gaps = {round(b.intended_send_s - a.intended_send_s, 3) for a, b in zip(recs, recs[1:])}
    assert gaps == {0.1}  # the rate holds across the seams
    prompts = [b["prompt"] for b in server.take_bodies()]
    assert len(set(prompts)) == 25  # no loop replays an earlier loop's prompt
    firsts = {p[:60] for p in prompts}
    assert len(firsts) == 3  # the shared first block: one per loop, not one for all


def test_loops_keep_each_loops_hit_ratio_and_sessions_apart():
    tr = synthetic_trace(Synthetic(isl="256", osl="4", requests=50, prefix_hit=0.5), seed=0)
    load = LoadConfig(mode="poisson", rate=10.0, duration_s=14.0)
    looped = loop_trace(tr, load)
    assert looped.meta["loops"] == 3 and len(looped) == 150
    one = inspect_trace(tr)["hit_ratio_tokens"]
    for k in range(3):
        part = Trace(looped.requests[50 * k:50 * (k + 1)], block_size=tr.block_size)
        assert inspect_trace(part)["hit_ratio_tokens"] == pytest.approx(one)
    assert inspect_trace(Trace(list(looped.requests), block_size=tr.block_size))["hit_ratio_tokens"] == \
        pytest.approx(one, abs=0.002)
    assert len({r.session_id for r in looped.requests}) == 150
    assert looped.requests[-1].hash_ids[0] == 2 * (1 + max(max(r.hash_ids) for r in tr.requests))


def test_loop_needs_a_duration(server, tmp_path):
    res, _ = _run(server, tmp_path, "--trace", _trace(tmp_path / "t.jsonl"), "--loop")
    assert res.exit_code == 2 and "'--loop'" in res.output
