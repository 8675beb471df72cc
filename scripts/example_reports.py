#!/usr/bin/env python3
"""Regenerate the example reports in reports/ from the shipped workloads (real runs; minutes each).

    python scripts/example_reports.py [ci-small] [modes] [white-paper-64k]

* ci-small         — `paasbench sweep --workload ci-small` on the embedded CPU server -> reports/ci-small/
* modes            — the same ci-small load (Poisson 2 req/s, 30 s after a 5 s warm-up) against the reference
                     server in colocated, chunked and disaggregated mode -> reports/modes-ci-small/compare.*
* white-paper-64k  — the white-paper workload's 64K bucket on the sim engine (GLM-5.2-FP8 x MTT S5000 profile),
                     shortened steps (45 s + 15 s warm-up, from 0.2 req/s: lower rates offer too few
                     requests per step to judge) -> reports/white-paper-64k/
Raw results go to runs/examples/ (git-ignored).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "examples"


def sh(*args: str, ok: tuple[int, ...] = (0,)) -> int:
    """Run a command; stop on a failure, so a broken run never leaves a stale example report in place."""
    print("+", " ".join(args), flush=True)
    rc = subprocess.run(args, cwd=ROOT).returncode
    if rc not in ok:
        sys.exit(f"{args[0]} {args[1]} failed with exit {rc}")
    return rc


def ci_small() -> None:
    sh("paasbench", "sweep", "--workload", "ci-small", "--out", str(RUNS / "ci-small"), ok=(0, 99))
    sh("paasbench", "report", str(RUNS / "ci-small"), "-o", "reports/ci-small",
       "--title", "paasbench example: ci-small sweep on the embedded CPU reference server")


def modes() -> None:
    sys.path.insert(0, str(ROOT))
    from reference_server.launcher import EmbeddedServer

    dirs = []
    for mode in ("colocated", "chunked", "disaggregated"):
        out = RUNS / "modes" / mode
        with EmbeddedServer(["--mode", mode, "--engine", "cpu", "--model", "tiny", "--block-size", "64"]) as srv:
            sh("paasbench", "run", "--target", srv.url, "--workload", "ci-small", "--rate", "2", "--duration", "35",
               "--warmup", "5", "--goodput", "ttft:2000", "--out", str(out), "--no-live", ok=(0, 99))
        dirs.append(str(out))
    sh("paasbench", "compare", *dirs, "-o", "reports/modes-ci-small", "--slo", "p50(ttft) <= 2000ms",
       "--slo", "error_rate <= 1%", "--title", "paasbench example: colocated vs chunked vs disaggregated (ci-small)")


def white_paper_64k() -> None:
    sh("paasbench", "sweep", "--workload", "white-paper-agent", "--out", str(RUNS / "white-paper-64k"),
       "--context-buckets", "64K", "--start", "0.2", "--step-duration", "45", "--warmup", "15", "--max-steps", "4",
       "--bisect-steps", "2", "--time-budget", "660", ok=(0, 99))
    sh("paasbench", "report", str(RUNS / "white-paper-64k"), "-o", "reports/white-paper-64k",
       "--title", "paasbench example: white-paper agent workload, 64K bucket, sim engine (GLM-5.2-FP8 x MTT S5000)")


JOBS = {"ci-small": ci_small, "modes": modes, "white-paper-64k": white_paper_64k}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(JOBS):
        JOBS[name]()
