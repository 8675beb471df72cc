"""Issue 29 item 3's acceptance: the README's gate line on fresh quick starts of unchanged code, and of an engine
made 2× slower, on this machine as it is.

Each try is what a user does after the quick start::

    paasbench sweep --workload ci-small --out DIR
    paasbench gate --baseline reports/baseline/ci-small.json --current DIR --tolerance 35%

under one condition:

* ``idle``: the machine as it is (other sessions' work included: recorded, not controlled);
* ``busy``: two busy loops (``sh -c 'while :; do :; done'``) beside the sweep, started before it and stopped
  after it;
* ``slow``: the engine 2× slower, ``--server-arg debug_step_slowdown=1.0`` (every cpu-engine step burns as much
  CPU again: docs/reference_server.md), the machine as it is.

Acceptance: ``idle`` and ``busy`` exit 0 in 10 of 10 tries each; ``slow`` exits 99 in every try. With
``--other-gate PAASBENCH`` each try is judged also by another installation's gate (e.g. main's, to show the
"before"), from the same sweep. Per try: both exit codes, what was called and held, the sweep's fingerprint
and the other work the machine did (``meta.host_load`` of the compared step), the load average.

    python benchmarks/readme_gate_acceptance.py --idle 10 --busy 10 --slow 3 --json reports/gate-acceptance/readme-line.json
    python benchmarks/readme_gate_acceptance.py --idle 1 --busy 0 --slow 0                  # one look

Not a CI test: a try is a 3-6 minute sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAASBENCH = [sys.executable, "-c", "from paasbench.cli import main; main()"]
BASELINE = ROOT / "reports" / "baseline" / "ci-small.json"
GATE_ARGS = ["--tolerance", "35%"]


def busy_loops(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True) for _ in range(n)]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def gate(cmd: list[str], out: Path) -> tuple[int, str]:
    done = subprocess.run([*cmd, "gate", "--baseline", str(BASELINE), "--current", str(out), *GATE_ARGS],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    return done.returncode, done.stdout


def statuses(markdown: str) -> dict[str, list[str]]:
    """Metric labels by status, read off the gate's Markdown table."""
    marks = {"❌ regression": "regression", "⏸ not called": "held", "⚠️ unclear": "held", "⚠️ undecided": "undecided",
             "✅ improved": "improved"}
    out: dict[str, list[str]] = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 7 and cells[-1] in marks:
            out.setdefault(marks[cells[-1]], []).append(f"{cells[0]} {cells[3]}")
    return out


def one(kind: str, index: int, work: Path, other: list[str] | None) -> dict:
    out = work / f"{kind}-{index}"
    loops = busy_loops(2) if kind == "busy" else []
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        cmd = [*PAASBENCH, "sweep", "--workload", "ci-small", "--out", str(out), "--no-live"]
        if kind == "slow":
            cmd += ["--server-arg", "debug_step_slowdown=1.0"]
        sweep = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    finally:
        stop(loops)
    seconds = time.monotonic() - t0
    rc, md = gate(PAASBENCH, out)
    row = {"kind": kind, "index": index, "sweep_exit": sweep.returncode, "sweep_s": round(seconds, 1),
           "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)], "gate_exit": rc, "called": statuses(md),
           "notes": [line[2:] for line in md.splitlines() if line.startswith("- ") and "no confidence" not in line]}
    try:
        data = json.loads((out / "sweep.json").read_text())
        row["fingerprint_ms"] = round(data["meta"]["machine"]["seconds_per_iter"] * 1e3, 3)
        row["best_input_tpm"] = (data.get("best") or {}).get("input_tpm")
        row["host_load_others_cpus"] = {s["dir"]: ((s["summary"].get("meta") or {}).get("host_load") or {})
                                        .get("others_cpus") for s in data["steps"]}
    except (OSError, KeyError, TypeError, ValueError):
        pass
    if other:
        row["other_gate_exit"], other_md = gate(other, out)
        row["other_called"] = statuses(other_md)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=int, default=10)
    ap.add_argument("--busy", type=int, default=10)
    ap.add_argument("--slow", type=int, default=3)
    ap.add_argument("--other-gate", metavar="PAASBENCH", help="another installation's paasbench to gate each try too")
    ap.add_argument("--json", type=Path, help="append the tries to this JSON file")
    ap.add_argument("--keep", type=Path, help="keep the sweeps under this directory")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="readme-gate-"))
    work.mkdir(parents=True, exist_ok=True)
    other = [args.other_gate] if args.other_gate else None
    kept = json.loads(args.json.read_text()) if args.json and args.json.exists() else {"tries": []}
    plan = [(k, i) for k, n in (("idle", args.idle), ("busy", args.busy), ("slow", args.slow)) for i in range(n)]
    try:
        for kind, _ in plan:
            row = one(kind, sum(t["kind"] == kind for t in kept["tries"]), work, other)
            kept["tries"].append(row)
            print(json.dumps({k: row.get(k) for k in ("kind", "index", "gate_exit", "other_gate_exit", "sweep_s",
                                                      "load_avg", "fingerprint_ms", "called")}), flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(kept, indent=1) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for kind in ("idle", "busy", "slow"):
        rows = [t for t in kept["tries"] if t["kind"] == kind]
        if rows:
            want = 99 if kind == "slow" else 0
            print(f"{kind}: {sum(t['gate_exit'] == want for t in rows)} of {len(rows)} exited {want}"
                  + (f"; the other gate: {sum(t.get('other_gate_exit') == want for t in rows)}" if other else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
