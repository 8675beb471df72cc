"""Synthetic load without a trace file (`--isl/--osl/--prefix-tokens/--prefix-hit`): built by the workload
generator, seeded, inspect-able, sent at exactly the asked lengths; bad values name their option (exit 2)."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from click.testing import CliRunner
from sse_server import SSEServer

from paas_common.tokenizer import encode
from paasbench.cli import main
from paasbench.load.prompts import PromptBuilder
from paasbench.trace.inspect import inspect_trace
from paasbench.trace.mooncake import read_trace
from paasbench.workload.synthetic import Synthetic, synthetic_trace


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with SSEServer(record=tmp_path_factory.mktemp("srv") / "bodies.jsonl", ttft_ms=1, itl_ms=0.5) as srv:
        yield srv


def test_run_isl_osl_prefix_hit_sends_that_load_and_writes_an_inspectable_trace(server, tmp_path):
    server.take_bodies()
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", "--target", server.url, "--isl", "512", "--osl", "8", "--prefix-hit",
                                    "0.75", "--rate", "100", "--max-requests", "40", "--out", str(out), "--no-live"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    syn = summary["meta"]["synthetic"]
    assert summary["requests"]["ok"] == 40 and syn["isl"] == "512" and syn["prefix_hit"] == 0.75
    bs = syn["block_size"]
    inspect = CliRunner().invoke(main, ["trace", "inspect", str(out / "trace.jsonl"), "--block-size", str(bs),
                                        "--json"])
    assert inspect.exit_code == 0, inspect.output
    stats = json.loads(inspect.output)
    assert stats["requests"] == 40 and stats["input_tokens_min"] == stats["input_tokens_max"] == 512
    assert abs(stats["hit_ratio_tokens"] - 0.75) <= 0.01
    bodies = server.take_bodies()
    assert len(bodies) == 40 and {b["max_tokens"] for b in bodies} == {8}
    assert {len(encode(b["prompt"])) for b in bodies} == {512}
    salt = int(summary["meta"]["prompt_salt"], 16)  # the run's own: another run would send other text
    prefix = "".join(PromptBuilder(bs, salt=salt).block_text(h) for h in range(syn["prefix_tokens_shared"] // bs))
    assert syn["prefix_tokens_shared"] > 0 and all(b["prompt"].startswith(prefix) for b in bodies)
    assert len({b["prompt"][len(prefix):] for b in bodies}) == 40  # the rest is each request's own


def test_same_options_and_seed_same_trace(tmp_path):
    def gen(name: str, *extra: str) -> str:
        res = CliRunner().invoke(main, ["trace", "gen", "--isl", "normal:1024:128", "--osl", "lognormal:64:0.5",
                                        "--prefix-tokens", "256", "--requests", "50", "--block-size", "16", "-o", str(tmp_path / name),
                                        *extra])
        assert res.exit_code == 0, res.output
        return (tmp_path / name).read_text()

    assert gen("a.jsonl") == gen("b.jsonl") != gen("c.jsonl", "--seed", "3")
    tr = read_trace(tmp_path / "a.jsonl", block_size=16)
    assert len(tr) == 50 and all(r.hash_ids[:16] == list(range(16)) for r in tr.requests)  # 256 shared tokens


@pytest.mark.parametrize("isl,mean,std", [("normal:2048:256", 2048, 256), ("uniform:1000:3000", 2000, 577),
                                          ("lognormal:2048:0.25", 2048, 2048 * 0.2526)])
def test_length_distributions(isl, mean, std):
    tr = synthetic_trace(Synthetic(isl=isl, osl="16", requests=2000), seed=1)
    x = np.array([r.input_length for r in tr.requests])
    assert abs(x.mean() - mean) < 0.03 * mean and abs(x.std() - std) < 0.1 * std
    assert inspect_trace(tr)["hit_ratio_tokens"] == 0.0


@pytest.mark.parametrize("args,option", [
    (["--isl", "normal:2048", "--osl", "8"], "--isl"), (["--isl", "abc", "--osl", "8"], "--isl"),
    (["--isl", "zipf:1:2", "--osl", "8"], "--isl"), (["--isl", "0", "--osl", "8"], "--isl"), (["--isl", "512", "--osl", "-4"], "--osl"), (["--isl", "512"], "--osl"),
    (["--osl", "64"], "--osl"), (["--isl", "512", "--osl", "8", "--prefix-hit", "1.5"], "--prefix-hit"),
    (["--isl", "512", "--osl", "8", "--prefix-tokens", "600"], "--prefix-tokens"),
    (["--isl", "512", "--osl", "8", "--prefix-tokens", "64", "--prefix-hit", "0.5"], "--prefix-hit"),
    (["--isl", "512", "--osl", "8", "--prefix-tokens", "-1"], "--prefix-tokens"),
    (["--isl", "512", "--osl", "8", "--rate", "0"], "rate"),
])
def test_bad_synthetic_values_exit_2_naming_the_option(tmp_path, args, option):
    rate = [] if "--rate" in args else ["--rate", "5"]
    res = CliRunner().invoke(main, ["run", "--target", "http://127.0.0.1:9", "--out", str(tmp_path / "o"),
                                    *rate, *args])
    assert res.exit_code == 2, res.output
    assert f"'{option}'" in res.output


def test_synthetic_needs_a_load_and_excludes_a_trace(tmp_path):
    base = ["run", "--target", "http://127.0.0.1:9", "--out", str(tmp_path / "o"), "--isl", "64", "--osl", "4"]
    res = CliRunner().invoke(main, base)
    assert res.exit_code == 2 and "--rate or --concurrency" in res.output
    res = CliRunner().invoke(main, [*base, "--rate", "1", "--workload", "ci-small"])
    assert res.exit_code == 2 and "exactly one of" in res.output


def test_sweep_takes_synthetic_load(server, tmp_path):
    res = CliRunner().invoke(main, ["sweep", "--target", server.url, "--isl", "256", "--osl", "4", "--prefix-hit",
                                    "0.5", "--slo", "p50(ttft) <= 1000ms", "--max-steps", "1", "--step-duration",
                                    "1", "--warmup", "0", "--start", "5", "--bisect-steps", "0",
                                    "--out", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert "synthetic isl=256" in data["meta"]["workload"] and data["steps"][0]["summary"]["requests"]["ok"] >= 4
    assert {len(encode(b["prompt"])) for b in server.take_bodies()} == {256}


def test_prefix_hit_says_how_it_reshaped_the_asked_lengths(tmp_path):
    # before: --isl normal:2048:256 --prefix-hit 0.9 raised 77 of 298 lengths to exactly 1,873 tokens, and with
    # 12 requests the shared prefix (2,096) was longer than the 2,048 mean, without a word
    trace = synthetic_trace(Synthetic(isl="normal:2048:256", osl="8", requests=298, prefix_hit=0.9))
    syn = trace.meta["synthetic"]
    lengths = np.array([r.input_length for r in trace.requests])
    r = syn["reshaped"]
    assert r["raised"] == int((lengths == r["to_tokens"]).sum()) == 87 and r["to_tokens"] == 1889
    assert abs(r["mean_sent"] - lengths.mean()) < 1e-9
    res = CliRunner().invoke(main, ["run", "--target", "http://127.0.0.1:9", "--isl", "normal:2048:256", "--osl", "8",
                                    "--prefix-hit", "0.9", "--rate", "4", "--max-requests", "12", "--out",
                                    str(tmp_path / "o"), "--no-live", "--model", "m"], env={"COLUMNS": "400"})
    assert "8 of 12 input lengths drawn from --isl normal:2048:256" in res.output, res.output
    assert "raised to 2,113" in res.output and "the prefix is longer than the mean asked" in res.output
    # lengths the prefix does not reach are left alone, and nothing is said
    assert synthetic_trace(Synthetic(isl="normal:8192:256", osl="8", requests=50, prefix_hit=0.5)
                           ).meta["synthetic"]["reshaped"] is None


@pytest.mark.parametrize("report", ["models_block_size", "vllm_block_size"])
def test_prefix_is_sized_in_the_targets_own_blocks(tmp_path, report):
    # before: the prefix was sized in 16-token blocks whatever the server cached in: a 1,872-token prefix on a
    # 512-token-block server is cached as 1,536 tokens, and the server reported 0.56 hit against 0.894 announced
    with SSEServer(ttft_ms=1, itl_ms=0.5, **{report: 256}) as srv:
        out = tmp_path / "o"
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--isl", "4096", "--osl", "2", "--prefix-hit",
                                        "0.77", "--rate", "100", "--max-requests", "20", "--out", str(out),
                                        "--no-live"], env={"COLUMNS": "400"})
        assert res.exit_code == 0, res.output
        syn = json.loads((out / "summary.json").read_text())["meta"]["synthetic"]
        assert syn["block_size"] == 256 and syn["prefix_tokens_shared"] % 256 == 0
        assert "256-token blocks (the target's, from its " in res.output
        # a hit the target's blocks cannot carry is refused, saying what they can
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--isl", "300", "--osl", "2", "--prefix-hit",
                                        "0.9", "--rate", "100", "--max-requests", "20", "--out", str(tmp_path / "x"),
                                        "--no-live"], env={"COLUMNS": "400"})
        assert res.exit_code == 2 and "the target caches whole 256-token blocks" in res.output, res.output
        assert "(got 0.811)" in res.output                        # one 256-token block of 300, 19 of 20 hitting


def test_sweep_sizes_the_prefix_in_the_targets_own_blocks(tmp_path):
    # before: `sweep --isl --prefix-hit` never asked the target (run did), so its prefix was sized in blocks the
    # server does not cache in, and a hit the target's blocks cannot carry was swept without a word
    sweep_args = ["--slo", "p50(ttft) <= 1000ms", "--max-steps", "1", "--step-duration", "1", "--warmup", "0",
                  "--start", "5", "--bisect-steps", "0", "--no-live"]
    with SSEServer(ttft_ms=1, itl_ms=0.5, models_block_size=256) as srv:
        out = tmp_path / "s"
        res = CliRunner().invoke(main, ["sweep", "--target", srv.url, "--isl", "4096", "--osl", "2", "--prefix-hit",
                                        "0.75", *sweep_args, "--out", str(out)], env={"COLUMNS": "400"})
        assert res.exit_code == 0, res.output
        syn = json.loads((out / "sweep.json").read_text())["meta"]["synthetic"]
        assert syn["block_size"] == 256 and syn["prefix_tokens_shared"] % 256 == 0
        assert "256-token blocks (the target's, from its /v1/models)" in res.output
        res = CliRunner().invoke(main, ["sweep", "--target", srv.url, "--isl", "300", "--osl", "2", "--prefix-hit",
                                        "0.9", *sweep_args, "--out", str(tmp_path / "x")], env={"COLUMNS": "400"})
        assert res.exit_code == 2 and "the target caches whole 256-token blocks" in res.output, res.output


def test_run_and_sweep_ask_the_targets_models_once(tmp_path):
    # before: `run --isl --prefix-hit` read /v1/models for the block size and then again for the model name, and
    # a sweep asked it again at every step (3 GETs for this 2-step sweep, 2 for the run); one answer serves all.
    # And a sweep's step summaries said model null: the sweep's own meta (no --model given) overwrote the name
    sweep_args = ["--slo", "p50(ttft) <= 1000ms", "--max-steps", "2", "--step-duration", "1", "--warmup", "0",
                  "--start", "5", "--bisect-steps", "0", "--no-live"]
    for argv, hit in ((["run", "--rate", "40", "--max-requests", "40"], "0.73"), (["sweep", *sweep_args], "0.75")):
        with SSEServer(ttft_ms=1, itl_ms=0.5, models_block_size=256) as srv:
            res = CliRunner().invoke(main, [*argv, "--target", srv.url, "--isl", "4096", "--osl", "2", "--prefix-hit",
                                            hit, "--out", str(tmp_path / argv[0])], env={"COLUMNS": "400"})
            assert res.exit_code == 0, res.output
            with urllib.request.urlopen(srv.url + "/debug/gets", timeout=5) as r:
                gets = json.loads(r.read())
        assert gets.get("/v1/models") == 1, (argv[0], gets)
        summary = json.loads(next((tmp_path / argv[0]).rglob("summary.json")).read_text())
        assert summary["meta"]["model"] == "sse-test", argv[0]   # the model name came from that one answer


def test_every_request_to_the_target_carries_the_key_and_the_users_headers(tmp_path):
    # before: `run --header` went with the load and /tokenize only; /v1/models (model name, block size) and
    # /metrics (vLLM's block size, the server's figures) were asked with the key alone, so a gateway admitting
    # only requests with the header answered the run's look-ups 401 (and the sweep's /health likewise). And
    # `sweep` took neither --header nor --extra-body (exit 2): a gateway wanting a header could not be swept
    sweep_args = ["--slo", "p50(ttft) <= 1000ms", "--max-steps", "1", "--step-duration", "1", "--warmup", "0",
                  "--start", "5", "--bisect-steps", "0", "--no-live"]
    want = {"authorization": "Bearer k", "x-team": "bench"}
    for argv in (["run", "--rate", "40", "--max-requests", "40", "--prefix-hit", "0.73"],
                 ["sweep", *sweep_args, "--prefix-hit", "0.75"]):
        record = tmp_path / f"{argv[0]}-bodies.jsonl"
        with SSEServer(ttft_ms=1, itl_ms=0.5, vllm_block_size=256, tokenize=True, record=record) as srv:
            res = CliRunner().invoke(main, [*argv, "--target", srv.url, "--isl", "4096", "--osl", "2", "--api-key", "k",
                                            "--header", "X-Team: bench", "--extra-body", '{"temperature": 0.25}',
                                            "--out", str(tmp_path / argv[0])], env={"COLUMNS": "400"})
            assert res.exit_code == 0, res.output
            with urllib.request.urlopen(srv.url + "/debug/headers", timeout=5) as r:
                common = json.loads(r.read())
            if argv[0] == "sweep":   # a resume asking for other bodies would mix two workloads in one sweep.json
                again = CliRunner().invoke(main, [*argv, "--target", srv.url, "--isl", "4096", "--osl", "2",
                                                  "--api-key", "k", "--out", str(tmp_path / argv[0]), "--resume"],
                                           env={"COLUMNS": "400"})
                assert again.exit_code == 2 and "extra_body" in again.output, again.output
        paths = {"/v1/models", "/tokenize", "/metrics", "/v1/completions"} | ({"/health"} if argv[0] == "sweep" else set())
        assert paths <= set(common), (argv[0], sorted(common))
        for path in paths:
            assert {k: common[path].get(k) for k in want} == want, (argv[0], path, common[path])
        bodies = [json.loads(line) for line in record.read_text().splitlines()]
        assert bodies and all(b["temperature"] == 0.25 for b in bodies), argv[0]


def test_a_hit_run_accepts_is_reachable_by_the_sweep_too(tmp_path):
    # before: on 128-token blocks, `run --isl 1024 --prefix-hit 0.85 --max-requests 40` was accepted (0.853:
    # 7 shared blocks are 0.875, and the first request's miss brought 40 requests to 0.853) while the same
    # `sweep` was refused ("got 0.872": its 256-request trace has the miss diluted). Whole blocks shared by every
    # request reach a hit only in steps of 128 / 1024 here; a share of requests sharing one block more fills them
    sweep_args = ["--slo", "p50(ttft) <= 1000ms", "--max-steps", "1", "--step-duration", "1", "--warmup", "0.5",
                  "--start", "30", "--bisect-steps", "0", "--no-live"]
    with SSEServer(ttft_ms=1, itl_ms=0.5, vllm_block_size=128) as srv:
        run = CliRunner().invoke(main, ["run", "--target", srv.url, "--isl", "1024", "--osl", "2", "--prefix-hit",
                                        "0.85", "--rate", "100", "--max-requests", "40", "--out", str(tmp_path / "r"),
                                        "--no-live"], env={"COLUMNS": "400"})
        sweep = CliRunner().invoke(main, ["sweep", "--target", srv.url, "--isl", "1024", "--osl", "2",
                                          "--prefix-hit", "0.85", *sweep_args, "--out", str(tmp_path / "s")],
                                   env={"COLUMNS": "400"})
    assert run.exit_code == 0, run.output
    assert sweep.exit_code == 0, sweep.output
    data = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert data["meta"]["synthetic"]["block_size"] == 128 and abs(data["meta"]["hit_ratio_tokens"] - 0.85) <= 0.01
    step = data["steps"][0]
    assert abs(step["traffic_hit_ratio"] - 0.85) <= 0.02, step["traffic_hit_ratio"]   # what the window offered
    for out in (tmp_path / "r" / "trace.jsonl",):
        stats = inspect_trace(read_trace(out, block_size=128))
        assert abs(stats["hit_ratio_tokens"] - 0.85) <= 0.01


def test_a_synthetic_trace_has_the_targets_block_size_with_or_without_a_prefix(tmp_path):
    # before: with no shared prefix the target was not asked, and the trace's blocks came from --isl: 1 token
    # at --isl 64, 16 at 2048, 256 at 32768; its hash ids and offered hit then described other blocks than the
    # server's (128 on the vLLM that was tested)
    with SSEServer(ttft_ms=1, itl_ms=0.5, vllm_block_size=128) as srv:
        for isl in ("64", "2048"):
            out = tmp_path / isl
            res = CliRunner().invoke(main, ["run", "--target", srv.url, "--isl", isl, "--osl", "2", "--rate", "100",
                                            "--max-requests", "4", "--out", str(out), "--no-live"],
                                     env={"COLUMNS": "400"})
            assert res.exit_code == 0, res.output
            syn = json.loads((out / "summary.json").read_text())["meta"]["synthetic"]
            assert syn["block_size"] == 128, (isl, syn["block_size"])
            assert "128-token blocks (the target's, from its /metrics" in res.output


def test_an_embedded_synthetic_sweep_is_described_in_the_embedded_servers_blocks(monkeypatch):
    # the embedded server's block size is known before it starts (its section's, else its default): the trace
    # is made in it, as a --target's is in what the target reports. Before: 16-token blocks for --isl 2048
    from paasbench.commands.sweep import sweep as sweep_cmd
    from paasbench.gate import fingerprint
    from paasbench.sweep.settings import SYNTHETIC_REQUESTS, sweep_setup
    from paasbench.workload.options import synthetic_from

    untimed = fingerprint.describe
    monkeypatch.setattr(fingerprint, "describe", lambda **_: untimed(timed=False))   # the machine's speed: not here

    for extra, want in (([], 512), (["--server-arg", "block_size=64"], 64)):
        opts = sweep_cmd.make_context("sweep", ["--isl", "2048", "--osl", "2", "--prefix-hit", "0.5", "--slo",
                                                "p50(ttft) <= 1s", "--out", "unused", *extra]).params
        setup = sweep_setup(opts, synthetic_from(opts, requests=SYNTHETIC_REQUESTS))
        syn = setup.meta["synthetic"]
        assert (syn["block_size"], syn["block_size_source"]) == (want, "the embedded server's block_size")
        assert int(setup.config.server_section.get("block_size", 512)) == want


def test_a_hit_whose_extra_block_would_fill_the_shortest_input_falls_back_to_whole_blocks():
    """--isl 512 with 32-token blocks over 20 requests at 0.9 (tests/test_vllm_real.py's run): the extended share
    needs a 16th block, as long as every input, and was refused ('the shared prefix (512 tokens) must be shorter
    than every input length'); whole blocks give 480 shared tokens, a hit of 19 * 480 / 10,240 = 0.8906."""
    from paasbench.workload.synthetic import Synthetic, synthetic_spec

    s = synthetic_spec(Synthetic("512", "8", requests=20, prefix_hit=0.9, block_size=32))
    assert s.shared_prefix_tokens == 480 and s.extended_prefix_share == 0.0
