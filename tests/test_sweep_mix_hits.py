"""scripts/sweep_mix_hits.py (the traffic-hit-by-load table of docs/sweep.md) computes from the schedule alone what
a real sweep recorded: its lanes column matches the committed baseline's per-step traffic_hit_ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_lanes_match_what_the_committed_sweep_recorded():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_mix_hits.py"), "--workload", "ci-small",
                          "--warmup", "3", "--duration", "15", "--rates", "0.5,2"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {line.split("\t")[0]: line.split("\t")[1:] for line in out.splitlines()[2:]}
    steps = json.loads((ROOT / "reports" / "baseline" / "ci-small.json").read_text())["steps"]
    recorded = {f"{s['load']['value']:g}": s["traffic_hit_ratio"] for s in steps}
    for rate in ("0.5", "2"):
        first_n, lanes = (float(x.rstrip("%")) for x in rows[rate])
        assert abs(lanes - 100 * recorded[rate]) < 0.05, (rate, lanes, recorded[rate])
    assert float(rows["0.5"][0].rstrip("%")) < 70 < float(rows["0.5"][1].rstrip("%"))   # the head is the cold start
