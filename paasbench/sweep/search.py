"""Where to put the next step: escalate geometrically, stop at the first failure, then bisect.

The search is pure: it proposes loads and is told outcomes, it never runs anything. That keeps it
testable on a synthetic system and makes ``--resume`` trivial -- replaying recorded outcomes through
the same search lands it exactly where the interrupted sweep stopped.

A step *passes* when the SLO verdict passed and the step was not saturated: a load at which queues
still grow is not sustainable, however good its first minutes looked. Escalation stops at the first
step that does not pass, or when throughput stops rising (a plateau: more offered load, no more
served), or after ``max_steps``. Bisection then narrows the bracket [last pass, first fail]; the
result is the passing step with the highest *measured* input TPM (not merely the highest offered load).

Several searches (one per context bucket) share one time budget, so :func:`run_searches` runs them in two
passes: first each bucket is *bracketed* in turn (escalate / descend until a passing load has a failing one
above it), each starting where ``start_for`` says from the buckets before it; then the bisections take one
step per bucket in turn. A budget that runs out then leaves every bucket bracketed at a coarser precision,
rather than the first bucket exact and the last unmeasured.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Sequence, TypeVar


@dataclass(frozen=True, slots=True)
class SearchConfig:
    start: float                  # first load (req/s, concurrency or sessions/s, by axis)
    factor: float = 2.0           # escalation multiplier
    max_steps: int = 6            # escalation steps at most
    bisect_steps: int = 3         # bisection steps at most
    descend_steps: int = 2        # if the first step fails: try start/factor^k this many times
    integer: bool = False         # concurrency: loads are whole numbers
    rel_tol: float = 0.03         # stop bisecting once (hi - lo) / lo is below this
    estimate_factor: float = 2 ** 0.5   # escalation/descent multiplier of a search that starts from an
                                  # estimate (run_searches): finer, so a first failing step overshoots the
                                  # capacity by less (past capacity a step runs long); max_steps and
                                  # descend_steps grow so that the reach in load stays that of ``factor``
    plateau_gain: float = 0.05    # escalation stops when input TPM grew less than this fraction; 0: off.
                                  # For closed loops (concurrency) only: an open loop's served TPM tracks
                                  # its offered load, Poisson noise included, until saturation says no.
    plateau_steps: int = 2        # ... over the best so far, this many passing steps in a row: a server's
                                  # throughput can dip and rise again (the twin, 2 colocated workers: 17.2
                                  # req/s at 2 streams, 14.8 at 4, 40.7 at 22 within the SLO)

    def from_estimate(self, start: float) -> "SearchConfig":
        """This search started at an estimate instead of ``start``: steps of ``estimate_factor``, as far."""
        f = self.factor if self.integer else min(self.factor, self.estimate_factor)
        steps = math.log(self.factor) / math.log(f)
        return dataclasses.replace(self, start=start, factor=f, max_steps=math.ceil(self.max_steps * steps - 1e-9),
                                   descend_steps=math.ceil(self.descend_steps * steps - 1e-9))

    def __post_init__(self) -> None:
        if not self.start > 0:
            raise ValueError(f"start must be > 0, got {self.start}")
        if not self.factor > 1 or not self.estimate_factor > 1:
            raise ValueError(f"factor must be > 1, got {self.factor}")
        if self.max_steps < 1 or self.bisect_steps < 0 or self.descend_steps < 0:
            raise ValueError("max_steps must be >= 1; bisect_steps and descend_steps >= 0")


@dataclass(frozen=True, slots=True)
class Outcome:
    slo_passed: bool              # every SLO gate passed
    input_tpm: float              # measured (achieved) input tokens per minute in the window
    saturated: bool = False       # a saturation signal fired (saturation.py)
    exhausted: bool = False       # the trace ran out: the load was not fully offered
    certified: str | None = None  # "pass" | "fail" | "undecided" (metrics/certify.py); None: a point verdict

    @property
    def passed(self) -> bool:
        """A load is claimed only when the SLO passed (certified, where the step was), queues did not grow, and all
        of it was offered. An undecided step is not a pass: the search takes it as the failing side."""
        slo = self.slo_passed if self.certified is None else self.certified == "pass"
        return slo and not self.saturated and not self.exhausted


@dataclass(slots=True)
class Trial:
    phase: str                    # "escalate" | "descend" | "bisect"
    load: float
    outcome: Outcome


@dataclass(slots=True)
class SearchResult:
    trials: list[Trial] = field(default_factory=list)
    stop_reason: str = ""         # why escalation ended; "time_budget" if the budget cut the search
    bracket: tuple[float, float] | None = None   # [last pass, first fail], once both are known

    @property
    def best(self) -> Trial | None:
        passing = [t for t in self.trials if t.outcome.passed]
        return max(passing, key=lambda t: (t.outcome.input_tpm, t.load)) if passing else None

    @property
    def anchor(self) -> float | None:
        """The load the next search scales its start from: the best passing load, else the lowest load tried
        (none passed); None before any step. The low end of what is known, on purpose: past capacity a step
        runs long (its queue drains into client timeouts), so a start just under the capacity is cheaper
        than one just over it."""
        if self.best is not None:
            return self.best.load
        return min((t.load for t in self.trials), default=None)


class BudgetExhausted(Exception):
    """Raised by a ``measure`` callable when the next step would not fit the time budget."""


class LoadSearch:
    """Propose a load with :meth:`next`, report it with :meth:`observe`; ``None`` from next means done."""

    def __init__(self, cfg: SearchConfig) -> None:
        self.cfg = cfg
        self.result = SearchResult()
        self._phase = "escalate"
        self._k = 0                          # steps taken in the current phase
        self._lo: float | None = None        # highest passing load
        self._hi: float | None = None        # lowest failing load
        self._flat = 0                       # escalation passes in a row that gained nothing over the best
        self._lift = 0                       # escalation exponents skipped: they rounded to a load already passed

    @property
    def bracketing(self) -> bool:
        """Still looking for a bracket (escalating or descending)."""
        return self._phase in ("escalate", "descend")

    @property
    def done(self) -> bool:
        return self._phase == "done"

    def _round(self, x: float) -> float:
        return float(max(1, round(x))) if self.cfg.integer else float(f"{x:.6g}")   # 0.9, not 0.8999999999999999

    def next(self) -> tuple[str, float] | None:
        c = self.cfg
        if self._phase == "escalate":
            # whole loads: a start and its first multiples can round to the same load (0.5 and 1 both to 1 stream);
            # each escalation step goes above the last, or a step of max_steps is spent on a load already measured
            load = self._round(c.start * c.factor ** (self._k + self._lift))
            while self._lo is not None and load <= self._lo:
                self._lift += 1
                load = self._round(c.start * c.factor ** (self._k + self._lift))
            return ("escalate", load)
        if self._phase == "descend":
            load = self._round(c.start / c.factor ** self._k)
            tried = {t.load for t in self.result.trials}
            if self._k > c.descend_steps or load in tried:   # cannot go lower (integer floor)
                return self._finish()
            return ("descend", load)
        if self._phase == "bisect":
            lo, hi = self._lo, self._hi
            assert lo is not None and hi is not None
            if self._k >= c.bisect_steps or (hi - lo) <= c.rel_tol * lo:
                return self._finish()
            mid = self._round((lo + hi) / 2)
            if mid <= lo or mid >= hi:                        # integer bracket closed
                return self._finish()
            return ("bisect", mid)
        return None

    def _finish(self) -> None:
        if self._lo is not None and self._hi is not None:
            self.result.bracket = (self._lo, self._hi)
        self._phase = "done"
        return None

    def observe(self, phase: str, load: float, outcome: Outcome) -> None:
        self._observe(phase, load, outcome)
        if self._lo is not None and self._hi is not None:
            self.result.bracket = (self._lo, self._hi)

    def _observe(self, phase: str, load: float, outcome: Outcome) -> None:
        c = self.cfg
        prev_pass = self.result.best
        self.result.trials.append(Trial(phase, load, outcome))
        self._k += 1
        if phase == "escalate":
            if outcome.passed:
                self._lo = load
                flat = (c.plateau_gain > 0 and prev_pass is not None
                        and outcome.input_tpm < prev_pass.outcome.input_tpm * (1 + c.plateau_gain))
                self._flat = self._flat + 1 if flat else 0
                if self._flat >= c.plateau_steps:
                    self.result.stop_reason = "plateau"      # more offered, no more served
                    self._finish()
                elif self._k >= c.max_steps:
                    self.result.stop_reason = "max_steps"
                    self._finish()
                return
            self._hi = load
            self.result.stop_reason = "saturated" if outcome.saturated else "slo_fail"
            if self._lo is None:                           # the very first step failed
                self._phase, self._k = "descend", 1
            else:
                self._phase, self._k = "bisect", 0
        elif phase == "descend":
            if outcome.passed:
                self._lo = load
                self._phase, self._k = "bisect", 0
            else:
                self._hi = load
        elif phase == "bisect":
            if outcome.passed:
                self._lo = load
            else:
                self._hi = load


G = TypeVar("G", bound=Hashable)


def run_search(cfg: SearchConfig, measure: Callable[[str, float], Outcome]) -> SearchResult:
    """One search driven with ``measure(phase, load)`` (:func:`run_searches` with one group). Bounded: at most
    ``max_steps + descend_steps + bisect_steps`` measurements. A :class:`BudgetExhausted` from ``measure``
    ends the search cleanly with what was measured so far."""
    return run_searches([None], cfg, lambda g, earlier: None, lambda g, phase, load: measure(phase, load))[None]


def run_searches(groups: Sequence[G], cfg: SearchConfig,
                 start_for: Callable[[G, Mapping[G, SearchResult]], float | None],
                 measure: Callable[[G, str, float], Outcome]) -> dict[G, SearchResult]:
    """A search per group, in two passes (module docstring): bracket each group in order, starting at
    ``start_for(group, results of the groups before it)`` -- an estimate, searched in steps of
    ``estimate_factor`` (:meth:`SearchConfig.from_estimate`) -- or, where it returns None, at ``cfg.start``; then bisect them one step each in turn.
    ``measure(group, phase, load)``; a :class:`BudgetExhausted` from it ends every unfinished search with
    stop reason ``time_budget`` (groups not reached are absent from the result)."""
    searches: dict[G, LoadSearch] = {}

    def step(group: G, search: LoadSearch) -> bool:
        proposal = search.next()
        if proposal is None:
            return False
        search.observe(*proposal, measure(group, *proposal))
        return True

    try:
        for group in groups:
            start = start_for(group, {g: s.result for g, s in searches.items()})
            search = searches[group] = LoadSearch(cfg if start is None else cfg.from_estimate(start))
            while search.bracketing and step(group, search):
                pass
        while any([step(g, s) for g, s in searches.items() if not s.done]):   # a list: every group steps
            pass
    except BudgetExhausted:
        for search in searches.values():
            if not search.done:
                search.result.stop_reason = "time_budget"
                search._finish()
    return {g: s.result for g, s in searches.items()}
