"""The routing rule and the mode budget, without processes."""

from __future__ import annotations

from reference_server.config import ServerConfig, WorkerSpec
from reference_server.router import Router, WorkerHandle


def _router(threshold: int = 1000, bound: int = 2, prefill: int = 2) -> Router:
    cfg = ServerConfig(mode="disaggregated", remote_prefill_threshold=threshold, prefill_queue_bound=bound)
    r = Router(cfg)
    r.prefill = [WorkerHandle(WorkerSpec("prefill", i, cfg, "t"), process=None) for i in range(prefill)]
    return r


def test_remote_iff_uncached_exceeds_threshold():
    r = _router(threshold=1000)
    assert r.route(1000, 0) is None                 # exactly the threshold: local
    assert r.route(1001, 0) is r.prefill[0]         # above: remote
    assert r.route(8000, 7680) is None              # 320 uncached after the prefix hit: local
    assert r.route(8000, 6000) is not None          # 2000 uncached: remote


def test_prefill_queue_bound_and_least_loaded():
    r = _router(bound=2)
    r.prefill[0].inflight, r.prefill[1].inflight = 2, 1
    assert r.route(5000, 0) is r.prefill[1]         # least loaded
    r.prefill[1].inflight = 2
    assert r.route(5000, 0) is None                 # every prefill queue full: prefill locally
    assert _router(bound=0).route(5000, 0) is None  # bound 0 disables remote prefill


def test_no_prefill_pool_means_local():
    r = _router(prefill=0)
    assert r.route(10**6, 0) is None


def test_same_worker_budget_across_modes():
    assert ServerConfig(mode="colocated", workers=4).pools() == {"mixed": 4}
    assert ServerConfig(mode="chunked", workers=4).pools() == {"mixed": 4}
    assert ServerConfig(mode="disaggregated", workers=4).pools() == {"prefill": 2, "decode": 2}
    assert ServerConfig(mode="disaggregated", workers=3).pools() == {"prefill": 1, "decode": 2}
    assert ServerConfig(mode="disaggregated", workers=4, prefill_workers=3).pools() == {"prefill": 3, "decode": 1}
    assert ServerConfig(mode="disaggregated", prefill_workers=1, decode_workers=3).pools() == {"prefill": 1, "decode": 3}


def test_unknown_model_or_profile_exits_2_before_spawning():
    from click.testing import CliRunner

    from reference_server.cli import serve

    r = CliRunner().invoke(serve, ["--model", "huge", "--port", "0"])
    assert r.exit_code == 2 and "unknown cpu model 'huge'" in r.output
    r = CliRunner().invoke(serve, ["--engine", "sim", "--device-profile", "nope", "--port", "0"])
    assert r.exit_code == 2 and "nope" in r.output
