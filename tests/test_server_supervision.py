"""Worker supervision (reference_server/supervisor.py), against a real server and real signals.

A worker that dies (SIGKILL) or hangs (SIGSTOP) is declared down within the heartbeat bound; a request
whose prefill worker is lost is prefilled by its decode worker instead, and its timings say so; a request
whose decode worker is lost ends with an error event and [DONE]; the worker is restarted, re-registered
and routed to again, and /health reports degraded (or unavailable) and then ok. Every internal wait is
bounded by --request-timeout even when no heartbeat would fire.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Callable

import pytest
from proctree import alive, wait_gone

from reference_server.launcher import EmbeddedServer
from server_client import get, stream

HEARTBEAT = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "1"]
BOUND_S = 0.2 + 1.0          # interval + timeout: the detection bound these flags promise


@pytest.fixture(scope="module")
def server():
    # threshold routing: requests go remote without asking the prefill worker first, so a stopped one
    # is found by the failover path these tests check (the cost rule would leave it out of the decision)
    args = ["--mode", "disaggregated", "--workers", "2", "--block-size", "64", "--remote-prefill-threshold", "100",
            "--routing", "threshold",
            "--trust-tenant-header", *HEARTBEAT]
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        yield s


def health(url: str) -> tuple[int, dict[str, Any]]:
    status, body = get(url, "/health")
    return status, json.loads(body)


def wait_health(url: str, want: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = health(url)
        if body["status"] == want:
            return body
        assert time.monotonic() < deadline, f"/health stayed {body} ({status}), wanted {want}"
        time.sleep(0.05)


def bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return in time."""
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert box, f"no answer within {timeout_s}s"
    return box[0]


def test_killed_prefill_worker_is_detected_restarted_and_routed_to_again(server):
    url = server.url
    body = {"prompt": list(range(4000, 4400)), "max_tokens": 3, "ignore_eos": True}
    before = stream(url, body, headers={"x-tenant": "a"})
    assert before.timings["prefill_location"] == "remote"
    old = health(url)[1]["workers"]["prefill-0"]["pid"]
    os.kill(old, signal.SIGKILL)
    down = wait_health(url, "degraded", BOUND_S + 1.0)         # before: 503 "unhealthy", forever
    assert down["down"] == ["prefill-0"] and health(url)[0] == 200
    up = wait_health(url, "ok", 60)
    assert up["workers"]["prefill-0"]["pid"] != old and up["restarts"] >= 1 and not alive(old)
    after = stream(url, body, headers={"x-tenant": "b"})       # another tenant: no prefix hit
    assert after.status == 200 and after.timings["prefill_location"] == "remote"   # re-registered
    assert after.text == before.text
    # the router says how it ended (before: "closed its control connection", no exit code or signal)
    assert any(f"worker prefill-0 was killed by signal 9 (SIGKILL) (pid {old})" in line for line in server.log), \
        list(server.log)[-20:]


def test_stopped_prefill_worker_fails_over_to_a_local_prefill(server):
    url = server.url
    wait_health(url, "ok", 60)
    pid = health(url)[1]["workers"]["prefill-0"]["pid"]
    os.kill(pid, signal.SIGSTOP)                                # paused: alive, but answers nothing
    try:
        t0 = time.monotonic()
        r = bounded(lambda: stream(url, {"prompt": list(range(5000, 5400)), "max_tokens": 3, "ignore_eos": True},
                                   headers={"x-tenant": "c"}), 30)    # before: hung for good
        took = time.monotonic() - t0
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert r.status == 200 and r.done and r.usage["completion_tokens"] == 3
    assert r.timings["prefill_location"] == "local"             # before: said "remote"
    assert "prefill-0 missed its heartbeat" in r.timings["prefill_failover"] and r.timings["kv_recomputed"]
    assert took < BOUND_S + 10.0
    assert wait_gone([pid], 5.0) == []                          # killed, and then replaced
    assert wait_health(url, "ok", 60)["workers"]["prefill-0"]["pid"] != pid
    # why it went down, after what: how long it had been silent and what it was last sent
    said = [line for line in server.log if f"worker prefill-0 missed its heartbeat" in line and f"pid {pid}" in line]
    assert said and "(no answer in 1 s; its last frame" in said[0] and "the last message sent to it 'prefill'" \
        in said[0] and "killed it with SIGKILL" in said[0], said


def test_stopped_decode_worker_ends_its_streams_with_an_error_and_done(server):
    url = server.url
    wait_health(url, "ok", 60)
    pid = health(url)[1]["workers"]["decode-0"]["pid"]
    stopped: list[float] = []

    def pause_after_five_tokens(out: Any) -> None:
        if len(out.times) == 5 and not stopped:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(time.monotonic())

    try:
        r = bounded(lambda: stream(url, {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True},
                                   on_event=pause_after_five_tokens), 30)   # before: hung for good
        ended = time.monotonic()
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert stopped and r.status == 200
    assert r.done                                                # before: no [DONE] after an in-band error
    errors = [e["error"] for e in r.events if "error" in e]
    assert errors and "decode-0 missed its heartbeat" in errors[0]["message"] and errors[0]["code"] == 503
    assert r.usage is None and ended - stopped[0] < BOUND_S + 5.0
    status, _ = health(url)
    assert status in (200, 503)                                  # unavailable until decode-0 is back
    assert wait_health(url, "ok", 60)["workers"]["decode-0"]["pid"] != pid
    again = stream(url, {"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert again.status == 200 and again.usage["completion_tokens"] == 4   # before: 503 for every later request


def test_request_deadline_bounds_the_wait_when_no_heartbeat_fires():
    # A heartbeat too slow to notice: only the request deadline ends the wait on a paused worker.
    with EmbeddedServer(["--mode", "chunked", "--workers", "1", "--request-timeout", "1.5",
                         "--heartbeat-timeout", "60"], startup_timeout_s=90) as s:
        pid = s.procs["mixed-0"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = bounded(lambda: stream(s.url, {"prompt": "hello", "max_tokens": 4}), 30)   # before: hung
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert r.status == 504 and "deadline" in json.loads(r.body)["error"]["message"]
        assert 1.5 <= took < 5.0
        ok = stream(s.url, {"prompt": "hello", "max_tokens": 4, "ignore_eos": True})   # resumed: serving again
        assert ok.status == 200 and ok.usage["completion_tokens"] == 4


def test_an_answer_read_late_is_not_a_missed_heartbeat():
    # The router's own loop was held up past the timeout while the worker's answer sat in the socket:
    # a frame seen from the worker within the timeout means it is alive.
    import asyncio
    from types import SimpleNamespace

    from reference_server.config import ServerConfig, WorkerSpec
    from reference_server.supervisor import Supervisor, WorkerHandle

    cfg = ServerConfig(heartbeat_timeout_s=1.0)
    sup = Supervisor(cfg, "t")
    sup._stopping = True                                        # no real restart from this test
    h = WorkerHandle(WorkerSpec("decode", 0, cfg, "t"), SimpleNamespace(is_alive=lambda: False))

    async def late(*_a, **_k):
        h.last_seen = time.monotonic()                          # the pump read a frame just now
        raise asyncio.TimeoutError

    async def silent(*_a, **_k):
        raise asyncio.TimeoutError

    h.call = late
    asyncio.run(sup._ping(h))
    assert not h.dead
    h.call, h.last_seen = silent, time.monotonic() - 2.0
    asyncio.run(sup._ping(h))
    assert h.dead and "missed its heartbeat" in h.down_reason


def test_the_dropped_list_is_bounded():
    """Joined workers that went down are listed in /health (the latest DROPPED_KEPT) and counted (all of them);
    before, the list grew by one for every drop, for the router's lifetime."""
    from types import SimpleNamespace

    from reference_server.config import ServerConfig, WorkerSpec
    from reference_server.supervisor import DROPPED_KEPT, Supervisor, WorkerHandle

    cfg = ServerConfig()
    sup = Supervisor(cfg, "t")
    for i in range(DROPPED_KEPT + 8):
        h = WorkerHandle(WorkerSpec("prefill", i, cfg, "t", host="10.0.0.2"), None, tie=SimpleNamespace(close=lambda: None))
        sup.prefill.append(h)
        sup._drop(h, "missed its heartbeat")
    state = sup.health()
    assert len(state["dropped"]) == DROPPED_KEPT and state["dropped_total"] == DROPPED_KEPT + 8
    assert state["dropped"][-1]["name"] == f"prefill-{DROPPED_KEPT + 7}"
    assert sup._join_index("prefill", "10.0.0.2") == 0      # a worker rejoining from that host takes a freed name
