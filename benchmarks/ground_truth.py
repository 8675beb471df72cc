"""The true max of a workload on its embedded server, found by long runs of the sweep's own step: what a sweep's
answer is judged against (issue 31, "Ground truth").

Why: a sweep step is short (ci-small: a 3 s warm-up and a 15 s window), and a queue that grows slowly looks healthy
for 15 s. On ci-small's cpu engine a 90 s run at 6 req/s had its p50 TTFT at 0.36, 0.65 and 21.3 s by thirds of
the run: not sustained, though its whole-run p50 (829 ms) met the 2 s SLO, and though a point-verdict sweep passed
8 req/s on its 15 s step. So a rate is **sustained** here when a run of ``--run-s`` (default 6 steps' windows) at
it meets the workload's SLO over the run *and over its last third* (a queue that only grows breaks the last third
first), with the sweep's own saturation test (paasbench/sweep/saturation.py) quiet on the whole run. From a
bracket ``--lo`` (sustained) and ``--hi`` (not), checked first, the script bisects geometrically until
``hi / lo - 1 <= --resolution`` (2%).

Each run is the sweep's step (``paasbench.sweep.step.run_step``) stretched to ``--run-s``: the same steady mix of
the same sessions at the same context ``--bucket``, with its Poisson arrivals conditioned on their count, its
warm-up, its drain and its primed sessions, fresh prefixes per run, against one server started for all of them.
What the truth is measured with is what the sweep is judged on; a ``paasbench run --loop`` of the whole trace (this
script's first version) offered another mix. The table is printed and written as JSON.

    python benchmarks/ground_truth.py --workload ci-small --lo 4 --hi 6      # about 15 minutes on 2 cores
    python benchmarks/ground_truth.py --workload white-paper-agent --bucket 64K --run-s 480 --lo 0.8 --hi 1.2

One run per rate is one draw, and one horizon. Near the capacity a run's verdict is itself random: on the twin's
white-paper 64K bucket, held 420 s per run and judged by queue growth alone (the rule of d812c57), 2.85 req/s was
sustained on 4 seeds of 5 and 2.9 on 1 of 5 (a seed is one draw of the sessions and the arrivals). Held 30 minutes,
2.95 req/s was sustained on 3 seeds of 3 and 3.0 on none, while 3.0 held 15 minutes on 2 of 3: state the horizon
with the truth (``--run-s``), and judge its runs again at shorter ones with benchmarks/rejudge.py
(reports/ground-truth/). ``--rates R ... --seed S`` holds each listed rate once on seed ``S`` (no
bisection); run it for several seeds, side by side, and the truth is where the share of sustained runs crosses one
half (``--combine`` tabulates the files: each rate's sustained runs out of its runs, and the highest rate
sustained by a majority with the lowest above it that is not):

    for s in 1 2 3; do python benchmarks/ground_truth.py --workload white-paper-agent --bucket 64K --run-s 420 \
        --rates 2.7 2.8 2.9 3.0 3.1 --response-s 18 --seed $s --out runs/gt/seed$s & done; wait
    python benchmarks/ground_truth.py --combine runs/gt/seed*/ground_truth.json

``--response-s`` sizes the first rate's sessions in flight from an answer time known beforehand (a later rate takes
the measured E2E of the run below it, as a sweep's steps do); without it the first rate plays the trace's turn gap.

The cpu engine's capacity moves with the host (its CPU and its other work): a truth measured there holds for this
box in this state, and a sweep is judged against it in the same sitting. The sim twin's modeled time does not move
with the host, so its truth holds until the twin's model changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paasbench.metrics import slo  # noqa: E402
from paasbench.metrics.records import RequestRecord, read_records  # noqa: E402
from paasbench.metrics.summary import summarize  # noqa: E402
from paasbench.sweep.embedded import embedded_server, prime_concurrency, server_section  # noqa: E402
from paasbench.sweep.saturation import SaturationLimits, detect, step_limits  # noqa: E402
from paasbench.sweep.settings import step_client  # noqa: E402
from paasbench.sweep.source import Source, fresh_prefixes, parse_buckets  # noqa: E402
from paasbench.sweep.step import StepPlan, mean_e2e_s, response_near, run_step  # noqa: E402


def sustained(records: list[RequestRecord], gates: list[slo.Gate], warmup: float, length: float, drain: float,
              limits: SaturationLimits | None = None) -> dict:
    """The truth's rule, for a run held ``length`` seconds after its ``warmup``: the SLO met over
    ``[warmup, warmup + length)`` *and over its last third* (a queue that only grows breaks the last third first),
    and the saturation test quiet on that window, judged once as a fixed-length step is (``limits``: by default a
    verification's, ``step_limits("verify")``). One rule for a live run (:func:`main`) and for
    a recorded one judged again at a shorter horizon (benchmarks/rejudge.py)."""
    window = (warmup, warmup + length)
    whole = summarize(records, window=window, drain_s=drain)
    tail = summarize(records, window=(warmup + length * 2 / 3, window[1]), drain_s=drain)
    sat = detect(records, window, drain_s=drain, gates=gates, limits=limits or step_limits("verify"))
    out = {"length_s": length, "slo_whole": slo.evaluate(gates, whole).passed,
           "slo_last_third": slo.evaluate(gates, tail).passed,
           "ttft_p50_ms": (whole.get("ttft_ms") or {}).get("p50"),
           "ttft_p50_last_third_ms": (tail.get("ttft_ms") or {}).get("p50"),
           "saturated": sat["saturated"], "saturation": sat["reasons"], "swings": sat.get("swings", [])}
    return {**out, "sustained": out["slo_whole"] and out["slo_last_third"] and not out["saturated"]}


def majority(rows: list[dict]) -> tuple[list[dict], float | None, float | None]:
    """Runs (``rate``, ``sustained``) as a table of each rate's sustained runs out of its runs, and the truth: the
    highest rate a majority of its runs sustained and the lowest rate above it that a majority did not. One seed's
    ``--rates`` runs and several seeds' (``--combine``) are read the same way."""
    by_rate: dict[float, list[bool]] = {}
    for row in rows:
        by_rate.setdefault(float(row["rate"]), []).append(bool(row["sustained"]))
    table = [{"rate": r, "sustained": sum(v), "runs": len(v)} for r, v in sorted(by_rate.items())]
    lo = max((t["rate"] for t in table if 2 * t["sustained"] > t["runs"]), default=None)
    hi = min((t["rate"] for t in table if 2 * t["sustained"] <= t["runs"] and (lo is None or t["rate"] > lo)),
             default=None)
    return table, lo, hi


def combine(paths: list[str]) -> dict:
    """Several seeds' ``--rates`` files as one table and their majority truth (:func:`majority`)."""
    table, lo, hi = majority([row for path in paths for row in json.loads(Path(path).read_text())["runs"]])
    return {"files": paths, "rates": table, "true_max_rps": {"sustained": lo, "not_sustained": hi}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="ci-small")
    ap.add_argument("--bucket", default=None, help="context bucket, e.g. 64K (default: the workload as it is)")
    ap.add_argument("--lo", type=float, help="a rate (req/s) expected to be sustained")
    ap.add_argument("--hi", type=float, help="a rate (req/s) expected not to be")
    ap.add_argument("--rates", type=float, nargs="+", help="hold each of these rates once, no bisection")
    ap.add_argument("--response-s", type=float, default=0.0,
                    help="the answer time that sizes the first rate's sessions in flight (default: the turn gap)")
    ap.add_argument("--combine", nargs="+", metavar="JSON", help="tabulate several seeds' --rates files and exit")
    ap.add_argument("--resolution", type=float, default=0.02)
    ap.add_argument("--run-s", type=float, default=None, help="measured seconds a run (default: 6 x the step)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="runs/ground-truth")
    a = ap.parse_args()
    if a.combine:
        result = combine(a.combine)
        for t in result["rates"]:
            print(f"{t['rate']:8.4g} req/s  sustained in {t['sustained']} of {t['runs']} runs")
        truth = result["true_max_rps"]
        print(f"true max: {truth['sustained']} req/s sustained by a majority, {truth['not_sustained']} not")
        print(json.dumps(result, indent=1))
        return 0
    if not a.rates and (a.lo is None or a.hi is None):
        ap.error("give --lo and --hi (a bisection), or --rates (each held once), or --combine")
    source = Source.from_workload(a.workload, a.seed)
    bucket = parse_buckets(a.bucket)[0] if a.bucket else None
    sweep = source.sweep_defaults
    warmup = float(sweep.get("warmup_s", 3.0))
    run_s = a.run_s or 6 * float(sweep.get("duration_s", 15.0))
    plan = StepPlan("rate", warmup, run_s, seed=a.seed)
    gates = slo.parse_gates(source.slo)
    section = server_section(source.server, source.max_context_tokens())
    client = step_client({"prompt_format": "auto", "target": None, "api": None, "model": None, "api_key": None},
                         {"warmup_s": warmup, "step_duration_s": run_s}, section)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def save(lo: float | None, hi: float | None) -> None:    # after every run: a stopped search keeps its runs
        result = {"workload": a.workload, "bucket": bucket, "slo": source.slo, "run_s": run_s, "warmup_s": warmup,
                  "seed": a.seed, "true_max_rps": {"sustained": lo, "not_sustained": hi}, "runs": rows}
        (out / "ground_truth.json").write_text(json.dumps(result, indent=1))

    with embedded_server(section) as srv:
        client = dataclasses.replace(client, target=srv.url)

        def probe(rate: float) -> bool:
            step_dir = out / f"rate-{rate:.4g}"
            # its sessions in flight follow the E2E of the closest run below, as a sweep's steps do (driver._plan)
            below = response_near(((r["rate"], r["e2e_mean_s"]) for r in rows), rate)
            at = dataclasses.replace(plan, response_s=below or a.response_s)
            trace = fresh_prefixes(at.trace(source, bucket, at.trace_size(rate), rate), len(rows) + 1)
            entry = run_step(trace, at, rate, client, step_dir, gates=gates, meta={"ground_truth": a.workload},
                             prime_concurrency=prime_concurrency(section))
            summ = entry["summary"]
            held = sustained(list(read_records(step_dir / "records.jsonl")), gates, at.warmup_s, at.duration_s,
                             at.drain_s)
            row = {"rate": rate, "sustained": bool(held["sustained"] and not entry["trace_exhausted"]),
                   "slo_whole": held["slo_whole"], "slo_last_third": held["slo_last_third"],
                   "saturated": held["saturated"], "saturation": held["saturation"], "swings": held["swings"],
                   "trace_exhausted": entry["trace_exhausted"],
                   "requests": summ["requests"], "ttft_p50_ms": held["ttft_p50_ms"],
                   "ttft_p50_last_third_ms": held["ttft_p50_last_third_ms"], "input_tpm": summ.get("input_tpm"),
                   "error_rate": summ.get("error_rate"), "traffic_hit_ratio": entry.get("traffic_hit_ratio"),
                   "prefix_hit_ratio": summ.get("prefix_hit_ratio"), "wall_s": round(entry["wall_s"], 1),
                   "e2e_mean_s": mean_e2e_s(summ), "lanes": entry.get("lanes"),
                   "response_s": at.response_s}
            rows.append(row)
            save(None, None)
            print(f"{rate:8.4g} req/s  {'sustained' if row['sustained'] else 'NOT sustained':14s} "
                  f"p50 TTFT {row['ttft_p50_ms'] or 0:9.0f} ms (last third {row['ttft_p50_last_third_ms'] or 0:9.0f})  "
                  f"input TPM {row['input_tpm'] or 0:10.0f}  {'; '.join(row['saturation'])[:120]}", flush=True)
            return row["sustained"]

        if a.rates:
            for rate in sorted(a.rates):
                probe(rate)
            _, lo, hi = majority(rows)
            save(lo, hi)
            print(f"seed {a.seed}: highest sustained {lo} req/s, lowest above it not {hi}; {out / 'ground_truth.json'}")
            return 0
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
    save(lo, hi)
    where = f" at {bucket} tokens" if bucket else ""
    print(f"true max of {a.workload}{where}: between {lo:.4g} (sustained) and {hi:.4g} req/s (not); "
          f"{out / 'ground_truth.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
