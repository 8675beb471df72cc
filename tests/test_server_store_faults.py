"""A store fault is a miss, never an outage (issue 30), on the built-in store: no Mooncake needed.

One 1P + 1D sim server with the user's defaults (``--heartbeat-timeout 3``, ``--kv-store-timeout 1``) and a
small built-in store (``--kv-store-gb 0.02``: 38 of the sim's 512-token blocks):

* a store that stops answering: the test holds the store's lock (``flock`` on its shared-memory segment, as a
  writer wedged inside the store would), so every store call of every worker blocks. Before, the decode
  worker's reader thread hung in the ``match`` of the first request, the heartbeat it also answers went
  unanswered, the worker was killed and restarted, and requests failed (503). Now each store call waits at
  most ``--kv-store-timeout``, later ones are misses at once, every request is answered, no worker restarts,
  and each worker logs the outage once with its cause and once when the store answers again;
* capacity on the sim engine's virtual KV: occupancy <= 1 at every scrape, evictions counted;
* a worker killed with SIGKILL: the router logs how it ended (signal 9, SIGKILL) and the server-wide store
  counters do not go back when its replacement starts.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import random
import signal
import threading
import time

import pytest

from reference_server.launcher import EmbeddedServer
from server_client import get, metric, stream

SIM_1P1D = ["--engine", "sim", "--sim-time-scale", "0", "--mode", "disaggregated", "--prefill-workers", "1",
            "--decode-workers", "1", "--kv-store-gb", "0.02"]
BS = 512


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 90000) for _ in range(n)]


@pytest.fixture(scope="module")
def server():
    with EmbeddedServer(SIM_1P1D, startup_timeout_s=120) as s:
        yield s


def _health(url: str) -> dict:
    return json.loads(get(url, "/health")[1])


def _segment(router_pid: int) -> str:
    """The built-in store's shared-memory segment (kv/store.py names it after the router's pid)."""
    [path] = glob.glob(f"/dev/shm/*_{router_pid}_store*")
    return path


def test_a_store_that_stops_answering_is_a_miss_not_a_restart(server):
    url = server.url
    warm = stream(url, {"prompt": _ids(3 * BS, 1), "max_tokens": 4, "ignore_eos": True})
    assert warm.status == 200
    fd = os.open(_segment(server.pid), os.O_RDWR)
    results: list = []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)          # every worker's store call now blocks on the store lock
        t0 = time.monotonic()
        threads = [threading.Thread(target=lambda i=i: results.append(stream(url, {
            "prompt": _ids(2 * BS, 100 + i), "max_tokens": 4, "ignore_eos": True}))) for i in range(6)]
        for i, t in enumerate(threads):
            t.start()
            time.sleep(0.8)                     # spread over 4.8 s: past the 3 s heartbeat timeout
        for t in threads:
            t.join(60)
        held_s = time.monotonic() - t0
        during = _health(url)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert held_s > 3.0 + 0.5                    # the lock outlived the heartbeat timeout
    assert len(results) == 6 and all(r.status == 200 and r.usage["completion_tokens"] == 4 for r in results), \
        [r.status for r in results]
    assert during["restarts"] == 0 and during["down"] == [], during
    after = stream(url, {"prompt": _ids(2 * BS, 200), "max_tokens": 4, "ignore_eos": True})
    assert after.status == 200
    _, text = get(url, "/metrics")
    assert metric(text, "paasbench_kv_store_timeouts_total") >= 1
    log = list(server.log)
    for w in ("decode-0",):
        said = [line for line in log if f"worker {w}: the KV store is not answering" in line]
        assert len(said) == 1 and "did not answer within 1 s (--kv-store-timeout)" in said[0], log[-30:]
    assert _health(url)["restarts"] == 0


def test_the_store_evicts_at_its_capacity_on_virtual_kv(server):
    url = server.url
    occupancy = []
    for i in range(12):                          # 12 x 6 new blocks into a store of 38
        r = stream(url, {"prompt": _ids(6 * BS, 1000 + i), "max_tokens": 4, "ignore_eos": True})
        assert r.status == 200
        _, text = get(url, "/metrics")
        occupancy.append(metric(text, "paasbench_kv_store_occupancy_ratio"))
    time.sleep(0.5)
    _, text = get(url, "/metrics")
    occupancy.append(metric(text, "paasbench_kv_store_occupancy_ratio"))
    assert metric(text, "paasbench_kv_store_capacity_blocks") == 38
    assert max(occupancy) <= 1.0 and metric(text, "paasbench_kv_store_evictions_total") > 0, occupancy


def test_a_killed_worker_is_logged_with_its_signal_and_the_store_counters_stay(server):
    url = server.url
    _, text = get(url, "/metrics")
    before = {k: metric(text, f"paasbench_kv_store_{k}_total") for k in ("put_blocks", "lookup_blocks")}
    pid = _health(url)["workers"]["decode-0"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while True:
        body = _health(url)
        if body["status"] == "ok" and body["workers"]["decode-0"]["pid"] != pid:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.2)
    assert any("worker decode-0 was killed by signal 9 (SIGKILL)" in line for line in server.log), list(server.log)
    _, text = get(url, "/metrics")
    for k, v in before.items():
        assert metric(text, f"paasbench_kv_store_{k}_total") >= v, (k, v)
