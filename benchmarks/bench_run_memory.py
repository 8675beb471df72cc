"""Peak memory of a whole ``paasbench run``, as a user meets it: 256 streams against a zero-latency target, the
records' summary and export included, and that it does not grow with the number of records.

The command is the one a user types (issue 29 item 7, which measured 416 MB with it)::

    paasbench run --target URL --isl 128 --osl 128 --concurrency 256 --duration 12 --out DIR

against ``paasbench.gate.probe_target`` (answers every completion at once, one token an SSE event). Each run is
measured from outside: its peak RSS as the kernel reports it when the process is reaped (``os.wait4``,
``ru_maxrss``: the whole command, imports to export) and the requests it made. Figure: the peak of the 12 s
run, goal <= 250 MB. Baseline, in the same invocation: the same command at 3× the duration (3× the records, on an
idle box): the ratio of the two peaks says whether memory grows with the records (it did: the records, their
per-chunk timelines and the set of every prefix-block id sent were all held at once after the load).

    python benchmarks/bench_run_memory.py [--duration 12] [--json reports/client-probe/run-memory.json]
    python benchmarks/bench_run_memory.py --paasbench /path/to/other/venv/bin/paasbench   # another installation

Exit 1 when the 12 s peak is over 250 MB or the longer run's peak is more than 15% above it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paasbench.gate.probe_target import ProbeTarget  # noqa: E402

GOAL_MB = 250.0
GROWTH = 1.15


def measured_run(paasbench: list[str], url: str, out: Path, duration: float) -> dict:
    cmd = [*paasbench, "run", "--target", url, "--isl", "128", "--osl", "128", "--concurrency", "256",
           "--duration", f"{duration:g}", "--out", str(out), "--no-live"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    _, status, ru = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"paasbench run exited {code}: {' '.join(cmd)}")
    summary = json.loads((out / "summary.json").read_text())
    return {"duration_s": duration, "requests": summary["requests"]["total"],
            "peak_rss_mb": round(ru.ru_maxrss / 1024, 1), "wall_s": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=12.0)
    ap.add_argument("--paasbench", help="the paasbench command to measure (default: this checkout's)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    paasbench = [args.paasbench] if args.paasbench else [sys.executable, "-c", "from paasbench.cli import main; main()"]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, ProbeTarget() as target:
        short = measured_run(paasbench, target.url, Path(tmp) / "short", args.duration)
        long = measured_run(paasbench, target.url, Path(tmp) / "long", 3 * args.duration)
    ratio = long["peak_rss_mb"] / short["peak_rss_mb"]
    result = {"command": f"paasbench run --isl 128 --osl 128 --concurrency 256 --duration {args.duration:g}",
              "short": short, "long": long, "peak_ratio_long_over_short": round(ratio, 3),
              "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)], "goal_mb": GOAL_MB,
              "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"peak RSS of the whole command, {short['requests']} requests in {args.duration:g} s: "
          f"{short['peak_rss_mb']:.1f} MB (goal <= {GOAL_MB:g}); {long['requests']} requests in "
          f"{3 * args.duration:g} s: {long['peak_rss_mb']:.1f} MB, ratio {ratio:.2f} (<= {GROWTH}); "
          f"load average {result['load_avg'][0]}-{result['load_avg'][1]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if short["peak_rss_mb"] <= GOAL_MB and ratio <= GROWTH else 1


if __name__ == "__main__":
    sys.exit(main())
