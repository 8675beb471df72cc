"""The engine's own view (issue #21 items 5 and 6): /metrics scraped on the measurement window, parsed for
each engine family from real and documented /metrics texts, and shown in the report beside the client's figures.

* a sweep step against a server whose prefix cache is cold during the warm-up: the engine's counter hit and
  the client's usage hit cover the same window and agree (they once read 60% vs 90% on one page);
* ``paasbench run`` keeps the same figures in summary.json;
* vLLM's /metrics as vLLM 0.32 (CPU build) really wrote it, before and after a handful of requests, and
  SGLang's documented names: each family's own columns in report.md, with the client − engine TTFT.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from sse_server import SSEServer

from paasbench.client import ClientConfig
from paasbench.report.engine import Row, engine_section
from paasbench.metrics import prometheus as prom
from paasbench.sweep.step import StepPlan, run_step
from paasbench.workload.synthetic import Synthetic, synthetic_trace

FIX = Path(__file__).parent / "fixtures" / "sweep"


def _fixture(name: str, at_s: float = 0.0) -> prom.Scrape:
    return prom.Scrape(url="fixture", at_s=at_s, samples=prom.parse((FIX / name).read_text()))


def _clear_of(times: list[float], at: float, margin: float) -> bool:
    return all(abs(t - at) > margin for t in times)


def test_step_counters_cover_the_measured_window_not_the_warmup(tmp_path):
    """Warm-up requests hit 0% (cold cache), window requests 90%. The step's server hit from usage is 90%;
    the engine's counters must say the same, not the warm-up-diluted ~60% of a before/after-step scrape."""
    warmup, duration, rate = 2.0, 3.0, 4.0
    trace = synthetic_trace(Synthetic(isl="64", osl="2", requests=200), seed=0)

    def arrivals(seed: int) -> list[float]:
        return [r.arrival_ms / 1e3 for r in StepPlan("rate", warmup, duration, seed).schedule(trace, rate)[0].requests]

    # a seed whose arrivals keep 0.3 s clear of the window start, so no request straddles the scrape there
    seed = next(s for s in range(500) if _clear_of(arrivals(s), warmup, 0.3))
    warm = sum(t < warmup for t in arrivals(seed))
    plan = StepPlan("rate", warmup_s=warmup, duration_s=duration, seed=seed)
    with SSEServer(ttft_ms=20, itl_ms=1, cached_ratio=0.9, warm_cached_ratio=0.0, warm_requests=warm) as srv:
        entry = run_step(trace, plan, rate, ClientConfig(target=srv.url), tmp_path / "step-000", gates=[], meta={})
    client_hit = entry["summary"]["prefix_hit_ratio"]
    m = entry["server_metrics"]
    assert client_hit == pytest.approx(0.9, abs=0.02)          # the window's own traffic (int() per request)
    assert m["prefix_hit_ratio"] == pytest.approx(client_hit, abs=1e-9)   # same requests, same tokens
    # the last response came long before window end + drain; gauges at the window end if the run lasted that long
    assert m["window"]["from"] == "window start" and m["window"]["to"] == "last response"
    assert m["window"]["gauges_at"] in ("window end", "last response")
    # the counters hold exactly the window's requests: as many prompt tokens as the summary's input tokens
    assert m["deltas"]["prompt_tokens"] == entry["summary"]["input_tokens"]
    # the engine's TTFT (receipt -> first write) is the client's less the way there and back
    client_ttft, engine_ttft = entry["summary"]["ttft_ms"]["mean"], m["means_ms"]["ttft"]
    assert 20.0 <= engine_ttft < client_ttft


def test_run_writes_the_engine_view_into_summary(tmp_path):
    from paasbench.commands.run import run

    with SSEServer(ttft_ms=10, itl_ms=1, cached_ratio=0.5) as srv:
        res = CliRunner().invoke(run, ["--target", srv.url, "--isl", "32", "--osl", "2", "--rate", "20",
                                       "--max-requests", "12", "--out", str(tmp_path / "r"), "--no-live"])
        assert res.exit_code == 0, res.output
        off = CliRunner().invoke(run, ["--target", srv.url, "--isl", "32", "--osl", "2", "--rate", "20",
                                       "--max-requests", "2", "--out", str(tmp_path / "o"), "--no-live",
                                       "--no-scrape-metrics"])
        assert off.exit_code == 0, off.output
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    m = s["server_metrics"]
    assert m["family"] == "vllm" and m["deltas"]["requests_finished"] == 12
    assert m["window"] == {"from": "window start", "to": "last response", "gauges_at": "last response"}
    assert m["deltas"]["prompt_tokens"] == s["input_tokens"] and m["prefix_hit_ratio"] == s["prefix_hit_ratio"]
    assert "engine TTFT mean (vllm)" in res.output and "client − engine" in res.output
    assert "server_metrics" not in json.loads((tmp_path / "o" / "summary.json").read_text())


def test_run_against_a_target_without_metrics_asks_once(tmp_path):
    """No /metrics: one failed scrape is recorded, the run is unaffected, nothing more is asked."""
    w = prom.Watch("http://127.0.0.1:9", start_s=1.0)
    import asyncio

    async def go() -> None:
        await w.begin()
        w.follow(0.0)
        await w.finish()

    asyncio.run(go())
    assert list(w.scrapes) == ["before"]
    fig = w.figures()
    assert fig["scrape_errors"] and fig["window"] is None and not fig.get("deltas")


# --------------------------------------------------------------------------------------------------
# Real vLLM 0.32 /metrics (CPU build, tiny random Llama, prefix caching on), and SGLang's documented names.


def test_real_vllm_scrapes_parse_into_the_engine_view():
    """Two scrapes of a real vLLM 0.32 around 8 streamed completions of 416 prompt tokens sharing a 384-token
    prefix, 8 output tokens each (``fixtures/sweep/capture_vllm_metrics.py``); their usage said cached_tokens
    0 for the first and 384 for each of the other seven."""
    before, after = _fixture("vllm032_before.prom", 0.0), _fixture("vllm032_after.prom", 30.0)
    fig = prom.step_figures(before, after)
    assert fig["family"] == "vllm"
    d, means = fig["deltas"], fig["means_ms"]
    assert d["requests_finished"] == 8 and d["preemptions"] == 0
    assert d["prompt_tokens"] == d["prefix_cache_queries"] == 8 * 416 and d["generation_tokens"] == 8 * 8
    assert d["prefix_cache_hits"] == 7 * 384                       # what the requests' usage reported
    assert fig["prefix_hit_ratio"] == pytest.approx(7 * 384 / (8 * 416))
    # every per-request histogram vLLM exports got its mean; the engine's phases nest inside its TTFT / E2E
    assert set(means) == {"ttft", "e2e", "queue", "prefill", "decode", "itl"}
    assert means["queue"] + means["prefill"] <= means["ttft"] <= means["e2e"]
    assert means["ttft"] + means["decode"] == pytest.approx(means["e2e"], rel=0.1)
    assert fig["gauges"]["requests_running"] == 0 and fig["gauges"]["kv_cache_usage"] == 0.0


def _row(name: str, metrics: dict, ttft_mean: float, hit: float) -> Row:
    return Row(name, "1.000", {"ttft_ms": {"mean": ttft_mean}, "prefix_hit_ratio": hit}, metrics,
               {"saturation": {"saturated": False}})


def test_report_shows_vllm_figures_in_vllms_terms():
    fig = prom.step_figures(_fixture("vllm032_before.prom"), _fixture("vllm032_after.prom", 30.0))
    sec = engine_section([_row("step-000", fig, fig["means_ms"]["ttft"] + 15.0, fig["prefix_hit_ratio"])],
                         "rate (req/s)")
    assert sec["family"] == "vLLM"
    head = sec["table"].headers
    assert {"preemptions", "prefill mean (ms)", "decode mean (ms)", "KV cache usage", "prompt tokens"} <= set(head)
    assert not any("util" in h or "evictions" in h or "checksum" in h for h in head)   # the bundled server's
    assert "—" not in sec["table"].rows[0]                      # every column shown has a figure
    versus = dict(zip(sec["versus"].headers, sec["versus"].rows[0]))
    assert versus["client − engine (ms)"] == "+15.0"
    assert versus["client prefix hit (usage)"] == versus["engine prefix hit (counters)"]


def test_sglang_documented_names():
    fig = prom.step_figures(_fixture("sglang_before.prom"), _fixture("sglang_after.prom", 10.0))
    assert fig["family"] == "sglang"
    assert fig["means_ms"]["ttft"] == pytest.approx(1000 * (64.0 - 40.0) / (180 - 100))
    assert fig["means_ms"]["e2e"] == pytest.approx(1000 * (420.0 - 300.0) / (180 - 100))
    assert fig["means_ms"]["queue"] == pytest.approx(1000 * (9.0 - 5.0) / (180 - 100))
    assert fig["means_ms"]["itl"] == pytest.approx(1000 * (40.0 - 20.0) / (4100 - 2100))   # per token
    assert fig["deltas"]["preemptions"] == 3 and fig["deltas"]["requests_finished"] == 80
    sec = engine_section([_row("step-000", fig, 320.0, 0.8)], "rate (req/s)")
    head = sec["table"].headers
    assert sec["family"] == "SGLang" and "retractions" in head and "token usage" in head
    assert "cached tokens" in head and "prefill mean (ms)" not in head
    versus = dict(zip(sec["versus"].headers, sec["versus"].rows[0]))
    assert versus["engine TTFT mean (ms)"] == "300.0" and versus["client − engine (ms)"] == "+20.0"


def test_histogram_reset_counts_from_zero():
    before = prom.Scrape("x", 0.0, samples=prom.parse("vllm:time_to_first_token_seconds_sum 50\n"
                                                       "vllm:time_to_first_token_seconds_count 100\n"))
    after = prom.Scrape("x", 1.0, samples=prom.parse("vllm:time_to_first_token_seconds_sum 0.5\n"
                                                      "vllm:time_to_first_token_seconds_count 5\n"))
    assert prom.step_figures(before, after)["means_ms"]["ttft"] == pytest.approx(100.0)


def test_reference_server_exports_a_ttft_histogram():
    from reference_server.metrics import RouterMetrics, render

    rm = RouterMetrics()
    for s in (0.004, 0.02, 0.3):
        rm.ttft.observe(s)
    samples = prom.parse(render(rm, []))
    by = {(x.name, x.label("le")): x.value for x in samples}
    assert by[("paasbench_time_to_first_token_seconds_count", None)] == 3
    assert by[("paasbench_time_to_first_token_seconds_bucket", "0.005")] == 1     # cumulative
    assert by[("paasbench_time_to_first_token_seconds_bucket", "0.025")] == 2
    assert by[("paasbench_time_to_first_token_seconds_bucket", "+Inf")] == 3
    empty = prom.Scrape("x", 0.0, samples=[])
    full = prom.Scrape("x", 1.0, samples=samples)
    assert prom.step_figures(empty, full)["means_ms"]["ttft"] == pytest.approx(1000 * 0.324 / 3)
    assert not math.isnan(by[("paasbench_time_to_first_token_seconds_sum", None)])
