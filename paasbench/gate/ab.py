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
* ``cpu`` — the real cpu engine: engine CPU time per token (``cpu_us_per_*``), for the model math;
* ``client`` — no reference server: the side's ``paasbench run`` against a zero-latency target
  (:mod:`paasbench.gate.client_probe`): client CPU per streamed token, peak RSS at 256 streams, launch → first
  request, schedule lag p99 at a constant rate — the load generator's own cost, which is what users buy it for.
  Its two sides run side by side within a round, not one after the other (``client_probe.measure_pair``).

A probe can run more rounds than the others (``rounds_by_probe``): the client probe's noisy figures need at least
``paasbench.gate.stats.MIN_RUNS`` pairs to be judged at all, the twin's exact ones need two.

Results: ``OUT/<probe>/<A|B>/round-NN/`` (a ``paasbench run`` directory each) and ``OUT/ab.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


from paas_common.errors import InputError, RunFailed
from paasbench.progress import Stage, hms

# --routing threshold: on the cpu engine the cost rule estimates prefill times from measured wall-clock step times,
# so on a busy machine its local/remote choice (and with it the prefix hit) would vary run to run. The twin's cost
# rule runs on its roofline (deterministic); its probe keeps threshold so the probes' records stay comparable.
PROBES: dict[str, list[str]] = {
    "twin": ["--engine", "sim", "--model-profile", "tiny", "--device-profile", "cpu-local", "--block-size", "64",
             "--routing", "threshold"],
    "cpu": ["--engine", "cpu", "--model", "tiny", "--block-size", "64", "--routing", "threshold"],
    "client": [],   # no reference server: paasbench.gate.client_probe
}
WORKLOAD = "ci-small"


@dataclass(frozen=True, slots=True)
class Side:
    name: str                      # "A" or "B"
    python: Path                   # the install's interpreter
    server_args: list[str] = field(default_factory=list)   # extra reference-server flags (e.g. an injected slowdown)
    client_env: dict[str, str] = field(default_factory=dict)  # extra environment of the side's paasbench runs

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


def client_env(items: tuple[str, ...], what: str) -> dict[str, str]:
    """``NAME=VALUE`` items -> environment variables for a side's paasbench runs."""
    env = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise InputError(f"expected NAME=VALUE, got {item!r}", field=what)
        env[name] = value
    return env


def probe_round_counts(items: tuple[str, ...]) -> dict[str, int]:
    """``PROBE=N`` items (``--probe-rounds``) -> rounds per probe."""
    counts = {}
    for item in items:
        probe, eq, n = item.partition("=")
        if not eq or probe not in PROBES or not n.isdigit() or int(n) < 1:
            raise InputError(f"expected PROBE=N with PROBE one of {', '.join(PROBES)} and N >= 1, got {item!r}",
                             field="--probe-rounds")
        counts[probe] = int(n)
    return counts


def run_round(side: Side, probe: str, out: Path, requests: int, workload: str, timeout_s: float) -> float:
    """One measurement: the side's server for this probe, its client at concurrency 1, then stop. Seconds taken."""
    from reference_server.launcher import EmbeddedServer, ServerStartError

    t0 = time.monotonic()
    try:
        with EmbeddedServer([*PROBES[probe], *side.server_args], python=str(side.python)) as server:
            cmd = [str(side.paasbench), "run", "--target", server.url, "--workload", workload, "--concurrency", "1",
                   "--max-requests", str(requests), "--out", str(out), "--no-live"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, **side.client_env})
    except ServerStartError as exc:
        raise RunFailed(f"side {side.name} ({probe}): the reference server did not start: {exc}") from None
    except subprocess.TimeoutExpired:
        raise RunFailed(f"side {side.name} ({probe}): the run took over {timeout_s:.0f}s") from None
    if proc.returncode != 0 or not (out / "summary.json").is_file():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RunFailed(f"side {side.name} ({probe}): paasbench run exited {proc.returncode}:\n{tail}")
    return time.monotonic() - t0


def run_client_round(a: Side, b: Side, out: Path, k: int, timeout_s: float) -> float:
    """Round ``k`` of the client probe, both sides side by side (:func:`paasbench.gate.client_probe.measure_pair`)."""
    from paasbench.gate.client_probe import ProbeSide, measure_pair

    t0 = time.monotonic()
    first, second = (a, b) if k % 2 else (b, a)   # who is started first alternates too, as in the other probes
    measure_pair(*(ProbeSide(s.paasbench, out / "client" / s.name / f"round-{k:02d}", s.client_env,
                             f"side {s.name} (client)") for s in (first, second)), timeout_s=timeout_s)
    return time.monotonic() - t0


def run_ab(a: Side, b: Side, out: Path, *, rounds: int, probes: list[str], requests: int, workload: str = WORKLOAD,
           timeout_s: float = 600.0, rounds_by_probe: dict[str, int] | None = None, log=print) -> dict:
    """Rounds of A then B for every probe (``rounds``, or the probe's own count in ``rounds_by_probe``); returns
    (and writes to OUT/ab.json) what ran and how long it took."""
    per_probe = {p: (rounds_by_probe or {}).get(p, rounds) for p in probes}
    record = {"sides": {s.name: {"python": str(s.python), "server_args": s.server_args, "client_env": s.client_env}
                        for s in (a, b)},
              "rounds": rounds, "rounds_by_probe": per_probe, "probes": probes, "requests": requests, "workload": workload, "seconds": []}
    out.mkdir(parents=True, exist_ok=True)
    runs, began = sum(n * (1 if p == "client" else 2) for p, n in per_probe.items()), time.monotonic()

    def eta() -> str:
        at = Stage("ab", len(record["seconds"]), runs, "runs", time.monotonic() - began)
        return f"(run {at.done:.0f} of {runs}, ETA {hms(at.eta_s)})"

    for k in range(1, max(per_probe.values(), default=0) + 1):
        for probe in (p for p in probes if k <= per_probe[p]):
            if probe == "client":   # both sides at once (client_probe.measure_pair says why)
                secs = run_client_round(a, b, out, k, timeout_s)
                record["seconds"].append({"round": k, "probe": probe, "side": "A+B", "s": round(secs, 2)})
                log(f"round {k}/{per_probe[probe]} {probe:<6} A+B: {secs:5.1f} s -> {out / probe}/[AB]/round-{k:02d}  "
                    f"{eta()}")
                (out / "ab.json").write_text(json.dumps(record, indent=2))
                continue
            for side in ((a, b) if k % 2 else (b, a)):    # A B, B A, ...: a steady drift cancels over two rounds
                dest = out / probe / side.name / f"round-{k:02d}"
                secs = run_round(side, probe, dest, requests, workload, timeout_s)
                record["seconds"].append({"round": k, "probe": probe, "side": side.name, "s": round(secs, 2)})
                log(f"round {k}/{per_probe[probe]} {probe:<6} {side.name}: {secs:5.1f} s -> {dest}  {eta()}")
                (out / "ab.json").write_text(json.dumps(record, indent=2))
    return record
