"""Prometheus text parsing and the per-step figures, for our, vLLM's and SGLang's metric names."""

from __future__ import annotations

import http.server
import math
import socket
import threading
from pathlib import Path

import pytest

from paasbench.metrics import prometheus as prom

FIX = Path(__file__).parent / "fixtures" / "sweep"


def _scrape(name: str, at_s: float = 0.0) -> prom.Scrape:
    return prom.Scrape(url="fixture", at_s=at_s, samples=prom.parse((FIX / name).read_text()))


def test_parse_labels_escapes_comments_special_values():
    samples = prom.parse(
        '# HELP x y\n# TYPE a_total counter\n'
        'a_total{k="v",q="say \\"hi\\", ok\\\\",e=""} 3 1700000000\n'
        'b +Inf\nc NaN\nd -Inf\ne 1.5e3\nvllm:x{le="0.1"} 2\n# EOF\n'
    )
    by = {s.name: s for s in samples}
    assert by["a_total"].labels == (("e", ""), ("k", "v"), ("q", 'say "hi", ok\\'))
    assert by["a_total"].value == 3
    assert by["b"].value == math.inf and by["d"].value == -math.inf and math.isnan(by["c"].value)
    assert by["e"].value == 1500.0
    assert by["vllm:x"].label("le") == "0.1"


def test_parse_rejects_garbage_with_line_number():
    with pytest.raises(prom.ParseError, match="line 2"):
        prom.parse("ok 1\nbroken{a=\"x\" \n")
    with pytest.raises(prom.ParseError):
        prom.parse("novalue\n")


def test_paasbench_family():
    fig = prom.step_figures(_scrape("paasbench_before.prom", 100.0), _scrape("paasbench_after.prom", 110.0))
    assert fig["family"] == "paasbench"
    assert fig["pools"]["decode"]["step_utilization"] == pytest.approx(0.5)     # 5 busy s / 10 s / 1 worker
    assert fig["pools"]["prefill"]["step_utilization"] == pytest.approx(0.8)    # 16 busy s / 10 s / 2 workers
    assert fig["gauges"]["requests_running"] == 3 and fig["gauges"]["requests_waiting"] == 9
    assert fig["gauges"]["kv_cache_usage"] == pytest.approx(0.4)  # mean over pools
    assert fig["prefix_hit_ratio"] == pytest.approx(0.9)           # step delta 900/1000, not the 0.5 gauge
    assert fig["deltas"]["kv_evictions"] == 7 and fig["deltas"]["kv_transfer_checksum_failures"] == 1
    assert fig["pools"]["prefill"]["utilization"] == 0.83 and fig["pools"]["prefill"]["kv_cache_usage"] == 0.2
    assert fig["pools"]["decode"]["utilization"] == 0.41
    assert fig["stage_mean_ms"]["prefill"] == pytest.approx(200.0)   # (3-1) s / (20-10)
    assert fig["stage_mean_ms"]["kv_transfer"] == pytest.approx(10.0)
    info = [s for s in _scrape("paasbench_after.prom").samples if s.name == "paasbench_info"][0]
    assert info.label("note") == 'quote " and backslash \\ and, comma} brace'


def test_vllm_v1_family():
    fig = prom.step_figures(_scrape("vllm_before.prom"), _scrape("vllm_after.prom"))
    assert fig["family"] == "vllm"
    assert fig["gauges"]["requests_running"] == 7 and fig["gauges"]["requests_waiting"] == 3
    assert fig["gauges"]["kv_cache_usage"] == 0.625
    assert fig["deltas"]["prefix_cache_queries"] == 100000 and fig["deltas"]["prefix_cache_hits"] == 90000
    assert fig["prefix_hit_ratio"] == pytest.approx(0.9)
    assert fig["deltas"]["generation_tokens"] == 4000 and fig["deltas"]["preemptions"] == 2


def test_vllm_v0_names_and_missing_before():
    after = _scrape("vllm_v0_after.prom")
    fig = prom.step_figures(prom.Scrape("x", 0.0, error="ConnectionRefusedError"), after)
    assert fig["gauges"]["kv_cache_usage"] == 0.42       # gpu_cache_usage_perc
    assert fig["prefix_hit_ratio"] == 0.8                # falls back to the hit-rate gauge
    assert fig["deltas"] == {}                           # no delta without a 'before'
    assert fig["scrape_errors"] == ["ConnectionRefusedError"]


def test_sglang_family():
    fig = prom.step_figures(_scrape("sglang_before.prom"), _scrape("sglang_after.prom"))
    assert fig["family"] == "sglang"
    assert fig["gauges"]["kv_cache_usage"] == 0.28
    assert fig["gauges"]["requests_running"] == 12 and fig["gauges"]["requests_waiting"] == 5
    assert fig["prefix_hit_ratio"] == pytest.approx(32000 / 40000)   # cached / prompt tokens over the step
    assert fig["deltas"]["generation_tokens"] == 2000


def test_counter_reset_counts_from_zero():
    before = prom.Scrape("x", 0.0, samples=prom.parse("paasbench_prefix_cache_queries_total 500\n"
                                                       "paasbench_prefix_cache_hits_total 400\n"))
    after = prom.Scrape("x", 1.0, samples=prom.parse("paasbench_prefix_cache_queries_total 100\n"
                                                      "paasbench_prefix_cache_hits_total 50\n"))
    fig = prom.step_figures(before, after)
    assert fig["deltas"]["prefix_cache_queries"] == 100 and fig["prefix_hit_ratio"] == 0.5


def test_metrics_url():
    assert prom.metrics_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/metrics"
    assert prom.metrics_url("http://h:1") == "http://h:1/metrics"


def test_scrape_live_and_failure_recorded_not_raised():
    body = (FIX / "vllm_after.prom").read_bytes()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        got = prom.scrape(f"http://127.0.0.1:{srv.server_address[1]}/v1", timeout_s=5)
        assert got.error is None and got.total("vllm:num_requests_running") == 7
    finally:
        srv.shutdown()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    bad = prom.scrape(f"http://127.0.0.1:{dead}", timeout_s=2)
    assert bad.error and not bad.samples


def test_wait_idle_waits_for_the_queue_to_drain():
    polls = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            polls.append(1)
            busy = 3 if len(polls) < 4 else 0      # busy for the first three scrapes
            self.send_response(200)
            self.end_headers()
            self.wfile.write(f"vllm:num_requests_running 0\nvllm:num_requests_waiting {busy}\n".encode())

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        waited = prom.wait_idle(f"http://127.0.0.1:{srv.server_address[1]}", poll_s=0.05, timeout_s=10)
        assert waited is not None and len(polls) == 4
        assert prom.wait_idle(f"http://127.0.0.1:{srv.server_address[1]}", poll_s=0.05, timeout_s=10) < 1
    finally:
        srv.shutdown()
    assert prom.wait_idle("http://127.0.0.1:9", timeout_s=1) is None     # no /metrics: do not wait
