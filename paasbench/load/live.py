"""Progress counters of a running load and their view: live counters over a progress bar (stderr, 4 Hz).

The runner only bumps counters; rendering happens on rich's refresh thread (or, off a terminal and with
``--no-live``, as a plain line every 10 s from a thread: :mod:`paasbench.progress`) from a snapshot, so the event
loop never waits on the terminal. With several load workers the driver's :class:`paasbench.load.fleet.Fleet`
sums their counters into the one :class:`Progress`, so they show one bar.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from paasbench.progress import EVERY_S, Clock, Display, Stage


@dataclass(slots=True)
class Progress:
    planned: int | None = None
    sent: int = 0
    done: int = 0
    errors: int = 0
    input_tokens: int = 0          # of successful requests
    output_tokens: int = 0
    recent_ttft_ms: deque[float] = field(default_factory=lambda: deque(maxlen=2048))
    started: float = field(default_factory=time.monotonic)   # the run's t0 once set (before it: starting)
    duration_s: float | None = None  # a time-bound run (--duration): its bar is elapsed over this
    warmup_s: float = 0.0

    @property
    def in_flight(self) -> int:
        return self.sent - self.done


def stage(p: Progress, now: float) -> Stage:
    """The run's bar: elapsed over ``--duration`` when time-bound, else finished over planned requests."""
    elapsed = now - p.started
    phase = ("starting" if elapsed < 0 else "warm-up" if elapsed < p.warmup_s
             else "draining" if p.duration_s is not None and elapsed >= p.duration_s else "")
    elapsed = max(0.0, elapsed)
    if p.duration_s is not None:
        return Stage("run", min(elapsed, p.duration_s), p.duration_s, "s", elapsed, phase)
    return Stage("run", p.done, p.planned, "requests", elapsed, phase)


def render(p: Progress, now: float | None = None) -> Table:
    elapsed = max(1e-9, (time.monotonic() if now is None else now) - p.started)
    try:  # rich renders on its own thread while the event loop appends
        ttft = sorted(p.recent_ttft_ms)
    except RuntimeError:
        ttft = []
    p50 = f"{ttft[len(ttft) // 2]:.1f} ms" if ttft else "-"
    t = Table(title="paasbench run", show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    sent = f"{p.sent}" + (f" / {p.planned}" if p.planned else "")
    for k, v in (("elapsed", f"{elapsed:.1f} s"), ("sent", sent), ("in flight", str(p.in_flight)),
                 ("done", str(p.done)), ("errors", str(p.errors)), ("TTFT p50 (recent)", p50),
                 ("input TPM", f"{p.input_tokens / elapsed * 60:,.0f}"),
                 ("output TPM", f"{p.output_tokens / elapsed * 60:,.0f}")):
        t.add_row(k, v)
    return t


class LiveView:
    """The counters over the bar on a terminal; plain lines (no control characters) when ``live`` is off or
    the console is not a terminal."""

    def __init__(self, progress: Progress, console: Console | None = None, *, live: bool = True,
                 clock: Clock = time.monotonic, every_s: float = EVERY_S) -> None:
        self._display = Display(lambda: [stage(progress, clock())], console or Console(stderr=True), live=live,
                                above=lambda: render(progress, clock()), every_s=every_s, clock=clock)

    def __enter__(self) -> "LiveView":
        self._display.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._display.__exit__(*exc)
