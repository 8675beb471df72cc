"""The report's Pareto view (issue 31 item 5): every decided step as a point of system input TPM against
per-user output tokens/s, the frontier through the passing steps no other passing step beats on both."""

from __future__ import annotations

import json
from pathlib import Path

from paasbench.cost.table import CostInputs
from paasbench.report import render
from paasbench.report.load import load_result
from paasbench.report.pareto import ParetoPoint, frontier, per_user_output_tps
from paasbench.report.sections import section


def point(tpm: float, speed: float, passed: bool = True) -> ParetoPoint:
    return ParetoPoint(f"s{tpm:g}", "", None, tpm, speed, None, passed, True)


def test_frontier_keeps_only_the_passes_nothing_beats_on_both_axes():
    a, b, c = point(1e6, 100), point(2e6, 50), point(3e6, 20)
    dominated = point(1.5e6, 40)          # b has more TPM and more speed
    tie = point(2e6, 50)                  # equal to b on both: neither beats the other
    failed = point(9e6, 200, passed=False)
    front = frontier([a, b, c, dominated, tie, failed])
    assert front == [a, b, tie, c]        # fastest first; a fail is never on it, however good its figures


def test_per_user_speed_is_1000_over_tpot_p50():
    assert per_user_output_tps({"tpot_ms": {"p50": 8.0}}) == 125.0
    assert per_user_output_tps({"tpot_ms": {"p50": None}}) is None and per_user_output_tps({}) is None


def _sweep(tmp_path: Path) -> Path:
    """Five certified steps at rising rate: 3 passes (the 2nd beaten by the 3rd on both axes: a noisy step),
    one undecided, one fail."""
    rows = [(1, 0.6e6, 10.0, "pass"), (2, 1.1e6, 14.0, "pass"), (3, 1.6e6, 12.0, "pass"),
            (4, 2.0e6, 20.0, "undecided"), (5, 2.1e6, 60.0, "fail")]
    steps = [{"index": i, "phase": "escalate", "load": {"kind": "rate", "value": r, "unit": "req/s"},
              "passed": verdict == "pass", "certified": {"verdict": verdict, "requests": 40, "window_s": 10},
              "summary": {"input_tpm": tpm, "good_input_tpm": tpm, "ttft_ms": {"p50": 100.0 * r},
                          "tpot_ms": {"p50": tpot}, "requests": {"total": 40, "ok": 40, "served": 40}}}
             for i, (r, tpm, tpot, verdict) in enumerate(rows)]
    data = {"schema": "paasbench.sweep/1", "meta": {}, "slo": ["p50(ttft) <= 6s"], "steps": steps,
            "best": {"index": 2, "input_tpm": 1.6e6}}
    (tmp_path / "sweep.json").write_text(json.dumps(data))
    return tmp_path / "sweep.json"


def test_sweep_report_draws_the_decided_steps_and_their_certified_frontier(tmp_path: Path):
    sec = section(load_result(_sweep(tmp_path)), None, CostInputs())
    rows = {r[0]: r for r in sec["pareto"].rows}
    assert set(rows) == {"step-000", "step-001", "step-002", "step-004"}   # the undecided step is left off
    assert [r[0] for r in sec["pareto"].rows if r[-1] == "★"] == ["step-000", "step-002"]
    assert rows["step-001"][-1] == "" and rows["step-004"][2] == "FAIL (certified)"
    assert rows["step-000"][4] == "100.0" and rows["step-002"][5] == "300.0"   # 1000 / 10 ms; TTFT p50
    assert "certified frontier" in sec["pareto_chart"] and "failed the SLO" in sec["pareto_chart"]
    html, md = render([tmp_path], tmp_path / "rep", title="pareto")
    assert "Pareto: system throughput vs per-user speed" in html.read_text()
    assert "| step-002 | 3 | PASS (certified) | 1.60M | 83.3 | 300.0 | ★ |" in md.read_text()
