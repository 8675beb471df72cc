"""Same-runner A/B (``paasbench ab``, :mod:`paasbench.commands.ab`) — two installs of paasbench measured interleaved on one machine.

Comparing a pull request with a baseline recorded elsewhere, or earlier, mostly measures the machine: on a
shared 2-core box the same code moved +24% in p50 TTFT from one run to the next. Running the base (A) and the
candidate (B) on the same machine, in the same job, interleaved round by round, exposes both to the same noise,
and several rounds per side let ``paasbench gate --paired`` put a confidence interval on the round-by-round
difference. Within a round the order alternates (A B, then B A, ...), so a steady drift in the machine's load
favours neither side.

A side is an installed environment (a virtualenv directory or its python). Each round runs, for each side and
each probe, that side's own reference server (``python -m reference_server`` of that install) and that side's
own ``paasbench run`` against it, so server and harness changes are both measured. The load is closed-loop at
concurrency 1 with a fixed request count from a fixed workload: the same requests in the same order every time,
which is what makes the sim twin's modeled times exactly reproducible (with more than one request in flight,
which requests share a step depends on wall-clock arrival, docs/slo.md). For the same reason the probes route
by the threshold rule: the cost rule's estimates come from measured wall-clock step times. Probes:

* ``twin`` — the sim engine (tiny model on the fitted cpu-local device): latencies in modeled time
  (``modeled_*``), deterministic, for router, scheduler, cache and harness logic;
* ``cpu`` — the real cpu engine: engine CPU time per token (``cpu_us_per_*``), for the model math.

Results: ``OUT/<probe>/<A|B>/round-NN/`` (a ``paasbench run`` directory each) and ``OUT/ab.json``.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


from paas_common.errors import InputError, RunFailed
from paasbench.progress import Stage, hms

# --routing threshold: the cost rule estimates prefill times from measured wall-clock step times, so on a busy
# machine its local/remote choice (and with it the modeled times and the prefix hit) would vary run to run.
PROBES: dict[str, list[str]] = {
    "twin": ["--engine", "sim", "--model-profile", "tiny", "--device-profile", "cpu-local", "--block-size", "64",
             "--routing", "threshold"],
    "cpu": ["--engine", "cpu", "--model", "tiny", "--block-size", "64", "--routing", "threshold"],
}
WORKLOAD = "ci-small"


@dataclass(frozen=True, slots=True)
class Side:
    name: str                      # "A" or "B"
    python: Path                   # the install's interpreter
    server_args: list[str] = field(default_factory=list)   # extra reference-server flags (e.g. an injected slowdown)

    @property
    def paasbench(self) -> Path:
        return self.python.parent / "paasbench"


def resolve_python(spec: str, what: str) -> Path:
    """A virtualenv directory or a python executable -> the interpreter."""
    path = Path(spec)
    python = path / "bin" / "python" if path.is_dir() else path
    if not python.exists():
        raise InputError("not a virtualenv directory or a python executable", file=spec, field=what)
    if not (python.parent / "paasbench").exists():
        raise InputError(f"no paasbench next to {python} (install the package into it)", file=spec, field=what)
    return python


def server_flags(items: tuple[str, ...]) -> list[str]:
    """``NAME=VALUE`` items -> reference-server flags, as `paasbench sweep --server-arg` reads them."""
    from paasbench.sweep.embedded import parse_server_args, server_args

    return server_args(parse_server_args(items))


def run_round(side: Side, probe: str, out: Path, requests: int, workload: str, timeout_s: float) -> float:
    """One measurement: the side's server for this probe, its client at concurrency 1, then stop. Seconds taken."""
    from reference_server.launcher import EmbeddedServer, ServerStartError

    t0 = time.monotonic()
    try:
        with EmbeddedServer([*PROBES[probe], *side.server_args], python=str(side.python)) as server:
            cmd = [str(side.paasbench), "run", "--target", server.url, "--workload", workload, "--concurrency", "1",
                   "--max-requests", str(requests), "--out", str(out), "--no-live"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except ServerStartError as exc:
        raise RunFailed(f"side {side.name} ({probe}): the reference server did not start: {exc}") from None
    except subprocess.TimeoutExpired:
        raise RunFailed(f"side {side.name} ({probe}): the run took over {timeout_s:.0f}s") from None
    if proc.returncode != 0 or not (out / "summary.json").is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RunFailed(f"side {side.name} ({probe}): paasbench run exited {proc.returncode}:\n{tail}")
    return time.monotonic() - t0


def run_ab(a: Side, b: Side, out: Path, *, rounds: int, probes: list[str], requests: int, workload: str = WORKLOAD,
           timeout_s: float = 600.0, log=print) -> dict:
    """Rounds of A then B for every probe; returns (and writes to OUT/ab.json) what ran and how long it took."""
    record = {"sides": {s.name: {"python": str(s.python), "server_args": s.server_args} for s in (a, b)},
              "rounds": rounds, "probes": probes, "requests": requests, "workload": workload, "seconds": []}
    out.mkdir(parents=True, exist_ok=True)
    runs, began = rounds * len(probes) * 2, time.monotonic()
    for k in range(1, rounds + 1):
        for probe in probes:
            for side in ((a, b) if k % 2 else (b, a)):    # A B, B A, ...: a steady drift cancels over two rounds
                dest = out / probe / side.name / f"round-{k:02d}"
                secs = run_round(side, probe, dest, requests, workload, timeout_s)
                record["seconds"].append({"round": k, "probe": probe, "side": side.name, "s": round(secs, 2)})
                at = Stage("ab", len(record["seconds"]), runs, "runs", time.monotonic() - began)
                log(f"round {k}/{rounds} {probe:<4} {side.name}: {secs:5.1f} s -> {dest}  "
                    f"(run {at.done:.0f} of {runs}, ETA {hms(at.eta_s)})")
                (out / "ab.json").write_text(json.dumps(record, indent=2))
    return record
