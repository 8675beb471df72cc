"""SLO expressions: every documented form parses to the right summary key and unit; every mistake is an
InputError naming it (never a gate that silently passes, k6 #1526)."""

from __future__ import annotations

from pathlib import Path

import pytest

from paas_common.errors import EXIT_CONFIG, InputError
from paasbench.metrics.slo import PRESETS, parse_gate, parse_gates


@pytest.mark.parametrize("expr, key, stat, op, threshold", [
    ("p50(ttft) <= 6000ms", "ttft_ms", "p50", "<=", 6000.0),
    ("p90(tpot) <= 50ms", "tpot_ms", "p90", "<=", 50.0),
    ("p99.9(itl) < 200ms", "itl_ms", "p999", "<", 200.0),
    ("mean(e2e) <= 30s", "e2e_ms", "mean", "<=", 30000.0),
    ("max(schedule_lag) < 500us", "schedule_lag_ms", "max", "<", 0.5),
    ("p95(ttft)<=1.5 s", "ttft_ms", "p95", "<=", 1500.0),
    ("error_rate < 1%", "error_rate", None, "<", 0.01),
    ("prefix_hit_ratio >= 0.85", "prefix_hit_ratio", None, ">=", 0.85),
    ("input_tpm >= 5.8M", "input_tpm", None, ">=", 5.8e6),
    ("output_tpm > 12K", "output_tpm", None, ">", 12e3),
    ("goodput_rps >= 2", "goodput_rps", None, ">=", 2.0),
])
def test_valid_expressions(expr, key, stat, op, threshold):
    g = parse_gate(expr)
    assert (g.key, g.stat, g.op) == (key, stat, op)
    assert g.threshold == pytest.approx(threshold)
    assert g.source == expr.strip()


@pytest.mark.parametrize("expr, named", [
    ("p50(ttf) <= 6000ms", "'ttf'"),               # misspelled metric
    ("error_rat < 1%", "'error_rat'"),
    ("p42(ttft) <= 1s", "'p42'"),                  # unknown percentile
    ("p50(ttft) <= 6000kg", "'kg'"),               # unknown unit
    ("p50(ttft) <= 6000", "needs a unit"),         # bare latency number: ms or s? refuse to guess
    ("input_tpm >= 5ms", "'ms'"),                  # unit that does not fit the metric
    ("error_rate < 5", "fraction"),                # 5 = 500%?
    ("ttft <= 5ms", "statistic"),                  # a distribution without a statistic
    ("p50(error_rate) <= 1%", "scalar"),           # a statistic of a scalar
    ("p50(ttft) == 5ms", "'=='"),
    ("p50(ttft) <=", "malformed"),
    ("latency is low", "malformed"),
    ("p50(ttft) <= 1e400ms", "finite"),            # inf: a bound nothing can breach
])
def test_invalid_expressions_name_the_problem(expr, named):
    with pytest.raises(InputError) as err:
        parse_gate(expr)
    assert named in str(err.value)
    assert err.value.exit_code == EXIT_CONFIG


def test_inline_list_and_separators():
    gates = parse_gates("p50(ttft) <= 6000ms, p90(tpot) <= 50ms; error_rate < 1%")
    assert [g.key for g in gates] == ["ttft_ms", "tpot_ms", "error_rate"]
    assert [g.key for g in parse_gates(["p50(ttft) <= 1s", "preset:white-paper"])] == \
        ["ttft_ms", "ttft_ms", "prefix_hit_ratio", "error_rate"]


def test_white_paper_preset():
    gates = parse_gates("preset:white-paper")
    by_key = {g.key: g for g in gates}
    assert by_key["ttft_ms"].stat == "p50" and by_key["ttft_ms"].threshold == 6000.0
    assert by_key["prefix_hit_ratio"].threshold == 0.85
    assert all(g.origin == "preset:white-paper" for g in gates)
    with pytest.raises(InputError, match="unknown SLO preset 'nope'"):
        parse_gates("preset:nope")
    for name in PRESETS:  # every shipped preset parses
        assert parse_gates(f"preset:{name}")


def test_yaml_file_and_located_errors(tmp_path: Path):
    good = tmp_path / "slo.yaml"
    good.write_text("slo:\n  - p50(ttft) <= 6000ms\n  - error_rate < 1%\n")
    gates = parse_gates(good)
    assert [g.origin for g in gates] == [f"{good}:2", f"{good}:3"]
    assert parse_gates(str(good)) == gates

    bad = tmp_path / "bad.yaml"
    bad.write_text("- p50(ttft) <= 6000ms\n- p90(tpot) <= 50ms\n- p99(ttfb) < 1s\n")
    with pytest.raises(InputError) as err:
        parse_gates(bad)
    assert err.value.file == str(bad) and err.value.line == 3 and "'ttfb'" in str(err.value)

    wrong_key = tmp_path / "wrong.yaml"
    wrong_key.write_text("slos:\n  - p50(ttft) <= 1s\n")
    with pytest.raises(InputError, match="slos"):
        parse_gates(wrong_key)
    with pytest.raises(InputError, match="cannot read"):
        parse_gates(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("- p50(ttft) <= 1s\n- [unclosed\n")
    with pytest.raises(InputError) as err:
        parse_gates(broken)
    assert err.value.line is not None


def test_empty_specs_are_errors_not_a_gate_set_that_passes_everything(tmp_path: Path):
    for spec in ("", "  ", " , ;"):
        with pytest.raises(InputError, match="empty SLO"):
            parse_gates(spec)
    with pytest.raises(InputError, match="empty SLO"):
        parse_gates(["p50(ttft) <= 1s", ""])
    empty = tmp_path / "empty.yaml"
    empty.write_text("slo: []\n")
    with pytest.raises(InputError, match="empty") as err:
        parse_gates(empty)
    assert err.value.file == str(empty)
