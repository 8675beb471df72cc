"""The sweep loop through the CLI, with the step replaced by a synthetic system of known capacity.

What is real here: option parsing, the search, sweep.json (best, buckets, cost, server_param), resume
and the exit codes. What is fake: the load itself (run_step), so these run in well under a second.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from paasbench.commands.sweep import sweep
from paasbench.sweep import driver
from paasbench.sweep.estimate import BucketStarts

CAPACITY_RPS = 3.3          # the synthetic target meets the SLO up to this rate
TOKENS_PER_REQ = 2000
PROBE_SERVED_RPS = 4.0       # the most the synthetic target serves to closed loops (at 4 of them)


def probe_served(streams: int) -> float:
    return float(min(streams, PROBE_SERVED_RPS)) if streams <= 8 else 2.0


def fake_step(calls):
    def run_step(trace, plan, value, client, step_dir, *, gates, meta, certify=None, min_pass_s=None, **_):
        calls.append((value, meta.get("bucket"), meta.get("server_param")))
        ok = value <= CAPACITY_RPS
        param = meta.get("server_param")
        ttft = 900.0 if ok else 5000.0
        if param:  # threshold sweep: TTFT is lowest at 1024
            ttft = 300.0 + abs(int(param["value"]) - 1024) / 10
        (step_dir / "records.jsonl").write_text("")
        summary = {"input_tpm": min(value, CAPACITY_RPS) * TOKENS_PER_REQ * 60, "output_tpm": 100.0,
                   "prefix_hit_ratio": 0.9, "goodput_rps": min(value, CAPACITY_RPS),
                   "ttft_ms": {"count": 10, "p50": ttft, "p90": ttft * 1.5}, "requests": {"ok": 10, "total": 10},
                   "input_tokens": 10 * TOKENS_PER_REQ, "error_rate": 0.0}
        if plan.axis == "concurrency":      # closed loops: one req/s a loop up to the peak, less past it
            summary["request_throughput_rps"] = probe_served(value)
        (step_dir / "summary.json").write_text(json.dumps(summary))
        from paasbench.metrics.slo import evaluate

        verdict = evaluate(gates, summary)
        return {"load": {"kind": plan.axis, "value": value, "unit": "req/s"}, "dir": step_dir.name,
                "summary": summary, "verdict": verdict.to_dict(), "slo_passed": verdict.passed,
                "saturation": {"saturated": not ok and value > 2 * CAPACITY_RPS, "reasons": []},
                "passed": verdict.passed, "server_metrics": {}, "remote_prefill_share": None, "wall_s": 0.01,
                "certified": None if certify is None else {
                    "verdict": "pass" if verdict.passed else "fail", "confidence": certify.confidence,
                    "judged_requests": 10, "window_s": plan.duration_s, "stopped_early": False,
                    "binding": None if verdict.passed else gates[0].label}}
    return run_step


@pytest.fixture
def calls(monkeypatch):
    made: list = []
    monkeypatch.setattr(driver, "run_step", fake_step(made))
    return made


BASE = ["--workload", "ci-small", "--target", "http://127.0.0.1:9", "--slo", "p50(ttft) <= 2000ms",
        "--start", "0.5", "--factor", "2", "--max-steps", "8", "--bisect-steps", "4", "--step-duration", "1",
        "--warmup", "0", "--context-buckets", "none",
        "--confidence", "0"]   # the search on point verdicts (the fake has no records to certify); certified below


def test_sweep_finds_capacity_and_writes_results(tmp_path, calls):
    out = tmp_path / "s"
    res = CliRunner().invoke(sweep, BASE + ["--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "sweep.json").read_text())
    assert data["schema"] == "paasbench.sweep/1" and data["status"] == "done"
    loads = [s["load"]["value"] for s in data["steps"]]
    assert loads[:4] == [0.5, 1, 2, 4]                              # escalate until 4 fails
    assert all(s["phase"] == "bisect" for s in data["steps"][4:])
    best = data["best"]
    assert 3.0 <= best["load"]["value"] <= CAPACITY_RPS
    assert best["input_tpm"] == pytest.approx(best["load"]["value"] * TOKENS_PER_REQ * 60)
    assert data["buckets"][0]["max_input_tpm"] == best["input_tpm"]
    assert best["lower_bound"] is False                             # a failing load was found above it
    row = data["cost"][0]
    assert row["max_input_tpm"] == best["input_tpm"] and row["hit_ratio"] == 0.9
    assert row["revenue_per_minute"] == pytest.approx(best["input_tpm"] / 1e6 * 2.6)   # white-paper prices
    assert all((out / s["dir"] / "summary.json").exists() for s in data["steps"])


def test_impossible_slo_exits_99(tmp_path, calls):
    args = [a if a != "p50(ttft) <= 2000ms" else "p50(ttft) <= 1ms" for a in BASE]
    res = CliRunner().invoke(sweep, args + ["--out", str(tmp_path / "x")])
    assert res.exit_code == 99, res.output
    assert "no load met the SLO" in res.output
    assert len(calls) == 3                                          # start + 2 descend steps, then give up


def test_malformed_slo_exits_2_and_names_it(tmp_path, calls):
    args = [a if a != "p50(ttft) <= 2000ms" else "p50(tfft) <= 1ms" for a in BASE]
    res = CliRunner().invoke(sweep, args + ["--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "tfft" in res.output and calls == []


def test_resume_does_not_rerun_finished_steps(tmp_path, calls):
    out = tmp_path / "s"
    assert CliRunner().invoke(sweep, BASE + ["--out", str(out), "--max-steps", "2"]).exit_code == 0
    # max-steps differs, but it is not part of the sweep's identity: a longer continuation is allowed
    first = list(calls)
    res = CliRunner().invoke(sweep, BASE + ["--out", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    rerun = calls[len(first):]
    assert [c[0] for c in rerun][:2] == [2, 4]                      # 0.5 and 1 came from sweep.json
    data = json.loads((out / "sweep.json").read_text())
    assert [s["index"] for s in data["steps"]] == list(range(len(data["steps"])))
    assert data["meta"]["resumed"] == 1


def test_resume_with_other_settings_is_refused(tmp_path, calls):
    out = tmp_path / "s"
    CliRunner().invoke(sweep, BASE + ["--out", str(out), "--max-steps", "1"])
    res = CliRunner().invoke(sweep, BASE + ["--out", str(out), "--resume", "--start", "1"])
    assert res.exit_code == 2 and "start" in res.output


def test_time_budget_stops_cleanly(tmp_path, calls, monkeypatch):
    monkeypatch.setattr(driver, "STEP_OVERHEAD", 0.0)
    clock = iter(range(0, 10_000, 10))                              # every monotonic() call: +10 s
    monkeypatch.setattr(driver.time, "monotonic", lambda: float(next(clock)))
    out = tmp_path / "s"
    res = CliRunner().invoke(sweep, BASE + ["--out", str(out), "--time-budget", "45"])
    data = json.loads((out / "sweep.json").read_text())
    assert data["status"] == "time_budget" and 1 <= len(data["steps"]) < 5
    assert res.exit_code == 0 and data["best"] is not None


def test_time_budget_cutting_an_all_passing_escalation_gives_a_lower_bound(tmp_path, calls, monkeypatch):
    monkeypatch.setattr(driver, "STEP_OVERHEAD", 0.0)
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(driver.time, "monotonic", lambda: float(next(clock)))
    out = tmp_path / "s"
    res = CliRunner().invoke(sweep, BASE + ["--out", str(out), "--time-budget", "45", "--start", "0.05"])
    data = json.loads((out / "sweep.json").read_text())
    assert res.exit_code == 0 and data["status"] == "time_budget"
    assert data["steps"] and all(s["passed"] for s in data["steps"])   # no failing load seen
    assert data["best"]["lower_bound"] is True and data["buckets"][0]["lower_bound"] is True


def test_context_buckets_give_cost_rows(tmp_path, calls):
    args = [a for a in BASE if a not in ("--context-buckets", "none")]
    res = CliRunner().invoke(sweep, args + ["--out", str(tmp_path / "b"), "--context-buckets", "2K,4K",
                                            "--max-steps", "2", "--bisect-steps", "0"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "b" / "sweep.json").read_text())
    assert [b["context_tokens"] for b in data["buckets"]] == [2048, 4096]
    assert [r["label"] for r in data["cost"]] == ["2K", "4K"]
    assert {c[1] for c in calls} == {2048, 4096}


@pytest.fixture
def servers(monkeypatch):
    """The embedded server, faked: each start is logged as {section, overrides, stopped}."""
    started: list[dict] = []

    class FakeServer:
        def __init__(self, section, overrides):
            self.entry = {"section": dict(section), "overrides": dict(overrides), "stopped": False}
            started.append(self.entry)

        def __enter__(self):
            return SimpleNamespace(url="http://127.0.0.1:9", procs={})

        def __exit__(self, *a):
            self.entry["stopped"] = True
            return False

    monkeypatch.setattr(driver, "embedded_server", FakeServer)
    return started


def test_server_param_sweep_finds_best_value(tmp_path, calls, servers):
    args = [a for a in BASE if a not in ("--target", "http://127.0.0.1:9")]
    res = CliRunner().invoke(sweep, args + ["--out", str(tmp_path / "p"), "--server-param",
                                            "remote-prefill-threshold", "--values", "0,1024,8192"])
    assert res.exit_code == 0, res.output
    assert [e["overrides"] for e in servers] == [{"remote_prefill_threshold": v} for v in ("0", "1024", "8192")]
    assert all(e["stopped"] for e in servers)                                      # one server per value
    data = json.loads((tmp_path / "p" / "sweep.json").read_text())
    assert data["server_param"]["best_value"] == "1024"
    assert data["best"]["lower_bound"] is False                    # a fixed load is no capacity search
    assert "(remote-prefill-threshold=8192)" in res.output
    assert [r["value"] for r in data["server_param"]["rows"]] == ["0", "1024", "8192"]


def test_cost_file_prices_the_rows(tmp_path, calls):
    cost = tmp_path / "cost.yaml"
    cost.write_text("currency: USD\nprice_input_per_m: 1.0\nprice_cached_input_per_m: 0.5\n")
    res = CliRunner().invoke(sweep, BASE + ["--out", str(tmp_path / "c"), "--cost-inputs", str(cost), "--max-steps", "2",
                                            "--bisect-steps", "0"])
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "c" / "sweep.json").read_text())["cost"][0]
    assert row["currency"] == "USD" and row["blended_price_per_m"] == pytest.approx(0.9 * 0.5 + 0.1 * 1.0)
    cost.write_text("price_input_per_m: -3\n")
    bad = CliRunner().invoke(sweep, BASE + ["--out", str(tmp_path / "d"), "--cost-inputs", str(cost)])
    assert bad.exit_code == 2 and "price_input_per_m" in bad.output


def test_all_steps_passing_is_reported_as_a_lower_bound(tmp_path, calls):
    res = CliRunner().invoke(sweep, BASE + ["--out", str(tmp_path / "lb"), "--max-steps", "2"])
    assert res.exit_code == 0
    assert "a lower bound: 1 req/s passed and no step above it failed" in " ".join(res.output.split())
    data = json.loads((tmp_path / "lb" / "sweep.json").read_text())
    assert data["best"]["lower_bound"] is True and data["buckets"][0]["lower_bound"] is True


def test_closed_loop_step_reruns_with_a_longer_trace(tmp_path, monkeypatch):
    seen = []
    inner = fake_step([])

    def run_step(trace, plan, value, client, step_dir, **kw):
        seen.append(len(trace))
        entry = inner(trace, plan, value, client, step_dir, **kw)
        entry["trace_exhausted"] = len(trace) < 1000           # this target needs 1000 requests per step
        entry["passed"] = entry["passed"] and not entry["trace_exhausted"]
        return entry

    monkeypatch.setattr(driver, "run_step", run_step)
    res = CliRunner().invoke(sweep, BASE + ["--out", str(tmp_path / "c"), "--axis", "concurrency", "--start", "1",
                                            "--max-steps", "1"])
    assert res.exit_code == 0, res.output
    assert seen[0] < 1000 <= seen[-1] and len(seen) <= 3
    step = json.loads((tmp_path / "c" / "sweep.json").read_text())["steps"][0]
    assert step["index"] == 0 and not step["trace_exhausted"] and step["passed"]


def test_trace_rerun_respects_the_time_budget(tmp_path, monkeypatch):
    now = [0.0]
    seen = []
    inner = fake_step([])

    def run_step(trace, plan, value, client, step_dir, **kw):
        seen.append(len(trace))
        now[0] += 100.0                                         # each attempt takes 100 s
        entry = inner(trace, plan, value, client, step_dir, **kw)
        entry["trace_exhausted"], entry["passed"] = True, False
        return entry

    monkeypatch.setattr(driver, "STEP_OVERHEAD", 0.0)
    monkeypatch.setattr(driver.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(driver, "run_step", run_step)
    res = CliRunner().invoke(sweep, BASE + ["--out", str(tmp_path / "c"), "--axis", "concurrency", "--start", "1",
                                            "--max-steps", "1", "--time-budget", "150"])
    assert res.exit_code == 99, res.output
    assert len(seen) == 1 and now[0] <= 150                     # no rerun past the budget
    assert json.loads((tmp_path / "c" / "sweep.json").read_text())["steps"][0]["trace_exhausted"]


def test_server_args_reach_the_embedded_server(tmp_path, calls, servers):
    args = [a for a in BASE if a not in ("--target", "http://127.0.0.1:9")]
    res = CliRunner().invoke(sweep, args + ["--out", str(tmp_path / "m"), "--server-arg", "mode=chunked",
                                            "--server-arg", "prefill-chunk-tokens=256", "--max-steps", "1"])
    assert res.exit_code == 0, res.output
    assert [e["section"] for e in servers] == [{"engine": "cpu", "model": "tiny", "block_size": 64,
                                                "mode": "chunked", "prefill_chunk_tokens": "256"}]
    bad = CliRunner().invoke(sweep, args + ["--out", str(tmp_path / "n"), "--server-arg", "chunked"])
    assert bad.exit_code == 2 and "NAME=VALUE" in bad.output


def test_embedded_server_is_stopped_when_a_step_is_interrupted(tmp_path, servers, monkeypatch):
    def run_step(*a, **kw):
        raise KeyboardInterrupt          # Ctrl-C (or SIGTERM, which the CLI turns into this) mid-step

    monkeypatch.setattr(driver, "run_step", run_step)
    args = [a for a in BASE if a not in ("--target", "http://127.0.0.1:9")]
    res = CliRunner().invoke(sweep, args + ["--out", str(tmp_path / "i")])
    assert res.exit_code == 130, res.output
    assert len(servers) == 1 and servers[0]["stopped"]
    assert json.loads((tmp_path / "i" / "sweep.json").read_text())["status"] == "interrupted"


def test_unknown_hit_ratio_gives_no_cost_row(tmp_path, monkeypatch):
    inner = fake_step([])

    def run_step(*a, **kw):
        entry = inner(*a, **kw)
        entry["summary"]["prefix_hit_ratio"] = None         # the target reports no cached tokens
        return entry

    monkeypatch.setattr(driver, "run_step", run_step)
    res = CliRunner().invoke(sweep, BASE + ["--out", str(tmp_path / "h"), "--max-steps", "2", "--bisect-steps", "0"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "h" / "sweep.json").read_text())
    assert data["best"] is not None and data["cost"] == []    # not priced as if 0% of tokens hit the cache


def test_server_param_sweep_names_no_best_value_when_none_meets_the_slo(tmp_path, calls, servers):
    args = [a for a in BASE if a not in ("--target", "http://127.0.0.1:9", "--slo", "p50(ttft) <= 2000ms")]
    res = CliRunner().invoke(sweep, args + ["--out", str(tmp_path / "p"), "--slo", "p50(ttft) <= 100ms",
                                            "--server-param", "remote-prefill-threshold", "--values", "0,1024"])
    assert res.exit_code == 99, res.output
    param = json.loads((tmp_path / "p" / "sweep.json").read_text())["server_param"]
    assert [r["passed"] for r in param["rows"]] == [False, False] and param["best_value"] is None
    assert "best: none met the SLO" in res.output


def test_white_paper_sweep_records_cards_machines_and_the_claim(tmp_path, calls, servers):
    """GLM-5.2-FP8 on S5000, 1P+1D: 32 cards on 4 machines in meta, on each cost row, and in the claim table."""
    out = tmp_path / "wp"
    res = CliRunner().invoke(sweep, ["--workload", "white-paper-agent", "--out", str(out), "--start", "1",
                                     "--max-steps", "3", "--bisect-steps", "1", "--step-duration", "1",
                                     "--warmup", "0", "--context-buckets", "64K"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "sweep.json").read_text())
    hw = data["meta"]["hardware"]
    assert (hw["cards"], hw["machines"], hw["cards_per_worker"]) == (32, 4, 16)
    assert all(s["hardware"] == {"cards": 32, "machines": 4, "cards_per_worker": 16} for s in data["steps"])
    row = data["cost"][0]
    assert (row["cards"], row["machines"], row["hardware_source"]) == (32, 4, "server")
    assert row["tpm_per_card"] == pytest.approx(row["max_input_tpm"] / 32)
    assert row["cost_per_day"] == pytest.approx(4 * (1_200_000 / (5 * 365) + 8 * 24 * 0.7 + 100))
    claim = data["claim"]
    assert claim["claim"]["input_tpm"] == 5.8e6 and claim["claim"]["cards"] == 8
    assert claim["twin_tpm_per_claim_cards"] == pytest.approx(row["max_input_tpm"] * 8 / 32)
    assert claim["twin_tpm_per_claim_prefill_cards"] == pytest.approx(row["max_input_tpm"] * 8 / 16)   # 1P x 16
    fit = claim["feasibility"]
    assert fit["fits"] is False and "impossible" in fit["text"]
    assert fit["needed_gb_per_card"] == pytest.approx(742.95e9 / 0.8 / 8 / 1e9, rel=1e-3)   # ~116 GB per card
    assert 0.5 <= fit["max_weight_bytes_per_param"] < 1                                     # 4-bit fits, FP8 not
    assert {a["assumption"] for a in claim["assumptions"]} >= {"card memory", "MFU linear / attention, MBU"}

    from paasbench.report import render

    html, md = render([out], tmp_path / "r")
    text = md.read_text()
    assert "Reproduction: MTT S5000 PrfaaS white paper vs this twin" in text
    assert "| input TPM per 8 cards | 5.80M |" in text and "| cards (machines) | 8 (1) | 32 (4) |" in text
    assert "TPM / card" in text and "TPM / machine" in text and "impossible" in text
    assert "**hardware**: 32 cards (2 workers x 16) on 4 machines of mtt-s5000" in text
    assert "Reproduction: MTT S5000 PrfaaS white paper" in html.read_text()
    assert claim["measured_by"] == "this twin"


def test_a_claim_measured_on_a_target_is_not_called_the_twin(tmp_path, calls):
    # before: `sweep --target URL` headed the column "this twin" and noted "no prefill pool (not
    # disaggregated)", also for a disaggregated server: paasbench does not know a target's pools
    out = tmp_path / "t"
    res = CliRunner().invoke(sweep, ["--workload", "white-paper-agent", "--target", "http://127.0.0.1:9",
                                     "--out", str(out), "--start", "1", "--max-steps", "3", "--bisect-steps", "1",
                                     "--step-duration", "1", "--warmup", "0", "--context-buckets", "64K"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    claim = json.loads((out / "sweep.json").read_text())["claim"]
    assert claim["measured_by"] == "the target"
    [prefill] = [r for r in claim["rows"] if "prefill-pool" in r["figure"]]
    assert "not disaggregated" not in prefill["note"] and "not known" in prefill["note"]
    assert "this twin" not in res.output and "claim vs the target" in res.output

    from paasbench.report import render

    _, md = render([out], tmp_path / "r")
    assert "vs the target" in md.read_text() and "this twin" not in md.read_text()


# The issue #20 scenario: the white-paper twin's default sweep (0.05 req/s start, factor 2, 6 escalation steps,
# 30 s + 120 s steps, 30 min budget) over its four buckets, each step costing its 150 s on a fake clock, against a
# target whose capacity falls with the context as the twin's does (measured: ~2.2 req/s at 64K).
TWIN_CAPACITY = {65536: 2.2, 131072: 1.3, 262144: 0.55, 409600: 0.3}


def twin_entry(plan, value, step_dir, gates, bucket: int, wall: float) -> dict:
    """A fake twin step's sweep.json entry at ``value`` in ``bucket``: it meets the SLO up to TWIN_CAPACITY."""
    from paasbench.metrics.slo import evaluate

    ok = value <= TWIN_CAPACITY[bucket]
    served = min(value, TWIN_CAPACITY[bucket])
    (step_dir / "records.jsonl").write_text("")
    summary = {"input_tpm": served * 0.9 * bucket * 60, "output_tpm": served * 500 * 60, "prefix_hit_ratio": 0.9,
               "goodput_rps": served, "ttft_ms": {"count": 10, "p50": 900.0 if ok else 20_000.0},
               "requests": {"ok": 10, "total": 10}, "input_tokens": 10 * bucket, "error_rate": 0.0}
    verdict = evaluate(gates, summary)
    return {"load": {"kind": plan.axis, "value": value, "unit": "req/s"}, "dir": step_dir.name,
            "summary": summary, "verdict": verdict.to_dict(), "slo_passed": verdict.passed,
            "saturation": {"saturated": not ok, "reasons": [] if ok else ["TTFT grew"]},
            "passed": ok and verdict.passed, "server_metrics": {}, "remote_prefill_share": None, "wall_s": wall}


def test_default_twin_sweep_brackets_every_bucket_within_its_budget(tmp_path, servers, monkeypatch):
    now, calls = [0.0], []

    def run_step(trace, plan, value, client, step_dir, *, gates, meta, **_):
        now[0] += plan.warmup_s + plan.duration_s + 10.0            # each step: its length plus some overhead
        calls.append((meta["bucket"], value))
        return twin_entry(plan, value, step_dir, gates, meta["bucket"], plan.warmup_s + plan.duration_s + 10.0)

    monkeypatch.setattr(driver, "run_step", run_step)
    monkeypatch.setattr(driver.time, "monotonic", lambda: now[0])
    out = tmp_path / "wp"
    res = CliRunner().invoke(sweep, ["--workload", "white-paper-agent", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "sweep.json").read_text())
    assert now[0] <= 1800
    for row in data["buckets"]:                # every bucket: a passing load with a failing one above it
        cap = TWIN_CAPACITY[row["bucket"]]
        assert row["passed"] and not row["lower_bound"], row
        assert row["load"]["value"] <= cap < row["failed_load"], row
        assert row["failed_load"] / row["load"]["value"] <= 2                 # no wider than one escalation factor
    # per-bucket lines, and the headline names its bucket; nothing is called a lower bound
    text = " ".join(res.output.split())
    for label in ("64K context:", "128K context:", "256K context:", "400K context:"):
        assert label in text
    best = next(r for r in data["buckets"] if r["index"] == data["best"]["index"])
    assert f"max sustained input TPM under the SLO at {best['bucket'] // 1024}K context:" in text
    assert "lower bound" not in text


def test_a_certified_twin_sweep_keeps_its_budget_for_verifying_before_it_bisects(tmp_path, servers, monkeypatch):
    """The white-paper workload certified at 0.95, its default 30-minute budget, on a fake twin whose steps are
    decided at their configured window (a verification at its whole 5x). Bracketing the four buckets takes most of
    the budget; each bisection step after it was run while it fit, and then not one bucket's max had time to be
    verified (the default certified sweep on the real twin: 11 steps in 27:22, all four brackets certified, none
    verified, runs/wp-cert-s44 at b6935dc). An unverified certified max is no answer: a bisection step now runs only
    if the verifications of every bucket's max still fit after it, so the budget goes to verifying."""
    now = [0.0]

    def run_step(trace, plan, value, client, step_dir, *, gates, meta, certify=None, min_pass_s=None, **_):
        verify = min_pass_s is not None and min_pass_s >= plan.duration_s     # a verification: its whole length
        wall = plan.warmup_s + (plan.duration_s if verify or min_pass_s is None else min_pass_s) + 10.0
        now[0] += wall
        entry = twin_entry(plan, value, step_dir, gates, meta["bucket"], wall)
        ok = entry["passed"]
        entry["certified"] = {"verdict": "pass" if ok else "fail", "confidence": certify.confidence,
                              "judged_requests": 40, "window_s": wall - plan.warmup_s - 10.0,
                              "stopped_early": not verify, "binding": None if ok else gates[0].label}
        return entry

    monkeypatch.setattr(driver, "run_step", run_step)
    monkeypatch.setattr(driver.time, "monotonic", lambda: now[0])
    out = tmp_path / "wp"
    res = CliRunner().invoke(sweep, ["--workload", "white-paper-agent", "--out", str(out), "--confidence", "0.95"])
    assert res.exit_code == 0, res.output
    # the user reads before the first step that the budget cannot verify all four: each needs a pass (30 + 60 s),
    # a fail (30 + 60) and a verification (30 + 5 x 60), 2,040 s in all; the twin's steps take longer than that
    text = " ".join(res.output.split())
    assert ("time budget: 1800 s is less than the least a verified answer for each of the 4 buckets takes (2040 s"
            in text), text
    data = json.loads((out / "sweep.json").read_text())
    assert now[0] <= 1800
    verified = [r for r in data["buckets"] if ((r.get("certified") or {}).get("verified") or {}).get("passed")]
    assert verified, res.output
    assert len(verified) < 4, res.output
    phases = [s["phase"] for s in data["steps"]]
    assert "verify" in phases and "bisect" not in phases[phases.index("verify"):], phases
    # the claim's reproduction reads the claim against the 64K bucket's certified interval (cost/claim.py)
    at = next(r for r in data["buckets"] if r["bucket"] == 65536)
    row = {r["figure"]: r for r in data["claim"]["rows"]}["certified capacity interval"]
    assert at["passed"] and row["note"].startswith(f"at 0.95: [{at['certified']['pass']['load']:.4g}, "), row


def test_a_bucket_starts_half_a_step_below_the_previous_buckets_capacity_scaled_by_its_context(tmp_path, calls,
                                                                                                servers):
    """The first bucket starts a step below the twin's roofline bound; the next at the geometric middle of the
    first's bracket times the ratio of the two buckets' bounds (one bucket known, on the twin), half a step lower
    (estimate.py)."""
    from paasbench.sweep.embedded import server_section
    from paasbench.sweep.source import Source

    out = tmp_path / "s"
    res = CliRunner().invoke(sweep, ["--workload", "white-paper-agent", "--out", str(out), "--max-steps", "4",
                                     "--bisect-steps", "1", "--step-duration", "1", "--warmup", "0",
                                     "--context-buckets", "64K,256K"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "sweep.json").read_text())
    src = Source.from_workload("white-paper-agent", None)
    starts = BucketStarts("rate", 0.05, False, lambda b: src.trace_for(b, requests=512),
                          server_section(src.server, 409600))
    t64 = starts.twin_rps(65536)
    loads = [(s["bucket"], s["load"]["value"], driver.outcome_of(s).passed) for s in data["steps"]]
    at = next(i for i, (b, _, _) in enumerate(loads) if b == 262144)   # 64K is bracketed before 256K starts
    first = {65536: loads[0][1], 262144: loads[at][1]}
    assert first[65536] == float(f"{t64 / 2 ** 0.5:.3g}")              # a step below the twin's bound, not 0.05
    lo = max(v for b, v, ok in loads[:at] if ok)                        # the fake passes up to 3.3 req/s
    hi = min(v for b, v, ok in loads[:at] if not ok and v > lo)
    middle = (lo * hi) ** 0.5
    ratio = starts.twin_rps(262144) / t64
    assert first[262144] == float(f"{middle * ratio / 2 ** 0.25:.3g}")
    assert data["searches"]["262144"]["start"]["load"] == first[262144]
    assert "64K -> 256K" in data["searches"]["262144"]["start"]["from"]


def test_cost_row_context_is_the_mean_over_served_requests():
    # Past saturation: 10 requests succeeded, but only 4 had their first token by the deadline, and the
    # 36,000 input tokens are those 4's (8,000 + 9,000 + 9,500 + 9,500). Mean context: 36,000 / 4 = 9,000
    # (dividing by the 10 successes gave 3,600).
    from paasbench.sweep.driver import _mean_context

    step = {"summary": {"requests": {"total": 12, "ok": 10, "failed": 2, "served": 4}, "input_tokens": 36_000}}
    assert _mean_context(step) == 9_000
    # a summary from before `served` was recorded: the served rate (4 requests / 60 s) times the window
    old = {"summary": {"requests": {"total": 12, "ok": 10, "failed": 2}, "input_tokens": 36_000,
                       "request_throughput_rps": 4 / 60, "duration_s": 60.0}}
    assert _mean_context(old) == 9_000
    assert _mean_context({"summary": {"requests": {"ok": 0, "served": 0}, "input_tokens": 0}}) is None


def test_a_target_that_reports_its_hardware_is_charged_for_it(tmp_path, calls):
    """A --target whose /health names its machines (the reference server with joined hosts) is charged for them,
    not for one assumed machine; it is one server for the whole sweep, so its /health is asked once (before: once
    a step)."""
    import urllib.request

    from sse_server import SSEServer

    args = [a for a in BASE if a not in ("--context-buckets", "none")]
    with SSEServer(machines=3) as srv:
        res = CliRunner().invoke(sweep, [srv.url if a == "http://127.0.0.1:9" else a for a in args]
                                 + ["--out", str(tmp_path / "h"), "--context-buckets", "2K", "--max-steps", "2",
                                    "--bisect-steps", "0"])
        with urllib.request.urlopen(srv.url + "/debug/gets", timeout=5) as r:
            gets = json.loads(r.read())
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "h" / "sweep.json").read_text())
    assert len(data["steps"]) == 2 and gets.get("/health") == 1, gets
    assert all(s["hardware"] == {"cards": None, "machines": 3, "cards_per_worker": None} for s in data["steps"])
    row = data["cost"][0]
    assert (row["machines"], row["hardware_source"]) == (3, "server")


def _certified_sweep(tmp_path, monkeypatch, breaks_above: float, name: str, exit_code: int = 0) -> tuple[dict, str]:
    """A certified sweep (--confidence 0.9, --verify-for 5) on the fake, whose capacity is ``breaks_above`` for
    runs longer than a step (verifications): the sweep.json and the console."""
    made: list = []
    inner = fake_step(made)

    def run_step(trace, plan, value, client, step_dir, **kw):
        entry = inner(trace, plan, value, client, step_dir, **kw)
        if plan.duration_s > 3 and value > breaks_above:      # a verification (5 s) above the limit: breaks
            entry["passed"] = entry["slo_passed"] = False
            entry["certified"]["verdict"] = "fail"
        return entry

    monkeypatch.setattr(driver, "run_step", run_step)
    out = tmp_path / name
    args = BASE[:-2]                                        # less "--confidence 0"
    res = CliRunner().invoke(sweep, args + ["--out", str(out), "--confidence", "0.9", "--verify-for", "5"])
    assert res.exit_code == exit_code, res.output
    return json.loads((out / "sweep.json").read_text()), res.output


def test_certified_max_is_verified_and_steps_down_when_it_fails(tmp_path, monkeypatch):
    """With --confidence the bucket's max runs once more for --verify-for steps; here every longer run above
    3.1 req/s fails, so the answer steps down: first to the middle of the gap between the failed max and the
    search's next pass below (which fails too), then to that pass, which is verified. Before certified sweeps
    there was no verification at all."""
    data, output = _certified_sweep(tmp_path, monkeypatch, 3.1, "v")
    searched = [s["load"]["value"] for s in data["steps"] if s["phase"] != "verify" and s["passed"]]
    checks = [s for s in data["steps"] if s["phase"] == "verify"]
    assert [c["passed"] for c in checks] == [False, False, True], output
    top, mid, low = (c["load"]["value"] for c in checks)
    assert top == max(searched) <= CAPACITY_RPS and low == max(x for x in searched if x < top)
    assert mid == pytest.approx((top * low) ** 0.5)
    row = data["buckets"][0]
    assert row["index"] == checks[2]["index"]                       # the answer is the verified run
    assert row["failed_load"] == mid                                # the lowest failed verification bounds it
    cert = row["certified"]
    assert cert["confidence"] == 0.9 and cert["verified"]["passed"] and cert["fail"]["verdict"] == "fail"
    assert "verification failed" in output and "stepping down" in output
    assert "is less than the least a verified answer" not in " ".join(output.split())   # its budget fits one


def test_a_failed_verification_steps_down_to_the_middle_of_the_gap(tmp_path, monkeypatch):
    """A verification that fails at the search's max, with the capacity of longer runs between that max and
    the next pass below: the middle of the gap is verified and is the answer, above the search's pass. Before,
    the answer stepped down to that pass (the whole gap lost: 8 -> 4 req/s on ci-small)."""
    data, output = _certified_sweep(tmp_path, monkeypatch, 3.15, "m")
    searched = [s["load"]["value"] for s in data["steps"] if s["phase"] != "verify" and s["passed"]]
    checks = [s for s in data["steps"] if s["phase"] == "verify"]
    assert [c["passed"] for c in checks] == [False, True], output
    top, mid = checks[0]["load"]["value"], checks[1]["load"]["value"]
    low = max(x for x in searched if x < top)
    assert low < mid <= 3.15 < top and mid == pytest.approx((top * low) ** 0.5)
    row = data["buckets"][0]
    assert row["index"] == checks[1]["index"] and row["failed_load"] == top


def test_verification_steps_down_until_a_load_verifies(tmp_path, monkeypatch):
    """Longer runs hold only up to 1.9 req/s, below the search's two highest passes (3.25, 3.0): the
    verifications go down the search's passes, each gap's middle first, until one holds; the answer is that
    verified load. Before, verification stopped after three tries (3.25, its middle, 3.0) and the answer was the
    next pass below, 2.0 req/s, never run again and above what longer runs held (ci-small idle, seed 2: 12 req/s
    left unverified)."""
    data, output = _certified_sweep(tmp_path, monkeypatch, 1.9, "d")
    searched = sorted({s["load"]["value"] for s in data["steps"] if s["phase"] != "verify" and s["passed"]})
    checks = [s for s in data["steps"] if s["phase"] == "verify"]
    assert [c["passed"] for c in checks] == [False] * (len(checks) - 1) + [True], output
    tried = [c["load"]["value"] for c in checks]
    assert tried == sorted(tried, reverse=True) and tried[-1] <= 1.9 < tried[-2]
    assert set(searched) & set(tried) == {x for x in searched if tried[-1] <= x <= tried[0]}   # each pass once
    row = data["buckets"][0]
    assert row["index"] == checks[-1]["index"] and row["certified"]["verified"]["passed"]
    assert row["failed_load"] == tried[-2]


def test_no_answer_when_no_load_verifies(tmp_path, monkeypatch):
    """Longer runs fail at every load the search passed: no pass stands (before: the search's pass below the
    third failed verification was the answer, unverified); the sweep exits 99, as when no step passed."""
    data, output = _certified_sweep(tmp_path, monkeypatch, 0.1, "n", exit_code=99)
    checks = [s for s in data["steps"] if s["phase"] == "verify"]
    assert checks and not any(c["passed"] for c in checks)
    assert data["buckets"][0]["passed"] is False and data["best"] is None, output
    assert "no pass below it is left to verify" in output


def test_a_certified_search_starts_a_step_below_the_throughput_probe(tmp_path, calls):
    """Without --start a certified search first runs a short closed-loop probe, doubling the loops from 1 until
    they serve no more (1, 2, 4 and 8 serve 1, 2, 4 and 4 req/s), and starts a step (/2^0.5) below the
    peak instead of climbing from the workload's 0.5 req/s: the capacity (3.3) is bracketed in fewer steps. The
    probe is no step: never claimed, kept apart in sweep.json ``probes``, and a resume reads it back instead of
    probing again."""
    args = [a for a in BASE[:-2] if a not in ("--start", "0.5")]           # no --start, no "--confidence 0"
    out = tmp_path / "p"
    res = CliRunner().invoke(sweep, args + ["--out", str(out), "--confidence", "0.9", "--verify-for", "0"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "sweep.json").read_text())
    probe = data["probes"]["None"]
    assert [lv["streams"] for lv in probe["levels"]] == [1, 2, 4, 8] == [c[0] for c in calls[:4]]
    assert (probe["peak_streams"], probe["peak_rps"], probe["dir"]) == (4, PROBE_SERVED_RPS, "probe")
    assert (out / "probe" / "c4" / "summary.json").exists()
    assert all(s["load"]["kind"] == "rate" for s in data["steps"])
    first = data["steps"][0]["load"]["value"]
    assert first == pytest.approx(PROBE_SERVED_RPS / 2 ** 0.5, rel=1e-2)
    assert "throughput probe" in data["searches"]["None"]["start"]["from"]
    assert data["buckets"][0]["passed"] and data["buckets"][0]["failed_load"] is not None
    probed_steps = len(data["steps"])

    plain = tmp_path / "q"
    res = CliRunner().invoke(sweep, args + ["--out", str(plain), "--confidence", "0.9", "--verify-for", "0",
                                            "--probe-streams", "0"])
    assert res.exit_code == 0, res.output
    unprobed = json.loads((plain / "sweep.json").read_text())
    assert "probes" not in unprobed and unprobed["steps"][0]["load"]["value"] == 0.5
    assert probed_steps < len(unprobed["steps"])

    calls.clear()
    res = CliRunner().invoke(sweep, args + ["--out", str(out), "--confidence", "0.9", "--verify-for", "0",
                                            "--resume"])
    assert res.exit_code == 0, res.output
    assert calls == []                                                      # neither the probe nor a step rerun


def test_the_probe_doubles_the_loops_until_they_serve_no_more():
    """32 closed loops on ci-small's cpu engine served 4.3 req/s where 4 and 8 served 8.5 and 8.0: one high
    concurrency reads the collapse past capacity, not the peak. The probe stops at the first level that adds less
    than PROBE_GAIN, and at its most streams."""
    from paasbench.sweep.probe import Level, run_probe

    def measure(curve):
        seen = []

        def level(streams):
            seen.append(streams)
            return Level(streams, curve(streams), 10, 5.0, None)
        return level, seen

    level, seen = measure(lambda c: {1: 3.0, 2: 5.7, 4: 8.5, 8: 8.0, 16: 6.0, 32: 4.3}[c])
    r = run_probe(level, 64, "probe")
    assert seen == [1, 2, 4, 8] and (r.peak.streams, r.served_rps) == (4, 8.5)
    level, seen = measure(lambda c: float(c))                      # never saturates: stops at the most streams
    assert run_probe(level, 16, "probe").peak.streams == 16 and seen == [1, 2, 4, 8, 16]
    level, seen = measure(lambda c: 0.0)
    assert run_probe(level, 64, "probe") is None and seen == [1]
    assert run_probe(lambda c: None, 64, "probe") is None          # no budget for a level


def test_step_down_bisects_while_the_gap_is_wider_than_the_search_resolution():
    from paasbench.sweep.search import SearchConfig

    cfg = SearchConfig(start=1.0)
    assert driver.step_down(4.0, 8.0, cfg) == pytest.approx(32 ** 0.5)
    assert driver.step_down(4.0, 4.1, cfg) == 4.0                      # within rel_tol (3%): the pass itself
    whole = SearchConfig(start=1.0, integer=True)
    assert driver.step_down(4.0, 8.0, whole) == 6.0
    assert driver.step_down(4.0, 5.0, whole) == 4.0                    # no whole load in between


def test_each_rate_step_plays_the_sessions_the_answer_time_measured_at_the_closest_load_below(tmp_path, monkeypatch):
    """A rate step's sessions in flight follow the target's mean E2E (``StepPlan.response_s``, mix.lanes_wanted), and
    a sweep learns it from its own steps: each step is planned with the E2E of the step at the highest load not above
    its own (E2E grows with the load; past capacity a queue inflates it), none before the first. Before, every step
    played the trace's turn gap, however slowly the target answered (tests/test_sweep_step.py)."""
    made: list = []
    inner = fake_step(made)
    planned: list[tuple[float, float]] = []

    def run_step(trace, plan, value, client, step_dir, **kw):
        planned.append((value, plan.response_s))
        entry = inner(trace, plan, value, client, step_dir, **kw)
        entry["summary"]["e2e_ms"] = {"mean": 1000.0 * value}      # the fake answers in `load` seconds
        return entry

    monkeypatch.setattr(driver, "run_step", run_step)
    res = CliRunner().invoke(sweep, BASE + ["--out", str(tmp_path / "e2e")])
    assert res.exit_code == 0, res.output
    assert planned[0] == (0.5, 0.0), planned                        # nothing measured yet
    for i, (load, response) in enumerate(planned[1:], 1):
        below = [at for at, _ in planned[:i] if at <= load]
        assert response == (max(below) if below else 0.0), planned
    assert any(0 < response < load for load, response in planned), planned   # a bisection: from the pass below


def test_search_steps_count_any_queue_growth_and_a_verification_only_growth_near_the_slo_bound():
    """issue 31: judged against the SLO's bound, 60 s white-paper 64K point steps passed 3.261 and 3.064 req/s (TTFT
    grew to 43% and 17% of the bound), loads that do not hold for 30 minutes; a verification five windows long
    judged so passed every replayed load that holds (docs/sweep.md, "Saturation")."""
    from paasbench.sweep.saturation import SaturationLimits, step_limits

    for phase in ("escalate", "bisect"):
        assert step_limits(phase).slo_share == 0.0 and step_limits(phase).slo_share_early == 0.0
    assert step_limits("verify") == SaturationLimits() and SaturationLimits().slo_share == 0.5


def _certified_64k_sweep(tmp_path, monkeypatch, capacity: float, budget: int, timing) -> tuple[dict, list, float]:
    """A certified white-paper 64K sweep on a fake twin passing up to ``capacity`` req/s, on a fake clock:
    ``timing(value, plan, verify, ok)`` gives each step's judged window and its wall time. Its sweep.json, its
    steps as (phase, load, passed), and the clock at its end."""
    now = [0.0]

    def run_step(trace, plan, value, client, step_dir, *, gates, meta, certify=None, min_pass_s=None, **_):
        ok = value <= capacity
        verify = min_pass_s is not None and min_pass_s >= plan.duration_s
        window, wall = timing(value, plan, verify, ok, min_pass_s)
        now[0] += wall
        entry = twin_entry(plan, value, step_dir, gates, meta["bucket"], wall)
        entry["window_s"] = window
        entry["certified"] = {"verdict": "pass" if ok else "fail", "confidence": certify.confidence,
                              "judged_requests": 40, "window_s": window, "stopped_early": window < plan.duration_s,
                              "binding": None if ok else gates[0].label}
        return entry

    monkeypatch.setitem(TWIN_CAPACITY, 65536, capacity)
    monkeypatch.setattr(driver, "run_step", run_step)
    monkeypatch.setattr(driver.time, "monotonic", lambda: now[0])
    # the ladder of the sweeps these model, which started two steps below the bound: 1.57, 2.22, 3.14 req/s, ...
    monkeypatch.setattr(BucketStarts, "twin_rps", lambda self, bucket: 2.22)
    out = tmp_path / "wp"
    res = CliRunner().invoke(sweep, ["--workload", "white-paper-agent", "--out", str(out), "--confidence", "0.95",
                                     "--context-buckets", "64K", "--time-budget", str(budget)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "sweep.json").read_text())
    return data, [(s["phase"], round(s["load"]["value"], 2), s["passed"]) for s in data["steps"]], now[0]


def test_a_verification_is_budgeted_at_a_search_steps_overrun_in_seconds_not_as_a_share_of_its_length(
        tmp_path, servers, monkeypatch):
    """issue 31: a seeded white-paper 64K certified sweep (seed 5) passed 3.0 req/s and failed 4.24, that fail's
    step taking 309 s for its 150 (97 s priming its sessions); taken as a share (+106%), that overrun put the 330 s
    verification at 680 s, the budget had no room to bisect first, and the answer was [3.0, 4.24), 41% wide. The
    verification took 447 s: its priming and tail are a search step's, in seconds, not five times them. Here the
    steps take 60 s around a passing window and 200 s around a failing one, and the budget fits a bisection and a
    verification reckoned in seconds (350 + 530 s: test below), not as shares of their lengths (290 + 638 s)."""
    def timing(value, plan, verify, ok, min_pass_s):   # 60 s around a passing window, 200 s around a failing one
        window = plan.duration_s if verify else (min_pass_s if ok else 60.0)
        return window, plan.warmup_s + window + (60.0 if ok else 200.0)

    _, phases, end = _certified_64k_sweep(tmp_path, monkeypatch, 3.0, 1490, timing)
    assert [p for p, _, _ in phases] == ["escalate", "escalate", "escalate", "bisect", "verify"], phases
    assert phases[3][2] and phases[4][1] == phases[3][1] and phases[4][2], phases     # the bisection's pass verified
    assert end <= 1490


def test_a_certified_step_is_budgeted_at_its_whole_window_plus_what_steps_took_around_theirs(
        tmp_path, servers, monkeypatch):
    """issue 31: once fails stopped on their known misses, a seeded white-paper 64K sweep (seed 6) had only steps that
    stopped early behind it when it bisected to 3.071 req/s; that pass ran its whole stretched window, 265 s where
    225 were reckoned (the largest overrun of a step's length so far), and the sweep had too little left to verify
    anything. A certified step is now reckoned at its whole length plus the most a step took around its judged window
    (priming, tail). Here every step takes 90 s around its window; passes stop at the configured window but those
    near the knee (3.2-3.35 req/s) run their whole one. Reckoned the old way the sweep bisected to 3.3, which ran its
    whole window, and stopped with 380 s of its 1,700 left and nothing verified; now it verifies 3.14 instead."""
    def timing(value, plan, verify, ok, min_pass_s):   # 90 s around every window; the knee's passes run it whole
        window = plan.duration_s if verify or 3.2 < value <= 3.35 else (min_pass_s if ok else 60.0)
        return window, plan.warmup_s + window + 90.0

    data, phases, end = _certified_64k_sweep(tmp_path, monkeypatch, 3.35, 1700, timing)
    assert phases[-1][0] == "verify" and phases[-1][2], phases          # it ends on a verified answer
    assert data["buckets"][0]["certified"]["verified"]["passed"] and end <= 1700, (phases, end)
