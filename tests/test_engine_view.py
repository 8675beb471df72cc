"""The engine's own view (issue #21 items 5 and 6, #29 item 1): /metrics scraped with the engine idle around a
step, parsed for each engine family from real and documented /metrics texts, and shown in the report beside the
client's figures over the same requests.

* a sweep step against an engine with a queue, its prefix cache cold during the warm-up: the engine's counters
  and the client's side of the comparison cover the same requests, every request the step sent (read at the
  window start, the counters once took in the warm-up's queued requests: client − engine −239 ms);
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


def _queued_step(tmp_path: Path) -> tuple[dict, list]:
    """A sweep step against an engine with a queue (one request at a time, 150 ms each) offered 8 req/s, above
    its 6.5: the warm-up's last requests are still waiting when the window starts, and the window's last ones
    run past its end. The warm-up's requests hit 0% (a cold cache), the window's 90%."""
    from paasbench.metrics.records import read_records

    warmup, duration, rate = 1.5, 3.0, 8.0
    trace = synthetic_trace(Synthetic(isl="64", osl="2", requests=200), seed=0)
    plan = StepPlan("rate", warmup_s=warmup, duration_s=duration, seed=3)
    warm = sum(r.arrival_ms / 1e3 < warmup for r in plan.schedule(trace, rate)[0].requests)
    with SSEServer(ttft_ms=150, itl_ms=1, cached_ratio=0.9, warm_cached_ratio=0.0, warm_requests=warm,
                   max_running=1) as srv:
        entry = run_step(trace, plan, rate, ClientConfig(target=srv.url), tmp_path / "step-000", gates=[], meta={})
    return entry, list(read_records(tmp_path / "step-000" / "records.jsonl"))


def test_client_and_engine_count_the_same_requests_on_an_engine_with_a_queue(tmp_path):
    """An engine's counters cannot say which request an observation came from, and a scrape taken with requests
    queued splits them: read at the window start, vLLM-style counters took in the warm-up's queued requests
    (0% hit) and the report set their mean beside the window's (the quick start's client − engine −239 ms,
    engine hit 82.5% vs the client's 88.9%). Read with the engine idle, before the step and after it, they
    cover every request the step sent, and so does the client's side of the comparison: the same requests,
    the same tokens, the same count."""
    entry, recs = _queued_step(tmp_path)
    m = entry["server_metrics"]
    warm = [r for r in recs if r.intended_send_s < 1.5]
    assert warm and m["gauges"]["requests_waiting"] > 0         # the premise: a queue while the load was on
    # the counters hold every request the step sent, no more, no fewer
    assert m["deltas"]["prompt_tokens"] == sum(r.prompt_tokens for r in recs)
    assert m["deltas"]["prefix_cache_hits"] == sum(r.cached_tokens or 0 for r in recs)
    assert m["window"]["idle_before"] is True and m["window"]["idle_after"] is True
    v = m["versus"]
    assert v["covers"] == "every request sent" and v["note"] is None
    assert v["client"]["requests"] == v["engine"]["requests"] == len(recs) == m["observations"]["ttft"]
    assert v["engine"]["prefix_hit"] == pytest.approx(v["client"]["prefix_hit"], abs=1e-12)
    # each request's client TTFT (from its intended send) holds the engine's (receipt -> first write)
    assert 0.0 <= v["gap_ms"] < 50.0, v
    # and the report says so: both counts, a positive difference, no note
    sec = engine_section([Row("step-000", "8.000", entry["summary"], m, entry)], "rate (req/s)")
    row = dict(zip(sec["versus"].headers, sec["versus"].rows[0]))
    assert row["requests (client / engine)"] == f"{len(recs)} / {len(recs)}" and "note" not in row
    assert float(row["client − engine (ms)"]) >= 0.0
    assert "every request the step sent" in sec["versus_text"] and "idle" in sec["counters"]


def test_bundled_server_compares_the_windows_own_requests_one_by_one(tmp_path):
    """The bundled server times each request itself (``paasbench_timings.ttft_ms``: the observation its TTFT
    histogram got), so client vs engine covers exactly the requests the step's summary measures, the warm-up's
    queued ones left out, however busy the window's edges were: here 4 req/s of 512-token prompts, a queue
    at the window start and at its end."""
    from paasbench.metrics.records import read_records
    from reference_server.launcher import EmbeddedServer

    trace = synthetic_trace(Synthetic(isl="512", osl="8", requests=300, prefix_hit=0.5), seed=0)
    plan = StepPlan("rate", warmup_s=1.5, duration_s=3.0, seed=3)
    with EmbeddedServer(["--engine", "cpu", "--model", "tiny", "--block-size", "64", "--mode", "colocated",
                         "--workers", "1"], startup_timeout_s=90) as srv:
        entry = run_step(trace, plan, 4.0, ClientConfig(target=srv.url), tmp_path / "step-000", gates=[], meta={})
    recs = list(read_records(tmp_path / "step-000" / "records.jsonl"))
    m, summary = entry["server_metrics"], entry["summary"]
    v = m["versus"]
    assert v["covers"] == "window" and v["note"] is None, v
    assert v["client"]["requests"] == v["engine"]["requests"] == summary["ttft_ms"]["count"] > 0
    assert v["client"]["ttft_mean_ms"] == pytest.approx(summary["ttft_ms"]["mean"], rel=1e-12)
    assert v["client"]["prefix_hit"] == pytest.approx(summary["prefix_hit_ratio"], rel=1e-12) == v["engine"]["prefix_hit"]
    # each request's engine TTFT lies inside its client TTFT (from the actual send, the later clock start)
    for r in recs:
        assert r.error_kind is None and 0 < r.server_timings["ttft_ms"] <= 1e3 * (r.first_token_s - r.actual_send_s)
    assert v["gap_ms"] >= 0
    # ... and is the very observation the router's TTFT histogram got: its sum and count over the step (the
    # counters between the idle scrapes) are the per-request values' (sum: its repr digits, to 1 µs a request)
    assert m["observations"]["ttft"] == len(recs)
    assert m["means_ms"]["ttft"] * len(recs) == pytest.approx(sum(r.server_timings["ttft_ms"] for r in recs),
                                                              abs=1e-3 * len(recs))
    sec = engine_section([Row("step-000", "4.000", summary, m, entry)], "rate (req/s)")
    row = dict(zip(sec["versus"].headers, sec["versus"].rows[0]))
    assert row["requests (client / engine)"] == f"{len(recs) - len([r for r in recs if r.intended_send_s < 1.5])}" \
        f" / {v['engine']['requests']}" and "the window's requests" in sec["versus_text"]


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
    assert m["window"]["idle_before"] is True and m["window"]["idle_after"] is True
    assert m["window"]["gauges_at"] == "last response"
    assert m["deltas"]["prompt_tokens"] == s["input_tokens"] and m["prefix_hit_ratio"] == s["prefix_hit_ratio"]
    v = m["versus"]
    assert v["client"]["requests"] == v["engine"]["requests"] == 12 and v["gap_ms"] >= 0
    assert "engine TTFT mean (vllm)" in res.output and "client − engine" in res.output
    assert "of 12 requests" in res.output
    assert "server_metrics" not in json.loads((tmp_path / "o" / "summary.json").read_text())


def test_run_against_a_target_without_metrics_asks_once(tmp_path):
    """No /metrics: one failed scrape is recorded, the run is unaffected, nothing more is asked."""
    w = prom.Watch("http://127.0.0.1:9", end_s=1.0)
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
    assert versus["client prefix hit"] == versus["engine prefix hit"]
    # a step recorded before both sides were matched (no server_metrics.versus) says so beside its difference
    assert versus["requests (client / engine)"].endswith("/ —") and "before both sides were matched" in versus["note"]


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
