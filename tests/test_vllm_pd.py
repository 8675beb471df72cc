"""The reference system on real engines: paasbench's router over a vLLM prefill and a vLLM decode instance.

One ``serve --engine vllm --kv-connector example`` (issue #22) starts 1 prefill + 1 decode vLLM instance
(vLLM's shared-storage ExampleConnector between them, timed: :mod:`reference_server.vllm_connectors`; NIXL is
tests/test_vllm_nixl.py) behind the threshold rule; a second router (``--routing cost``) is attached to
the same two instances (``--vllm-prefill-url/--vllm-decode-url``), so the module starts vLLM twice, not four
times. The decode instance also serves as the single-instance baseline, asked directly with a ``cache_salt``
(its prefix cache then holds nothing of the prompt, and the connector's storage holds nothing yet). Checks:

* greedy output through P/D (remote prefill + KV transfer) equals that single instance's for the same prompt,
  and so does every prompt's through a third router (attached) that sends all of them remote (threshold 0);
* the KV arrived by transfer: over the P/D request the decode instance's own ``vllm:external_prefix_cache_hits``
  counter (tokens its connector loaded) grows by the prompt's whole blocks, and it computed only the rest;
* the connector's own times are the request's: ``kv_transfer_ms`` is what the decode instance's
  ``vllm:example_connector_load_time_seconds`` gained over the request (one load), ``kv_write_ms`` what the
  prefill instance's ``..._save_time_seconds`` gained, each inside its instance's own request time;
  ``transfer_bytes`` the bytes of the request's files the decode instance read;
* the router's ``/v1/models`` says the instances' ``max_model_len`` and its ``/tokenize`` counts as usage does;
* the threshold rule sends a short prompt local and a long one remote, and the same long prompt local again
  once the decode worker's hit (confirmed by vLLM's ``cached_tokens``) leaves it under the threshold;
* the cost rule decides on the instances' own estimates (``route_local_est_ms`` vs ``route_remote_est_ms``);
* the server's ``/metrics`` passes both instances' ``vllm:*`` series through, labelled by worker; stopping the
  server removes the connector's directory and every vLLM process.

Figures (KV tokens transferred vs computed, TTFT P/D vs single instance, routing decisions) are printed
(``pytest -s``) and written to ``$PAASBENCH_VLLM_PD_FIGURES`` when set. Runs only with ``PAASBENCH_VLLM_PYTHON``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from paasbench.metrics.prometheus import scrape
from reference_server.launcher import EmbeddedServer
from tests.proctree import wait_gone
from tests.vllm_fixture import BLOCK, MODEL, NO_VLLM, VLLM_PYTHON, write_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

THRESHOLD = 200                  # --remote-prefill-threshold: uncached tokens above it go remote
LONG, SHORT, OSL = 700, 64, 16
STARTUP_S = 1200                 # two vLLM instances starting at once on the busy 2-core box
FIGURES: dict[str, Any] = {}


def server_args(*extra: str) -> list[str]:
    return ["--engine", "vllm", "--model", "CKPT", "--model-name", MODEL, "--block-size", str(BLOCK),
            "--remote-prefill-threshold", str(THRESHOLD), "--max-num-seqs", "16",
            "--vllm-args", "--dtype float32 --max-model-len 4096", *extra]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("vllm-pd") / "ckpt")


@pytest.fixture(scope="module")
def pd(ckpt: Path) -> Iterator[EmbeddedServer]:
    """``serve --engine vllm``: 1 prefill + 1 decode vLLM instance, threshold rule."""
    if not VLLM_PYTHON:
        pytest.skip(NO_VLLM)
    args = [a.replace("CKPT", str(ckpt)) for a in server_args("--prefill-workers", "1", "--decode-workers", "1",
                                                               "--routing", "threshold", "--kv-connector", "example")]
    t0 = time.monotonic()
    srv = EmbeddedServer(args, startup_timeout_s=STARTUP_S, env={**os.environ, "PAASBENCH_VLLM_PYTHON": VLLM_PYTHON})
    srv.start()
    FIGURES["ready_s"] = round(time.monotonic() - t0, 1)
    try:
        yield srv
    finally:
        srv.stop()
        _report()


def _report() -> None:
    if FIGURES:
        print("\nvLLM P/D figures: " + json.dumps(FIGURES, indent=1), flush=True)
        if os.environ.get("PAASBENCH_VLLM_PD_FIGURES"):
            Path(os.environ["PAASBENCH_VLLM_PD_FIGURES"]).write_text(json.dumps(FIGURES, indent=1))


def engine_url(srv: EmbeddedServer, role: str) -> str:
    return srv.procs[f"{role}-0"]["engine_url"]


def prompt_ids(ckpt: Path, n: int, seed: int) -> list[int]:
    """``n`` token ids of ordinary words (no special tokens), different per seed."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    special = set(tok.get_added_tokens_decoder())
    ids = [i for i in range(tok.get_vocab_size()) if i not in special]
    rng = random.Random(seed)
    return [rng.choice(ids) for _ in range(n)]


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    """One streamed greedy completion: its text, client TTFT, usage and (from paasbench's router) timings."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": OSL, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    out: dict[str, Any] = {"text": "", "ttft_s": None, "usage": None, "timings": None, "token_ids": []}
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            for ch in ev.get("choices") or []:
                if ch.get("text") and out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                out["text"] += ch.get("text") or ""
                out["token_ids"] += ch.get("token_ids") or []
            out["usage"] = ev.get("usage") or out["usage"]
            out["timings"] = ev.get("paasbench_timings") or out["timings"]
    return out


def counters(url: str, *names: str) -> dict[str, float]:
    sc = scrape(url)
    assert sc.error is None, sc.error
    return {n: sc.total(n) or 0.0 for n in names}


KV = ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total")
SAVE, LOAD = "vllm:example_connector_save_time_seconds", "vllm:example_connector_load_time_seconds"
TIMES = tuple(f"{h}_{s}" for h in (SAVE, LOAD) for s in ("sum", "count"))


def scratch_dir(srv: EmbeddedServer) -> Path:
    """The server's directory for vLLM's logs and the connector's KV files (``kv/``)."""
    return Path(srv.procs["decode-0"]["engine_log"]).parent


def test_pd_greedy_equals_single_instance_and_kv_arrived_by_transfer(pd: EmbeddedServer, ckpt: Path) -> None:
    """A fresh prompt through P/D, then the same prompt on the decode instance alone. The ExampleConnector
    saves and loads on every instance whatever its role, keyed by the prompt's tokens only, so before the
    single-instance run its files are removed and the request carries a ``cache_salt`` (vLLM's own prefix
    cache then misses too): that instance computes every token itself, as the counters confirm."""
    prompt = prompt_ids(ckpt, LONG, seed=1)
    prefill, decode = engine_url(pd, "prefill"), engine_url(pd, "decode")
    complete(pd.url, prompt_ids(ckpt, LONG, seed=0))    # warm: router's tokenizer, both instances, the connector
    p0, d0 = counters(prefill, *KV, *TIMES), counters(decode, *KV, *TIMES)
    folders = set((scratch_dir(pd) / "kv").iterdir())
    through = complete(pd.url, prompt)
    p1, d1 = counters(prefill, *KV, *TIMES), counters(decode, *KV, *TIMES)
    written = [sum(f.stat().st_size for f in d.iterdir()) for d in set((scratch_dir(pd) / "kv").iterdir()) - folders]
    for f in (scratch_dir(pd) / "kv").iterdir():
        shutil.rmtree(f)
    single = complete(decode, prompt, cache_salt="single-instance", return_token_ids=True)
    d2 = counters(decode, *KV)
    pd_p = {k: p1[k] - p0[k] for k in KV + TIMES}
    pd_d = {k: d1[k] - d0[k] for k in KV + TIMES}
    alone = {k: d2[k] - d1[k] for k in KV}
    t = through["timings"]
    loaded = pd_d["vllm:external_prefix_cache_hits_total"]
    FIGURES["pd_request"] = {
        "prompt_tokens": LONG, "route": t["prefill_location"], "route_reason": t["route_reason"],
        "prefill_instance_tokens_computed": LONG - pd_p["vllm:external_prefix_cache_hits_total"]
        - pd_p["vllm:prefix_cache_hits_total"],
        "kv_tokens_transferred": loaded,
        "decode_instance_tokens_computed": LONG - loaded - pd_d["vllm:prefix_cache_hits_total"],
        "ttft_ms_pd": 1e3 * through["ttft_s"], "ttft_ms_single_instance": 1e3 * single["ttft_s"],
        "single_instance_tokens_loaded_or_cached": alone["vllm:external_prefix_cache_hits_total"]
        + alone["vllm:prefix_cache_hits_total"],
        "usage": through["usage"], "timings": {k: t.get(k) for k in (
            "queue_ms", "prefill_ms", "kv_write_ms", "kv_wait_ms", "kv_transfer_ms", "kv_transfer_source",
            "decode_first_token_ms")}}
    assert t["prefill_location"] == "remote" and t["route_reason"] == "above-threshold", t
    # the prefill instance computed the whole prompt; every whole block of it except the last token's reached
    # the decode instance through the connector, which computed only the rest
    assert pd_p["vllm:external_prefix_cache_hits_total"] == pd_p["vllm:prefix_cache_hits_total"] == 0, pd_p
    assert loaded == (LONG - 1) // BLOCK * BLOCK and pd_d["vllm:prefix_cache_hits_total"] == 0, pd_d
    # the single instance computed everything itself, and produced the same greedy tokens
    assert alone["vllm:external_prefix_cache_hits_total"] == alone["vllm:prefix_cache_hits_total"] == 0, alone
    assert len(single["token_ids"]) == OSL and through["text"] == single["text"], (through["text"], single["text"])
    assert through["usage"]["prompt_tokens"] == LONG and through["usage"]["completion_tokens"] == OSL
    # the connector's own times, as each instance's /metrics has them: the decode instance loaded this
    # request's files once, in kv_transfer_ms, within its time to first token; the prefill instance wrote
    # them, in kv_write_ms, within its prefill
    assert pd_d[LOAD + "_count"] == 1 and t["kv_transfer_source"] == "connector", (pd_d, t)
    assert t["kv_transfer_ms"] == pytest.approx(1e3 * pd_d[LOAD + "_sum"], rel=1e-6)
    assert 0 < t["kv_transfer_ms"] < t["decode_first_token_ms"], t
    # the bytes moved are the request's files the decode instance read (its connector's own count, one folder
    # of one file per layer); at least the KV of the tokens it loaded, K and V of every layer, 4-byte floats
    cfg = json.loads((ckpt / "config.json").read_text())
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["hidden_size"] \
        // cfg["num_attention_heads"] * 4
    FIGURES["pd_request"]["transfer_bytes"] = t.get("transfer_bytes")
    assert t["transfer_bytes"] in written and t["transfer_bytes"] >= loaded * kv_per_token, (t, written, loaded)
    assert pd_p[SAVE + "_count"] >= 1 and t["kv_write_ms"] == pytest.approx(
        1e3 * pd_p[SAVE + "_sum"] / pd_p[SAVE + "_count"], rel=1e-6), (pd_p, t)
    assert 0 < t["kv_write_ms"] < t["prefill_ms"], t


def test_threshold_rule_on_the_decode_instances_hit(pd: EmbeddedServer, ckpt: Path) -> None:
    short = complete(pd.url, prompt_ids(ckpt, SHORT, seed=2))["timings"]
    long_prompt = prompt_ids(ckpt, LONG, seed=3)
    first = complete(pd.url, long_prompt)["timings"]
    again = complete(pd.url, long_prompt)
    FIGURES["threshold_decisions"] = [
        {k: x[k] for k in ("prefill_location", "route_reason", "route_decode_hit_tokens", "engine_cached_tokens")}
        for x in (short, first, again["timings"])]
    assert (short["prefill_location"], short["route_reason"]) == ("local", "below-threshold"), short
    assert (first["prefill_location"], first["route_reason"]) == ("remote", "above-threshold"), first
    t = again["timings"]
    assert (t["prefill_location"], t["route_reason"]) == ("local", "below-threshold"), t
    assert LONG - t["route_decode_hit_tokens"] <= THRESHOLD
    # the hit the rule used is the one vLLM then reported for that very request
    assert t["engine_cached_tokens"] >= t["route_decode_hit_tokens"] > 0, t
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == t["engine_cached_tokens"]


def test_cost_rule_on_the_instances_estimates(pd: EmbeddedServer, ckpt: Path) -> None:
    """A second router over the same two instances (attached), cost rule: the first long prompt has no
    estimate yet (the threshold floor decides, remote); a short one runs local; then each side has measured its
    own seconds per token, and the next long prompt goes where the estimates say."""
    args = [a.replace("CKPT", str(ckpt)) for a in server_args(
        "--routing", "cost", "--vllm-prefill-url", engine_url(pd, "prefill"),
        "--vllm-decode-url", engine_url(pd, "decode"))]
    with EmbeddedServer(args, startup_timeout_s=120) as cost:
        warm_remote = complete(cost.url, prompt_ids(ckpt, LONG, seed=4))["timings"]
        warm_local = complete(cost.url, prompt_ids(ckpt, SHORT, seed=5))["timings"]
        t = complete(cost.url, prompt_ids(ckpt, LONG, seed=6))["timings"]
        m = urllib.request.urlopen(cost.url + "/metrics", timeout=30).read().decode()
    FIGURES["cost_decisions"] = [{k: x.get(k) for k in ("prefill_location", "route_reason", "route_local_est_ms",
                                                      "route_remote_est_ms", "route_transfer_est_ms")}
                                 for x in (warm_remote, warm_local, t)]
    assert warm_remote["route_reason"] == "no-estimate" and warm_remote["prefill_location"] == "remote"
    assert warm_local["prefill_location"] == "local"
    assert t["route_reason"] in ("cheaper-local", "cheaper-remote"), t
    assert (t["prefill_location"] == "remote") == (t["route_remote_est_ms"] < t["route_local_est_ms"]), t
    # /metrics: the router's own figures and both instances' series, labelled
    assert "paasbench_requests_routed_total" in m
    for role in ("prefill", "decode"):
        assert f'vllm:prompt_tokens_total{{worker="{role}-0"' in m


def test_every_prompt_remote_equals_one_plain_instance(pd: EmbeddedServer, ckpt: Path) -> None:
    """A second router over the module's two instances with ``--remote-prefill-threshold 0``: every prompt is
    prefilled on the prefill instance and its KV loaded by the decode instance, whatever its length or its hit
    there (a fresh long prompt; one extending it, the decode instance holding its prefix; one of two blocks;
    one shorter than a block, nothing whole to move). Each one's greedy output equals the decode instance's
    alone for the same prompt, computed there from nothing (its connector's files removed, a ``cache_salt``
    its own prefix cache cannot match)."""
    long_prompt = prompt_ids(ckpt, LONG, seed=10)
    prompts = [long_prompt, long_prompt + prompt_ids(ckpt, 100, seed=11), prompt_ids(ckpt, SHORT, seed=12),
               prompt_ids(ckpt, 20, seed=13)]
    args = [a.replace("CKPT", str(ckpt)) for a in server_args(
        "--routing", "threshold", "--vllm-prefill-url", engine_url(pd, "prefill"),
        "--vllm-decode-url", engine_url(pd, "decode"))]
    args[args.index("--remote-prefill-threshold") + 1] = "0"
    with EmbeddedServer(args, startup_timeout_s=120) as remote:
        through = [complete(remote.url, p) for p in prompts]
    decode = engine_url(pd, "decode")
    alone = []
    for i, p in enumerate(prompts):
        for f in (scratch_dir(pd) / "kv").iterdir():
            shutil.rmtree(f)
        before = counters(decode, *KV)
        alone.append(complete(decode, p, cache_salt=f"plain-{i}", return_token_ids=True))
        after = counters(decode, *KV)
        # computed every token itself: nothing loaded, nothing from its own cache
        assert after[KV[0]] == before[KV[0]] and after[KV[1]] == before[KV[1]], (i, before, after)
    FIGURES["all_remote"] = [{"prompt_tokens": len(p), "route": t["timings"]["prefill_location"],
                              "route_decode_hit_tokens": t["timings"].get("route_decode_hit_tokens"),
                              "transfer_bytes": t["timings"].get("transfer_bytes"),
                              "same_output": t["text"] == a["text"]} for p, t, a in zip(prompts, through, alone)]
    for i, (t, a) in enumerate(zip(through, alone)):
        assert t["timings"]["prefill_location"] == "remote", (i, t["timings"])
        assert t["usage"]["completion_tokens"] == len(a["token_ids"]) == OSL
        assert t["text"] == a["text"], (i, t["text"], a["text"])
    assert through[1]["timings"]["route_decode_hit_tokens"] > 0         # remote although its prefix was cached


def test_router_says_the_instances_limit_and_tokenizes(pd: EmbeddedServer, ckpt: Path) -> None:
    """The router's ``/v1/models`` says the instances' own ``max_model_len`` (4,096: ``--max-model-len``), not its
    decode instance's KV pool (1,048,576 tokens before), and its ``/tokenize`` counts a prompt as the request's
    usage will, so the pre-flight can stop an over-long prompt before any load."""
    models = json.loads(urllib.request.urlopen(pd.url + "/v1/models", timeout=30).read())
    assert models["data"][0]["max_model_len"] == 4096, models
    text = "one two three four five"
    req = urllib.request.Request(pd.url + "/tokenize", json.dumps({"model": MODEL, "prompt": text}).encode(),
                                 {"Content-Type": "application/json"})
    tok = json.loads(urllib.request.urlopen(req, timeout=30).read())
    out = complete(pd.url, text)
    assert tok["count"] == out["usage"]["prompt_tokens"] > 0 and tok["max_model_len"] == 4096, (tok, out["usage"])


def test_stop_cleans_up(pd: EmbeddedServer) -> None:
    """Last in the module: stopping the server ends both vLLM process groups and removes the connector's
    files (the connector itself never deletes them)."""
    health = json.loads(urllib.request.urlopen(pd.url + "/health", timeout=10).read())
    assert health["status"] == "ok"
    pgids = [int(pd.procs[f"{r}-0"]["engine_pgid"]) for r in ("prefill", "decode")]
    scratch = scratch_dir(pd)
    files = [p for p in (scratch / "kv").rglob("*") if p.is_file()]
    FIGURES["connector_files_at_stop"] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    assert files, "the connector wrote no KV files"
    pd.stop()
    assert wait_gone(pgids, 30) == []
    deadline = time.monotonic() + 60           # nothing left in either instance's group (API server, engine
    while group_members(pgids) and time.monotonic() < deadline:   # core: SIGKILLed, the kernel may lag)
        time.sleep(0.5)
    assert group_members(pgids) == []
    assert not scratch.exists()


def group_members(pgids: list[int]) -> list[int]:
    """Live (not zombie) processes whose process group is one of ``pgids``, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            out.append(int(stat.parent.name))
    return out
