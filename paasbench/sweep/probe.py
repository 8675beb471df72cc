"""Where a certified search starts on a target nothing models: a short closed-loop throughput probe.

A search from the configured start climbs through loads nobody doubted. On ci-small (cpu engine, idle box) a
certified search passed 0.5, 1, 2, 4 and 8 req/s at a whole step's window each before reaching the loads that
decide anything (capacity 12-14): about 80 of its 265 step-seconds (reports/certified-sweep/). A certified pass
cannot stop early (it needs the step's window: docs/sweep.md), so the climb costs what it always did.

GuideLLM's sweep starts the same way, with a throughput run before the rates below it. One closed loop at a high
concurrency is not enough: 32 closed loops on ci-small (cpu engine, beside two soaks) served 4.3 req/s, half of
what 4 and 8 loops served (8.5 and 8.0) and of what an open loop held (8.5 verified): past what the server
holds, its queue and its recomputed prefixes eat the throughput. So the probe doubles the loops from 1
(``PROBE_FIRST``) until a level serves no ``PROBE_GAIN`` more requests per second than the best before it, each
level a warm-up and a short window (a quarter step, at least twice the warm-up), up to ``max_streams``, and reads
the peak. One level more past the peak was tried (two levels without a gain) and cost more than it found: beside
two soaks it ran 32 and 64 loops past a peak of 15 req/s at 16, 30 s for two collapsed levels. An open loop
at the peak's rate has no slack left for queueing, so the SLO capacity lies near it, mostly below (a closed
loop and an open loop do not queue alike, and a short window is noisy, so it can sit above), and the search starts
one of its estimate steps below the peak (``BucketStarts``, :mod:`paasbench.sweep.estimate`). How far below varies:
beside two soaks a peak of 7.67 req/s (1 loop) sat under the verified capacity (8.12, failed at 8.45) and one of
15.0 (16 loops) twice over it (7.28, failed at 7.60); a first step that passes is cheaper than one that fails,
which waits out its queue. A probe that reads low only makes the search climb further, as from any
start. The probe is not a step: it decides nothing and is never claimed. Its records are kept in
``OUT/probe[-<bucket>]/c<streams>/`` and its figures in sweep.json ``probes`` (a resume reads them instead of
probing again).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

PROBE_STREAMS = 64     # the most closed loops the probe doubles up to, by default
PROBE_FIRST = 1        # closed loops of its first level
PROBE_GAIN = 0.10      # a level that serves less than this much more than the best before it ends the probe
PROBE_INDEX = 9_999    # the probe's hash-id range (source.fresh_prefixes), apart from every step's


@dataclass(frozen=True, slots=True)
class Level:
    streams: int
    served_rps: float            # requests served per second of the window (docs/metrics.md, request_throughput_rps)
    requests: int                # requests sent in the window
    window_s: float
    ttft_p50_ms: float | None
    wall_s: float = 0.0          # what the level took, warm-up, drain and idle wait included: cluster time


@dataclass(frozen=True, slots=True)
class ProbeResult:
    levels: list[Level]
    dir: str                     # the probe's records, relative to the sweep's output

    @property
    def peak(self) -> Level:
        return max(self.levels, key=lambda lv: lv.served_rps)

    @property
    def served_rps(self) -> float:
        return self.peak.served_rps

    @property
    def window_s(self) -> float:
        return sum(lv.window_s for lv in self.levels)

    def to_dict(self) -> dict[str, Any]:
        return {"levels": [dataclasses.asdict(lv) for lv in self.levels], "dir": self.dir,
                "peak_streams": self.peak.streams, "peak_rps": self.peak.served_rps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProbeResult":
        return cls([Level(**lv) for lv in d["levels"]], d["dir"])


def probe_plan(plan: Any) -> Any:
    """One probe level's step plan: ``plan``'s warm-up and seed, closed loops, a window of a quarter step (at least
    twice the warm-up, so the window's requests are not the warm-up's backlog)."""
    window = max(plan.duration_s / 4, 2 * plan.warmup_s, 1.0)
    return dataclasses.replace(plan, axis="concurrency", duration_s=round(window, 1), window_requests=0)


def level_of(entry: dict[str, Any], streams: int) -> Level:
    """A level's figures from its step entry (``step.run_step``)."""
    summary = entry.get("summary") or {}
    return Level(streams=streams, served_rps=float(summary.get("request_throughput_rps") or 0.0),
                 requests=int((summary.get("requests") or {}).get("total", 0)),
                 window_s=float(entry.get("window_s") or 0.0), ttft_p50_ms=(summary.get("ttft_ms") or {}).get("p50"),
                 wall_s=round(float(entry.get("wall_s") or 0.0), 2))


def run_probe(measure: Callable[[int], Level | None], max_streams: int, dirname: str) -> ProbeResult | None:
    """Double the loops from ``PROBE_FIRST`` while each serves ``PROBE_GAIN`` more than the best before it, up to
    ``max_streams``; ``measure(streams)`` runs one level (None: no room left in the budget). A level that served nothing ends it
    (more loops into a target that answers none only wait out more timeouts). None when nothing was served."""
    levels: list[Level] = []
    streams = min(PROBE_FIRST, max_streams)
    while streams <= max_streams:
        level = measure(streams)
        if level is None:
            break
        best = max((lv.served_rps for lv in levels), default=0.0)
        levels.append(level)
        if not level.served_rps > 0 or level.served_rps < best * (1 + PROBE_GAIN):
            break
        streams *= 2
    result = ProbeResult(levels, dirname)
    return result if levels and result.served_rps > 0 else None
