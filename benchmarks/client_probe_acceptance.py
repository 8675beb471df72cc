"""Issue #23 item 1's acceptance for the A/B's client probe: does its gate pass unchanged code, and does it call
a client made 20% slower?

One repetition is the quick A/B's client part exactly: ``paasbench ab --a VENV --b VENV --probe client --rounds
N`` (both sides this checkout's environment), then ``paasbench gate --paired`` over its rounds with
scripts/perf_gate.sh's own ``client_gate_args`` (read from the script, so the two cannot drift apart).

* ``same``: both sides unchanged. Acceptance: 10 of 10 pass (gate exit 0).
* ``slow``: side B with ``PAASBENCH_DEBUG_CLIENT_SLOWDOWN=F`` (paasbench/client/debug.py: the client's event
  loop spins F × its own CPU, so B is F slower by construction). Acceptance: at least 9 of 10 fail (exit 99).

The two kinds alternate (same, slow, same, ...) so that the box's load weighs on both. Each repetition's per-round
B/A of every client figure and the 1-minute load average before and after it are kept; ``--json FILE`` writes
them with the counts and the noise of unchanged code (sd of log(B/A) per figure), which docs/performance.md
quotes (reports/client-probe/acceptance.json).

    python benchmarks/client_probe_acceptance.py --venv /path/to/venv --reps 10 --json reports/client-probe/acceptance.json --key NAME
    python benchmarks/client_probe_acceptance.py --venv VENV --reps 1 --rounds 3        # a short look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("client_cpu_us_per_token", "client_peak_rss_mb", "launch_s", "launch_cpu_s", "schedule_lag_ms.p99")


def client_gate_args() -> list[str]:
    """scripts/perf_gate.sh's ``client_gate_args``, expanded by bash as the script expands them."""
    out = subprocess.run(["bash", "-c", 'eval "$(grep "^client_gate_args=(" scripts/perf_gate.sh)"; '
                                        'printf "%s\\0" "${client_gate_args[@]}"'],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    args = out.split("\0")[:-1]
    if not args:
        sys.exit("client_probe_acceptance: no client_gate_args in scripts/perf_gate.sh")
    return args


def figure(summary: dict, name: str) -> float | None:
    value: object = summary
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def ratios(out: Path) -> dict[str, list[float]]:
    """Per round, B/A − 1 (%) of each figure."""
    res: dict[str, list[float]] = {f: [] for f in FIGURES}
    for a_dir in sorted((out / "client" / "A").glob("round-*")):
        a = json.loads((a_dir / "summary.json").read_text())
        b = json.loads((out / "client" / "B" / a_dir.name / "summary.json").read_text())
        for f in FIGURES:
            va, vb = figure(a, f), figure(b, f)
            if va and vb is not None:
                res[f].append(round((vb / va - 1) * 100, 2))
    return res


def repetition(kind: str, k: int, venv: str, rounds: int, slowdown: float, work: Path, gate: list[str]) -> dict:
    out = work / f"{kind}-{k}"
    env_b = ["--b-client-env", f"PAASBENCH_DEBUG_CLIENT_SLOWDOWN={slowdown:g}"] if kind == "slow" else []
    load0, t0 = os.getloadavg()[0], time.monotonic()
    ab = subprocess.run(["paasbench", "ab", "--a", venv, "--b", venv, "--probe", "client", "--rounds", str(rounds),
                         "--out", str(out), *env_b], capture_output=True, text=True)
    if ab.returncode != 0:
        sys.exit(f"client_probe_acceptance: paasbench ab exited {ab.returncode}:\n{ab.stderr[-2000:]}")
    g = subprocess.run(["paasbench", "gate", "--baseline", str(out / "client/A/round-*"),
                        "--current", str(out / "client/B/round-*"), *gate], capture_output=True, text=True)
    row = next((x for x in g.stdout.splitlines() if x.startswith("| client CPU per streamed")), "")
    return {"kind": kind, "index": k, "gate_exit": g.returncode, "cpu_row": row, "b_over_a_pct": ratios(out),
            "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "seconds": round(time.monotonic() - t0, 1), "finished_utc": time.strftime("%H:%M:%S", time.gmtime())}


def noise(reps: list[dict]) -> dict[str, dict]:
    res = {}
    for f in FIGURES:
        pct = [r for rep in reps for r in rep["b_over_a_pct"][f]]
        if len(pct) > 1:
            logs = [math.log1p(p / 100) for p in pct]
            res[f] = {"rounds": len(pct), "min_pct": min(pct), "max_pct": max(pct),
                      "sd_log_pct": round(statistics.stdev(logs) * 100, 2)}
    return res


def detection_by_rounds(sd_log: float, slowdown: float, tolerance: float, metrics: int,
                        rounds: range = range(2, 9)) -> dict[int, float]:
    """The chance that the paired gate calls a true ``slowdown`` a regression at ``tolerance`` with ``n`` rounds,
    for each n, when the per-round log ratio B/A has spread ``sd_log``: the gate's own test (a one-sided t-test of
    the mean log ratio against log(1 + tolerance), ``paasbench.gate.stats``), at Holm's strictest step
    (alpha / metrics), through the noncentral t distribution."""
    from scipy import stats

    beyond = math.log1p(slowdown) - math.log1p(tolerance)
    return {n: round(float(stats.nct.sf(stats.t.ppf(1 - 0.05 / metrics, n - 1), n - 1,
                                        beyond / (sd_log / math.sqrt(n)))), 3) for n in rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", required=True, help="The environment both sides run (its paasbench: this checkout).")
    ap.add_argument("--reps", type=int, default=10, help="Repetitions of each kind.")
    ap.add_argument("--rounds", type=int, default=5, help="Client rounds per A/B (the quick A/B's: 5).")
    ap.add_argument("--slowdown", type=float, default=0.2, help="Side B's slowdown in the slow repetitions.")
    ap.add_argument("--json", type=Path, help="Write the repetitions and counts here.")
    ap.add_argument("--key", help="With --json: put the result under this key of the file's object, keeping the "
                                  "others (the committed file holds one key per sitting).")
    args = ap.parse_args()
    gate = client_gate_args()
    reps: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="client-acceptance-") as tmp:
        for k in range(1, args.reps + 1):
            for kind in ("same", "slow"):
                rep = repetition(kind, k, args.venv, args.rounds, args.slowdown, Path(tmp), gate)
                reps.append(rep)
                print(f"{kind}-{k}: gate exit {rep['gate_exit']}  CPU/token B/A {rep['b_over_a_pct'][FIGURES[0]]}  "
                      f"load {rep['loadavg_1min']}  {rep['cpu_row']}", flush=True)
    same = [r for r in reps if r["kind"] == "same"]
    slow = [r for r in reps if r["kind"] == "slow"]
    result = {"what": f"paasbench ab --probe client --rounds {args.rounds}, gated with scripts/perf_gate.sh's "
                      f"client_gate_args; slow: side B PAASBENCH_DEBUG_CLIENT_SLOWDOWN={args.slowdown:g}",
              "same_passed": sum(r["gate_exit"] == 0 for r in same), "same_runs": len(same),
              "slow_failed": sum(r["gate_exit"] == 99 for r in slow), "slow_runs": len(slow),
              "noise_unchanged": noise(same),
              "slow_cpu_per_token_pct": sorted(p for r in slow for p in r["b_over_a_pct"][FIGURES[0]]),
              "loadavg_range": [min(x for r in reps for x in r["loadavg_1min"]),
                                max(x for r in reps for x in r["loadavg_1min"])],
              "repetitions": reps}
    sd = result["noise_unchanged"].get(FIGURES[0], {}).get("sd_log_pct")
    if sd:   # how many rounds a slowdown of exactly this size needs, from the noise of unchanged code
        result["detection_by_rounds"] = detection_by_rounds(sd / 100, args.slowdown, 0.05, gate.count("--metric"))
    print(f"unchanged passed {result['same_passed']}/{len(same)}; slowed by {args.slowdown:.0%} failed "
          f"{result['slow_failed']}/{len(slow)}; slow CPU/token per round {result['slow_cpu_per_token_pct']}")
    if args.json:
        whole = result
        if args.key:
            whole = json.loads(args.json.read_text()) if args.json.exists() else {}
            whole[args.key] = result
        args.json.write_text(json.dumps(whole, indent=1) + "\n")
    ok = result["same_passed"] == len(same) and result["slow_failed"] >= math.ceil(0.9 * len(slow))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
