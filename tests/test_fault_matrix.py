"""The fault matrix (docs/faults.md): every fault the reference server can inject, one test each.

One real server (``--fault-spec``, split prefill/decode, fast heartbeats) whose plan each test replaces
through ``POST /admin/faults``. Harness cells replay a small trace with ``paasbench``'s runner, every
second request faulted: the faulted ones carry the right error kind, the healthy ones around them
succeed, the errors count against the SLO (error_rate, goodput), and the run ends in bounded time.
Server cells check what the server does about its own faults: a corrupt or mis-ranged KV transfer is
refused for that request alone and recomputed (the same tokens as a healthy run), a killed or paused
worker fails its request over or ends it with a clear error and ``[DONE]``.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from paasbench.client import ClientConfig
from paasbench.load.runner import LoadConfig, run_load_sync
from paasbench.metrics.records import read_records
from paasbench.trace.model import Trace, TraceRequest
from reference_server.launcher import EmbeddedServer
from server_client import get, post, stream

HEARTBEAT_S = 0.2 + 1.0          # interval + timeout: how fast a dead or stopped worker is declared down


@pytest.fixture(scope="module")
def server():
    # two decode workers: while one restarts after a kill, the run goes on on the other
    args = ["--mode", "disaggregated", "--workers", "3", "--prefill-workers", "1", "--block-size", "16", "--routing", "threshold",
            "--remote-prefill-threshold", "100", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1",
            "--request-timeout", "20", "--trust-tenant-header", "--fault-spec", '{"rules": []}']
    with EmbeddedServer(args, startup_timeout_s=120) as s:
        yield s


def set_plan(url: str, *rules: dict[str, Any]) -> None:
    status, body, _ = post(url, "/admin/faults", {"seed": 0, "rules": list(rules)})
    assert status == 200 and body["requests_seen"] == 0, body


def wait_ok(url: str, timeout_s: float = 60.0) -> None:
    """Every worker up (a killed one restarted) before the next cell."""
    deadline = time.monotonic() + timeout_s
    while json.loads(get(url, "/health")[1])["status"] != "ok":
        assert time.monotonic() < deadline, get(url, "/health")
        time.sleep(0.1)


def prompt(i: int, n: int = 300) -> list[int]:
    """A prompt of its own (no prefix shared with any other test's), long enough to prefill remotely."""
    return [(1000 + 37 * i + 11 * k) % 4000 + 5 for k in range(n)]


# ---- harness cells: paasbench's runner against the faulty server ---------------------------------------

CLIENT = dict(first_byte_timeout_s=10.0, idle_timeout_s=3.0, total_timeout_s=30.0, model="paasbench-tiny")
N = 4      # requests per cell; the plan faults every 2nd: requests 1 and 3 (0-based)


def run_cell(url: str, tmp_path, rule: dict[str, Any], tag: int, *, stop_after: int | None = None,
             limits: dict[str, float] | None = None, gap_ms: float = 400.0):
    wait_ok(url)
    set_plan(url, {"every": 2, **rule})
    trace = Trace([TraceRequest(arrival_ms=gap_ms * i, input_length=300, output_length=8, hash_ids=[tag, i],
                                prompt=" ".join(map(str, prompt(100 * tag + i, 150)))) for i in range(N)])
    stop = None
    if stop_after is not None:
        seen: list[int] = []
        stop = lambda rec: (seen.append(1), "enough" if len(seen) >= stop_after else None)[1]  # noqa: E731
    t0 = time.monotonic()
    res = run_load_sync(trace, LoadConfig(mode="trace"), ClientConfig(target=url, **CLIENT), tmp_path,
                        goodput_limits=limits or {"ttft_ms": 10_000}, stop_when=stop)
    elapsed = time.monotonic() - t0
    set_plan(url)
    recs = {r.index: r for r in read_records(res.records_path)}
    return res.summary, recs, elapsed


HARNESS_CELLS = [  # (rule, the faulted requests' error kind, their HTTP status)
    ({"kind": "http_500"}, "http_status", 500),
    ({"kind": "http_503"}, "http_status", 503),
    ({"kind": "http_429", "seconds": 2}, "http_status", 429),
    ({"kind": "reset", "after_tokens": 2}, "connection", 200),
    ({"kind": "stall", "after_tokens": 2, "seconds": 30}, "idle_timeout", 200),
    ({"kind": "malformed_sse", "after_tokens": 1}, "protocol", 200),
    ({"kind": "truncated_json", "after_tokens": 1}, "protocol", 200),
    ({"kind": "zero_tokens"}, "zero_tokens", 200),
    # an error event, then [DONE]; paused past the heartbeat timeout, the worker is declared down
    ({"kind": "kill_decode", "after_tokens": 1}, "protocol", 200),
    ({"kind": "pause_decode", "after_tokens": 1, "seconds": 5}, "protocol", 200),
]


@pytest.mark.parametrize("rule, kind, status", HARNESS_CELLS, ids=[c[0]["kind"] for c in HARNESS_CELLS])
def test_harness_cell(server, tmp_path, rule, kind, status):
    tag = [c[0]["kind"] for c in HARNESS_CELLS].index(rule["kind"]) + 1
    # a request sent to a worker before it is killed or paused is lost with it: space them out
    gap = 1500.0 if rule["kind"].endswith("_decode") else 400.0
    summary, recs, elapsed = run_cell(server.url, tmp_path, rule, tag, gap_ms=gap)
    assert elapsed < 15, elapsed                                   # bounded: no fault hangs the run
    assert sorted(recs) == list(range(N))                          # every request recorded
    for i, r in recs.items():
        if i % 2:
            assert r.error_kind == kind, (i, r.error_kind, r.error_message)
            assert r.status == status and r.end_s is not None
        else:
            assert r.error_kind is None and r.completion_tokens == 8, (i, r.error_kind, r.error_message)
    assert summary["requests"]["failed"] == 2 and summary["errors"] == {kind: 2}
    assert summary["error_rate"] == pytest.approx(0.5)            # failures count against the SLO
    assert summary["goodput_ratio"] == pytest.approx(0.5)
    if rule["kind"] == "http_429":
        assert "injected fault: HTTP 429" in recs[1].error_message
    if rule["kind"] in ("kill_decode", "pause_decode"):
        assert "lost" in recs[1].error_message or "down" in recs[1].error_message, recs[1].error_message


def test_slow_drip_succeeds_but_misses_the_itl_target(server, tmp_path):
    summary, recs, elapsed = run_cell(server.url, tmp_path, {"kind": "slow_drip", "seconds": 0.1}, 40,
                                      limits={"itl_ms": 70})
    for i, r in recs.items():
        assert r.error_kind is None and r.completion_tokens == 8
        gaps = [b - a for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
        assert (min(gaps) >= 0.09) == bool(i % 2), gaps           # the drip is what the client measured
    assert summary["error_rate"] == 0 and summary["goodput_ratio"] == pytest.approx(0.5)


@pytest.mark.parametrize("kind", ["kill_prefill", "pause_prefill", "kv_corrupt", "kv_range"])
def test_recovered_faults_are_successes_and_say_where_prefill_ran(server, tmp_path, kind):
    summary, recs, elapsed = run_cell(server.url, tmp_path, {"kind": kind, "seconds": 5}, 50 + len(kind))
    assert elapsed < 15 and summary["error_rate"] == 0 and summary["goodput_ratio"] == 1
    for r in recs.values():
        assert r.error_kind is None and r.completion_tokens == 8, (kind, r.index, r.error_message)
    first, faulted = recs[0].server_timings, recs[1].server_timings
    assert first["prefill_location"] == "remote" and first["kv_recomputed"] is False and "fault" not in first
    assert faulted["fault"] == kind and faulted["kv_recomputed"] is True, faulted
    if kind.endswith("_prefill"):   # the prefill worker was lost: the decode worker prefilled it, and says so
        assert faulted["prefill_location"] == "local" and "prefill-0" in faulted["prefill_failover"], faulted
    else:                           # the KV arrived unusable: refused and recomputed on the decode worker
        assert faulted["prefill_location"] == "remote" and faulted["kv_error"], faulted


def test_a_stalled_request_in_flight_at_stop_is_recorded_cancelled(server, tmp_path):
    # the run stops once requests 0 and 2 finish; request 1 stalls: it is in flight, so cancelled;
    # request 3 was never sent, so it is not part of the run
    summary, recs, elapsed = run_cell(server.url, tmp_path, {"kind": "stall", "after_tokens": 1, "seconds": 30},
                                      60, stop_after=2)
    assert elapsed < 10 and sorted(recs) == [0, 1, 2]
    assert recs[0].error_kind is None and recs[2].error_kind is None
    assert recs[1].error_kind == "cancelled" and sum(recs[1].chunk_tokens) == 1   # what arrived is kept
    assert summary["errors"].get("cancelled") == 1


# ---- server cells: what the server does about its own faults -------------------------------------------

def _healthy_and_faulted(url: str, rule: dict[str, Any], tag: int, background: int = 0):
    """One healthy remote-prefilled request, then the same prompt as another tenant with ``rule``
    applied (no prefix hit: it is prefilled remotely again), while ``background`` tokens of a local
    request stream on the same decode worker (same tenant, a one-block prefix in common: prefix
    affinity sends the faulted request there)."""
    wait_ok(url)
    body = {"prompt": prompt(tag), "max_tokens": 12, "ignore_eos": True}
    set_plan(url)
    ref = stream(url, body, headers={"x-tenant": f"ref{tag}"})
    set_plan(url, {"every": 1, **rule})
    bg: list[Any] = []
    running = threading.Event()
    if background:
        th = threading.Thread(target=lambda: bg.append(stream(
            url, {"prompt": prompt(tag, 20), "max_tokens": background, "ignore_eos": True},
            headers={"x-tenant": f"bad{tag}"}, on_event=lambda s: running.set())), daemon=True)
        th.start()
        assert running.wait(30)
    bad = stream(url, body, headers={"x-tenant": f"bad{tag}"})
    if background:
        th.join(60)
    set_plan(url)
    return ref, bad, (bg[0] if bg else None)


def test_mismatched_kv_block_range_fails_only_its_request_and_is_recomputed(server):
    ref, bad, bg = _healthy_and_faulted(server.url, {"kind": "kv_range"}, 70, background=400)
    # before: the install raised inside admission and failed every sequence on the decode worker
    assert [e["error"]["message"] for e in bg.events if "error" in e] == []
    assert bg.done and bg.usage["completion_tokens"] == 400
    assert ref.timings["prefill_location"] == bad.timings["prefill_location"] == "remote"
    assert bad.timings["kv_recomputed"] is True and bad.timings["kv_error"] == "range"
    assert bad.done and bad.text == ref.text                       # recomputed: never garbage tokens


def test_corrupt_kv_transfer_fails_only_its_request_and_is_recomputed(server):
    ref, bad, bg = _healthy_and_faulted(server.url, {"kind": "kv_corrupt"}, 80, background=200)
    assert bad.timings["prefill_location"] == "remote" and bad.timings["kv_error"] == "checksum"
    assert bad.done and bad.text == ref.text
    assert bg.done and bg.usage["completion_tokens"] == 200


def router_fds(server) -> int:
    import os

    return len(os.listdir(f"/proc/{server.pid}/fd"))


def test_killed_decode_worker_ends_its_request_with_an_error_and_done_then_recovers(server):
    wait_ok(server.url)
    time.sleep(0.3)
    fds = router_fds(server)
    set_plan(server.url, {"kind": "kill_decode", "every": 1, "after_tokens": 3})
    t0 = time.monotonic()
    r = stream(server.url, {"prompt": prompt(90), "max_tokens": 50, "ignore_eos": True})
    set_plan(server.url)
    assert r.status == 200 and r.done and time.monotonic() - t0 < HEARTBEAT_S + 3
    assert "error" in r.events[-1] and len(r.times) >= 3                 # 3 tokens, then a clear error
    wait_ok(server.url)                                                   # restarted and re-registered
    assert stream(server.url, {"prompt": prompt(91), "max_tokens": 4}).status == 200
    time.sleep(0.3)
    assert router_fds(server) <= fds      # before: the dead worker's process sentinel stayed open (+1 each)


def test_briefly_paused_worker_resumes_and_its_request_completes(server):
    # paused for less than the heartbeat timeout: not declared down, the request just waits
    wait_ok(server.url)
    set_plan(server.url, {"kind": "pause_decode", "every": 1, "after_tokens": 2, "seconds": 0.5})
    r = stream(server.url, {"prompt": prompt(95), "max_tokens": 8, "ignore_eos": True})
    set_plan(server.url)
    assert r.done and r.usage["completion_tokens"] == 8
    assert max(r.itls) >= 0.45                                            # the pause is in the stream


def test_admin_endpoint_refuses_a_bad_plan(server):
    status, body, _ = post(server.url, "/admin/faults", {"rules": [{"kind": "explode", "every": 1}]})
    assert status == 400 and "unknown fault 'explode'" in body["error"]["message"]
    status, text = get(server.url, "/admin/faults")
    assert status == 200 and json.loads(text)["rules"] == []


# ---- bad requests (docs/bad-input.md, "HTTP requests"): the rows tests/test_server_bad_input.py lacks -------

def _raw_post(url: str, path: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", path, raw, {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read() or b"{}")
    conn.close()
    return r.status, out


BAD_REQUESTS = [  # (path, raw body, status, message)
    ("/v1/completions", b"{not json", 400, "request body is not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "request body must be a JSON object"),
    ("/v1/completions", b'{"max_tokens": 4}', 400, "'prompt' is required"),
    ("/v1/completions", b'{"prompt": ""}', 400, "the prompt is empty"),
    ("/v1/completions", b'{"prompt": {"a": 1}}', 400, "'prompt' must be a string or a list of token ids"),
    ("/v1/completions", b'{"prompt": [1, -5]}', 400, "token ids must be in [0, "),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "'max_tokens' must be an integer >= 1"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "8"}', 400, "'max_tokens' must be an integer >= 1"),
    ("/v1/completions", b'{"prompt": "hi", "n": 2}', 400, "only n=1 is supported"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000000}', 400, "exceeds this server's context"),
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-9"}', 404, "model 'gpt-9' does not exist"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "'messages' must be a non-empty list"),
    ("/admin/faults", b'{"rules": [{"kind": "reset"}]}', 400, "rules[0]: a rule needs 'every' or 'prob'"),
]


@pytest.mark.parametrize("path, raw, status, says", BAD_REQUESTS, ids=[r[1].decode()[:30] for r in BAD_REQUESTS])
def test_bad_request_gets_an_openai_style_error(server, path, raw, status, says):
    got, out = _raw_post(server.url, path, raw)
    assert got == status and out["error"]["code"] == status and says in out["error"]["message"], out
    assert out["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
