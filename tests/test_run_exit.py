"""Exit codes of runs that measured nothing: an unreachable target, or a warm-up longer than the sending.

Exit 1 means the run failed and there is no verdict; 99 is kept for an SLO judged on measurements and breached.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner
from sse_server import SSEServer

from paasbench.cli import main


def _dead_url() -> str:
    """A local port with nothing listening: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _trace(path: Path, n: int, gap_ms: int) -> Path:
    path.write_text("".join(json.dumps({"timestamp": i * gap_ms, "input_length": 2, "output_length": 4,
                                        "hash_ids": [i], "prompt": "hello world"}) + "\n" for i in range(n)))
    return path


def _run(target: str, tmp_path: Path, *args: str, n: int = 4, gap_ms: int = 20):
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--target", target, "--trace", str(_trace(tmp_path / "t.jsonl", n, gap_ms)),
                                    "--out", str(out), "--no-live", "--model", "m", *args])
    return res, out


def test_unreachable_target_with_slo_is_a_failed_run_not_a_breach(tmp_path):
    res, out = _run(_dead_url(), tmp_path, "--slo", "p50(ttft) <= 5s")
    assert res.exit_code == 1, res.output
    assert "no request succeeded" in res.output and "connection" in res.output
    assert not (out / "verdict.json").exists()  # no verdict: nothing was measured to judge
    assert json.loads((out / "summary.json").read_text())["requests"]["failed"] == 4


def test_unreachable_target_in_a_sweep_exits_1(tmp_path):
    trace = _trace(tmp_path / "t.jsonl", 20, 100)
    res = CliRunner().invoke(main, ["sweep", "--target", _dead_url(), "--trace", str(trace), "--out",
                                    str(tmp_path / "sw"), "--slo", "p50(ttft) <= 5s", "--max-steps", "1",
                                    "--step-duration", "1", "--warmup", "0", "--context-buckets", "none",
                                    "--start", "2", "--model", "m"])
    assert res.exit_code == 1, res.output
    assert "no request succeeded" in res.output


@pytest.mark.parametrize("slo", [(), ("--slo", "p50(ttft) <= 5s")])
def test_warmup_longer_than_the_sending_measured_nothing_and_fails(tmp_path, slo):
    with SSEServer(ttft_ms=5, itl_ms=1) as srv:
        res, out = _run(srv.url, tmp_path, "--warmup", "2", *slo, n=4, gap_ms=50)
    assert res.exit_code == 1, res.output
    assert "nothing measured" in res.output and "--warmup" in res.output
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"]["total"] == 0 and s["meta"]["sent"] == 4  # the records are kept all the same
