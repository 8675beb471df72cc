"""scripts/sweep_mix_hits.py (the traffic-hit-by-load table of docs/sweep.md) computes from the schedule alone what
a sweep step plans to send: its lanes column is the traffic hit of the window of the step's own schedule, made the
way the sweep makes it (``StepPlan.trace``, ``fresh_prefixes``, ``StepPlan.schedule``).

What a sweep *records* is the hit of what it sent, which since turns wait for the turn they follow can differ: a
send time whose planned turn is still in flight goes to another request (docs/sweep.md gives a recorded pair). The
test used to compare with a committed sweep's recording; that recording was made before turns waited, and before
arrivals were stratified, and no longer says what today's schedule plans."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from paasbench.metrics.verify import traffic_hit
from paasbench.sweep.source import Source, fresh_prefixes
from paasbench.sweep.step import StepPlan

ROOT = Path(__file__).resolve().parent.parent


def test_lanes_are_the_hit_of_the_window_the_sweep_schedules():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_mix_hits.py"), "--workload", "ci-small",
                          "--warmup", "3", "--duration", "15", "--rates", "0.5,2"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {line.split("\t")[0]: line.split("\t")[1:] for line in out.splitlines()[2:]}
    source = Source.from_workload("ci-small", 0)
    for rate in (0.5, 2.0):
        plan = StepPlan("rate", 3.0, 15.0, seed=0).for_load(rate)
        trace = fresh_prefixes(plan.trace(source, None, plan.trace_size(rate), rate), 3)
        sent, _ = plan.schedule(trace, rate)
        window = [plan.window[0] <= r.arrival_ms / 1e3 < plan.window[1] for r in sent.requests]
        planned = 100 * traffic_hit(sent.requests, window, sent.block_size)
        first_n, lanes = (float(x.rstrip("%")) for x in rows[f"{rate:g}"])
        assert abs(lanes - planned) < 0.05, (rate, lanes, planned)
    assert float(rows["0.5"][0].rstrip("%")) < 70 < float(rows["0.5"][1].rstrip("%"))   # the head is the cold start


def test_the_decode_work_table_reads_the_windows_the_sweep_schedules():
    """scripts/sweep_mix_work.py (docs/sweep.md: each seed's window, its mean output tokens and the twin's bound over
    it) runs as the docs give it and reads the windows the steady mix draws: within 2% of the spec's mean output on
    the window and its prefixes where a draw of 512 is, else the closest (seed 2's window: 490 of 500.1, 2.0%)."""
    from paasbench.workload import load_workload
    from paasbench.workload.generator import expected_output_tokens

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_mix_work.py"), "--workload",
                          "white-paper-agent", "--bucket", "65536", "--rate", "3", "--seeds", "1-2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split("\t") for line in out.splitlines()[1:3]]
    expected = expected_output_tokens(load_workload("white-paper-agent"))
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(abs(float(r[1]) / expected - 1) <= 0.025 and 3.0 < float(r[3]) < 3.3 for r in rows), rows
    assert out.splitlines()[-1].startswith("mean output tokens ")
