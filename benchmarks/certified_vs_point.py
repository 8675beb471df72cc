"""Seeded sweeps of one workload, point verdicts against certified ones: what each answers, and the cluster time
it spends to answer (issue 31's acceptance: the interval holds the true max in 19 of 20 seeds, no wider than
today's bracket, in at most half the step-seconds).

Why: a sweep's answer is a bracket [highest pass, lowest fail) per bucket. Point verdicts give one with no stated
confidence; ``--confidence`` gives one whose steps are certified and whose max is verified. Whether that is worth
it is a question of two numbers over many seeds: how often the bracket holds the true max (``--truth LO HI``, the
sustained and not-sustained rates of benchmarks/ground_truth.py, measured in the same sitting) and how many
step-seconds (the sum of the steps' wall time, verification and any throughput probe included) each mode spends. Each sweep is one
``paasbench sweep --workload W --seed S`` with its own embedded server, the two modes alternating seed by seed
(A B A B, so a drift in the host's load lands on both).

    python benchmarks/certified_vs_point.py --workload ci-small --seeds 3 --truth 9.536 9.664 --out runs/cvp

A bracket [low, fail) *holds* the truth when it can hold the true max, which lies in [LO, HI) (LO sustained, HI
not): ``low < HI`` and ``fail > LO``; a bracket with no fail (a lower bound) holds it when ``low < HI``. ``low`` is
a certified answer's lower end, its pass less the overload the pass's window could hold by chance
(paasbench/sweep/horizon.py; sweeps from before it have none, and their pass is their lower end); a point answer's
is its pass. A low at HI itself claims a load the truth found not sustained (before, ``pass <= HI`` counted it: a
verified [3.0, 4.24) against [2.95, 3.0), seed 5 at 1180003). Widths are ``fail / low - 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from paasbench.report.best import capacity_interval  # noqa: E402

PAASBENCH = [sys.executable, "-c", "from paasbench.cli import main; main()"]


def answer(sweep: dict) -> dict:
    """One sweep's bracket (its only bucket, or the first), step-seconds and step count."""
    bucket = (sweep.get("buckets") or [{}])[0]
    cert = bucket.get("certified")
    if cert:
        lo = (cert.get("pass") or {}).get("load")
        hi = (cert.get("fail") or {}).get("load")
        low = capacity_interval(cert)[0] if lo is not None else None
        verified = (cert.get("verified") or {}).get("passed")
    else:
        lo, hi, verified = (bucket.get("load") or {}).get("value"), bucket.get("failed_load"), None
        low = lo
    steps = sweep.get("steps") or []
    # a throughput probe (paasbench/sweep/probe.py) is no step, but it is cluster time the sweep spent
    probe_s = sum(float(lv.get("wall_s") or 0.0) for p in (sweep.get("probes") or {}).values() for lv in p["levels"])
    warmup = float(((sweep.get("meta") or {}).get("settings") or {}).get("warmup_s") or 0.0)
    # low: the interval's lower end, the pass less the overload its window could hold by chance (certified)
    return {"pass": lo, "low": low, "fail": hi, "verified": verified, "steps": len(steps),
            "step_s": round(sum(float(s.get("wall_s") or 0.0) for s in steps) + probe_s, 1),
            "probe_s": round(probe_s, 1),
            "verify_s": round(sum(float(s.get("wall_s") or 0.0) for s in steps if s.get("phase") == "verify"), 1),
            # where a step's wall time goes: the judged windows, and what each step costs around its window (its
            # primed sessions, its warm-up; the rest is the run past the window's end until the step is decided
            # and its requests are answered, and the waits for an idle target)
            "window_s": round(sum(float(s.get("window_s") or 0.0) for s in steps), 1),
            "primer_s": round(sum(float((s.get("primed") or {}).get("wall_s") or 0.0) for s in steps), 1),
            "warmup_s": round(warmup * len(steps), 1),
            "status": sweep.get("status")}


def holds(row: dict, lo: float, hi: float) -> bool:
    if row["low"] is None:
        return False
    return row["low"] < hi and (row["fail"] is None or row["fail"] > lo)


def width(row: dict) -> float | None:
    return None if row["low"] in (None, 0) or row["fail"] is None else row["fail"] / row["low"] - 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="ci-small")
    ap.add_argument("--seeds", type=int, default=5, help="seeds 1..N, each swept in both modes")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--truth", type=float, nargs=2, metavar=("LO", "HI"), default=None,
                    help="the true max's bracket from benchmarks/ground_truth.py (req/s)")
    ap.add_argument("--sweep-arg", action="append", default=[], help="passed to both modes' sweeps (repeatable)")
    ap.add_argument("--out", default="runs/certified-vs-point")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for mode, extra in (("point", []), ("certified", ["--confidence", f"{a.confidence:g}"])):
            d = out / f"{mode}-seed{seed}"
            t0 = time.monotonic()
            res = subprocess.run([*PAASBENCH, "sweep", "--workload", a.workload, "--seed", str(seed), "--out", str(d),
                                  "--no-live", *extra, *a.sweep_arg], capture_output=True, text=True)
            if not (d / "sweep.json").exists():
                raise SystemExit(f"{mode} sweep, seed {seed}, exited {res.returncode}:\n{res.stderr[-2000:]}")
            row = {"mode": mode, "seed": seed, "rc": res.returncode, "wall_s": round(time.monotonic() - t0, 1),
                   **answer(json.loads((d / "sweep.json").read_text()))}
            if a.truth:
                row["holds"] = holds(row, *a.truth)
            rows.append(row)
            w = width(row)
            low = "-" if row["low"] is None else f"{row['low']:.4g}"
            print(f"{mode:9s} seed {seed:2d}: [{low}, {row['fail']}) req/s, passed {row['pass']}"
                  f"{'' if w is None else f' (width {w:.1%})'}  verified {row['verified']}  "
                  f"{row['steps']} steps, {row['step_s']:.0f} step-s ({row['verify_s']:.0f} verifying, "
                  f"{row['probe_s']:.0f} probing; {row['window_s']:.0f} in windows, {row['primer_s']:.0f} priming, "
                  f"{row['warmup_s']:.0f} warming up)"
                  + (f"  holds the truth: {row['holds']}" if a.truth else ""), flush=True)
            (out / "rows.json").write_text(json.dumps({"workload": a.workload, "truth": a.truth, "rows": rows}, indent=1))
    print("\nmode       sweeps  holds  median width  median step-s")
    for mode in ("point", "certified"):
        mine = [r for r in rows if r["mode"] == mode]
        widths = [w for w in map(width, mine) if w is not None]
        held = sum(1 for r in mine if r.get("holds")) if a.truth else None
        print(f"{mode:9s}  {len(mine):6d}  {'-' if held is None else held:>5}  "
              f"{statistics.median(widths) if widths else float('nan'):12.1%}  "
              f"{statistics.median(r['step_s'] for r in mine):13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
