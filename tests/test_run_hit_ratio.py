"""Prefix hit ratio when only some requests report cached tokens: one denominator, a count, a warning."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sse_server import SSEServer

from paasbench.cli import main


@pytest.fixture(scope="module")
def server():
    with SSEServer(ttft_ms=5, itl_ms=1) as srv:
        yield srv


def test_requests_without_cached_tokens_count_as_uncached_and_are_reported(server, tmp_path):
    # 20-word prompts (the fake server's prompt tokens); every second one reports 90% of it cached
    words = " ".join(["w"] * 18)
    prompts = [f"[[sse cached_ratio=0.9]] {words}" if i % 2 == 0 else f"plain prompt {words}" for i in range(4)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 20 * i, "input_length": 20, "output_length": 3,
                                         "hash_ids": [i], "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--target", server.url, "--trace", str(trace), "--out", str(out),
                                    "--no-live"])
    assert res.exit_code == 0, res.output
    s = json.loads((out / "summary.json").read_text())
    assert s["input_tokens"] == 80 and s["cached_tokens"] == 36 and s["uncached_tokens"] == 44
    assert s["prefix_hit_ratio"] == pytest.approx(36 / 80)  # cached / input, the same 80 tokens: not 36/40
    assert s["cached_tokens_unreported"] == 2
    output = " ".join(res.output.split())
    assert "2 completed request(s) did not report cached tokens" in output
    assert "--enable-prompt-tokens-details" in output and "--enable-cache-report" in output


def test_sweep_warns_when_its_best_step_has_unreported_cached_tokens(server, tmp_path):
    trace = tmp_path / "t.jsonl"  # the fake server reports no cached tokens at all: the hit ratio is unknown
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 4, "output_length": 3,
                                         "hash_ids": [i], "prompt": "a b c d"}) + "\n" for i in range(20)))
    res = CliRunner().invoke(main, ["sweep", "--target", server.url, "--trace", str(trace), "--out",
                                    str(tmp_path / "sw"), "--slo", "p50(ttft) <= 5s", "--max-steps", "1",
                                    "--step-duration", "1", "--warmup", "0", "--context-buckets", "none",
                                    "--start", "2"])
    assert res.exit_code == 0, res.output
    output = " ".join(res.output.split())
    assert "did not report cached tokens" in output and "prefix_hit_ratio is unknown" in output
    assert "--enable-cache-report" in output
