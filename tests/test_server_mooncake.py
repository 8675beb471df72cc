"""The disaggregated server on Mooncake Store (``--kv-store mooncake``): the same store hits and answers as
the built-in store; an agent workload's server hit within 2 points of what the traffic offered; issue #16's
hit acceptance (a public Mooncake trace slice within 2 points, white-paper-agent within 1, on one 2P+2D
twin); workers joined from another loopback address sharing the store both ways, and a host that cannot
reach the master refused with the reason; and every store failure a recompute: another host's master killed
under load fails no request with the user's defaults, /health says degraded and the failures are counted (this
server's own master and memory owner, killed mid-run: tests/test_server_mooncake_faults.py); a corrupt block is
dropped and
recomputed, never installed. Skipped (with the reason) only where the package cannot be imported."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mooncake_fixture import mooncake_or_skip
from paasbench.cli import main
from reference_server.launcher import EmbeddedServer
from server_client import get, metric, stream
from test_server_join import HEARTBEAT, JOIN_S, Joined, _token, wait_for
from test_server_kv_store import BS, ONBOARD_ARGS, _ids, _wait_metric, check_onboarding

pytestmark = pytest.mark.mooncake
mooncake_or_skip()

from reference_server.kv.mooncake_service import start_master  # noqa: E402


@pytest.fixture
def master(tmp_path):
    child, _ = start_master(tmp_path)
    yield child
    if child.proc.poll() is None:
        child.proc.kill()
        child.proc.wait()


def test_onboarding_matches_the_builtin_store():
    check_onboarding(ONBOARD_ARGS + ["--kv-store", "mooncake"])


@pytest.mark.parametrize("roles", [("prefill",), ("decode",), ("prefill", "decode")], ids=["prefill", "decode", "all-joined"])
def test_a_joined_worker_shares_the_mooncake_store_across_hosts(tmp_path, roles):
    """The router on 127.0.0.1, workers of ``roles`` joined from 127.0.0.2 and 127.0.0.3 (nothing leaves the
    machine): each starts its host's memory owner on the router's master, and blocks one host's worker computed
    are onboarded by the other host's (joined prefill: it reads what the router host's decode worker put; joined
    decode: the router host's prefill worker reads what the joined decode worker put; both joined, none on the
    router host: what the joined decode worker put, the joined prefill worker reads), with the same answer as
    computing them. Before, a joined worker had no store (0 store hits), and a router with no worker of its own
    started no Mooncake master for the joined ones to use (0 blocks put)."""
    token = _token(tmp_path / "internal.token")
    args = ONBOARD_ARGS + ["--kv-store", "mooncake", "--join-port", "0", "--kv-transport", "tcp",
                           "--internal-token-file", str(token), *HEARTBEAT, *(f"--{r}-workers=0" for r in roles)]
    joined: list[Joined] = []

    def join(server: EmbeddedServer) -> None:
        for i, role in enumerate(roles):
            joined.append(Joined(server, role, f"127.0.0.{2 + i}", token, tmp_path / f"joined-{role}.log"))
        body = wait_for(server.url, lambda b: sum(bool(w.get("joined")) for w in b.get("workers", {}).values())
                        == len(roles), "the workers joined", JOIN_S)
        assert body["status"] == "ok", body

    try:
        check_onboarding(args, join)
    finally:
        for j in joined:
            j.stop()
    for i, role in enumerate(roles):
        assert f"127.0.0.{2 + i}" in (tmp_path / f"joined-{role}.log").read_text()


def test_a_host_that_cannot_reach_the_mooncake_master_is_refused_saying_why(tmp_path, master):
    """The router uses an existing master; it is gone when a worker joins: the join fails on both sides with
    the master named, and the router keeps serving with its own workers."""
    token = _token(tmp_path / "internal.token")
    args = ONBOARD_ARGS + ["--kv-store", f"mooncake://{master.addr}", "--join-port", "0", "--kv-transport", "tcp",
                           "--internal-token-file", str(token), *HEARTBEAT, "--heartbeat-timeout", "30"]
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        master.proc.kill()
        master.proc.wait()
        j = Joined(s, "decode", "127.0.0.2", token, tmp_path / "joined.log")
        try:
            assert j.proc.wait(60) == 1
        finally:
            j.stop()
        said = " ".join((tmp_path / "joined.log").read_text().split())
        assert f"cannot join the router's Mooncake store (master {master.addr}) from 127.0.0.2" in said, said
        assert any("joining from" in line and f"master {master.addr}" in line for line in s.log), list(s.log)
        assert set(wait_for(s.url, lambda b: True, "", 1)["workers"]) == {"prefill-0", "decode-0"}
        assert stream(s.url, {"prompt": _ids(300, 5), "max_tokens": 2, "ignore_eos": True}).status == 200


def test_the_sim_engine_default_store_models_the_builtin_capacity_in_little_memory():
    """``--engine sim --kv-store mooncake`` without ``--kv-store-gb``: the default 1,024 GB of modeled host DRAM,
    as the built-in store's (the same capacity in blocks), while the memory owner takes only a checksum a block;
    the store takes the sim engine's puts. Before, it asked this host for 1,024 GB: the memory owner aborted
    ("Failed to allocate segment memory") and the server did not start."""
    base = ["--engine", "sim", "--sim-time-scale", "0", "--mode", "disaggregated", "--prefill-workers", "1",
            "--decode-workers", "1"]
    caps = {}
    for store in ("builtin", "mooncake"):
        with EmbeddedServer(base + ["--kv-store", store], startup_timeout_s=90) as s:
            assert stream(s.url, {"prompt": _ids(3000, 7), "max_tokens": 4, "ignore_eos": True}).status == 200
            assert _wait_metric(s.url, "paasbench_kv_store_put_blocks_total", 1) >= 1
            _, text = get(s.url, "/metrics")
            caps[store] = metric(text, "paasbench_kv_store_capacity_blocks")
            block = metric(text, "paasbench_kv_store_block_bytes")
    assert caps["mooncake"] == caps["builtin"] == 1024e9 // block, caps


def test_a_store_larger_than_the_host_exits_2_naming_kv_store_gb():
    """Before: the memory owner aborted after the workers had started, exit 1, the reason deep in its log."""
    res = CliRunner().invoke(main, ["serve", "--port", "0", "--kv-store", "mooncake", "--kv-store-gb", "1e6"])
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())
    assert "--kv-store-gb" in said and "GB available" in said, said


def _offered_hit(prompts: list[tuple[str, list[int]]]) -> float:
    """An infinite cache filled by the sent prompts: each request's leading full blocks seen before (per tenant)."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    hit = total = 0
    for tenant, p in prompts:
        n, h = 0, True
        for i in range(len(p) // BS):
            key = (tenant, tuple(p[:(i + 1) * BS]))
            if h and key in seen:
                n += 1
            else:
                h = False
            seen.add(key)
        hit += n * BS
        total += len(p)
    return hit / total


def test_agent_workload_hits_what_it_offers_in_2p2d():
    # 3 agent sessions x 4 turns: each turn re-sends the whole context plus a tool result, long (400 tokens:
    # prefilled remotely) and short (100: prefilled on the decode worker) in turn. A long turn's prefill worker
    # lacks the blocks the decode worker computed for the short turn before it: it onboards them from the store.
    args = ["--mode", "disaggregated", "--prefill-workers", "2", "--decode-workers", "2", "--block-size", str(BS),
            "--routing", "threshold", "--remote-prefill-threshold", "200", "--kv-store", "mooncake",
            "--kv-store-gb", "0.05", "--trust-tenant-header", "--kv-budget-mb", "8"]
    ctx = {s: _ids(300, 100 + s) for s in range(3)}
    sent: list[tuple[str, list[int]]] = []
    cached = 0
    with EmbeddedServer(args, startup_timeout_s=120) as s:
        for turn in range(4):
            for sess in range(3):
                ctx[sess] = ctx[sess] + _ids(100 if turn % 2 else 400, 1000 * turn + sess)
                r = stream(s.url, {"prompt": ctx[sess], "max_tokens": 4, "ignore_eos": True},
                           headers={"x-tenant": f"t{sess % 2}"})
                assert r.status == 200
                sent.append((f"t{sess % 2}", ctx[sess]))
                cached += r.usage["prompt_tokens_details"]["cached_tokens"]
            time.sleep(0.3)           # the agent's tool call; the last turn's blocks are published meanwhile
        _, text = get(s.url, "/metrics")
    offered = _offered_hit(sent)
    served = cached / sum(len(p) for _, p in sent)
    print(f"offered hit {offered:.3f}, server hit {served:.3f}, store hit tokens "
          f"{metric(text, 'paasbench_kv_store_hit_tokens_total'):.0f}")
    assert offered > 0.5
    assert abs(served - offered) <= 0.02
    assert metric(text, "paasbench_kv_store_hit_tokens_total") > 0      # the store, not only local caches
    assert metric(text, "paasbench_kv_store_errors_total") == 0


# 80 consecutive requests of the public Mooncake (FAST'25) conversation trace (kvcache-ai/Mooncake,
# FAST25-release/traces/conversation_trace.jsonl, lines 5281-5360, timestamps rebased to 0): 24 s, 782K input
# tokens, 14.6% token-weighted offered hit, the densest 80-request window of the file.
MOONCAKE_SLICE = Path(__file__).parent / "fixtures" / "trace" / "mooncake_conversation_slice.jsonl"
# The store holds both replays (the white-paper one alone stored about 3,400 blocks of 512 tokens): the hit is the
# traffic's only where nothing is evicted. --kv-store-gb is honoured on the sim (issue 30): 0.25 GB, 476 blocks,
# evicted 2,964 and read a gap of -1.22 points in CI. On the sim a block's value is its 8-byte sum, so 16 GB
# modeled takes Mooncake's smallest segment, 16 MiB.
TWIN_2P2D = ["--engine", "sim", "--mode", "disaggregated", "--prefill-workers", "2", "--decode-workers", "2",
             "--sim-time-scale", "0.01", "--kv-store", "mooncake", "--kv-store-gb", "16"]


def _replay(url: str, out: Path, *how: str) -> dict:
    """``paasbench run`` against ``url``: its summary's prefix-hit check (server hit vs the traffic's offered hit,
    paasbench/metrics/verify.py), every request answered."""
    res = CliRunner().invoke(main, ["run", "--target", url, "--prompt-format", "token-ids", "--out", str(out),
                                    "--no-live", *how])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"]["failed"] == 0, summary["requests"]
    return summary["prefix_hit_check"]


def test_public_trace_and_white_paper_hit_what_they_offer_on_mooncake_2p2d(tmp_path):
    """The acceptance of issue #16 on one 2P+2D twin (sim engine: the white paper's 64K-400K contexts at the
    block size both workloads use, 512) whose only shared store is Mooncake: a public Mooncake trace slice
    within 2 points of the hit it offers, the white-paper agent workload within 1 point. Each run salts its
    prompts, so the second finds nothing of the first."""
    with EmbeddedServer(TWIN_2P2D, startup_timeout_s=120) as s:
        trace = _replay(s.url, tmp_path / "trace", "--trace", str(MOONCAKE_SLICE), "--mode", "trace")
        paper = _replay(s.url, tmp_path / "paper", "--workload", "white-paper-agent", "--max-requests", "40")
        _, text = get(s.url, "/metrics")
    for name, check in (("mooncake trace slice", trace), ("white-paper-agent", paper)):
        print(f"{name}: offered {check['offered']:.4f}, server {check['measured']:.4f}, "
              f"gap {check['gap_points']:+.2f} points")
    assert trace["offered"] > 0.10 and abs(trace["gap_points"]) <= 2.0, trace
    assert paper["offered"] > 0.50 and abs(paper["gap_points"]) <= 1.0, paper
    assert metric(text, "paasbench_kv_store_hit_tokens_total") > 0      # onboarded from Mooncake, not only local
    assert metric(text, "paasbench_kv_store_errors_total") == 0
    assert metric(text, "paasbench_kv_store_evictions_total") == 0      # the store held it all: the hit is the traffic's


def test_another_hosts_master_killed_under_load_fails_no_request(master):
    """A master this server does not own (``mooncake://``) dies for good: nothing here can restart it, so the
    store stays down for the rest of the run. With the defaults a user gets (``--heartbeat-timeout 3``), load
    goes on for 6 s after the kill, twice past the heartbeat timeout: every request is answered, no worker
    misses its heartbeat, the prefix is recomputed to the same answer, /health says degraded. Before, this ran
    with ``--heartbeat-timeout 30`` and 2 s of load after the kill: it could not see a worker held up by a
    store call miss its heartbeat (issue 30: all four of a 2P + 2D server did)."""
    args = ONBOARD_ARGS + ["--kv-store", f"mooncake://{master.addr}"]
    p1 = _ids(600, 11)
    results: list[int] = []
    stop = threading.Event()

    def load(url: str) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            results.append(stream(url, {"prompt": p1 + _ids(1200, 100 + i), "max_tokens": 4,
                                        "ignore_eos": True}).status)

    with EmbeddedServer(args, startup_timeout_s=90) as s:
        assert stream(s.url, {"prompt": p1, "max_tokens": 4, "ignore_eos": True}).status == 200
        _wait_metric(s.url, "paasbench_kv_store_put_blocks_total", 9)
        assert json.loads(get(s.url, "/health")[1])["status"] == "ok"
        t = threading.Thread(target=load, args=(s.url,))
        t.start()
        time.sleep(1.0)
        master.proc.kill()
        master.proc.wait()
        time.sleep(6.0)
        stop.set()
        t.join(120)
        # after the master: the prefix the store held is recomputed, and the answer is the same
        after = stream(s.url, {"prompt": p1 + _ids(1500, 2), "max_tokens": 8, "ignore_eos": True})
        fresh = stream(s.url, {"prompt": p1 + _ids(1500, 2), "max_tokens": 8, "ignore_eos": True},
                       headers={"x-tenant": "other"})
        code, body = get(s.url, "/health")
        _, text = get(s.url, "/metrics")
    assert len(results) >= 4 and set(results) == {200}
    assert after.status == fresh.status == 200 and after.text == fresh.text
    state = json.loads(body)
    assert code == 200 and state["status"] == "degraded" and state["restarts"] == 0, state
    assert "mooncake master" in state["down"]
    assert metric(text, "paasbench_kv_store_errors_total") + metric(text, "paasbench_kv_store_timeouts_total") >= 1


def test_corrupt_blocks_are_recomputed_never_installed(master):
    from mooncake.store import MooncakeDistributedStore

    from reference_server.config import ServerConfig
    from reference_server.engine import create_engine
    from reference_server.kv.block_manager import BlockManager

    shape = create_engine("cpu", block_size=BS, num_blocks=2, model=ServerConfig().model).shape
    nbytes = BS * shape.host_bytes_per_token()
    p1 = _ids(600, 21)
    p2 = p1 + _ids(1500, 22)
    keys = [f"pkv/{nbytes}/{h.hex()}"
            for h in BlockManager(2, BS, f"{shape.name}@{shape.version}/bs{BS}").lookup("default", p1)[1]]
    args = ONBOARD_ARGS + ["--kv-store", f"mooncake://{master.addr}"]
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        # a foreign writer got there first: right size, wrong bytes (Mooncake keeps a key's first value)
        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.addr) == 0
        assert all(raw.put(k, b"\x07" * (nbytes + 8)) == 0 for k in keys)
        r1 = stream(s.url, {"prompt": p1, "max_tokens": 60, "ignore_eos": True})      # local on the decode worker
        r2 = stream(s.url, {"prompt": p2, "max_tokens": 8, "ignore_eos": True})       # the prefill worker onboards
        r3 = stream(s.url, {"prompt": p2, "max_tokens": 8, "ignore_eos": True}, headers={"x-tenant": "other"})
        _, text = get(s.url, "/metrics")
        raw.close()
    assert r1.status == r2.status == r3.status == 200
    # the onboarding read stops at the first corrupt block and drops it; a block rewritten since (a valid put
    # after the drop) may be read, a corrupt one never
    assert r2.timings["prefill_location"] == "remote" and r2.timings["store_hit_tokens"] < 9 * BS
    assert r2.text == r3.text                       # computed, not the corrupt KV
    assert metric(text, "paasbench_kv_store_corrupt_total") >= 1
