"""Workers that join a router from another host (``serve --join``; reference_server/join.py), without a second
machine: the router on 127.0.0.1, each joined worker bound to its own loopback address (127.0.0.2, 127.0.0.3),
real processes, real HTTP, the TCP KV transport between them. Nothing leaves the machine.

Checked: a 1P (router host) + 1P + 1D (joined) server replays an agent workload with remote prefills on the
joined prefill worker and the hit the traffic offered; the hardware it reports counts the joined hosts; a
joined worker killed mid-request is dropped (not restarted) and its requests fail over as a child's do; a
worker with the wrong internal token is refused, the refusal logged, and the router keeps serving.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from click.testing import CliRunner

from paasbench.cli import main
from paasbench.client import ClientConfig
from paasbench.sweep.driver import target_hardware
from paasbench.metrics.records import read_records
from reference_server.launcher import EmbeddedServer, ServerStartError
from server_client import get, stream

HEARTBEAT = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]
JOIN_S = 90.0          # a joined worker builds its engine before it is routed to


def _token(path: Path) -> Path:
    path.write_text(secrets.token_hex(32) + "\n")
    return path


def _router(token: Path, *args: str, until: str = "serving", startup_timeout_s: float = 90) -> EmbeddedServer:
    return EmbeddedServer(["--mode", "disaggregated", "--join-port", "0", "--kv-transport", "tcp",
                           "--internal-token-file", str(token), "--block-size", "64", *HEARTBEAT, *args],
                          startup_timeout_s=startup_timeout_s, until=until)


def _join_address(server: EmbeddedServer) -> str:
    return next(line.split(" ", 1)[1] for line in list(server.log) if line.startswith("JOIN "))


def _one_device_env() -> dict[str, str]:
    """A joined worker stands for one device, like a child worker (supervisor.py shares the cores among those):
    on this one machine it must not take every core for its BLAS threads."""
    share = str(max(1, (os.cpu_count() or 1) // 3))
    return {**os.environ, **{v: share for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}


class Joined:
    """One ``serve --join`` process (its output in ``log``)."""

    def __init__(self, server: EmbeddedServer, role: str, host: str, token: Path, log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "reference_server", "--join", _join_address(server),
                                      "--role", role, "--host", host, "--internal-token-file", str(token)],
                                     stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=_one_device_env())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def joins() -> Iterator[list[Joined]]:
    started: list[Joined] = []
    yield started
    for j in started:
        j.stop()


def _logs(server: EmbeddedServer, *worker_logs: Path) -> str:
    """The router's output and the joined workers' stderr, for a failure's message: what the servers said
    is the cause a failed run's counts cannot show."""
    parts = ["\n--- router ---", *list(server.log)[-80:]]
    for log in worker_logs:
        parts += [f"--- {log.name} ---", *(log.read_text(errors="replace").splitlines()[-40:] if log.exists() else [])]
    return "\n".join(parts)


def health(url: str) -> dict[str, Any]:
    return json.loads(get(url, "/health")[1])


def wait_for(url: str, pred, what: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        body = health(url)
        if pred(body):
            return body
        assert time.monotonic() < deadline, f"/health never showed {what}: {body}"
        time.sleep(0.1)


def test_a_router_with_no_decode_worker_is_not_ready_unless_asked_to_answer_only(tmp_path):
    # before: EmbeddedServer.start took /health's 503 (unavailable: no decode worker up) as ready for every
    # caller, so a sweep whose server lost its decode worker at start measured refusals; now only a caller
    # waiting for workers to join (until="answering") takes it
    token = _token(tmp_path / "internal.token")
    with pytest.raises(ServerStartError, match="/health says unavailable"):
        _router(token, "--prefill-workers", "0", "--decode-workers", "0", startup_timeout_s=15).start()
    with _router(token, "--prefill-workers", "0", "--decode-workers", "0", until="answering") as server:
        assert health(server.url)["status"] == "unavailable"


def test_joined_prefill_and_decode_workers_serve_an_agent_workload_at_its_offered_hit(tmp_path, joins):
    token = _token(tmp_path / "internal.token")
    with _router(token, "--prefill-workers", "1", "--decode-workers", "0", until="answering") as server:
        url = server.url
        assert health(url)["status"] == "unavailable"          # no decode worker until one joins
        joins.append(Joined(server, "prefill", "127.0.0.2", token, tmp_path / "p.log"))
        joins.append(Joined(server, "decode", "127.0.0.3", token, tmp_path / "d.log"))
        body = wait_for(url, lambda b: {"prefill-1", "decode-0"} <= set(b.get("workers", {})), "both joined", JOIN_S)
        assert body["status"] == "ok"
        assert body["workers"]["decode-0"] == {"host": "127.0.0.3", "port": body["workers"]["decode-0"]["port"],
                                               "up": True, "joined": True, "restarted_by_router": False}
        assert body["workers"]["prefill-0"]["restarted_by_router"] and not body["workers"]["prefill-0"]["joined"]
        hw = body["hardware"]       # the router's host + the two hosts workers joined from
        assert hw["machines"] == 3 and hw["workers"] == {"prefill": 2, "decode": 1}
        assert hw["joined"] == {"127.0.0.2": {"prefill": 1}, "127.0.0.3": {"decode": 1}}
        # what a sweep against this --target records for its cost rows (paasbench/sweep/driver.py)
        assert target_hardware(ClientConfig(target=url)) == {**hw, "machines": 3}
        out = tmp_path / "run"
        # Sessions (each turn follows its previous turn's answer), started far enough apart (--rate: session
        # starts/s) that a session's shared prefix is in the server's cache before the next session sends it:
        # the offered hit counts it from the first request that sent it (paasbench/metrics/verify.py).
        res = CliRunner().invoke(main, ["run", "--target", url, "--workload", "ci-small", "--mode", "sessions",
                                        "--rate", "0.1", "--max-requests", "16", "--out", str(out), "--no-live"])
        assert res.exit_code == 0, res.output + _logs(server, tmp_path / "p.log", tmp_path / "d.log")
        summary = json.loads((out / "summary.json").read_text())
        recs = list(read_records(out / "records.jsonl"))
        assert len(recs) == 16 and all(r.ok for r in recs), [r.error for r in recs if not r.ok]
        check = summary["prefix_hit_check"]
        print(f"joined 1P+1P+1D: hit offered {check['offered']:.4f}, server {check['measured']:.4f}, "
              f"gap {check['gap_points']:+.2f} points")
        assert check["offered"] > 0.5 and not check["off"], check           # within 2 points of offered
        timings = [r.server_timings or {} for r in recs]
        assert any(t.get("prefill_location") == "remote" for t in timings)    # prefilled on a prefill worker
        # Two cold prompts at once: the second goes to the joined prefill worker while the first holds the
        # router host's, and both KV transfers cross to the joined decode worker.
        cold: list[Any] = []
        threads = [threading.Thread(target=lambda i=i: cold.append(stream(url, {
            "prompt": list(range(20000 + 3000 * i, 22000 + 3000 * i)), "max_tokens": 2, "ignore_eos": True})))
            for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(cold) == 2 and all(r.status == 200 and r.timings["prefill_location"] == "remote" for r in cold)
        assert sorted(r.timings["route_prefill_worker"] for r in cold) == ["prefill-0", "prefill-1"]
        assert all(r.timings["transfer_bytes"] > 0 for r in cold)
        assert "127.0.0.2" in (tmp_path / "p.log").read_text()
    for j in joins:             # the router stopped: its join connections closed, the workers left
        assert j.proc.wait(30) == 0


def test_a_killed_joined_worker_is_dropped_and_its_requests_fail_over(tmp_path, joins):
    token = _token(tmp_path / "internal.token")
    # threshold routing: requests go remote without asking the prefill worker first, so the stopped one gets
    # them and is found by the failover path (the cost rule would leave it out of the decision)
    with _router(token, "--prefill-workers", "0", "--decode-workers", "1", "--routing", "threshold",
                 "--remote-prefill-threshold", "100") as server:
        url = server.url
        joins.append(Joined(server, "prefill", "127.0.0.2", token, tmp_path / "p.log"))
        wait_for(url, lambda b: "prefill-0" in b.get("workers", {}), "prefill-0 joined", JOIN_S)
        body = {"prompt": list(range(5000, 5400)), "max_tokens": 3, "ignore_eos": True}
        warm = stream(url, body)
        assert warm.status == 200 and warm.timings["prefill_location"] == "remote"   # on the joined worker
        pid = joins[0].proc.pid
        os.kill(pid, signal.SIGSTOP)       # hold it: the next requests are routed to it and wait there
        got: list[Any] = []
        threads = [threading.Thread(target=lambda i=i: got.append(stream(url, {**body, "prompt": list(
            range(6000 + 1000 * i, 6400 + 1000 * i))}))) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)       # killed mid-request: its connections close
        for t in threads:
            t.join(60)
        assert len(got) == 3, "a request did not end within 60 s"
        assert all(r.status == 200 and r.done and r.usage["completion_tokens"] == 3 for r in got)
        sent_to_it = [r for r in got if r.timings.get("route_prefill_worker") == "prefill-0"]
        assert len(sent_to_it) == 2          # --prefill-queue-bound 2: the third was prefilled locally at once
        assert all("prefill_failover" in r.timings and r.timings["prefill_location"] == "local" for r in sent_to_it)
        after = health(url)
        # its only prefill worker gone: an empty pool is degraded (before: "ok"), still serving
        assert after["status"] == "degraded" and after["empty_pools"] == ["prefill"], after
        assert "prefill-0" not in after["workers"] and after["restarts"] == 0
        assert [d["name"] for d in after["dropped"]] == ["prefill-0"] and after["dropped"][0]["host"] == "127.0.0.2"
        assert after["hardware"]["machines"] == 1 and after["hardware"]["joined"] == {}
        assert stream(url, body).status == 200      # the router keeps serving with its own decode worker
        # the same host and role joins again: it takes its old name (before: prefill-1, and the dropped list
        # kept growing with every rejoin), and it is no longer listed as dropped
        joins.append(Joined(server, "prefill", "127.0.0.2", token, tmp_path / "p2.log"))
        back = wait_for(url, lambda b: "prefill-0" in b.get("workers", {}), "prefill-0 joined again", JOIN_S)
        assert back["status"] == "ok" and set(back["workers"]) == {"prefill-0", "decode-0"}, back
        assert back["dropped"] == [] and back["dropped_total"] == 1
    assert any("prefill-0 (joined from 127.0.0.2)" in line and "dropped" in line for line in server.log)


def test_a_worker_with_the_wrong_internal_token_is_refused_and_logged(tmp_path, joins):
    token = _token(tmp_path / "internal.token")
    with _router(token, "--prefill-workers", "1", "--decode-workers", "1") as server:
        url = server.url
        wrong = Joined(server, "decode", "127.0.0.3", _token(tmp_path / "other.token"), tmp_path / "w.log")
        joins.append(wrong)
        assert wrong.proc.wait(30) == 1
        assert "join refused: the router refused this worker: unauthorized" in (tmp_path / "w.log").read_text()
        body = wait_for(url, lambda b: b.get("join_refused") == 1, "the refusal", 10)
        assert body["status"] == "ok" and set(body["workers"]) == {"prefill-0", "decode-0"}
        assert any("refused a worker joining from 127.0.0.3" in line and "wrong internal token" in line
                   for line in server.log)
        r = stream(url, {"prompt": list(range(100, 400)), "max_tokens": 2, "ignore_eos": True})
        assert r.status == 200 and r.done


@pytest.mark.parametrize("args, says", [
    (["--join-port", "0"], "--join-port needs --kv-transport tcp"),
    (["--join-port", "0", "--kv-transport", "tcp", "--host", "0.0.0.0"], "0.0.0.0 is a wildcard"),
    (["--join-port", "0", "--kv-transport", "tcp"], "--join-port needs --internal-token-file"),
    (["--decode-workers", "0"], "--decode-workers 0 leaves that pool empty unless workers join"),
    (["--join", "127.0.0.1:9"], "--join needs --role"),
    (["--join", "127.0.0.1", "--role", "decode", "--internal-token-file", "TOKEN"], "is not HOST:PORT"),
    (["--join", "127.0.0.1:9", "--role", "decode"], "--join needs --internal-token-file"),
    (["--join", "127.0.0.1:9", "--role", "decode", "--internal-token-file", "SHORT"], "at least 16"),
])
def test_join_flags_that_cannot_work_exit_2_naming_the_flag(tmp_path, args, says):
    from reference_server.cli import serve

    (tmp_path / "short").write_text("abc\n")
    args = [str(_token(tmp_path / "t")) if a == "TOKEN" else str(tmp_path / "short") if a == "SHORT" else a
            for a in args]
    res = CliRunner().invoke(serve, ["--port", "0", *args])
    assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output
