"""The A/B's ``client`` probe: what the load generator itself costs, measured from outside, one round of one side.

paasbench's lead over the tools it is compared with is the client's own cost: CPU per streamed token, memory,
launch time, pacing. The other probes measure the reference server; this one measures ``paasbench run`` against a
target that costs it nothing to reach (:mod:`paasbench.gate.probe_target`), so a change in the client — a slower
hot loop, a heavier import, a prompt tape rebuilt at every launch — shows as a change in these figures.

Everything is measured from outside the client process, so the base side of an A/B (an older paasbench) is
measured the same way as the candidate: the target (:mod:`paasbench.gate.probe_target`) is told the client's pid
and reads its CPU itself at the moments that bound each phase. One round of one side is two ``paasbench run``
invocations:

* **closed loop** (:class:`ProbeLoad`: 256 streams, 2,048 requests of 128 prompt tokens, built from the tokenizer's
  prompt tape as a real trace's are, and 128 output tokens):
  - ``launch_s`` — launch → first request on the wire: from just before the process is spawned to the
    target having read the first completion request's body (``time.monotonic`` on both sides);
  - ``launch_cpu_s`` — the client's CPU spent by then, read by the target at that moment (what a one-time cost
    adds, without the wait for a core that a busy machine adds to the wall time);
  - ``client_cpu_us_per_token`` — the client's CPU over the load phase (:class:`_LoadPhase`: from the target
    releasing the first responses to the client closing its last connection, every response read), divided by
    the tokens the target streamed: no imports, no prompt tape, no export. Read exactly at both ends, not
    sampled: before, ``/proc/PID/stat`` sampled every 10 ms and interpolated, up to the last response *written*,
    left the responses still unread then outside the phase;
  - ``client_peak_rss_mb`` — the process's peak RSS as the kernel reports it when reaped (``wait4``): the whole
    run, the summary and export included, since that is what a user's machine must hold.
* **open loop**: a constant 100 req/s for 3 s (prompts given literally in its trace: launch was measured above);
  ``schedule_lag_ms.p99`` from the run's summary (how late the client sent, by its own clock: ``actual − intended``
  send time).

The round's figures go to ``OUT/summary.json`` (schema ``paasbench.summary.client-probe``), which
``paasbench gate --paired`` reads like any run's summary. Test hooks (docs/performance.md): the environment a side
runs with (``paasbench ab --b-client-env``), e.g. ``PAASBENCH_DEBUG_CLIENT_SLOWDOWN`` (a client slower by a fraction of its own CPU)
or ``PAASBENCH_DEBUG_LAUNCH_S`` (a one-time CPU cost before the first request), to show the gate catches them.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable
from pathlib import Path

from paas_common.errors import RunFailed
from paasbench.gate.probe_target import ProbeTarget

SAMPLE_S = 0.01     # RSS sampling (the peak by phase); CPU is read by the target at the phase's ends
POLL_S = 0.02       # how often a side looks at its target's progress (its client is held or frozen meanwhile)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(pid: int) -> float | None:
    """A process's resident set now (MB), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[21]) * _PAGE / 2**20


def rss_between(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """The largest resident set sampled in ``[start, end]`` (MB)."""
    inside = [s[1] for s in samples if start <= s[0] <= end]
    return max(inside) if inside else None


@dataclass(frozen=True, slots=True)
class ProbeLoad:
    streams: int = 256           # closed loop: streams in flight
    requests: int = 2048         # closed loop: requests
    in_tokens: int = 128         # prompt tokens a request
    out_tokens: int = 128        # output tokens a request (one an SSE event)
    rate: float = 100.0          # open loop: requests/s, constant
    seconds: float = 3.0         # open loop: how long


class Measured:
    """A child process's resident set sampled while it runs, its peak RSS and CPU (``wait4``) when it ends."""

    def __init__(self, cmd: list[str], env: dict[str, str], timeout_s: float, cwd: Path | None = None,
                 on_spawn: Callable[["subprocess.Popen[str]"], object] = lambda proc: None) -> None:
        self.t_spawn = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        try:
            on_spawn(self.proc)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.samples: list[tuple[float, float]] = []   # (time.monotonic(), RSS MB)
        self.output = ""
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        sampler = threading.Thread(target=self._sample, daemon=True)
        sampler.start()
        killer = threading.Timer(timeout_s, self.proc.kill)
        killer.start()
        _, status, ru = os.wait4(self.proc.pid, 0)
        self.t_exit = time.monotonic()
        killer.cancel()
        self.returncode = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.returncode
        self.peak_rss_mb = ru.ru_maxrss / 1024
        self.cpu_total_s = ru.ru_utime + ru.ru_stime
        sampler.join()
        reader.join()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        self.output = self.proc.stdout.read()

    def _sample(self) -> None:
        while self.proc.returncode is None:
            now = rss_mb(self.proc.pid)
            if now is None:
                break
            self.samples.append((time.monotonic(), now))
            time.sleep(SAMPLE_S)


def _trace(path: Path, n: int, load: ProbeLoad, literal: bool) -> Path:
    """``n`` requests; ``literal``: with their prompt text in the trace (no tokenizer tape to build)."""
    text = " tok" * load.in_tokens
    path.write_text("".join(json.dumps({"timestamp": 0, "input_length": load.in_tokens,
                                        "output_length": load.out_tokens, "hash_ids": [i],
                                        **({"prompt": text} if literal else {})}) + "\n" for i in range(n)))
    return path


def _run(paasbench: Path, env: dict[str, str], target: str, trace: Path, out: Path, load: list[str], what: str,
         timeout_s: float, on_spawn: Callable[["subprocess.Popen[str]"], object] = lambda proc: None) -> Measured:
    cmd = [str(paasbench), "run", "--target", target, "--model", "probe", "--trace", str(trace), "--out", str(out),
           "--no-live", *load]
    try:
        m = Measured(cmd, env, timeout_s, on_spawn=on_spawn)
    except OSError as exc:
        raise RunFailed(f"{what}: cannot start {paasbench}: {exc.strerror or exc}") from None
    if m.returncode != 0 or not (out / "summary.json").is_file():
        tail = "\n".join(m.output.splitlines()[-15:])
        raise RunFailed(f"{what}: paasbench run exited {m.returncode}:\n{tail}")
    return m


def _pin(client: int, target: int | None) -> None:
    """Every client on the first CPU this process may use, every target on the others: the two clients of a pair
    then take turns on one core, with its neighbours and caches, instead of each drawing its own."""
    cpus = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(client, cpus[:1])
        if target is not None:
            os.sched_setaffinity(target, cpus[1:] or cpus)
    except OSError:
        pass   # gone already: the run reports it


class _LoadPhase:
    """The closed-loop run's load phase, bounded by its target: held until ``sync`` says both sides' first requests
    are in, then released; the client frozen once its last response is out, until ``sync`` says both are done;
    the client on the same CPU as the other side's (:func:`_pin`).

    So a side's measured phase overlaps neither its own launch or export nor the other side's: both clients stream
    over the same seconds, and what one does before or after (imports, the summary, parquet) cannot land in the
    other's CPU per token. With a no-op ``sync`` (one side alone) the release and the thaw follow at once."""

    def __init__(self, target: ProbeTarget, requests: int, sync: Callable[[], object]) -> None:
        self.target, self.requests, self.sync = target, requests, sync
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, proc: "subprocess.Popen[str]") -> None:
        _pin(proc.pid, self.target.proc.pid if self.target.proc is not None else None)
        self.target.watch(proc.pid, self.requests, hold=True, freeze=True)
        self.thread = threading.Thread(target=self._run, args=(proc,), daemon=True)
        self.thread.start()

    def _wait_for(self, proc: "subprocess.Popen[str]", key: str) -> bool:
        while proc.returncode is None:     # Measured sets it once the client is reaped
            if self.target.stats()[key]:
                return True
            time.sleep(POLL_S)
        return False

    def _run(self, proc: "subprocess.Popen[str]") -> None:
        try:
            if not self._wait_for(proc, "first_request_monotonic"):
                return                     # the client ended first: _run reports how
            self.sync()
            self.target.go()
            if not self._wait_for(proc, "frozen"):
                return
            self.sync()
            self.target.resume()
        except BaseException as exc:       # noqa: BLE001 - the other side failed (a broken barrier) or the target
            self.error = exc
            proc.kill()                    # works on a stopped process too

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


def _sched_delta(start: list | None, end: list | None) -> dict | None:
    if start is None or end is None:
        return None
    return {"wait_s": end[1] - start[1], "timeslices": end[2] - start[2]}


def measure_round(paasbench: Path, out: Path, *, load: ProbeLoad = ProbeLoad(), env: dict[str, str] | None = None,
                  timeout_s: float = 600.0, what: str = "client probe", sync: Callable[[], object] = lambda: None
                  ) -> dict:
    """One round of one side: the closed- and open-loop runs; their figures written to ``out/summary.json``.
    ``sync`` is called where :func:`measure_pair` lines the two sides up: before each run, and at both ends of
    the closed loop's load phase (:class:`_LoadPhase`)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(env or {})}
    trace = _trace(out / "trace.jsonl", load.requests, load, literal=False)
    with ProbeTarget() as target:
        sync()
        phase = _LoadPhase(target, load.requests, sync)
        try:
            m = _run(paasbench, env, target.url, trace, out / "closed",
                     ["--concurrency", str(load.streams), "--max-requests", str(load.requests)], what, timeout_s,
                     on_spawn=phase.start)
        finally:
            phase.join()
            if phase.error is not None:   # it killed the client: its cause is the error (a broken barrier: the
                raise phase.error         # other side's failure, which measure_pair reports)
        seen = target.stats()
    first, start, last, tokens = (seen["first_request_monotonic"], seen["load_start_monotonic"],
                                  seen["load_end_monotonic"], seen["tokens"])
    c_first, c_start, c_last = seen["client_cpu_at_first_s"], seen["client_cpu_at_start_s"], seen["client_cpu_at_last_s"]
    if None in (first, start, last, c_first, c_start, c_last) or not tokens:
        raise RunFailed(f"{what}: the target saw no complete load phase ({seen})")
    cpu = c_last - c_start
    closed = json.loads((out / "closed" / "summary.json").read_text())
    with ProbeTarget() as target:
        sync()
        # literal prompts: launch was measured above; the open-loop run need not pay the prompt tape again
        _run(paasbench, env, target.url, _trace(out / "open.jsonl", int(load.rate * load.seconds), load, literal=True),
             out / "open",
             ["--mode", "constant", "--rate", f"{load.rate:g}", "--duration", f"{load.seconds:g}",
              "--max-requests", str(int(load.rate * load.seconds))], what, timeout_s)
    lag = json.loads((out / "open" / "summary.json").read_text()).get("schedule_lag_ms") or {}
    errors = closed.get("error_rate")
    summary = {
        "schema": "paasbench.summary.client-probe",
        "client_cpu_us_per_token": cpu / tokens * 1e6,
        "client_peak_rss_mb": m.peak_rss_mb,
        "launch_s": first - m.t_spawn,
        "launch_cpu_s": c_first,
        "schedule_lag_ms": {k: lag.get(k) for k in ("p50", "p90", "p99")},
        "error_rate": errors,
        "meta": {"load": asdict(load), "tokens_streamed": tokens,
                 "load_phase_s": last - start, "load_phase_cpu_s": cpu, "process_cpu_s": m.cpu_total_s,
                 # the client's CPU after the last response was written: reading the responses still unread then
                 # (the phase ended at that write before)
                 "cpu_after_last_write_s": (c_last - seen["client_cpu_at_last_write_s"]
                                            if seen["client_cpu_at_last_write_s"] is not None else None),
                 # the scheduler's account of the phase (/proc/PID/task/*/schedstat): time runnable but waiting for
                 # a CPU, and timeslices run — what differs when two identical clients pay differently per token
                 "sched": _sched_delta(seen["client_sched_at_start"], seen["client_sched_at_last"]),
                 # the closed-loop run's events on the one monotonic clock: spawn, first request read (launch
                 # ends), responses released (load starts), last response written (load ends), reaped
                 "monotonic": {"spawn": m.t_spawn, "first_request": first, "load_start": start, "load_end": last,
                               "exit": m.t_exit},
                 "samples": len(m.samples),
                 # where the peak comes from: the largest sampled RSS before the load phase (interpreter,
                 # imports, tokenizer, prompt tape, the first requests), while streaming, and after (summary, export)
                 "rss_mb": {"launch": rss_between(m.samples, m.t_spawn, start),
                            "load": rss_between(m.samples, start, last),
                            "after_load": rss_between(m.samples, last, float("inf"))}},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@dataclass(frozen=True, slots=True)
class ProbeSide:
    paasbench: Path              # the side's paasbench command
    out: Path                    # where its round goes
    env: dict[str, str]          # extra environment of its runs
    what: str                    # its name in errors


def measure_pair(a: ProbeSide, b: ProbeSide, *, load: ProbeLoad = ProbeLoad(), timeout_s: float = 600.0
                 ) -> tuple[dict, dict]:
    """One round of both sides at once: A's and B's closed-loop runs start together, their load phases run over
    the same seconds, then their open-loop runs.

    Measured one after the other, the same code's CPU per token moved by up to ±20% between the two runs of a
    round on the shared 2-core box: the neighbours' load changes within seconds. Run side by side, both clients
    share whatever the machine does during the round, and only what differs between them is left in the ratio —
    provided each side's measured phase meets only the other's load phase: :class:`_LoadPhase` holds the first
    responses until both sides' first requests are in and freezes a finished client until the other has
    finished too (left free, the side that launched first streamed while the other imported, and exported while
    the other streamed). Each has its own target. A side that fails releases the other at its next step, and
    its error is raised.
    """
    barrier = threading.Barrier(2, timeout=timeout_s)
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def one(side: ProbeSide) -> None:
        try:
            results[side.what] = measure_round(side.paasbench, side.out, load=load, env=side.env,
                                               timeout_s=timeout_s, what=side.what, sync=barrier.wait)
        except threading.BrokenBarrierError:
            pass          # the other side failed: its error is the one to report
        except BaseException as exc:   # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(side,)) for side in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results[a.what], results[b.what]
