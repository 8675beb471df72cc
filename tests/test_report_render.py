"""report/compare render self-contained HTML and Markdown carrying the recorded numbers."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from paasbench.cli import main
from paasbench.cost.table import CostInputs
from paasbench.report import render, render_compare
from paasbench.report.curves import knee_index
from paasbench.report.load import load_result

FIX = Path(__file__).parent / "fixtures" / "report"
EXTERNAL = re.compile(r"""(?:src|href|url)\s*[=(]\s*["']?\s*(?:https?:)?//""", re.I)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[str, str]:
    out = tmp_path_factory.mktemp("rep")
    html, md = render([FIX / "run", FIX / "sweep"], out, title="fixture report")
    return html.read_text(), md.read_text()


def test_html_is_self_contained(rendered):
    html, _ = rendered
    assert not EXTERNAL.search(html), EXTERNAL.search(html).group(0)
    assert "<script" not in html and "<link" not in html and "@import" not in html
    assert "http://www.w3.org" not in html  # not even an SVG namespace URL: inline SVG does not need one


def test_external_url_detector_can_fail():
    assert EXTERNAL.search('<script src="https://cdn.plot.ly/plotly.js"></script>')
    assert EXTERNAL.search("<link href='//fonts.googleapis.com/css'>")
    assert EXTERNAL.search("background: url(https://x/y.png)")


def test_html_has_plots_tables_and_numbers(rendered):
    html, md = rendered
    summary = json.loads((FIX / "run" / "summary.json").read_text())
    p50 = f"{summary['ttft_ms']['p50']:,.1f}"
    assert p50 in html and p50 in md                       # the same figure in both forms
    for title in ("TTFT CDF", "TPOT CDF", "E2E CDF", "throughput vs latency", "TTFT percentiles vs load",
                  "server per-stage mean", "prefix hit achieved vs load", "goodput vs load"):
        assert title in html, title
    assert html.count("<svg") >= 10 and html.count("<polyline") >= 10
    assert "SLO p50(ttft) = 400 ms" in html                 # the SLO line on the throughput–latency curve
    assert ">knee" in html and "best under SLO" in html
    assert "first_byte_timeout" in html and "first_byte_timeout" in md   # errors
    assert "queue_ms" in md                                  # server per-stage breakdown
    assert "prefill util" in md and "pool utilization vs load" in html   # the /metrics scrape per step
    # the last step failed its SLO and was saturated: both reasons, in the verdict and the server table
    assert "| FAIL (SLO; saturated) |" in md and "yes: in-flight requests grew 2.0 -> 9.0" in md
    # a queue that rose far from the SLO's bound is shown, not counted (saturation.py: swings)
    assert "no (swing: TTFT grew 120 -> 260 ms, 33% of the SLO's bound)" in md
    assert "| 89.7% |" in md and "traffic hit" in md                 # per-step traffic-side hit (sweep.json)
    for text in ("15.08", "21,715.2", "blended price", "payback months"):  # cost table + formulas
        assert text in html and text in md
    assert "p50(ttft) &lt;= 400 ms" in html and "PASS" in md and "FAIL" in md  # verdicts


def test_knee_index():
    xs = [1, 2, 3, 4, 5, 6]
    assert knee_index(xs, [10, 10.5, 11, 12, 30, 90]) in (3, 4)
    assert knee_index(xs, [1, 2, 3, 4, 5, 6]) is None       # a straight line has no knee
    assert knee_index([1, 2], [1, 5]) is None
    assert knee_index(xs, [380, 150, 160, 80, 75, 76]) is None  # falling latency (warm-up noise): no knee


def test_compare_deltas(tmp_path: Path):
    html, md = render_compare([FIX / "run", FIX / "run_slow", FIX / "sweep"], tmp_path)
    text = md.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| TTFT p50"))
    # run_slow is 10% slower on TTFT, which its 118 requests a side cannot tell from noise (their p50 intervals)
    assert "(+10.0%; within noise (118 vs 118 requests))" in row
    assert 'class="bad">' in html.read_text()
    assert "max input TPM under SLO" in text                 # the sweep's headline capacity


def test_cost_inputs_change_the_table(tmp_path: Path):
    _, md = render([FIX / "run"], tmp_path, cost_inputs=CostInputs(currency="USD", price_input_per_m=1.0,
                                                                   price_cached_input_per_m=1.0))
    text = md.read_text()
    assert "revenue USD/min" in text and "| 1.00 |" in text


def test_cli_report_and_errors(tmp_path: Path):
    runner = CliRunner()
    res = runner.invoke(main, ["report", str(FIX / "sweep"), "-o", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "a" / "report.html").is_file() and (tmp_path / "a" / "report.md").is_file()
    res = runner.invoke(main, ["compare", str(FIX / "run"), str(FIX / "sweep"), "-o", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    empty = tmp_path / "empty"
    empty.mkdir()
    res = runner.invoke(main, ["report", str(empty), "-o", str(tmp_path / "c")])
    assert res.exit_code == 2 and "no summary.json or sweep.json" in res.output
    res = runner.invoke(main, ["report", str(FIX / "run"), "-o", str(tmp_path / "d"), "--slo", "p50(ttft) <= 5"])
    assert res.exit_code == 2 and "needs a unit" in res.output


def test_sweep_dir_without_step_dirs_loads_from_embedded_summaries(tmp_path: Path):
    shutil.copy(FIX / "sweep" / "sweep.json", tmp_path / "baseline.json")
    sweep = load_result(tmp_path / "baseline.json")
    assert len(sweep.steps) == 6 and sweep.best is not None and sweep.best.records_path is None
    html, _ = render([sweep], tmp_path / "out")
    assert "throughput vs latency" in html.read_text()


def test_degenerate_results_still_render(tmp_path: Path):
    """A run where every request failed, and a sweep with no step yet: the report says so, it does not crash."""
    from paasbench.metrics.records import RecordWriter, RequestRecord
    from paasbench.metrics.summary import summarize

    recs = [RequestRecord(index=i, request_id=str(i), session_id=None, turn=None, intended_send_s=i * 0.1,
                          actual_send_s=i * 0.1, first_token_s=None, end_s=i * 0.1 + 1, error_kind="connection",
                          error_message="refused") for i in range(5)]
    (tmp_path / "failed").mkdir()
    with RecordWriter(tmp_path / "failed" / "records.jsonl") as w:
        for r in recs:
            w.write(r)
    (tmp_path / "failed" / "summary.json").write_text(json.dumps(summarize(recs, meta={"target": "x"})))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "sweep.json").write_text(json.dumps(
        {"schema": "paasbench.sweep/1", "meta": {}, "slo": ["p50(ttft) <= 1s"], "steps": [], "best": None}))
    html, md = render([tmp_path / "failed", tmp_path / "empty"], tmp_path / "out",
                      gates=None)
    text = md.read_text()
    assert "| connection | 5 | 100.0% |" in text and "| error rate | 100.00% |" in text
    assert "none passed" in text
    assert "no data" in html.read_text()
    render_compare([tmp_path / "failed", tmp_path / "empty"], tmp_path / "out")


def test_committed_example_reports_are_self_contained():
    pages = list((Path(__file__).resolve().parent.parent / "reports").rglob("*.html"))
    assert pages, "reports/ should hold example reports"
    for page in pages:
        text = page.read_text()
        assert not EXTERNAL.search(text), f"{page}: {EXTERNAL.search(text).group(0)}"
        assert "<svg" in text and "<script" not in text, page


def test_bad_result_files_are_located_input_errors(tmp_path: Path):
    from paas_common.errors import InputError

    bad = tmp_path / "summary.json"
    bad.write_text('{"ttft_ms": {"p50": 1},\n "oops"\n}')
    with pytest.raises(InputError) as err:
        load_result(bad)
    assert err.value.file == str(bad) and err.value.line == 3
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(InputError, match="not a paasbench summary or sweep"):
        load_result(other)
    steps = tmp_path / "s.json"
    steps.write_text('{"schema": "paasbench.sweep/1", "steps": [{"index": 0}]}')
    with pytest.raises(InputError) as err:
        load_result(steps)
    assert err.value.field == "steps[0].summary"


def test_headline_revenue_is_the_best_buckets_row(tmp_path: Path):
    from paasbench.cost.table import cost_row
    from paasbench.report.sections import section

    data = json.loads((FIX / "sweep" / "sweep.json").read_text())
    best_tpm = data["best"]["input_tpm"]
    # a smaller bucket listed first: the headline capacity is the second bucket's
    data["buckets"] = [{"context_tokens": 4096, "max_input_tpm": best_tpm / 3, "hit_ratio": 0.5},
                       {"context_tokens": 8192, "max_input_tpm": best_tpm, "hit_ratio": 0.7875}]
    (tmp_path / "sweep.json").write_text(json.dumps(data))
    sec = section(load_result(tmp_path / "sweep.json"), None, CostInputs())
    revenue = dict(sec["key"])["revenue / day (CNY)"]
    assert revenue == f"{cost_row(best_tpm, 0.7875).revenue_per_day:,.0f}"


def test_compare_shows_a_sweep_with_no_passing_step_as_failed(tmp_path: Path):
    data = json.loads((FIX / "sweep" / "sweep.json").read_text())
    data["best"] = None
    for step in data["steps"]:
        step["passed"] = False
    (tmp_path / "none.json").write_text(json.dumps(data))
    _, md = render_compare([FIX / "sweep", tmp_path / "none.json"], tmp_path / "out")
    row = next(line for line in md.read_text().splitlines() if line.startswith("| none |"))
    assert "FAIL" in row and "no step met the SLO" in row


def test_report_names_results_relative_to_where_it_runs(tmp_path: Path, monkeypatch):
    """An absolute result path (a script's, a CI runner's) appears relative to the working directory, so the
    report never carries this machine's layout (it printed /work/.../runs/examples/ci-small)."""
    res_dir = tmp_path / "runs" / "s1"
    shutil.copytree(FIX / "sweep", res_dir)
    monkeypatch.chdir(tmp_path)
    html, md = render([res_dir.resolve()], tmp_path / "out", title="t")
    text = md.read_text() + html.read_text()
    assert str(tmp_path) not in text
    assert "runs/s1" in md.read_text()


def _white_paper_like(tmp_path: Path, good_last: float) -> Path:
    """The committed white-paper example's four steps (reports/white-paper-64k/report.md): p50 TTFT 103, 121, 113,
    181 ms at 0.757M, 1.35M, 3.10M, 6.00M input TPM; the best step (6.00M) lies past the knee at 3.10M."""
    rows = [(0.2, 757_000, 103.2), (0.4, 1_350_000, 121.2), (0.8, 3_100_000, 113.1), (1.6, 6_000_000, 180.5)]
    steps = [{"index": i, "phase": "escalate", "load": {"kind": "rate", "value": r, "unit": "req/s"}, "passed": True,
              "summary": {"input_tpm": tpm, "good_input_tpm": good_last if i == 3 else tpm,
                          "ttft_ms": {"p50": p50}, "requests": {"total": 10, "ok": 10, "served": 10}}}
             for i, (r, tpm, p50) in enumerate(rows)]
    data = {"schema": "paasbench.sweep/1", "meta": {}, "slo": ["p50(ttft) <= 6s", "error_rate <= 1%"],
            "steps": steps, "best": {"index": 3, "input_tpm": 6_000_000}}
    (tmp_path / "sweep.json").write_text(json.dumps(data))
    return tmp_path / "sweep.json"


def test_capacity_headline_says_past_the_knee_and_the_attaining_share(tmp_path: Path):
    from paasbench.report.sections import section

    sec = section(load_result(_white_paper_like(tmp_path, 4_450_000)), None, CostInputs())
    capacity = dict(sec["key"])["max input TPM under SLO"]
    assert capacity.startswith("6.00M (past the knee of its curve (knee at 3.10M input TPM;")
    assert "only 4.45M (74%) of it from requests within the SLO's per-request limits" in capacity
    assert sec["max_input_tpm"] == capacity                       # the sentence under the curve says it too
    # a best step before any knee, all of it within the limits: the bare number
    (tmp_path / "b").mkdir()
    data = json.loads(_white_paper_like(tmp_path / "b", 6_000_000).read_text())
    data["steps"], data["best"] = data["steps"][:3], {"index": 2, "input_tpm": 3_100_000}
    (tmp_path / "b" / "sweep.json").write_text(json.dumps(data))
    assert dict(section(load_result(tmp_path / "b" / "sweep.json"), None, CostInputs())["key"])[
        "max input TPM under SLO"] == "3.10M"


def test_sweep_console_prints_the_same_caveats(tmp_path: Path):
    from paasbench.commands.sweep import capacity_caveats_of
    from paasbench.metrics.slo import parse_gates

    _white_paper_like(tmp_path, 4_450_000)
    caveats = capacity_caveats_of(tmp_path, parse_gates(["p50(ttft) <= 6s"]))
    assert [c.split(" (")[0].split(" 4")[0] for c in caveats] == ["past the knee of its curve", "only"]
    assert "p50 TTFT there 113 ms, here 180 ms" in caveats[0]


def test_counts_print_as_integers(tmp_path: Path):
    """A count below a thousand prints whole ("467", once "467.00"); fractions and large counts as before."""
    from paasbench.report.tables import big

    assert (big(467), big(467.0), big(0), big(1.5), big(2500)) == ("467", "467", "0", "1.50", "2.50K")
    summary = json.loads((FIX / "run" / "summary.json").read_text())
    summary.update(input_tokens=900, cached_tokens=467, uncached_tokens=433, output_tokens=467)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "summary.json").write_text(json.dumps(summary))
    _, md = render([tmp_path / "r"], tmp_path / "out")
    text = md.read_text()
    assert "| input / cached / uncached tokens | 900 / 467 / 433 |" in text and "| output tokens | 467 |" in text
    assert ".00 " not in text.replace(".00 ms", "")


def test_best_step_is_named_by_its_offered_load(tmp_path: Path):
    """Poisson conditioned on a count over the whole step can offer less in the window than its nominal rate:
    the best step is named by what it offered (1.267 req/s), the nominal 1.375 after it."""
    data = json.loads((FIX / "sweep" / "sweep.json").read_text())
    best = next(s for s in data["steps"] if s["index"] == data["best"]["index"])
    best["load"]["value"], best["offered_rps"] = 1.375, 1.267
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "sweep.json").write_text(json.dumps(data))
    _, md = render([tmp_path / "s"], tmp_path / "out")
    text = md.read_text()
    assert "**at load**: 1.267 req/s offered (nominal 1.375 req/s)" in text
    assert re.search(r"\| step-004 \| [^|]+ \| 1\.375 \| 1\.267 \|", text)      # the steps table's offered column


def test_one_cost_inputs_flag_in_every_command():
    """The report tells readers to "override with --cost-inputs FILE.yaml": every command that takes cost
    inputs takes them under that one name (sweep once called it --cost)."""
    import click

    ctx = click.Context(main)
    takers = {}
    for name in main.list_commands(ctx):
        cmd = main.get_command(ctx, name)
        for sub in ([cmd] if not isinstance(cmd, click.Group) else [cmd.get_command(ctx, n)
                                                                     for n in cmd.list_commands(ctx)]):
            for p in sub.params:
                if isinstance(p, click.Option) and "cost" in (p.name or ""):
                    takers[f"{name} {sub.name}"] = p.opts
    assert {k.split()[0] for k in takers} >= {"sweep", "report", "compare"}
    assert all(opts == ["--cost-inputs"] for opts in takers.values()), takers
    macros = (Path(__file__).parents[1] / "paasbench" / "report" / "templates").glob("*.jinja")
    flags = {f for m in macros for f in re.findall(r"--cost[\w-]*", m.read_text())}
    assert flags == {"--cost-inputs"}


def test_a_certified_sweeps_throughput_probe_is_in_its_report(tmp_path: Path):
    """The probe's levels are step-seconds the sweep spent and the place its search started from; the report left
    them out (sweep.json ``probes`` only)."""
    data = json.loads((FIX / "sweep" / "sweep.json").read_text())
    data["probes"] = {"None": {"levels": [
        {"streams": 1, "served_rps": 7.667, "requests": 46, "window_s": 6.0, "ttft_p50_ms": 37.9, "wall_s": 9.12},
        {"streams": 2, "served_rps": 7.333, "requests": 44, "window_s": 6.0, "ttft_p50_ms": 47.3, "wall_s": 9.08}],
        "dir": "probe", "peak_streams": 1, "peak_rps": 7.667}}
    (tmp_path / "sweep.json").write_text(json.dumps(data))
    html, md = render([load_result(tmp_path / "sweep.json")], tmp_path / "out")
    text = md.read_text()
    assert "#### Throughput probe" in text and "| — | 1 | 7.667 | 37.9 | 46 | 6.0 | 9.1 | ★ |" in text
    assert "<h3>Throughput probe</h3>" in html.read_text()
    plain = render([load_result(FIX / "sweep" / "sweep.json")], tmp_path / "plain")[1].read_text()
    assert "Throughput probe" not in plain                               # no probe, no section


def test_a_certified_sweeps_cost_table_says_the_pass_it_prices_and_the_interval_around_it(tmp_path: Path):
    """issue 31 item 2: the cost table is priced at the certified pass, with the bracket shown. Before, the report's
    cost table gave the pass's TPM and nothing of the interval: the interval was in the headline only."""
    data = json.loads((FIX / "sweep" / "sweep.json").read_text())
    row, best = data["buckets"][0], data["best"]["index"]
    load = next(s["load"]["value"] for s in data["steps"] if s["index"] == best)
    row["certified"] = {"confidence": 0.95, "pass": {"index": best, "load": load, "requests": 900},
                        "fail": {"load": load * 1.05, "requests": 300}, "undecided_loads": [], "verified": None,
                        "horizon": {"held_s": 300.0, "overload_unseen": 0.05, "low": load / 1.05}}
    (tmp_path / "sweep.json").write_text(json.dumps(data))
    html, md = render([tmp_path / "sweep.json"], tmp_path / "out", title="certified")
    line = (f"priced at the certified pass, {load:g} req/s; the capacity lies in "
            f"[{load / 1.05:.4g}, {load * 1.05:.4g}) req/s at 0.95.")
    cost = md.read_text().split("#### Cost table", 1)[1].split("Formulas", 1)[0]
    assert line in cost, cost
    assert line in html.read_text()
    del row["certified"]                                     # point verdicts: no such line
    (tmp_path / "point.json").write_text(json.dumps(data))
    _, md = render([tmp_path / "point.json"], tmp_path / "point", title="point")
    assert "priced at the certified pass" not in md.read_text()


def test_the_claim_reproduction_reads_the_claim_against_the_certified_interval():
    """The default white-paper sweep's reproduction table set the claim's 5.80M beside the 64K pass's 7.86M, while
    the cost table beside it said the capacity lies in [1.974, 3.14) req/s, 11% below the pass at its lower end: the
    same report gave a point and an interval for one figure. The claim is now read against the interval too."""
    from paasbench.cost.claim import Claim, compare
    from paasbench.cost.table import CostInputs

    claim = Claim(source="white paper", context_tokens=65536, input_tpm=5.8e6, hit_ratio=0.9, ttft_p50_ms=6000,
                  cards=8)
    row = {"context_tokens": 65536, "max_input_tpm": 7.86e6, "hit_ratio": 0.853, "ttft_p50_ms": 140.0, "cards": 32,
           "machines": 4, "load": {"kind": "rate", "value": 2.22, "unit": "req/s"},
           "certified": {"confidence": 0.95, "pass": {"load": 2.22}, "fail": {"load": 3.14},
                         "horizon": {"held_s": 64.0, "overload_unseen": 0.1246, "low": 1.974}}}
    rows = {r["figure"]: r for r in compare(claim, row, None, CostInputs())["rows"]}
    got = rows["certified capacity interval"]
    assert got["twin"] == "[6.99M, 11.12M)", got                      # 7.86M x 1.974 / 2.22, x 3.14 / 2.22
    assert got["note"].startswith("at 0.95: [1.974, 3.14) req/s, the max at 2.22 req/s"), got
    del row["certified"]["fail"]
    got = {r["figure"]: r for r in compare(claim, row, None, CostInputs())["rows"]}["certified capacity interval"]
    assert got["twin"] == ">= 6.99M" and "at least 1.974 req/s" in got["note"], got
    del row["certified"]                                               # point verdicts: no such row
    assert "certified capacity interval" not in {r["figure"] for r in compare(claim, row, None, CostInputs())["rows"]}
