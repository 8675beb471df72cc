"""A certified sweep's steps replayed offline on their records, with and without first tokens told: when each step
would have been decided, and on what, with no cluster time.

Why: a certified step looks at its window while it runs (paasbench/sweep/sequential.py). Past capacity a step that
judges only finished requests waits for the queue to answer them; told each first token as it comes, it counts a
request still without one past the SLO's TTFT bound as a known miss and fails sooner ("Known misses"). The records
keep every request's intended send, first token and end on the run's clock, so feeding them to the monitor in time
order (first tokens as they came, records as they ended) replays what it saw live. The window, warm-up and minimum
pass window are the step's own (its ``summary.json`` ``meta.sweep_load``; a search step may pass on half its
stretched window, a verification on all of it), and so are its saturation limits (``saturation.step_limits``). A step the monitor leaves undecided ran to its end live and was
judged there: the replay says so and stops.

    python benchmarks/replay_steps.py runs/sweep-seed5 [runs/sweep-seed6 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paasbench.metrics.records import read_records  # noqa: E402
from paasbench.metrics.slo import parse_gates  # noqa: E402
from paasbench.sweep.saturation import step_limits  # noqa: E402
from paasbench.sweep.sequential import CertifyConfig, Sequential, recorded_schedule, replay  # noqa: E402


def step_rows(run: Path, confidence: float) -> list[dict]:
    sweep = json.loads((run / "sweep.json").read_text())
    gates = parse_gates(sweep["slo"])
    rows = []
    for s in sweep["steps"]:
        if not s.get("certified"):
            continue
        load = json.loads((run / s["dir"] / "summary.json").read_text())["meta"]["sweep_load"]
        warmup, duration = float(load["warmup_s"]), float(load["duration_s"])
        records = list(read_records(run / s["dir"] / "records.jsonl"))
        trace = recorded_schedule(records)   # the ones after its stop were not sent, nor recorded
        min_pass = duration if s["phase"] == "verify" else duration / 2
        row = {"step": s["index"], "phase": s["phase"], "load": s["load"]["value"],
               "live": s["certified"]["verdict"], "wall_s": round(s["wall_s"], 1)}
        for told in (False, True):
            m = Sequential(trace, (warmup, warmup + duration), warmup, gates, CertifyConfig(confidence=confidence),
                           min_pass_s=min_pass, saturation_limits=step_limits(s["phase"]), first_tokens=told)
            at = replay(m, records)
            row["told" if told else "untold"] = {"verdict": m.decided, "at_s": None if at is None else round(at, 1),
                                                 "late": m.history[-1].late if m.history else 0}
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="sweep directories (sweep.json, step-*/records.jsonl)")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    out = {}
    for run in a.runs:
        out[str(run)] = rows = step_rows(run, a.confidence)
        for r in rows:
            u, t = r["untold"], r["told"]
            print(f"{run.name} step {r['step']} {r['phase']:8s} {r['load']:.4g}: live {r['live']}; finished requests "
                  f"only: {u['verdict'] or 'to its end'} at {u['at_s']} s; told first tokens: {t['verdict'] or 'to its end'}"
                  f" at {t['at_s']} s ({t['late']} known misses at the last look)")
    if a.out:
        a.out.write_text(json.dumps({"command": " ".join(["python benchmarks/replay_steps.py", *sys.argv[1:]]),
                                     "runs": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
