"""What a running sweep shows between its step lines: an outer bar over the time budget, the step's own inside it.

The driver (:mod:`paasbench.sweep.driver`) calls this at fixed points only — :meth:`SweepView.step` around a
step (its index, phase, load, span) and :meth:`SweepView.waiting` around a wait with no known end (the embedded
server's start) — so the search logic never touches the terminal. Each finished step's line is printed by the
driver on the same console, above the bars on a terminal (rich's live view keeps them there). Off a terminal,
or with ``--no-live``, the same stages come out as plain lines (:mod:`paasbench.progress`), each step's inside a
``::group::`` under GitHub Actions with the step's result line after it, outside the fold.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator

from rich.console import Console

from paasbench.progress import EVERY_S, Clock, Display, Stage, group


@dataclass(slots=True)
class _Current:
    label: str
    phase: str
    note: str
    began: float
    span_s: float | None      # warm-up + duration of a step; None for a wait with no known end
    warmup_s: float = 0.0


class SweepView:
    """The sweep's progress: ``budget_s`` from entering, at most ``most_steps`` steps."""

    def __init__(self, console: Console, budget_s: float, most_steps: int, *, live: bool = True,
                 clock: Clock = time.monotonic, every_s: float = EVERY_S) -> None:
        self.console, self.budget_s, self.most_steps, self.clock = console, budget_s, most_steps, clock
        self.started = clock()
        self.steps = 0                      # steps started by this process (recorded ones are not rerun)
        self.current: _Current | None = None
        self.display = Display(self.stages, console, live=live, every_s=every_s, clock=clock)

    def __enter__(self) -> "SweepView":
        self.started = self.clock()
        self.display.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current = None
        self.display.__exit__(*exc)

    def stages(self) -> list[Stage]:
        now = self.clock()
        elapsed = now - self.started
        cur = self.current
        note = " · ".join(([f"step {self.steps} of at most {self.most_steps}"] if self.steps else [])
                          + ([cur.note] if cur and cur.note else []))
        out = [Stage("sweep", min(elapsed, self.budget_s), self.budget_s, "s", elapsed,
                     cur.phase if cur else "", note, rest="left")]
        if cur is not None:
            t = now - cur.began
            if cur.span_s is None:
                out.append(Stage(cur.label, t, None, "s", t))
            else:
                phase = "warm-up" if t < cur.warmup_s else "draining" if t >= cur.span_s else "measuring"
                out.append(Stage(cur.label, min(t, cur.span_s), cur.span_s, "s", t, phase))
        return out

    @contextlib.contextmanager
    def step(self, index: int, phase: str, load: str, *, warmup_s: float, duration_s: float) -> Iterator[None]:
        """Around one step: ``phase`` (escalate/descend/bisect/param) at ``load`` (e.g. ``rate=0.4 req/s``)."""
        self.steps += 1
        with group(self.console, f"step {index:03d} {phase} {load}"), \
                self._showing(_Current(f"step {index:03d}", phase, load, self.clock(), warmup_s + duration_s,
                                       warmup_s)):
            yield

    def waiting(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Around a wait of unknown length (``starting the embedded server``): elapsed shown, no end."""
        before = self.current
        return self._showing(_Current(what, before.phase if before else "", before.note if before else "",
                                      self.clock(), None))

    @contextlib.contextmanager
    def _showing(self, current: _Current) -> Iterator[None]:
        """``current`` is the inner bar while the block runs (a plain line at once off a terminal)."""
        before, self.current = self.current, current
        if self.display.plain:
            self.display.lines.tick(self.stages(), force=True)
        try:
            yield
        finally:
            self.current = before


class QuietView(SweepView):
    """No progress shown (a sweep driven from tests or code): the same calls, nothing printed."""

    def __init__(self) -> None:
        super().__init__(Console(quiet=True), 1.0, 1)

    def __enter__(self) -> "QuietView":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass
