"""The horizon margin (paasbench/sweep/horizon.py), measured again on sweeps that ran before it: each answer's lower
end with and without it, against a truth.

Why: a certified sweep's lower end is the load its verification held, for 300 s by default, and the truth it is
held to is a load that held 30 minutes. A pass a little past the capacity holds 300 s by chance. Sweeps recorded
before the margin existed keep every step's records, so the margin can be measured on the answer step's own window
exactly as a sweep now measures it, and each answer judged with it. Each argument is a sweep's ``--out`` directory
(its sweep.json and step folders); only its first bucket is read.

    python benchmarks/horizon_margin.py runs/cv/seed{2,4,5,6,7} --truth 2.95 3.0 --out margin.json

The rows say, per sweep: the pass and the window it held, the margin, the lower end with it, the fail, the
step-seconds it spent and whether the bracket holds the truth, with and without the margin (the step-seconds and the
rule are benchmarks/certified_vs_point.py's).

The fail side is measured too, and not applied. A fail on queue growth alone (no SLO term failed) is a claim that
the load is past the capacity, and its window resolves an overload no finer than a pass's does: a symmetric margin
would put the upper end at ``fail * (1 + its window's margin)``. The rows keep what failed the step (``fail_by``:
the binding term, or "growth"), its window and that margin, and the summary counts the upper ends that lie above
the truth's lower end as they are and as they would be with it, with the median width it would cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from certified_vs_point import answer, holds, width  # noqa: E402
from paasbench.metrics.records import read_records  # noqa: E402
from paasbench.report.best import capacity_interval  # noqa: E402
from paasbench.sweep.horizon import answer_horizon, unseen_overload  # noqa: E402


def margin_row(sweep_dir: Path) -> dict:
    """One sweep's answer with the margin measured on its pass's window; KeyError-free on a sweep with no pass."""
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    cert = dict((sweep.get("buckets") or [{}])[0].get("certified") or {})
    passed = cert.get("pass")
    row = {"sweep": str(sweep_dir), "pass": None, "fail": (cert.get("fail") or {}).get("load"), "low": None,
           "held_s": None, "margin": None, "verified": (cert.get("verified") or {}).get("passed"),
           "step_s": answer(sweep)["step_s"]}
    confidence = float(cert.get("confidence") or 0.95)
    row.update(fail_side(sweep_dir, sweep, cert.get("fail"), confidence))
    if passed is None:
        return row
    margin = _window_margin(sweep_dir, _step(sweep, passed["index"]), confidence)
    cert["horizon"] = answer_horizon(passed["load"], margin)
    return {**row, "pass": passed["load"], "low": capacity_interval(cert)[0],
            "held_s": None if margin is None else margin["held_s"],
            "margin": None if margin is None else round(margin["overload_unseen"], 4)}


def fail_side(sweep_dir: Path, sweep: dict, fail: dict | None, confidence: float) -> dict:
    """What failed the answer's fail step (its binding term, or "growth": saturation with no term failed), its
    window, the overload its window could not tell apart (the pass side's margin, on the fail's window) and the
    upper end that margin would give a growth fail (module docstring)."""
    if fail is None:
        return {"fail_by": None, "fail_window_s": None, "fail_margin": None, "high_margined": None}
    step = _step(sweep, fail["index"])
    by = (step.get("certified") or {}).get("binding") or \
        ("growth" if (step.get("saturation") or {}).get("saturated") else None)
    margin = _window_margin(sweep_dir, step, confidence)
    m = None if margin is None else margin["overload_unseen"]
    return {"fail_by": by, "fail_window_s": None if margin is None else margin["held_s"],
            "fail_margin": None if m is None else round(m, 4),
            "high_margined": fail["load"] * (1 + m) if by == "growth" and m is not None else fail["load"]}


def _step(sweep: dict, index: int) -> dict:
    return next(s for s in sweep["steps"] if s["index"] == index)


def _window_margin(sweep_dir: Path, step: dict, confidence: float) -> dict | None:
    w0 = float(step["summary"]["window"]["start_s"])
    return unseen_overload(read_records(sweep_dir / step["dir"] / "records.jsonl"),
                           (w0, w0 + float(step["window_s"])), confidence)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+", type=Path, help="sweep output directories")
    ap.add_argument("--truth", type=float, nargs=2, metavar=("LO", "HI"), required=True)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    rows = []
    for d in a.sweeps:
        row = margin_row(d)
        row["holds"] = holds(row, *a.truth)
        row["holds_without"] = holds({**row, "low": row["pass"]}, *a.truth)
        rows.append(row)
        print(f"{row['sweep']}: passed {row['pass']} over {row['held_s']} s, margin {row['margin']}, "
              f"[{row['low'] and round(row['low'], 4)}, {row['fail']})  holds {row['holds']} "
              f"(without the margin {row['holds_without']})")
    widths = [w for w in map(width, rows) if w is not None]
    plain = [w for w in (width({**r, "low": r["pass"]}) for r in rows) if w is not None]
    print(f"\n{len(rows)} sweeps: {sum(r['holds'] for r in rows)} hold the truth with the margin, "
          f"{sum(r['holds_without'] for r in rows)} without; median width {statistics.median(widths):.1%} with, "
          f"{statistics.median(plain):.1%} without; margins {min(r['margin'] for r in rows if r['margin']):.1%}-"
          f"{max(r['margin'] for r in rows if r['margin']):.1%}; step-seconds median "
          f"{statistics.median(r['step_s'] for r in rows):,.0f}")
    failed = [r for r in rows if r["fail"] is not None]
    growth = [r for r in failed if r["fail_by"] == "growth"]
    above = sum(r["fail"] > a.truth[0] for r in failed)
    margined = [{**r, "fail": r["high_margined"]} for r in rows]
    print(f"upper ends: {len(growth)} of {len(failed)} fails on growth alone; {above} of {len(failed)} above the "
          f"truth's lower end as they are, {sum(r['fail'] > a.truth[0] for r in margined if r['fail'] is not None)} "
          f"with a margin on growth fails, which would hold {sum(holds(r, *a.truth) for r in margined)} of "
          f"{len(rows)} at a median width of {statistics.median(w for w in map(width, margined) if w is not None):.1%}")
    if a.out:
        a.out.write_text(json.dumps({"truth": a.truth, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
