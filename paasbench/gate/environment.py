"""Which figures two results' machines let the gate call: their speed (``fingerprint.py``) and the other work each
ran beside (``host_load.py``). docs/slo.md, "Across machines".

Why: the committed-baseline gate judges one sweep against one recorded on another machine or day. Two things
there move figures that the code does not:

* **speed.** Figures that are CPU time per unit of work scale with the machine's speed as the fingerprint
  measures it (the same code gave 155 → 312 µs per prefill token on a machine about half as fast), so across
  machines they are normalised to the baseline's machine; but the fingerprint itself is only known to a factor
  (``fingerprint.NOISE_FLOOR``: one VM read ×1.68 apart on two days), so a normalised change is called only when
  it is beyond the tolerance for every speed ratio the fingerprint allows. Every other figure the machine sets —
  latencies, throughputs, capacity — does not scale in proportion (queueing, the client's share, the SLO's knee:
  the same run gave capacity ×0.68 and TTFT p50 ×2.6), so across machines none of them is called; they are shown;
* **other work.** On one machine, at one speed, other processes taking its CPUs turn the same load into a queue:
  capacity 1.02M → 410K input TPM and TTFT p50 ×3.8 with other work at load 4–6; with two busy loops beside the
  sweep its reference step saturated, and then even the figures no machine speed moves did (prefix hit 89% →
  44%, errors 0 → 10%), and so did CPU per *decode* token (×0.34: decode steps batch what queues, a step's CPU
  split over its batch). When either side is known to have run on a machine busy with other work (more than
  :data:`QUIET_SHARE` of its CPUs), only the CPU per unit of work that no batch shares is called: engine CPU per prefill token (chunks of one
  prompt), the client's CPU per token and before its first request.

What cannot be called here is shown with its change and a note that says why ("held"); the A/B (both sides on one
machine in the same minutes, ``paasbench ab``) is where such figures are gated.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from paasbench.gate.fingerprint import Machine, Speed, compare_machines
from paasbench.gate.host_load import HostLoad

CPU_PER_WORK = {"cpu_us_per_prefill_token", "cpu_us_per_decode_token", "client_cpu_us_per_token", "launch_cpu_s"}
BATCHED = {"cpu_us_per_decode_token"}   # CPU per work a batch shares: the queue sets it
MACHINE_FREE = {"error_rate", "prefix_hit_ratio", "client_peak_rss_mb"}   # plus modeled_*: the twin's clock
# The most other work, as a share of the machine's CPUs, with which a run counts as run on a quiet machine. Other
# work is bursty, so two sides with the same mean share did not meet the same queue: figures the queue sets are
# judged only where neither side is known to have run beside more than this. A tenth: 0.2 of the dev box's 2 CPUs.
QUIET_SHARE = 0.10


def machine_bound(path: str) -> bool:
    return path not in MACHINE_FREE and not path.startswith("modeled_")


def local(meta: dict[str, Any]) -> bool:
    """The server ran on the machine that measured the fingerprint: the embedded server, or a loopback URL."""
    target = str(meta.get("target") or "")
    if target == "embedded":
        return True
    host = urlsplit(target).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def machine_speed(base_meta: dict[str, Any], cur_meta: dict[str, Any], paired: bool) -> Speed | None:
    """How the current side's machine compares with the baseline's; None when it cannot matter: paired rounds ran
    on one machine by construction, a remote server's speed is not the harness machine's, and results with no
    machine record at all (from before paasbench kept one) are judged as they always were."""
    if paired or not (local(base_meta) and local(cur_meta)):
        return None
    return compare_machines(Machine.from_meta(base_meta), Machine.from_meta(cur_meta))


@dataclass(frozen=True, slots=True)
class OtherWork:
    """The two sides' other work: the median over each side's compared runs of the share of the machine's CPUs
    that processes outside the run took (``meta.host_load``); None for a side with no record."""

    base_share: float | None
    cur_share: float | None
    cpus: int

    def busy(self) -> list[str]:
        """The sides known to have run on a machine busy with other work."""
        return [side for side, x in (("baseline", self.base_share), ("current", self.cur_share))
                if x is not None and x > QUIET_SHARE]

    @property
    def quiet(self) -> bool:
        """No side is known to have run busy (a side with no record, from before paasbench kept one, is judged
        as it was before: by the other side alone)."""
        return not self.busy()

    def text(self) -> str:
        def cpus(x: float | None) -> str:
            return "no record" if x is None else f"{x * self.cpus:.2f} of the machine's {self.cpus} CPUs"

        busy = self.busy()
        return (f"other processes took, beside the compared run: baseline {cpus(self.base_share)}, current "
                f"{cpus(self.cur_share)}" + (f": the {' and the '.join(busy)} ran on a machine busy with other "
                                             f"work (more than {QUIET_SHARE * 100:g}% of its CPUs), so only CPU "
                                             "per unit of work that no batch shares is called" if busy else ""))


def other_work(base_results: Sequence[Any], cur_results: Sequence[Any], base_runs: Sequence[Any],
               cur_runs: Sequence[Any], paired: bool) -> OtherWork | None:
    """Only where the run's own processes are all known to be its own (the embedded server is a child of the
    sweep; a server started apart on this machine would count as other work) and not paired (a round's two
    runs share the minutes). None when neither side has a record (results from before paasbench kept one)."""
    if paired or not all(str(r.meta.get("target")) == "embedded" for r in (*base_results, *cur_results)):
        return None

    def share(runs: Sequence[Any]) -> tuple[float | None, int | None]:
        loads = [HostLoad.from_json(r.meta.get("host_load")) for r in runs if r is not None]
        loads = [x for x in loads if x is not None]
        return (statistics.median(x.others_share for x in loads), loads[0].cpus) if loads else (None, None)

    (b, nb), (c, nc) = share(base_runs), share(cur_runs)
    return None if b is None and c is None else OtherWork(b, c, nc or nb or 1)


def normalise(values: list[dict[str, float | None]], speed: Speed | None) -> None:
    """CPU per unit of work, as if on the baseline's machine (current × speed ratio), where the machines differ."""
    if speed is None or not speed.differs or speed.ratio is None:
        return
    for v in values:
        for p in CPU_PER_WORK:
            if v.get(p) is not None:
                v[p] = v[p] * speed.ratio     # type: ignore[operator]


def tolerance(path: str, tol: float, speed: Speed | None) -> float:
    """A normalised figure is called only beyond the tolerance for every ratio the fingerprint allows."""
    if speed is not None and speed.differs and speed.ratio is not None and path in CPU_PER_WORK:
        return speed.widened(tol)
    return tol


def hold(rows: list[Any], speed: Speed | None, work: OtherWork | None, notes: list[str],
         fmt: Callable[[float | None], str]) -> list[Any]:
    """Rows whose call the environment does not allow become ``held``, with a note naming them and why."""
    calls = ("regression", "improved")
    across = speed is not None and speed.differs
    if across and speed.ratio is not None:
        normed = [c.metric.label for c in rows if c.metric.path in CPU_PER_WORK and c.change is not None]
        if normed:
            notes.append(f"normalised to the baseline's machine (current × {speed.ratio:.2f}) and called only beyond "
                         f"the tolerance for every ratio the fingerprint allows (×/÷{1 + speed.noise:.2f}: "
                         f"(1 + tolerance) × {1 + speed.noise:.2f} − 1): {', '.join(normed)}")
    by_speed = [c for c in rows if across and c.status in calls and machine_bound(c.metric.path)
                and not (speed.ratio is not None and c.metric.path in CPU_PER_WORK)]
    if by_speed:
        notes.append("not called across machines (the machine sets them, not in proportion to its speed): "
                     + ", ".join(f"{c.metric.label} {fmt(c.worse)}" for c in by_speed))
    busy = work is not None and not work.quiet
    # "missing" too: a step the queue overran serves nothing, and then has no hit ratio or latency to show
    by_work = [c for c in rows if busy and c not in by_speed and c.status in (*calls, "missing")
               and not (c.metric.path in CPU_PER_WORK and c.metric.path not in BATCHED)]
    if work is not None:
        notes.append(work.text())
    if by_work:
        notes.append("not called (the other work on the machine sets them through its queue): "
                     + ", ".join(f"{c.metric.label} {fmt(c.worse) if c.status != 'missing' else 'missing'}"
                                 for c in by_work))
    held = by_speed + by_work
    return [dataclasses.replace(c, status="held") if c in held else c for c in rows]
