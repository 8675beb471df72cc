"""Rapid mode's time: a whole plan from the model and device profiles alone, against its 30-second target.

The issue's bound (Dynamo's rapid profiler simulates in about 30 s; paasbench's rapid mode must not take longer) is
for the whole answer: the white paper's traffic and SLO, the curves of three cards' pools computed from the roofline
(`plan-curves --rapid`: S5000 prefill and mixed, H200 decode, S5000 decode), then the plan with its alternatives and
their cost (`plan`), each a fresh `paasbench` process as a user runs them, import time included.

    python benchmarks/bench_plan_rapid.py            # prints each command's seconds, the total, and total / 30 s

The figure is wall time on this machine, printed with the load average it ran at.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 30.0
WP = ["--workload", "white-paper-agent", "--slo", "p50(ttft) <= 6000ms"]


def run(args: list[str]) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "from paasbench.cli import main; main()", *args], check=True,
                   capture_output=True, text=True)
    return time.monotonic() - t0


def main() -> None:
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        steps = [
            ("curves s5000 prefill+mixed", ["plan-curves", "--rapid", *WP, "--device-profile", "mtt-s5000", "--pools",
                                            "prefill,mixed", "--context-buckets", "64K,192K,400K", "-o", str(d / "s.json")]),
            ("curves s5000 decode", ["plan-curves", "--rapid", *WP, "--device-profile", "mtt-s5000", "--pools", "decode",
                                     "--decode-output", "500", "-o", str(d / "sd.json")]),
            ("curves h200 decode", ["plan-curves", "--rapid", *WP, "--device-profile", "h200", "--pools", "decode",
                                    "--decode-output", "500", "-o", str(d / "h.json")]),
            ("plan", ["plan", "--traffic", "5.8M", *WP, "--prefill-curves", str(d / "s.json"), "--decode-curves",
                      str(d / "h.json"), "--mixed-curves", str(d / "s.json"), "--mixed-decode-curves", str(d / "sd.json"),
                      "--out", str(d / "plan")]),
        ]
        total = 0.0
        for name, args in steps:
            s = run(args)
            total += s
            print(f"{name:<28} {s:6.2f} s")
    print(f"{'rapid plan, total':<28} {total:6.2f} s  = {total / TARGET_S:.2f} x the {TARGET_S:g} s target  "
          f"(load average {' '.join(load)})")


if __name__ == "__main__":
    main()
