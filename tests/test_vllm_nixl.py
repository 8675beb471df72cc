"""The reference system on real engines with NIXL: paasbench's router over a vLLM prefill and a vLLM decode
instance joined by vLLM's NixlConnector (UCX, host memory), as on a GPU cluster (issue #22).

``serve --engine vllm`` with the default ``--kv-connector auto`` picks NIXL when vLLM's environment imports it
(``scripts/install_vllm_cpu.sh`` installs ``nixl==1.5.1``), with NIXL's progress thread off on a CPU host
(:mod:`reference_server.vllm_connectors`: on 2 cores it stalled requests until the prefill side's KV lease
expired). Checks, on the instances' own counters:

* a run of fresh long prompts, one at a time: each goes remote, the decode instance's connector reads it
  once (``vllm:nixl_xfer_time_seconds`` count +1), that read is the request's ``kv_transfer_ms``, the decode
  instance computes at most the last block, and no request's KV lease expired on the prefill instance;
* greedy output through P/D equals the decode instance's own (asked directly with a ``cache_salt``).

Runs only with ``PAASBENCH_VLLM_PYTHON`` whose environment has NIXL. Figures go to
``$PAASBENCH_VLLM_NIXL_FIGURES`` when set (and are printed with ``pytest -s``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from reference_server.launcher import EmbeddedServer
from reference_server.vllm_instance import nixl_importable, vllm_env
from tests.test_vllm_pd import BLOCK, KV, LONG, OSL, STARTUP_S, complete, counters, engine_url, prompt_ids, server_args
from tests.vllm_fixture import NO_VLLM, VLLM_PYTHON, write_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

XFER = "vllm:nixl_xfer_time_seconds"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
ROUNDS = 4
FIGURES: dict[str, Any] = {}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedServer, Path]]:
    if not VLLM_PYTHON:
        pytest.skip(NO_VLLM)
    if not nixl_importable(VLLM_PYTHON, vllm_env()):
        pytest.skip("NIXL not importable in vLLM's environment (scripts/install_vllm_cpu.sh installs nixl==1.5.1)")
    ckpt = write_checkpoint(tmp_path_factory.mktemp("vllm-nixl") / "ckpt")
    args = [a.replace("CKPT", str(ckpt)) for a in server_args("--prefill-workers", "1", "--decode-workers", "1",
                                                               "--routing", "threshold")]
    t0 = time.monotonic()
    srv = EmbeddedServer(args, startup_timeout_s=STARTUP_S, env={**os.environ, "PAASBENCH_VLLM_PYTHON": VLLM_PYTHON})
    srv.start()
    FIGURES["ready_s"] = round(time.monotonic() - t0, 1)
    try:
        yield srv, ckpt
    finally:
        srv.stop()
        print("\nvLLM P/D (NIXL) figures: " + json.dumps(FIGURES, indent=1), flush=True)
        if os.environ.get("PAASBENCH_VLLM_NIXL_FIGURES"):
            Path(os.environ["PAASBENCH_VLLM_NIXL_FIGURES"]).write_text(json.dumps(FIGURES, indent=1))


def test_nixl_moves_the_kv_and_times_it(pd: tuple[EmbeddedServer, Path]) -> None:
    srv, ckpt = pd
    prefill, decode = engine_url(srv, "prefill"), engine_url(srv, "decode")
    names = (*KV, XFER + "_sum", XFER + "_count", EXPIRED)
    complete(srv.url, prompt_ids(ckpt, LONG, seed=10))      # warm: the two agents' handshake happens here
    p0 = counters(prefill, *names)
    rows = []
    for k in range(ROUNDS):
        d0 = counters(decode, *names)
        out = complete(srv.url, prompt_ids(ckpt, LONG, seed=11 + k))
        d1 = counters(decode, *names)
        t, delta = out["timings"], {n: d1[n] - d0[n] for n in names}
        rows.append({"ttft_ms": round(1e3 * out["ttft_s"], 1), "route": t["prefill_location"],
                     "kv_tokens_transferred": delta["vllm:external_prefix_cache_hits_total"],
                     "decode_tokens_computed": LONG - delta["vllm:external_prefix_cache_hits_total"]
                     - delta["vllm:prefix_cache_hits_total"],
                     **{k2: t.get(k2) for k2 in ("prefill_ms", "kv_wait_ms", "kv_transfer_ms", "kv_transfer_source",
                                                 "decode_first_token_ms")}})
        assert t["prefill_location"] == "remote", t
        # the decode instance's connector read it once; that read is the request's kv_transfer_ms
        assert delta[XFER + "_count"] == 1 and t["kv_transfer_source"] == "connector", (delta, t)
        assert t["kv_transfer_ms"] == pytest.approx(1e3 * delta[XFER + "_sum"], rel=1e-6)
        assert 0 < t["kv_transfer_ms"] < t["decode_first_token_ms"], t
        # every whole block arrived by transfer; the decode instance computed at most the rest
        assert delta["vllm:external_prefix_cache_hits_total"] >= (LONG - 1) // BLOCK * BLOCK, delta
        assert out["usage"]["completion_tokens"] == OSL
    FIGURES["requests"] = rows
    p1 = counters(prefill, *names)
    FIGURES["kv_leases_expired"] = p1[EXPIRED] - p0[EXPIRED]
    assert p1[EXPIRED] == p0[EXPIRED], "a request's KV lease expired on the prefill instance (a stalled transfer)"


def test_nixl_greedy_equals_single_instance(pd: tuple[EmbeddedServer, Path]) -> None:
    srv, ckpt = pd
    prompt = prompt_ids(ckpt, LONG, seed=30)
    through = complete(srv.url, prompt)
    single = complete(engine_url(srv, "decode"), prompt, cache_salt="single-instance", return_token_ids=True)
    FIGURES["greedy"] = {"pd_ttft_ms": round(1e3 * through["ttft_s"], 1),
                         "single_instance_ttft_ms": round(1e3 * single["ttft_s"], 1),
                         "same_tokens": through["text"] == single["text"]}
    assert through["timings"]["prefill_location"] == "remote"
    assert len(single["token_ids"]) == OSL and through["text"] == single["text"]
