"""KV corruption in transfer is detected and recomputed (same answer, counted in /metrics); API key on
public endpoints; worker control ports refuse unauthenticated peers; several tokens per SSE chunk;
the launcher leaves no process behind (a SIGKILLed router too: tests/test_process_lifetime.py)."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from proctree import wait_gone
from reference_server.launcher import EmbeddedServer
from server_client import get, metric, post, stream

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module", params=["shm", "tcp"])
def server(request):
    args = ["--mode", "disaggregated", "--workers", "2", "--block-size", "64", "--remote-prefill-threshold", "100",
            "--debug-corrupt-kv-every", "2", "--tokens-per-chunk", "4", "--api-key", KEY, "--kv-transport", request.param,
            "--trust-tenant-header"]
    s = EmbeddedServer(args, startup_timeout_s=90).start()
    yield s
    pids = [p["pid"] for p in s.procs.values()]
    assert len(pids) >= 3                                  # router + 2 workers (+ resource tracker)
    s.stop()
    assert wait_gone(pids, 3.0) == []                      # the whole tree is gone


def test_flipped_kv_byte_is_detected_and_recomputed(server):
    prompt = list(range(2000, 2600))
    body = {"prompt": prompt, "max_tokens": 9, "ignore_eos": True}
    ok = stream(server.url, body, headers={**AUTH, "x-tenant": "t1"})        # transfer 1: intact
    bad = stream(server.url, body, headers={**AUTH, "x-tenant": "t2"})       # transfer 2: one byte flipped
    assert ok.timings["prefill_location"] == bad.timings["prefill_location"] == "remote"
    assert ok.timings["kv_recomputed"] is False
    assert bad.timings["kv_recomputed"] is True and bad.timings["kv_error"] == "checksum"
    assert bad.text == ok.text and bad.usage["completion_tokens"] == 9        # the answer is still right
    _, text = get(server.url, "/metrics", headers=AUTH)
    assert metric(text, "paasbench_kv_transfer_checksum_failures_total") == 1
    assert metric(text, "paasbench_kv_transfers_total") == 2


def test_tokens_per_chunk(server):
    r = stream(server.url, {"prompt": "abc", "max_tokens": 9, "ignore_eos": True}, headers=AUTH)
    assert r.usage["completion_tokens"] == 9
    assert len(r.times) == 3          # first token alone, then 4 + 4


def test_api_key_required(server):
    assert stream(server.url, {"prompt": "abc", "max_tokens": 2}).status == 401
    assert post(server.url, "/v1/completions", {"prompt": "abc"}, {"Authorization": "Bearer wrong"})[0] == 401
    assert get(server.url, "/metrics")[0] == 401
    assert get(server.url, "/v1/models", AUTH)[0] == 200
    status, body = get(server.url, "/health")             # liveness probes stay open, but say no more
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, body = get(server.url, "/health", AUTH)
    assert status == 200 and set(json.loads(body)["workers"]) == {"prefill-0", "decode-0"}


def _frame(sock: socket.socket) -> dict:
    jlen, _ = struct.unpack("!II", sock.recv(8))
    return json.loads(sock.recv(jlen))


def test_worker_ports_refuse_unauthenticated(server):
    ports = [w["ports"][0] for name, w in server.procs.items() if w["ports"] and name != "router"]  # control ports
    assert len(ports) >= 2
    for port in ports:
        for first in ({"op": "hello", "token": "guess"},                   # the old clear-text hello
                      {"op": "hello", "mac": "00" * 32},                    # a wrong answer
                      {"op": "match", "id": 1, "tenant": "x"}):             # no hello at all
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                assert _frame(sock)["op"] == "challenge"
                msg = json.dumps(first).encode()
                sock.sendall(struct.pack("!II", len(msg), 0) + msg)
                assert _frame(sock) == {"op": "error", "error": "unauthorized"}
                sock.settimeout(5)
                assert sock.recv(1) == b""                 # and it hangs up


def test_fp8_kv_on_the_wire_quarters_the_bytes():
    with EmbeddedServer(["--mode", "disaggregated", "--workers", "2", "--block-size", "64",
                         "--remote-prefill-threshold", "100", "--kv-fp8"], startup_timeout_s=90) as s:
        r = stream(s.url, {"prompt": list(range(3000, 3600)), "max_tokens": 5, "ignore_eos": True})
    assert r.timings["prefill_location"] == "remote" and r.timings["kv_recomputed"] is False
    assert r.usage["completion_tokens"] == 5
    fp32_bytes = 10 * 64 * 1024                    # 10 blocks x 64 tokens x 1 KiB/token (tiny model, float32)
    assert fp32_bytes / 4 <= r.timings["transfer_bytes"] < fp32_bytes / 3.5    # e4m3 codes + per-block scales


def test_kv_pool_pressure_queues_instead_of_failing():
    # 40 blocks of 16 tokens; each request reserves ceil((200 + 50) / 16) = 16 blocks: two run at a time.
    budget_mb = 40 * 16 * 1024 / 2**20
    with EmbeddedServer(["--mode", "chunked", "--workers", "1", "--block-size", "16", "--kv-budget-mb", str(budget_mb)],
                        startup_timeout_s=90) as s:
        got: list = [None] * 4

        def one(i: int) -> None:
            got[i] = stream(s.url, {"prompt": list(range(500 + 300 * i, 700 + 300 * i)), "max_tokens": 50,
                                    "ignore_eos": True})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        _, text = get(s.url, "/metrics")
    assert [r.status for r in got] == [200] * 4
    assert all(r.usage["completion_tokens"] == 50 for r in got)
    assert max(r.timings["queue_ms"] for r in got) > min(r.timings["queue_ms"] for r in got) + 50   # someone waited
    assert metric(text, "paasbench_kv_evictions_total") > 0       # cached blocks of finished requests were reused
