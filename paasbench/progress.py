"""Where long work stands: one progress model, shown as rich bars on a terminal and as plain lines elsewhere.

Why one module: ``run``, ``sweep`` (its time budget and each step), ``ab`` rounds and the embedded server's start
all answer "how far, how long so far, how much longer" the same way, from a :class:`Stage`. On a terminal it is a
rich bar redrawn on rich's own refresh thread (the event loop never waits on the terminal). Off a terminal (CI
logs, pipes) or with ``--no-live`` there are no bars and no control characters: a plain line at most every
:data:`EVERY_S` seconds (a CI log of a 30-minute sweep stays readable), and under GitHub Actions
(``GITHUB_ACTIONS=true``) a long part's lines sit inside ``::group::`` / ``::endgroup::`` so the log folds them.
The clock is a parameter so the plain lines are deterministic under test.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

EVERY_S = 10.0            # plain lines: at most one per stage this often
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Stage:
    """One bar: ``done`` of ``total`` ``unit`` (None: not known yet), ``elapsed_s`` since it began."""

    label: str
    done: float
    total: float | None
    unit: str = "requests"          # "s": a time-bound stage (done = elapsed of its span)
    elapsed_s: float = 0.0
    phase: str = ""                 # "warm-up", "escalate", ...: shown beside the label
    note: str = ""                  # what else the line says (the load, step k of at most N)
    rest: str = "ETA"               # what the time left is called ("left" of a budget the work may not use up)

    @property
    def eta_s(self) -> float | None:
        """Seconds left: the span's rest for a time-bound stage, else at the rate so far; None when unknown."""
        if self.total is None:
            return None
        if self.unit == "s":
            return max(0.0, self.total - self.done)
        if self.done <= 0:
            return None
        return self.elapsed_s * max(0.0, self.total - self.done) / self.done


def hms(seconds: float | None) -> str:
    """``1:05``, ``1:02:03``; ``-:--`` when unknown."""
    if seconds is None:
        return "-:--"
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _amount(st: Stage) -> str:
    if st.total is None and (st.unit == "s" or not st.done):
        return ""
    if st.unit == "s":
        return f"{hms(st.done)} of {hms(st.total)}"
    total = "?" if st.total is None else f"{st.total:,.0f}"
    return f"{st.done:,.0f}/{total} {st.unit}"


def line(st: Stage) -> str:
    """The plain-text form: ``run [warm-up]: 120/600 requests (20%), elapsed 0:12, ETA 0:48``."""
    pct = f" ({min(1.0, st.done / st.total):.0%})" if st.total else ""
    head = st.label + (f" [{st.phase}]" if st.phase else "") + (f" {st.note}" if st.note else "")
    if st.total is None and (st.unit == "s" or not st.done):   # no known end: how long so far
        return f"{head}: elapsed {hms(st.elapsed_s)}"
    return f"{head}: {_amount(st)}{pct}, elapsed {hms(st.elapsed_s)}, {st.rest} {hms(st.eta_s)}"


def bars(stages: Sequence[Stage]) -> RenderableType:
    """The terminal form: each stage's note on a line of its own, then one row per stage with its bar; fits
    80 columns."""
    t = Table.grid(padding=(0, 1))
    for _ in range(6):
        t.add_column(no_wrap=True)
    for st in stages:
        t.add_row(f"[bold]{escape(st.label)}[/]", f"[yellow]{st.phase}[/]" if st.phase else "",
                  ProgressBar(total=st.total, completed=min(st.done, st.total or st.done), width=20),
                  _amount(st), f"elapsed {hms(st.elapsed_s)}", f"{st.rest} {hms(st.eta_s)}")
    notes = [Text(f"{st.label}: {st.note}", style="dim", no_wrap=True, overflow="ellipsis")
             for st in stages if st.note]
    return Group(*notes, t) if notes else t


class Lines:
    """Plain progress lines: every stage's line on the first tick, then at most once per ``every_s``."""

    def __init__(self, console: Console, *, every_s: float = EVERY_S, clock: Clock = time.monotonic) -> None:
        self.console, self.every_s, self.clock = console, every_s, clock
        self._next: float | None = None

    def tick(self, stages: Sequence[Stage], *, force: bool = False) -> None:
        now = self.clock()
        if force or self._next is None or now >= self._next:
            for st in stages:
                self.console.print(line(st), markup=False, highlight=False, soft_wrap=True)
            self._next = now + self.every_s


def plain(console: Console, live: bool = True) -> bool:
    """Plain lines instead of bars: off a terminal, or when the user asked for no live view."""
    return not (live and console.is_terminal)


@contextlib.contextmanager
def group(console: Console, title: str) -> Iterator[None]:
    """A foldable ``::group::`` of the lines printed inside, under GitHub Actions and off a terminal only."""
    on = os.environ.get("GITHUB_ACTIONS") == "true" and not console.is_terminal
    if on:
        console.print(f"::group::{title}", markup=False, highlight=False, soft_wrap=True)
    try:
        yield
    finally:
        if on:
            console.print("::endgroup::", markup=False, highlight=False, soft_wrap=True)


class Display:
    """Shows ``stages()`` while a piece of work runs: a rich live view (``above()`` over the bars) on a terminal,
    plain lines from a background thread otherwise, and at the end the last line once more and ``above()``."""

    def __init__(self, stages: Callable[[], Sequence[Stage]], console: Console, *, live: bool = True,
                 above: Callable[[], RenderableType] | None = None, every_s: float = EVERY_S,
                 clock: Clock = time.monotonic, after_s: float = 0.0, transient: bool = False) -> None:
        self.stages, self.console, self.above = stages, console, above
        self.plain = plain(console, live)
        self.lines = Lines(console, every_s=every_s, clock=clock)
        self.clock, self.after_s, self.transient = clock, after_s, transient   # after_s: plain lines only
        self.began = clock()                                                   # for work that long
        self._live: Live | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renderable(self) -> RenderableType:
        return Group(self.above(), bars(self.stages())) if self.above else bars(self.stages())

    def _due(self) -> bool:
        return self.clock() - self.began >= self.after_s

    def __enter__(self) -> "Display":
        self.began = self.clock()
        if self.plain:
            if self._due():
                self.lines.tick(self.stages())  # the first line at once, from the caller (deterministic order)
            self._thread = threading.Thread(target=self._loop, name="progress-lines", daemon=True)
            self._thread.start()
        else:
            self._live = Live(get_renderable=self.renderable, refresh_per_second=4, console=self.console,
                              transient=self.transient)
            self._live.__enter__()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(min(1.0, self.lines.every_s)):
            if self._due():
                self.lines.tick(self.stages())

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self._due():
                self.lines.tick(self.stages(), force=True)
                if self.above:     # the final figures once, as a terminal keeps them (ends with a newline)
                    self.console.print(self.above())


class Counter:
    """One stage counted by the work itself: it calls ``counter(done, total, phase)``, the display reads it."""

    def __init__(self, label: str, unit: str, clock: Clock = time.monotonic) -> None:
        self.label, self.unit, self.clock = label, unit, clock
        self.began = clock()
        self.done: float = 0.0
        self.total: float | None = None
        self.phase = ""

    def __call__(self, done: float, total: float | None = None, phase: str = "") -> None:
        self.done, self.total, self.phase = done, total, phase

    def stages(self) -> list[Stage]:
        return [Stage(self.label, self.done, self.total, self.unit, self.clock() - self.began, self.phase)]


@contextlib.contextmanager
def counting(label: str, console: Console, *, unit: str = "steps", live: bool = True, after_s: float = 3.0,
             every_s: float = EVERY_S, clock: Clock = time.monotonic) -> Iterator[Counter]:
    """A bar (gone when the work ends) or, off a terminal, plain lines once the work has run ``after_s``:
    for commands that are quick on small inputs and long on large ones (``trace gen``, ``calibrate``)."""
    counter = Counter(label, unit, clock)
    with Display(counter.stages, console, live=live, every_s=every_s, clock=clock, after_s=after_s,
                 transient=True):
        yield counter
