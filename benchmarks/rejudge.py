"""Recorded runs judged again, offline, by the sweep's own rules: what a verdict rule says of runs already measured,
at any horizon, with no cluster time.

Why: near a target's capacity a run's verdict depends on how long it is held. On the twin's white-paper 64K bucket a
rate whose queue grows too slowly to show in a minute breaks the SLO only after a quarter of an hour, while a lower
rate's queue swings up and back down for as long as it runs (reports/ground-truth/). A rule for a step or a
verification (saturation.py, sequential.py) is then judged against where each long run's queue went. This script
reads one run's records (a ``benchmarks/ground_truth.py`` run directory: ``records.jsonl`` and the
``summary.json`` whose meta names the workload, the rate and the warm-up) and gives

* its p50 TTFT (from the intended send) and its requests by segment of ``--segment-s`` seconds of intended send;
* for each horizon ``--horizons L``: whether a ground-truth run of ``L`` seconds would have been *sustained*
  (``benchmarks/ground_truth.py``'s rule: the SLO over ``[warm-up, warm-up + L)`` and over its last third, and the
  saturation test, saturation.py, quiet on that window, judged once as a fixed-length step is);
* for ``--verify L``: what a certified verification of ``L`` seconds (sequential.py, at ``--confidence``) decides on
  the run's first ``L`` seconds, and at which look. The run's first seconds are such a verification's: the same
  schedule of the same sessions from an idle target, and the monitor sees each record when it ends, as it would
  live (a live verification would then cancel what is in flight; nothing it judged changes).

    python benchmarks/rejudge.py runs/long/s1-r3.05/rate-3.05 --horizons 300 420 1800 --verify 300

Rows print as a table and, with ``--out``, are written as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ground_truth import sustained  # noqa: E402  (the truth's rule, one function for both scripts)
from paasbench.metrics import slo  # noqa: E402
from paasbench.metrics.records import RequestRecord, read_records  # noqa: E402
from paasbench.sweep.saturation import SaturationLimits  # noqa: E402
from paasbench.sweep.sequential import CertifyConfig, Sequential, recorded_schedule, replay  # noqa: E402
from paasbench.sweep.source import Source  # noqa: E402


def segments(records: list[RequestRecord], start: float, end: float, seg_s: float) -> list[dict]:
    """p50 TTFT (ms, from the intended send, successful requests) and request counts by segment of intended send."""
    out = []
    for k in range(math.ceil((end - start) / seg_s)):
        a, b = start + k * seg_s, min(end, start + (k + 1) * seg_s)
        rs = [r for r in records if a <= r.intended_send_s < b]
        ttft = [(r.first_token_s - r.intended_send_s) * 1e3 for r in rs if r.ok and r.first_token_s is not None]
        out.append({"from_s": round(a - start, 1), "to_s": round(b - start, 1), "requests": len(rs),
                    "failed": sum(1 for r in rs if not r.ok),
                    "ttft_p50_ms": round(float(np.median(ttft)), 1) if ttft else None})
    return out


def verification(records: list[RequestRecord], gates: list[slo.Gate], warmup: float, length: float, drain: float,
                 confidence: float, limits: SaturationLimits) -> dict:
    """What a certified verification of ``length`` seconds decides on the run's first seconds (module docstring)."""
    window = (warmup, warmup + length)
    monitor = Sequential(recorded_schedule(records), window, drain, gates, CertifyConfig(confidence=confidence),
                         min_pass_s=length, saturation_limits=limits, sends="schedule")
    if replay(monitor, records, until_s=window[1] + drain) is not None:   # past that the verification's run is over
        assert monitor.cut_s is not None
        return {"length_s": length, "verdict": monitor.decided, "at_s": round(monitor.cut_s - warmup, 1),
                "looks": len(monitor.history), "saturated": monitor.history[-1].saturated}
    verdict, _, saturated = monitor.judge(records, window[1], final=True)
    return {"length_s": length, "verdict": verdict, "at_s": length, "looks": len(monitor.history) + 1,
            "saturated": saturated}


def rejudge(run_dir: Path, horizons: list[float], verify_s: float | None, seg_s: float, confidence: float,
            slo_spec: str | None, limits: SaturationLimits) -> dict:
    summary = run_dir / "summary.json"
    if not summary.is_file() or not (run_dir / "records.jsonl").is_file():
        raise SystemExit(f"{run_dir}: not a finished run: it needs records.jsonl and summary.json (a run still going, "
                         "or stopped before its end, has no summary.json to name its rate and warm-up)")
    meta = json.loads(summary.read_text()).get("meta") or {}
    load = meta.get("sweep_load") or {}
    warmup, run_s = float(load["warmup_s"]), float(load["duration_s"])
    workload = meta.get("ground_truth") or meta.get("workload")
    gates = slo.parse_gates(slo_spec or Source.from_workload(workload, 1).slo)
    drain = warmup   # the step's drain is its warm-up (step.StepPlan.drain_s)
    records = list(read_records(run_dir / "records.jsonl"))
    return {"run": str(run_dir), "workload": workload, "rate": load.get("value"), "warmup_s": warmup, "run_s": run_s,
            "seed": meta.get("seed"),
            "segments": segments(records, warmup, warmup + run_s, seg_s),
            "horizons": [sustained(records, gates, warmup, h, drain, limits) for h in horizons if h <= run_s],
            "verification": verification(records, gates, warmup, verify_s, drain, confidence, limits)
            if verify_s else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (records.jsonl, summary.json)")
    ap.add_argument("--horizons", type=float, nargs="*", default=[300.0, 420.0], help="windows to judge (s)")
    ap.add_argument("--verify", type=float, default=None, help="a certified verification of this many seconds")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--segment-s", type=float, default=150.0)
    ap.add_argument("--slo", default=None, help="the SLO (default: the run's workload's)")
    ap.add_argument("--slo-share", type=float, nargs=2, metavar=("END", "EARLY"), default=None,
                    help="the share of the SLO's bound a growth must reach to count, at a window's end and at a "
                         "certified step's earlier looks (default: saturation.py's; 0 0: growth alone, the rule "
                         "before it)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    limits = SaturationLimits() if a.slo_share is None else \
        SaturationLimits(slo_share=a.slo_share[0], slo_share_early=a.slo_share[1])
    rows = [rejudge(d, a.horizons, a.verify, a.segment_s, a.confidence, a.slo, limits) for d in a.runs]
    for row in sorted(rows, key=lambda r: (r["rate"], r["seed"] or 0)):
        p50s = " ".join(f"{(s['ttft_p50_ms'] or 0) / 1e3:.1f}" for s in row["segments"])
        print(f"{row['rate']:.4g} req/s seed {row['seed']}: p50 TTFT by {a.segment_s:g} s (s): {p50s}")
        for h in row["horizons"]:
            print(f"    {h['length_s']:6.0f} s: {'sustained' if h['sustained'] else 'NOT sustained':13s} SLO "
                  f"{'met' if h['slo_whole'] else 'BROKEN'}, last third {'met' if h['slo_last_third'] else 'BROKEN'} "
                  f"(p50 {(h['ttft_p50_last_third_ms'] or 0):.0f} ms); "
                  f"{'saturated: ' + '; '.join(h['saturation']) if h['saturated'] else 'not saturated'}")
        v = row["verification"]
        if v:
            print(f"    verification of {v['length_s']:g} s: {v['verdict']} at {v['at_s']:g} s, look {v['looks']}"
                  f"{' (saturated)' if v['saturated'] else ''}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python benchmarks/rejudge.py", *sys.argv[1:]])
        a.out.write_text(json.dumps({"command": command, "slo_share": {"end": limits.slo_share,
                                     "early": limits.slo_share_early}, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
