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
    # closed loop: the schedule is only known as it runs; 4 quick requests all go out within the 2 s warm-up
    with SSEServer(ttft_ms=5, itl_ms=1) as srv:
        res, out = _run(srv.url, tmp_path, "--warmup", "2", "--concurrency", "1", *slo, n=4, gap_ms=50)
    assert res.exit_code == 1, res.output
    assert "nothing measured" in res.output and "--warmup" in res.output
    assert not (out / "verdict.json").exists()
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"]["total"] == 0 and s["meta"]["sent"] == 4  # the records are kept all the same


def test_warmup_longer_than_an_open_loop_schedule_is_refused_before_sending(tmp_path):
    res, out = _run(_dead_url(), tmp_path, "--warmup", "2", n=4, gap_ms=50)  # the last send is at 0.15 s
    assert res.exit_code == 2, res.output
    assert "--warmup" in res.output and "the last at 0.15 s" in res.output
    assert not (out / "records.jsonl").exists()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_aborted_run_records_in_flight_requests_as_cancelled(tmp_path, workers):
    # request 0 is quick; 1 and 2 are still streaming (20 tokens, 100 ms apart: 2 s) when 3 fails at 0.5 s and
    # aborts the run; with 2 load workers, 0 and 2 go to one and 1 and 3 to the other: the abort stops both.
    # The margins (2 has streamed 0.3 s when 3 fails; the abort has 1.5 s to arrive before 1 would end) are
    # for a loaded 2-core box, where a worker process can send or hear the abort 100s of ms late.
    prompts = ["quick", "[[sse itl_ms=100]] slow", "[[sse itl_ms=100]] slow", "[[sse status=503]] fails"]
    sent_ms = [0, 100, 200, 500]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": sent_ms[i], "input_length": 2, "output_length": 20 if i else 2,
                                         "hash_ids": [i], "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out"
    with SSEServer(ttft_ms=5, itl_ms=1) as srv:
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--trace", str(trace), "--out", str(out),
                                        "--no-live", "--slo", "error_rate <= 0%", "--abort-on-fail",
                                        "--workers", workers])
    assert res.exit_code == 99, res.output
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"] == {"total": 4, "ok": 1, "failed": 3, "completed_in_window": 4, "served": 1}
    assert s["errors"] == {"cancelled": 2, "http_status": 1} and s["error_rate"] == 0.75
    from paasbench.metrics.records import read_records

    cancelled = [r for r in read_records(out / "records.jsonl") if r.error_kind == "cancelled"]
    assert sorted(r.index for r in cancelled) == [1, 2]
    for r in cancelled:  # what they had waited, and what had arrived, is kept
        assert r.status == 200 and r.first_token_s is not None and r.chunk_times_s
        assert r.end_s - r.intended_send_s >= (sent_ms[3] - sent_ms[r.index]) / 1e3 - 0.02
        assert "aborted after the request had waited" in r.error_message


def test_interrupted_run_records_streaming_and_slot_waiting_requests_as_cancelled(tmp_path):
    import asyncio

    from paasbench.client import ClientConfig
    from paasbench.load.runner import LoadConfig, run_load
    from paasbench.metrics.records import read_records
    from paasbench.trace.model import Trace, TraceRequest

    trace = Trace([TraceRequest(arrival_ms=0.0, input_length=2, output_length=40, hash_ids=[i],
                                prompt="[[sse itl_ms=100]] long") for i in range(3)])

    async def interrupt_after(srv: SSEServer, s: float) -> None:
        task = asyncio.create_task(run_load(trace, LoadConfig(mode="trace", max_concurrency=2),
                                            ClientConfig(target=srv.url, model="m"), tmp_path))
        # the interrupt comes s after both streams began, not s after the task was made: the run's clock
        # starts only after its launch (tokenizer, /v1/models), which took 0.3 s on a loaded box
        bodies: list[dict] = []
        for _ in range(500):
            bodies += srv.take_bodies()
            if len(bodies) >= 2:
                break
            await asyncio.sleep(0.01)
        assert len(bodies) == 2, bodies
        await asyncio.sleep(s)
        task.cancel()  # what Ctrl-C does to the run
        with pytest.raises(asyncio.CancelledError):
            await task

    with SSEServer(record=tmp_path / "bodies.jsonl", ttft_ms=5, itl_ms=1) as srv:
        asyncio.run(interrupt_after(srv, 0.5))
    recs = sorted(read_records(tmp_path / "records.jsonl"), key=lambda r: r.index)
    assert [r.error_kind for r in recs] == ["cancelled"] * 3
    streaming, waiting = [r for r in recs if r.actual_send_s is not None], [r for r in recs if r.actual_send_s is None]
    assert len(streaming) == 2 and len(waiting) == 1  # the third waited for a --max-concurrency slot
    # ended at the interrupt (0.5 s after both streams began), not at the intended send nor the 4 s stream
    # end; the upper slack is for a loaded 2-core box starting the streams and delivering the cancel late. This
    # test failed once in a full run beside three sweeps (load average 5-9), its assertion not kept; a 1.5 s bound
    # on a 2 s stream was its one timing margin, now 3 s on a 4 s stream
    assert all(0.5 <= r.end_s - r.intended_send_s < 3.0 for r in recs)
    assert "interrupted" in waiting[0].error_message and "concurrency slot" in waiting[0].error_message
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["meta"]["interrupted"] and s["errors"] == {"cancelled": 3} and s["error_rate"] == 1.0


def test_a_run_whose_every_request_was_refused_says_what_the_server_said(tmp_path):
    # before: "no request succeeded (http_status 4)", the count alone; CI lost a failure's cause that way
    with SSEServer(status=503) as srv:
        res, out = _run(srv.url, tmp_path)
    assert res.exit_code == 1, res.output
    said = json.loads((out / "summary.json").read_text())["error_messages"]
    assert said == {"http_status": {"message": said["http_status"]["message"], "count": 4}}
    assert "503" in said["http_status"]["message"] and "injected HTTP 503" in said["http_status"]["message"]
    assert "4 of them: HTTP 503" in " ".join(res.output.split())


def test_an_interrupted_run_records_a_send_time_that_waited_for_a_previous_turn_as_cancelled(tmp_path):
    """Turn 1 of a session is due 10 ms after turn 0, whose 2 s stream is still going: its send time waits for it
    (load.schedule.Turns). Interrupted then, the run recorded turn 0 only, and the request it had meant to send was
    lost from the summary; it is a failed request of the run, as one waiting for a --max-concurrency slot is."""
    import asyncio

    from paasbench.client import ClientConfig
    from paasbench.load.runner import LoadConfig, run_load
    from paasbench.metrics.records import read_records
    from paasbench.trace.model import Trace, TraceRequest

    trace = Trace([TraceRequest(arrival_ms=10.0 * t, input_length=2, output_length=40, hash_ids=[t],
                                session_id="a", turn=t, prompt="[[sse itl_ms=50]] long") for t in range(2)])

    async def interrupt_after(srv: SSEServer, s: float) -> None:
        task = asyncio.create_task(run_load(trace, LoadConfig(mode="trace"), ClientConfig(target=srv.url, model="m"),
                                            tmp_path))
        bodies: list[dict] = []
        for _ in range(500):
            bodies += srv.take_bodies()
            if bodies:
                break
            await asyncio.sleep(0.01)
        assert len(bodies) == 1, bodies
        await asyncio.sleep(s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with SSEServer(record=tmp_path / "bodies.jsonl", ttft_ms=5, itl_ms=1) as srv:
        asyncio.run(interrupt_after(srv, 0.5))
    recs = sorted(read_records(tmp_path / "records.jsonl"), key=lambda r: r.turn)
    assert [(r.turn, r.error_kind) for r in recs] == [(0, "cancelled"), (1, "cancelled")]
    waited = recs[1]
    assert waited.actual_send_s is None and waited.intended_send_s == pytest.approx(0.01)
    assert 0.5 <= waited.turn_wait_s < 1.5 and "previous turn" in waited.error_message
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["errors"] == {"cancelled": 2}
