"""``run --ray``: the load workers as Ray actors, on a local Ray instance (2 CPUs, no dashboard, loopback).

The same acceptance as ``--workers``: a 2-actor run summarizes like a 1-process run of the same trace, the
driver measured each actor's clock offset before and after, and an actor lost mid-run is reported with
the requests it never recorded. Skipped when Ray (the optional extra ``paasbench[ray]``) is not installed.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import pytest
from sse_server import SSEServer
from test_run_workers import ITL_MS, TTFT_MS, _assert_same_run, _run, _trace

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'paasbench[ray]'")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def test_two_ray_actors_summarize_like_one_process(tmp_path, local_ray):
    trace = _trace(tmp_path / "t.jsonl", 48, 25)
    with SSEServer(ttft_ms=TTFT_MS, itl_ms=ITL_MS) as srv:
        one = _run(srv.url, trace, tmp_path / "one", "--mode", "constant", "--rate", "40")
        two = _run(srv.url, trace, tmp_path / "two", "--mode", "constant", "--rate", "40",
                   "--ray", "local", "--workers", "2")
    _assert_same_run(one, two)
    workers = two["meta"]["workers"]
    assert workers["backend"] == "ray" and len(workers["actors"]) == 2 and workers["lost"] == []
    # each actor's node by its address and id, not only the hostname (two VMs of one image share it)
    assert {(a["node_address"], a["node_id"]) for a in workers["actors"]} == {
        (n["NodeManagerAddress"], n["NodeID"]) for n in ray.nodes()}
    for actor in workers["actors"]:  # one machine: the measured offset is ~0, within its uncertainty + noise
        for when in ("start", "end"):
            c = actor["clock"][when]
            assert 0 < c["uncertainty_s"] < 0.05 and abs(c["offset_s"]) <= c["uncertainty_s"] + 0.005


def test_a_lost_actor_is_reported_with_its_unrecorded_requests(tmp_path, local_ray):
    from paasbench.client import ClientConfig
    from paasbench.load.runner import LoadConfig, run_load
    from paasbench.trace import load_trace

    trace = load_trace(_trace(tmp_path / "t.jsonl", 80, 25))

    def kill_second(line: str) -> None:  # where the actors run, once they are ready
        pid = int(re.search(r"pids: (\d+) (\d+)", line).group(2))
        asyncio.get_running_loop().call_later(0.8, os.kill, pid, signal.SIGKILL)

    with SSEServer(ttft_ms=TTFT_MS, itl_ms=ITL_MS) as srv:
        res = asyncio.run(run_load(trace, LoadConfig(mode="constant", rate=40), ClientConfig(target=srv.url, model="m"),
                                   tmp_path / "out", ray="local", workers=2, announce=kill_second))
    [lost] = res.summary["meta"]["workers"]["lost"]
    assert lost["worker"] == 1 and lost["planned"] == 40 and lost["recorded"] < 40
    assert lost["unsent_or_unrecorded"] == 40 - lost["recorded"] and "lost" in lost["why"]
    assert res.summary["requests"]["total"] == 40 + lost["recorded"]  # worker 0 sent all of its share


def test_ray_auto_with_no_cluster_is_an_input_error_that_writes_nothing(tmp_path):
    # before: Ray's 40-line traceback (advice about an `--address` flag paasbench has no), exit 1, an empty
    # records.jsonl. Ray's own discovery is told there is no cluster, as on a machine without one (another
    # test's local Ray instance on this box would otherwise be found).
    no_cluster = ("import functools, ray._private.services as s; s.find_gcs_addresses = functools.cache(list); "
                  "s.find_bootstrap_address = lambda temp_dir: None; from paasbench.cli import main; main()")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-c", no_cluster, "run", "--target", "http://127.0.0.1:9", "--trace",
                        str(_trace(tmp_path / "t.jsonl", 4, 10)), "--out", str(out), "--no-live", "--model", "m",
                        "--workers", "2", "--ray", "auto"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "--address" not in r.stderr
    assert "field '--ray'" in r.stderr and "ray start --head" in r.stderr and "--ray local" in r.stderr
    assert not out.exists()
