"""What else the machine was doing while a run measured: the CPU that processes outside the run took.

Why: the committed-baseline gate compares a sweep with one recorded on another day. On the shared 2-core dev box
the same code, the same machine (fingerprint ×1.12) gave capacity 1.02M → 410K input TPM and TTFT p50 112 →
426 ms at the reference load while other work kept the load average at 4–6; with two busy loops beside the
sweep the reference step saturated (TTFT p50 12.5 s, prefix hit 89% → 44%, errors 0 → 10%). Engine CPU per
decode token fell ×3 meanwhile: decode steps batch what queues, and a step's CPU is split over its batch. No
fingerprint of the machine's *speed* sees any of this: the machine was as fast, but it was not the sweep's.
So every run records how much of the machine other processes took during it, and the gate does not call a
figure the queue sets when the two sides' records differ (paasbench/gate/compare.py, docs/slo.md "Across
machines").

What: ``/proc/stat``'s busy time of the whole machine (user, nice, system, irq, softirq, steal — steal is the
hypervisor giving a virtual CPU's time to another guest) minus the CPU of this process and its descendants
(``/proc/PID/stat`` utime + stime, and cutime + cstime for children already reaped), between two samples, in
CPUs: 0.0 is a machine doing nothing else, 1.0 one CPU busy with other work on average. The embedded server is
a descendant of the sweep, so it counts as the run's own; a server started separately on this machine counts
as other work. None off Linux.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class Sample:
    wall_s: float        # time.monotonic()
    busy_ticks: int      # the machine's busy clock ticks, every CPU
    own_ticks: int       # this process tree's


@dataclass(frozen=True, slots=True)
class HostLoad:
    """Other processes' CPU between two samples."""

    others_cpus: float   # mean CPUs busy with work outside this process tree
    cpus: int            # the machine's CPUs (what /proc/stat counts)
    seconds: float       # how long the two samples were apart

    @property
    def others_share(self) -> float:
        return self.others_cpus / self.cpus

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> "HostLoad | None":
        if not isinstance(raw, dict):
            return None
        try:
            load = cls(float(raw["others_cpus"]), int(raw["cpus"]), float(raw["seconds"]))
        except (KeyError, TypeError, ValueError):
            return None
        return load if load.cpus > 0 and load.seconds > 0 and load.others_cpus >= 0 else None


def sample() -> Sample | None:
    """The machine's and this process tree's CPU now; None where /proc cannot say."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
        busy = sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8))   # user nice system irq softirq steal
        return Sample(time.monotonic(), busy, _tree_ticks(os.getpid()))
    except (OSError, ValueError, IndexError):
        return None


def between(a: Sample | None, b: Sample | None) -> HostLoad | None:
    if a is None or b is None or b.wall_s <= a.wall_s:
        return None
    cpus = _cpus()
    seconds = b.wall_s - a.wall_s
    others = max(0, (b.busy_ticks - a.busy_ticks) - (b.own_ticks - a.own_ticks)) / _TICK / seconds
    return HostLoad(round(min(others, float(cpus)), 3), cpus, round(seconds, 3))


def _cpus() -> int:
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            return max(1, sum(1 for line in fh if line.startswith("cpu") and line[3:4].isdigit()))
    except OSError:
        return os.cpu_count() or 1


def _tree_ticks(root: int) -> int:
    """utime + stime + cutime + cstime of ``root`` and every live descendant."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                raw = fh.read()
        except OSError:              # gone meanwhile
            continue
        rest = raw[raw.rfind(")") + 2:].split()   # after "pid (comm) ": state ppid ...
        pid = int(name)
        children.setdefault(int(rest[1]), []).append(pid)
        ticks[pid] = sum(int(v) for v in rest[11:15])   # utime stime cutime cstime (fields 14-17)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total
