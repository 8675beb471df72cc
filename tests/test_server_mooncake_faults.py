"""A store fault is a miss, never an outage (issue 30): the reference server on Mooncake Store while its parts
die, with the defaults a user gets (``--heartbeat-timeout 3``, ``--kv-store-timeout 1``, the server's own
master). Each scenario is a run of ``benchmarks/store_faults.py`` (the probe the issue's table came from): a
2P + 2D sim twin replays the committed 80-request slice of the public Mooncake conversation trace while the
probe samples /health, /metrics and the server's process tree every half second. The fault scenario routes
by ``--routing threshold``, which the probe sets so that its store probe's long prompt is prefilled remotely
and reads the store: under the cost rule an idle server never reads it, and a CI run never saw the memory
owner's store back once the replay was over.

* master, then memory owner, killed (SIGKILL) mid-run on one server: no request fails, every request is answered
  within the client's 120 s deadline, each part is back (restarted, puts and store hits again) within 30 s
  and reaped, no worker restarts, the worker processes never exceed the 4 configured + 1, and the store's
  counters never go back. Before (bf1a7f7): 190 of 250 requests failed (503) after either kill, every worker
  missed its heartbeat and was restarted, the master stayed a zombie, and the memory owner's death left
  restarts that piled up (10 worker processes of 4) and a store that never came back.
* a tiny store (0.16 GB: 305 of the sim's 512-token blocks; worker pools of 100 MB, so that the store holds
  what they evict): Mooncake's occupancy <= 1 at every scrape, evictions counted, the prefix hit within
  2 points of the built-in store's of the same capacity on the same traffic (what the capacity allows), and
  no more puts per stored block than the built-in store; a decode worker killed after the replay takes
  none of the server's store counters with it. Before: a 0.01 GB store held 5,297 blocks of 19 (occupancy
  278.8), evicted none, and the Mooncake path wrote 1.66 puts per stored block to the built-in store's 1.00.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_fixture import mooncake_or_skip

pytestmark = pytest.mark.mooncake
mooncake_or_skip()

ROOT = Path(__file__).resolve().parent.parent
SLICE = Path(__file__).parent / "fixtures" / "trace" / "mooncake_conversation_slice.jsonl"
DEADLINE_S = 120.0
BASE = ["--trace", str(SLICE), "--start", "0", "--count", "80", "--server-arg=--sim-time-scale=0.01",
        "--deadline", str(DEADLINE_S)]


def _probe(out: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "store_faults.py"), *BASE, *args,
                        "--out", str(out), "--json", str(out / "figures.json")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout)
    return json.loads((out / "figures.json").read_text())


def _never_back(samples: list[dict], keys: tuple[str, ...]) -> list[str]:
    """Counters that went back between two scrapes."""
    seen: dict[str, float] = {}
    back = []
    for s in samples:
        for k in keys:
            v = s["store"].get(k)
            if v is None:
                continue
            if v < seen.get(k, 0):
                back.append(f"{k} {seen[k]:g} -> {v:g} at {s['t']:.1f} s")
            seen[k] = v
    return back


def test_master_and_memory_owner_killed_mid_run_fail_no_request(tmp_path):
    f = _probe(tmp_path, "--time-scale", "2", "--fault", "master@8", "--fault", "client@28")
    log = (tmp_path / "server.log").read_text()
    assert f["requests"] == 80 and f["failed"] == 0, (f["failed_kinds"], log[-4000:])
    assert f["max_e2e_s"] <= DEADLINE_S
    assert [x["part"] for x in f["faults"]] == ["master", "client"]
    for x in f["faults"]:
        assert x["back_s"] is not None and x["back_s"] <= 30.0, (x, f["probes"], log[-4000:])
        assert x["reaped"], x
    assert f["zombies_at_end"] == []
    assert f["restarts"] == 0 and f["max_workers"] <= f["workers_configured"] + 1, f
    assert "mooncake_master (pid" in log and "was killed by signal 9 (SIGKILL)" in log
    assert _never_back(f["samples"], ("put_blocks_total", "lookup_blocks_total", "hit_blocks_total",
                                      "errors_total", "timeouts_total")) == []


# A deterministic store workload (sequential requests, threshold routing, 1P + 1D sim twin that sleeps nothing,
# worker pools of 12 MB = 24 blocks): K prefixes A_i of 4 blocks, each first prefilled on the decode worker (which
# puts them), then R rounds of A_i + 8 fresh blocks, prefilled on the prefill worker, which never computed A_i:
# its only source for A_i is the store. Between two uses of A_i the store takes ~8 new blocks of each of the
# other K - 1 requests: a store of 120 blocks keeps every A_i, one of 40 keeps none (LRU).
K, ROUNDS, BS = 6, 3, 512


def _store_workload(kv_store: str, gb: float, kill_worker: bool = False) -> dict:
    import random

    from reference_server.launcher import EmbeddedServer
    from server_client import get, metric, stream
    from test_server_join import health

    def ids(n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(1000, 90000) for _ in range(n)]

    args = ["--engine", "sim", "--sim-time-scale", "0", "--mode", "disaggregated", "--prefill-workers", "1",
            "--decode-workers", "1", "--routing", "threshold", "--remote-prefill-threshold", "3000",
            "--kv-budget-mb", "12", "--kv-store", kv_store, "--kv-store-gb", str(gb)]
    heads = [ids(4 * BS, i) for i in range(K)]
    occupancy: list[float] = []
    store_hit = prompt = 0
    with EmbeddedServer(args, startup_timeout_s=120) as s:
        def put_blocks() -> float:
            return metric(get(s.url, "/metrics")[1], "paasbench_kv_store_put_blocks_total")

        def send(p: list[int]) -> dict:
            before = put_blocks()
            r = stream(s.url, {"prompt": p, "max_tokens": 8, "ignore_eos": True})
            assert r.status == 200, r.body
            deadline = time.monotonic() + 5
            while put_blocks() == before and time.monotonic() < deadline:   # its blocks landed
                time.sleep(0.02)
            occupancy.append(metric(get(s.url, "/metrics")[1], "paasbench_kv_store_occupancy_ratio"))
            return r.timings
        for h in heads:
            assert send(h)["prefill_location"] == "local"
        for r in range(ROUNDS):
            for i, h in enumerate(heads):
                t = send(h + ids(8 * BS, 1000 * (r + 1) + i))
                assert t["prefill_location"] == "remote"
                store_hit += int(t.get("store_hit_tokens", 0))
                prompt += 12 * BS
        _, text = get(s.url, "/metrics")
        st = {k: metric(text, f"paasbench_kv_store_{k}") for k in (
            "capacity_blocks", "blocks", "evictions_total", "put_blocks_total", "lookup_blocks_total",
            "hit_blocks_total")}
        restart = None
        if kill_worker:
            import os
            import signal

            pid = health(s.url)["workers"]["decode-0"]["pid"]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 90
            while not (health(s.url)["status"] == "ok" and health(s.url)["workers"]["decode-0"]["pid"] != pid):
                assert time.monotonic() < deadline
                time.sleep(0.2)
            _, text = get(s.url, "/metrics")
            restart = {k: metric(text, f"paasbench_kv_store_{k}") for k in st if k.endswith("_total")}
    return {"store": st, "occupancy": occupancy, "hit": store_hit / prompt, "after_restart": restart}


@pytest.mark.parametrize("blocks, gb", [(40, 0.021), (120, 0.063)], ids=["does-not-fit", "fits"])
def test_a_tiny_store_evicts_at_its_capacity_and_hits_what_it_allows(blocks, gb):
    m = _store_workload("mooncake", gb, kill_worker=blocks == 40)
    b = _store_workload("builtin", gb)
    print(f"{blocks}-block store: store hit mooncake {m['hit']:.4f}, built-in {b['hit']:.4f}; "
          f"mooncake {m['store']}, built-in {b['store']}; mooncake occupancy max {max(m['occupancy']):.3f}")
    for f in (m, b):
        assert f["store"]["capacity_blocks"] == blocks, f["store"]
        assert max(f["occupancy"]) <= 1.0, f["occupancy"]
    assert abs(m["hit"] - b["hit"]) <= 0.02                     # what the capacity allows: the LRU store's
    if blocks == 40:                                             # it evicts: A_i is gone before its next use
        assert m["store"]["evictions_total"] > 0 and b["store"]["evictions_total"] > 0 and b["hit"] < 0.10
    else:                                                        # every A_i kept: a third of each prompt
        assert b["hit"] > 0.30

    def puts_per_block(st: dict) -> float:    # every block written is still stored or was evicted
        return st["put_blocks_total"] / (st["blocks"] + st["evictions_total"])
    assert puts_per_block(m["store"]) <= puts_per_block(b["store"]) + 1e-9, (m["store"], b["store"])
    if m["after_restart"] is not None:        # a decode worker killed: the server's counters stay
        assert all(m["after_restart"][k] >= v for k, v in m["store"].items() if k.endswith("_total")), m
