"""Verdicts: measured value, pass/fail, margins; a metric the summary lacks fails; early-abort rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paasbench.metrics.slo import evaluate, gates_breached_early, parse_gates, per_request_limits

FIX = Path(__file__).parent / "fixtures" / "report"


def summary() -> dict:
    return json.loads((FIX / "run" / "summary.json").read_text())


def test_verdict_values_and_margins():
    s = summary()
    p50 = s["ttft_ms"]["p50"]
    v = evaluate(parse_gates([f"p50(ttft) <= {p50 * 2}ms", f"p50(ttft) <= {p50 / 2}ms", "prefix_hit_ratio >= 0.5"]), s)
    ok, bad, hit = v.results
    assert ok.passed and ok.measured == pytest.approx(p50) and ok.margin == pytest.approx(p50)
    assert ok.margin_rel == pytest.approx(0.5)
    assert not bad.passed and bad.margin == pytest.approx(-p50 / 2) and bad.reason == "breached"
    assert hit.passed and hit.margin == pytest.approx(s["prefix_hit_ratio"] - 0.5)
    assert not v.passed and v.failures == [bad]
    d = v.to_dict()
    assert d["passed"] is False and d["gates"][1]["measured"] == pytest.approx(p50)


def test_strict_vs_inclusive_bounds():
    s = {"error_rate": 0.01}
    assert evaluate(parse_gates("error_rate <= 1%"), s).passed
    assert not evaluate(parse_gates("error_rate < 1%"), s).passed


def test_missing_metric_fails_never_passes():
    no_success = {"ttft_ms": {"count": 0, "p50": None}, "error_rate": 1.0}
    v = evaluate(parse_gates("p50(ttft) <= 6000ms, goodput_rps >= 0"), no_success)
    assert [r.passed for r in v.results] == [False, False]
    assert all(r.reason == "missing from summary" and r.measured is None for r in v.results)
    assert not evaluate(parse_gates("p50(ttft) <= 6000ms"), {}).passed
    assert evaluate([], {}).passed  # no gates: nothing to breach


def test_per_request_limits_take_the_tightest_upper_bound():
    gates = parse_gates("p50(ttft) <= 6000ms, p90(ttft) <= 4s, p90(tpot) <= 50ms, mean(e2e) <= 30s, "
                        "max(schedule_lag) < 5ms, error_rate < 1%, min(ttft) >= 1ms")
    assert per_request_limits(gates) == {"ttft_ms": 4000.0, "tpot_ms": 50.0, "e2e_ms": 30000.0}


def test_breached_early_only_for_verdicts_more_requests_cannot_change():
    partial = {"ttft_ms": {"count": 5, "p50": 9000.0, "max": 12000.0, "min": 100.0},
               "requests": {"total": 10, "ok": 5, "failed": 5}, "error_rate": 0.5}
    assert gates_breached_early(parse_gates("max(ttft) <= 10s"), partial)
    assert not gates_breached_early(parse_gates("max(ttft) <= 20s"), partial)
    # a p50 over the limit can still come down: never judged early
    assert not gates_breached_early(parse_gates("p50(ttft) <= 1s"), partial)
    assert gates_breached_early(parse_gates("min(ttft) >= 200ms"), partial)
    # 5 failures of 100 planned already exceed 1%; of the error rate alone nothing is known without the plan
    assert gates_breached_early(parse_gates("error_rate < 1%"), partial, planned_requests=100)
    assert not gates_breached_early(parse_gates("error_rate < 10%"), partial, planned_requests=100)
    assert not gates_breached_early(parse_gates("error_rate < 1%"), partial)
