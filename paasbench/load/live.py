"""Progress counters of a running load and their rich live view (stderr, 4 Hz).

The runner only bumps counters; rendering happens on rich's refresh thread from a snapshot, so the
event loop never waits on the terminal.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


@dataclass(slots=True)
class Progress:
    planned: int | None = None
    sent: int = 0
    done: int = 0
    errors: int = 0
    input_tokens: int = 0          # of successful requests
    output_tokens: int = 0
    recent_ttft_ms: deque[float] = field(default_factory=lambda: deque(maxlen=2048))
    started: float = field(default_factory=time.monotonic)

    @property
    def in_flight(self) -> int:
        return self.sent - self.done


def render(p: Progress) -> Table:
    elapsed = max(1e-9, time.monotonic() - p.started)
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
    def __init__(self, progress: Progress, console: Console | None = None) -> None:
        self._console = console or Console(stderr=True)
        self._live = Live(get_renderable=lambda: render(progress), refresh_per_second=4, console=self._console,
                          transient=False)

    def __enter__(self) -> "LiveView":
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._live.__exit__(*exc)
        if not self._console.is_terminal:   # off a terminal rich leaves the final view's last line open:
            self._console.line()            # what is printed next would run on from "output TPM 26,566"
