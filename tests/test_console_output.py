"""What the commands print off a terminal (a CI log, a pipe): tables whole, ratios in one unit, help text as
written (issue #29, section 5)."""

from __future__ import annotations

import re

from click.testing import CliRunner
from sse_server import SSEServer

from paasbench.cli import main

NO_TERMINAL = {"COLUMNS": None, "LINES": None}   # rich's 80-column default off a terminal


def test_run_prints_its_tables_whole_off_a_terminal(tmp_path):
    # before: off a TTY the final latency table was cut at 80 columns ("19,731.…", "schedule…"), and the
    # server's prefix hit printed as a fraction (0.50) beside the offered one as a percentage
    with SSEServer(ttft_ms=1, itl_ms=0.5, cached_ratio=0.5) as srv:
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--isl", "64", "--osl", "4", "--rate", "50",
                                        "--max-requests", "8", "--slo", "p50(ttft) <= 2000ms", "--out",
                                        str(tmp_path / "o"), "--no-live"], env=NO_TERMINAL)
    assert res.exit_code == 0, res.output
    assert "…" not in res.output, res.output
    lag = next(line for line in res.output.splitlines() if "schedule_lag" in line)
    assert len(re.findall(r"\d[\d,]*\.\d\d", lag)) == 5 and lag.rstrip().endswith("│")   # p50..max, then count
    assert re.search(r"prefix hit \(server\)\s+50\.0%", res.output), res.output
    assert re.search(r"error rate\s+0\.00%", res.output)


def test_help_shows_percent_signs_as_written():
    # before: `sweep --help` said "more than 2%% off" (click does not %-format help text)
    for cmd in ("sweep", "run", "gate", "report", "compare"):
        res = CliRunner().invoke(main, [cmd, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0 and "%%" not in res.output, (cmd, res.output)
    assert "more than 2% off" in " ".join(CliRunner().invoke(main, ["sweep", "--help"]).output.split())
