"""The true max of a workload on its embedded server, found by long runs: what a sweep's answer is judged against
(issue 31, "Ground truth").

Why: a sweep step is short (ci-small: a 3 s warm-up and a 15 s window), and a queue that grows slowly looks healthy
for 15 s. On ci-small's cpu engine a 90 s run at 6 req/s had its p50 TTFT at 0.36, 0.65 and 21.3 s by thirds of
the run: not sustained, though its whole-run p50 (829 ms) met the 2 s SLO, and though a point-verdict sweep passed
8 req/s on its 15 s step. So a rate is **sustained** here when a run of ``--run-s`` (default 6 steps' windows) at
it meets the workload's SLO over the run *and over its last third* (a queue that only grows breaks the last third
first), with the sweep's own saturation test (paasbench/sweep/saturation.py) quiet on the whole run. From a
bracket ``--lo`` (sustained) and ``--hi`` (not), checked first, the script bisects geometrically until
``hi / lo - 1 <= --resolution`` (2%). Each run is one ``paasbench run`` (Poisson, the trace looped, one seed)
against one server started for all of them; the table is printed and written as JSON.

    python benchmarks/ground_truth.py --workload ci-small --lo 4 --hi 6      # about 15 minutes on 2 cores

The cpu engine's capacity moves with the host (its CPU and its other work): a truth measured here holds for
this box in this state, and a sweep is judged against it in the same sitting. The sim twin's modeled time does
not move (a truth for white-paper-agent's buckets on it is still to be measured).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paasbench.metrics import slo  # noqa: E402
from paasbench.metrics.records import read_records  # noqa: E402
from paasbench.metrics.summary import summarize  # noqa: E402
from paasbench.sweep.embedded import server_args, server_section  # noqa: E402
from paasbench.sweep.saturation import detect  # noqa: E402
from paasbench.sweep.step import StepPlan  # noqa: E402
from paasbench.workload.spec import load_workload  # noqa: E402
from reference_server.launcher import EmbeddedServer  # noqa: E402

PAASBENCH = [sys.executable, "-c", "from paasbench.cli import main; main()"]


def judge(out: Path, gates: list[slo.Gate], plan: StepPlan) -> dict:
    """One long run's verdict, a sweep step's judgement on a longer window (its drain too): the SLO over the window
    and over its last third, and saturation on the window."""
    records = list(read_records(out / "records.jsonl"))
    window = plan.window
    last = (window[0] + plan.duration_s * 2 / 3, window[1])
    whole, tail = (summarize(records, window=w, drain_s=plan.drain_s) for w in (window, last))
    sat = detect(records, window, drain_s=plan.drain_s)
    v_whole, v_tail = slo.evaluate(gates, whole), slo.evaluate(gates, tail)
    return {"sustained": v_whole.passed and v_tail.passed and not sat["saturated"],
            "slo_whole": v_whole.passed, "slo_last_third": v_tail.passed, "saturated": sat["saturated"],
            "saturation": sat["reasons"], "requests": whole["requests"],
            "ttft_p50_ms": (whole.get("ttft_ms") or {}).get("p50"),
            "ttft_p50_last_third_ms": (tail.get("ttft_ms") or {}).get("p50"),
            "input_tpm": whole.get("input_tpm"), "error_rate": whole.get("error_rate")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="ci-small")
    ap.add_argument("--lo", type=float, required=True, help="a rate (req/s) expected to be sustained")
    ap.add_argument("--hi", type=float, required=True, help="a rate (req/s) expected not to be")
    ap.add_argument("--resolution", type=float, default=0.02)
    ap.add_argument("--run-s", type=float, default=None, help="measured seconds a run (default: 6 x the step)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="runs/ground-truth")
    a = ap.parse_args()
    spec = load_workload(a.workload)
    sweep = spec.sweep or {}
    warmup = float(sweep.get("warmup_s", 3.0))
    run_s = a.run_s or 6 * float(sweep.get("duration_s", 15.0))
    plan = StepPlan("rate", warmup, run_s)
    gates = slo.parse_gates(spec.slo)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with EmbeddedServer(server_args(server_section(spec.server, spec.cap_tokens))) as srv:
        def probe(rate: float) -> bool:
            d = out / f"rate-{rate:.4g}"
            t0 = time.monotonic()
            res = subprocess.run([*PAASBENCH, "run", "--target", srv.url, "--workload", a.workload, "--mode", "poisson",
                                  "--rate", f"{rate:.6g}", "--duration", f"{warmup + run_s:g}", "--warmup", f"{warmup:g}",
                                  "--loop", "--seed", str(a.seed), "--out", str(d), "--no-live"],
                                 capture_output=True, text=True)
            if res.returncode not in (0, 99) or not (d / "records.jsonl").exists():
                raise SystemExit(f"paasbench run at {rate:g} req/s exited {res.returncode}:\n{res.stderr[-2000:]}")
            row = {"rate": rate, **judge(d, gates, plan), "wall_s": round(time.monotonic() - t0, 1)}
            rows.append(row)
            print(f"{rate:8.4g} req/s  {'sustained' if row['sustained'] else 'NOT sustained':14s} "
                  f"p50 TTFT {row['ttft_p50_ms'] or 0:9.0f} ms (last third {row['ttft_p50_last_third_ms'] or 0:9.0f})  "
                  f"input TPM {row['input_tpm'] or 0:10.0f}  {'; '.join(row['saturation'])[:120]}", flush=True)
            return row["sustained"]

        lo, hi = a.lo, a.hi
        if not probe(lo):
            raise SystemExit(f"--lo {lo:g} is not sustained: give a lower one")
        if probe(hi):
            raise SystemExit(f"--hi {hi:g} is sustained: give a higher one")
        while hi / lo - 1 > a.resolution:
            mid = (lo * hi) ** 0.5
            if probe(mid):
                lo = mid
            else:
                hi = mid
    result = {"workload": a.workload, "slo": spec.slo, "run_s": run_s, "warmup_s": warmup, "seed": a.seed,
              "true_max_rps": {"sustained": lo, "not_sustained": hi}, "runs": rows}
    (out / "ground_truth.json").write_text(json.dumps(result, indent=1))
    print(f"true max of {a.workload}: between {lo:.4g} (sustained) and {hi:.4g} req/s (not); {out / 'ground_truth.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
