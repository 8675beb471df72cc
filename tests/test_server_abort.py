"""Clients that leave (docs/faults.md, "Clients that leave"), against real server processes over real HTTP.

A client that disconnects at any stage — queued behind another request, mid-prefill, while its KV is in
flight between a prefill and a decode worker, mid-stream — has its request aborted on every worker that
holds it: dropped from the scheduler's queues, its blocks freed, a prefill stopped at the next chunk
boundary, a KV transfer freed unread. Afterwards /metrics is back to idle (no request running or waiting
anywhere, KV usage at its pre-request level, no engine busy), a short request is not delayed by the
abandoned work, and SIGTERM stops the whole tree within seconds with no traceback and no shared-memory
segment left behind. Before the fix the server prefilled the whole prompt of a client that had left,
logged a traceback, kept ``paasbench_requests_running`` at 1 for good, and took ~60 s to stop.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Callable

import pytest
from proctree import Lines, cleanup, wait_gone

from server_client import get, stream

STOP_S = 10.0     # SIGTERM to exit: the server's 2 s handler grace + the workers' exit, with room for a busy box
SETTLE_S = 20.0   # bound on every wait for the server to reach a state


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 90000) for _ in range(n)]


def scrape(url: str) -> dict[str, float]:
    status, text = get(url, "/metrics")
    assert status == 200
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def until(url: str, pred: Callable[[dict[str, float]], bool], what: str,
          timeout_s: float = SETTLE_S) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        if pred(m):
            return m
        assert time.monotonic() < deadline, f"not reached within {timeout_s}s: {what}\n" + json.dumps(
            {k: v for k, v in m.items() if "requests" in k or "sequences" in k or "busy" in k or "kv_" in k}, indent=1)
        time.sleep(0.05)


def seqs(pool: str, state: str) -> str:
    return f'paasbench_pool_sequences{{pool="{pool}",state="{state}"}}'


def aborted(pool: str, stage: str) -> str:
    return f'paasbench_pool_requests_aborted_total{{pool="{pool}",stage="{stage}"}}'


def busy(pool: str) -> str:
    return f'paasbench_pool_busy_seconds_total{{pool="{pool}"}}'


class Client:
    """A streaming request on a raw socket, closed whenever the test says: a client that leaves."""

    def __init__(self, url: str, body: dict) -> None:
        u = urllib.parse.urlsplit(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=SETTLE_S)
        data = json.dumps({"stream": True, **body}).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(data) + data)
        self.t_send = time.monotonic()
        self.got = b""

    def read_tokens(self, n: int) -> None:
        """Read until ``n`` SSE events arrived (bounded by the socket timeout)."""
        while self.got.count(b"data: {") < n:
            chunk = self.sock.recv(65536)
            assert chunk, f"stream ended early: {self.got[-400:]!r}"
            self.got += chunk

    def read_all(self) -> bytes:
        while chunk := self.sock.recv(65536):
            self.got += chunk
        return self.got

    def leave(self) -> None:
        self.sock.close()


def start(args: list[str]) -> tuple[subprocess.Popen[str], Lines, str, dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "reference_server", "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = Lines(proc)
    procs = json.loads(lines.until(r"^PROCS (.*)$", 120).group(1))
    url = lines.until(r"^READY (\S+)", 60).group(1)
    return proc, lines, url, procs


def assert_idle(url: str, pools: tuple[str, ...], kv_before: dict[str, float]) -> None:
    """Nothing running or waiting anywhere, KV usage back where it was, and no engine computing."""
    m = until(url, lambda m: m["paasbench_requests_running"] == 0 and m["paasbench_requests_waiting"] == 0
              and all(m[seqs(p, s)] == 0 for p in pools for s in ("running", "waiting")),
              "router and workers idle")
    for p in pools:
        assert m[f'paasbench_kv_cache_usage_ratio{{pool="{p}"}}'] == kv_before[p], p
    b0, t0 = {p: m[busy(p)] for p in pools}, time.monotonic()
    time.sleep(1.0)
    m, dt = scrape(url), time.monotonic() - t0
    for p in pools:   # an engine still working on an abandoned request would add ~dt here
        assert m[busy(p)] - b0[p] < 0.1 * dt, f"{p} pool kept computing: {m[busy(p)] - b0[p]:.2f}s busy in {dt:.2f}s"


def stop_cleanly(proc: subprocess.Popen[str], lines: Lines, procs: dict) -> None:
    """SIGTERM to the router: the tree exits 0 within seconds, no traceback, no shared memory left."""
    pids = [p["pid"] for p in procs.values()]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=STOP_S + 5)
    took = time.monotonic() - t0
    assert wait_gone(pids, 5.0) == []
    log = "\n".join(lines.to_end(10.0))       # the resource tracker, last to go, would warn here
    assert code == 0, log
    assert took < STOP_S, f"SIGTERM took {took:.1f}s"
    assert "Traceback" not in log and "Error handling request" not in log, log
    assert "leaked shared_memory" not in log, log
    if Path("/dev/shm").is_dir():         # segment names carry their creator's pid (reference_server.kv)
        left = [n for n in os.listdir("/dev/shm") if any(f"_{pid}_" in n for pid in pids)]
        assert left == [], left


def test_colocated_client_leaves_queued_decoding_and_prefilling():
    """One mixed worker taking one sequence at a time, so a second request queues behind the first."""
    proc, lines, url, procs = start(["--mode", "colocated", "--workers", "1", "--max-num-seqs", "1",
                                     "--block-size", "64", "--prefill-chunk-tokens", "256"])
    try:
        kv_before = {"mixed": scrape(url)['paasbench_kv_cache_usage_ratio{pool="mixed"}']}
        # decoding: a long stream that has sent its first tokens
        a = Client(url, {"prompt": _ids(16, 1), "max_tokens": 2000, "ignore_eos": True})
        a.read_tokens(3)
        # queued: waiting on the worker behind it (max-num-seqs 1), no first token
        b = Client(url, {"prompt": _ids(16, 2), "max_tokens": 4})
        until(url, lambda m: m[seqs("mixed", "waiting")] == 1, "second request queued on the worker")
        b.leave()
        until(url, lambda m: m[aborted("mixed", "queued")] == 1, "queued request aborted")
        a.leave()
        until(url, lambda m: m[aborted("mixed", "decode")] == 1, "decoding request aborted")
        assert_idle(url, ("mixed",), kv_before)

        # prefilling: the client leaves once 1.5 s of prefill are done, long before the prompt's end (24K tokens: a
        # 6K prompt was wholly prefilled within 1.5 s on an idle 2-core box, so the test never saw it mid-prefill)
        b0 = scrape(url)[busy("mixed")]
        c = Client(url, {"prompt": _ids(24000, 3), "max_tokens": 4})
        m = until(url, lambda m: m[busy("mixed")] - b0 >= 1.5 and m["paasbench_requests_waiting"] == 1,
                  "long prompt part prefilled")
        consumed = m[busy("mixed")] - b0
        assert m[seqs("mixed", "running")] == 1 and m['paasbench_kv_cache_usage_ratio{pool="mixed"}'] > 0
        c.leave()
        until(url, lambda m: m[aborted("mixed", "prefill")] == 1, "prefilling request aborted")
        # the next request is not held up by the rest of the abandoned prefill (it would wait for all of it)
        short = stream(url, {"prompt": _ids(16, 4), "max_tokens": 2, "ignore_eos": True})
        assert short.done and short.ttft < consumed, (short.ttft, consumed)
        assert_idle(url, ("mixed",), kv_before)

        m = scrape(url)
        assert m['paasbench_requests_aborted_total{stage="waiting"}'] == 2     # queued, prefilling
        assert m['paasbench_requests_aborted_total{stage="streaming"}'] == 1   # decoding
        assert m['paasbench_requests_total{outcome="aborted"}'] == 3
        assert m['paasbench_requests_total{outcome="ok"}'] == 1

        # a client still waiting when the server stops gets a 503 at once instead of holding shutdown up
        live = Client(url, {"prompt": _ids(24000, 5), "max_tokens": 4})
        until(url, lambda m: m[seqs("mixed", "running")] == 1, "a live request prefilling")
        stop_cleanly(proc, lines, procs)
        assert live.read_all().startswith(b"HTTP/1.1 503"), live.got[:200]
    finally:
        cleanup(proc, [p["pid"] for p in procs.values()])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_disaggregated_client_leaves_prefilling_transferring_queued_and_decoding(transport):
    """A prefill and a decode worker; every request's KV is held 3 s in flight (kv_delay fault), so a client
    can leave while it is there. The prefill worker takes one sequence at a time, so a second remote prefill
    queues behind the first."""
    faults = json.dumps({"seed": 0, "rules": [{"kind": "kv_delay", "every": 1, "seconds": 3}]})
    proc, lines, url, procs = start(["--mode", "disaggregated", "--workers", "2", "--max-num-seqs", "1",
                                     "--block-size", "64", "--prefill-chunk-tokens", "256", "--routing", "threshold",
                                     "--remote-prefill-threshold", "300", "--kv-transport", transport,
                                     "--fault-spec", faults])
    pools = ("prefill", "decode")
    try:
        m0 = scrape(url)
        kv_before = {p: m0[f'paasbench_kv_cache_usage_ratio{{pool="{p}"}}'] for p in pools}

        # transferring: prefilled remotely, its KV in flight when the client leaves
        t = Client(url, {"prompt": _ids(400, 10), "max_tokens": 4})
        until(url, lambda m: m[seqs("prefill", "waiting")] == 1 and m[seqs("prefill", "running")] == 0,
              "KV in flight", timeout_s=60)
        t.leave()
        m = until(url, lambda m: m[aborted("prefill", "transfer")] == 1 and m[aborted("decode", "awaiting_kv")] == 1
                  and m["paasbench_kv_transfers_discarded_total"] == 1, "transfer aborted and freed")
        assert m["paasbench_kv_transfers_total"] == 0          # the decode worker never installed it

        # prefilling remotely, and queued on the prefill worker behind it
        b0 = scrape(url)[busy("prefill")]
        p = Client(url, {"prompt": _ids(24000, 11), "max_tokens": 4})
        until(url, lambda m: m[seqs("prefill", "running")] == 1 and m[busy("prefill")] - b0 >= 1.0,
              "long prompt prefilling remotely")
        q = Client(url, {"prompt": _ids(400, 12), "max_tokens": 4})
        until(url, lambda m: m[seqs("prefill", "waiting")] == 1, "a second remote prefill queued behind it")
        q.leave()
        until(url, lambda m: m[aborted("prefill", "queued")] == 1, "queued remote prefill aborted")
        p.leave()
        until(url, lambda m: m[aborted("prefill", "prefill")] == 1 and m[aborted("decode", "awaiting_kv")] == 3,
              "prefilling request aborted on both workers")

        # decoding on the decode worker (a short prompt prefilled there)
        d = Client(url, {"prompt": _ids(16, 13), "max_tokens": 2000, "ignore_eos": True})
        d.read_tokens(3)
        d.leave()
        until(url, lambda m: m[aborted("decode", "decode")] == 1, "decoding request aborted")
        assert_idle(url, pools, kv_before)

        # the server still serves a remote prefill end to end (the freed segment is reused)
        ok = stream(url, {"prompt": _ids(400, 14), "max_tokens": 4, "ignore_eos": True})
        assert ok.done and ok.timings["prefill_location"] == "remote" and ok.usage["completion_tokens"] == 4
        m = scrape(url)
        assert m['paasbench_requests_aborted_total{stage="waiting"}'] == 3
        assert m['paasbench_requests_aborted_total{stage="streaming"}'] == 1
        assert m["paasbench_kv_transfers_total"] == 1
        stop_cleanly(proc, lines, procs)
    finally:
        cleanup(proc, [p["pid"] for p in procs.values()])
