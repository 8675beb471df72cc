"""A step that stops as soon as it is decided: certified verdicts looked at while the load runs.

Why: a step far below capacity passes its SLO at high confidence within a few dozen requests, and one far above
it fails within a few; running either to a fixed length spends cluster time on a known answer, and a failing
step spends the most (its queue drains into the client's timeouts). This monitor is the runner's ``stop_when``:
it sees every finished record and, at a few looks, judges the window so far with ``metrics.certify``; a decided
step stops the run (the requests still in flight are cancelled and lie outside the judged window).

What a look judges. The step's window requests in order of intended send; the *prefix* is every one of them sent
before the earliest that has not finished yet, so it is a complete sample (no slow request left out because it
is still running), cut at that request's intended send time ``cut_s``. A look happens when the prefix has grown
to the next of the look counts ``n0, n0·g, n0·g², …, N`` (``N`` the window's planned requests), once when the
prefix first covers the shortest window a fail may be claimed on (below), and once when it first covers
``min_pass_s`` (so a slow step passes there, not at the end of its longest run): ``K`` looks
at most, each at ``(1 - confidence) / K`` (certify.py). At a look the window is ``[warm-up, cut_s)`` with the usual
drain, and:

* **fail** when a certified term fails or saturation fires (saturation.py), on a window of at least twice the
  warm-up (``min(min_pass_s, 2 * warm-up)``). Before ``min_pass_s`` a growth in TTFT or time in system fires only
  once its last third is past the SLO's bound on it, not half of it as at the window's end: near capacity a stable
  queue swings up to half the bound and back, and with 8-14 looks some look's last third lands on such a rise (a
  300 s verification replayed on a 30-minute twin run at 2.95 req/s, p50 TTFT 0.86 s over its second quarter-hour,
  failed at 203 s that way). A queue needs time to show, and saturation is a point test with no
  error budget; and requests sent within a second or two are no independent draws: they share the host's and the
  server's moment, so a stall of the host fails every one of them. The binomial test counts them as independent,
  and without the minimum a verification at 8 req/s on ci-small (a load its search had passed, beside two soaks
  whose workers restarted) was certified failed on 16 requests in its first 1.3 s, and the sweep's answer
  stepped down from 8 to 4 req/s. The counts fall where they fall in time, so without a look of its own at that
  minimum a clear fail whose count look landed just short of it waited for the next count, 1.5 times later: a 64
  req/s step on ci-small, saturated at every look, was looked at 3.99 s into its window (257 requests, short of
  the 4 s minimum) and next at 6.0 s (382), past its configured window;
* **pass** when every term passes, saturation did not fire, and the window is at least ``min_pass_s`` long: the
  configured window (a verification: its whole length). From there a look is as final as a fixed-length step's:
  point terms may fail it, and too few requests to judge saturation is no objection, as of old. Passes claimed
  on a step's first seconds were measured wrong on ci-small (docs/sweep.md, "Certified verdicts"): a failing
  step's queue only grows, a passing step's first seconds carry less than its load.

**Known misses.** The complete prefix of a failing step waits for its slowest request: past capacity the queue
delays every first token, and the cut lags the run by the queue (a white-paper 64K step at 4.24 req/s was decided 113
s after its cut, 310 s for a 150 s step). Where every gate is a certified upper bound on TTFT, a request still
without its first token longer than the largest bound after its intended send is a miss of every term whatever
comes next, since its TTFT runs from that time. The run tells the monitor each first token as it comes
(``first_token``), so the fail side of a look judges the longer prefix in which every request's TTFT is known (the
streaming ones') or such a known miss (at the wait so far, a lower bound past every bound: the binomial counts are
exact); the pass side judges the complete prefix, as before, and either side is one test a look, so each keeps its
error budget. Known misses are in the look's ``late``. An error-rate term (the sweep adds ``error_rate <= 1%``)
counts the requests not finished as no failure there, so a fail on it stays a fail. An E2E, TPOT, ITL or other
point term cannot be known before the answer ends: with one in the SLO, or a run that does not tell first tokens,
the step waits as before.

A step that reaches its end undecided is "undecided": it is not a pass (the search treats it as the failing side
of its bracket) and its counts are kept.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from paasbench.metrics.certify import TermVerdict, binding, certifiable, combine, judge_terms
from paasbench.metrics.records import RequestRecord
from paasbench.metrics.slo import Gate
from paasbench.sweep.saturation import SaturationLimits, detect
from paasbench.trace.model import Trace, TraceRequest

MIN_LOOK_REQUESTS = 15    # the saturation tests judge thirds of at least 5 requests
LOOK_GROWTH = 1.5         # each look at 1.5 times the requests of the one before
LONGEST = 2.0             # a step's window, undecided, runs on to twice the configured duration
LATE_KEY = "ttft_ms"      # the latency a request without its first token has already run up: a known miss past it


@dataclass(frozen=True, slots=True)
class CertifyConfig:
    """How steps are certified (``--confidence``); ``confidence`` 0 would be point verdicts, and is not made."""

    confidence: float = 0.95
    min_requests: int = MIN_LOOK_REQUESTS
    growth: float = LOOK_GROWTH
    longest: float = LONGEST   # an undecided step runs on up to this many times its configured duration

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence must be in [0.5, 1), got {self.confidence}")

    def looks(self, planned: int) -> list[int]:
        """The prefix sizes at which a step of ``planned`` window requests is looked at; the last is ``planned``."""
        out, n = [], float(min(self.min_requests, max(1, planned)))
        while math.ceil(n) < planned:
            out.append(math.ceil(n))
            n *= self.growth
        return out + [planned] if planned else []

    def budget(self, planned: int, *, fail_look: bool = True) -> int:
        """The looks that share the error budget of a step of ``planned`` window requests: its counts, the one at
        the shortest window a fail may be claimed on (``fail_look``), and the one at ``min_pass_s``."""
        return len(self.looks(planned)) + 1 + fail_look


@dataclass(slots=True)
class Look:
    n: int
    cut_s: float
    verdict: str
    saturated: bool
    late: int = 0     # requests past every bound still without a first token, in the prefix the fail side judged

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "cut_s": self.cut_s, "verdict": self.verdict, "saturated": self.saturated,
                "late": self.late}


def _slot(t: float) -> int:
    """A send time as the key its record is found by: whole microseconds (the runner's intended time is the trace's
    ``arrival_ms / 1e3``, computed the same way, so this only absorbs the last bit)."""
    return round(t * 1e6)


@dataclass
class Sequential:
    """``stop_when`` for one step's run (module docstring). ``trace``: the step's scheduled trace;
    ``window``: the step's planned window; ``min_pass_s``: the shortest window a pass may be claimed on.

    ``sends`` says how the run orders its requests, which is what makes a prefix complete: ``"schedule"`` (open
    loop: at the trace's arrival times), ``"index"`` (a closed loop on one load worker: each slot, as it frees, takes
    the next request in index order and sends it at that moment, so index order is send order and the window is
    read from the records' own intended times; the trace's times mean nothing there, and a concurrency step judged by
    them planned 32 window requests where 1,628 came, and never looked often enough to stop), or ``"end"`` (sessions:
    a turn's send time waits on its previous turn, so no prefix is known complete; the step is judged once, at its
    end)."""

    trace: Trace
    window: tuple[float, float]
    drain_s: float
    gates: Sequence[Gate]
    cfg: CertifyConfig
    min_pass_s: float
    saturation_limits: SaturationLimits = field(default_factory=SaturationLimits)
    sends: str = "schedule"
    first_tokens: bool = False             # the run tells it each first token (first_token): run_load does
    decided: str | None = None
    cut_s: float | None = None             # the judged window's end, once decided
    terms: list[TermVerdict] = field(default_factory=list)
    history: list[Look] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.sends not in ("schedule", "index", "end"):
            raise ValueError(f"sends must be schedule, index or end, got {self.sends!r}")
        w0, w1 = self.window
        self._done: dict[int, RequestRecord] = {}
        self._warm: list[RequestRecord] = []                            # the warm-up's, for saturation's lag
        self._pos = 0
        if self.sends == "schedule":
            # the window's send times; which request takes each is the runner's choice (load.schedule: Turns), so
            # a record is placed by its intended time, not by its index
            self._slots = [t for t in sorted(r.arrival_ms / 1e3 for r in self.trace.requests) if w0 <= t < w1]
            self._slot_of = {_slot(t): k for k, t in enumerate(self._slots)}
            self._order = list(range(len(self._slots)))                   # window slots in send order
            self._planned = len(self._slots)
        else:
            # the most the window can hold: the trace is sized for the whole run (a closed loop that outruns it
            # is rerun on a longer one), and its share in the window by time bounds the looks' error budget
            self._order, self._planned = [], math.ceil(len(self.trace) * (w1 - w0) / w1) if w1 > 0 else 0
        self._looks = self.cfg.looks(self._planned) if self.sends != "end" else []
        self._next = 0
        self._window_looked = False   # the one look when the prefix first covers min_pass_s (a pass may start)
        self._fail_looked = not self._fail_look   # the one look when the prefix first covers min_fail_s
        self._now = 0.0               # the run's clock, as far as the events seen tell (the latest of them)
        self._answered: dict[int, float] = {}   # window slots whose first token came: when (first_token)
        self._late_ms = self._late_bound()

    @property
    def planned(self) -> int:
        return self._planned

    @property
    def min_fail_s(self) -> float:
        """The shortest window a fail may be claimed on: twice the warm-up (no longer than ``min_pass_s``)."""
        return min(self.min_pass_s, 2 * self.window[0])

    @property
    def _fail_look(self) -> bool:
        """Whether ``min_fail_s`` has a look of its own: where it is above zero and comes before ``min_pass_s``."""
        return 0 < self.min_fail_s < self.min_pass_s

    @property
    def looks(self) -> int:
        """Looks at most, each spending its share of the error budget: the counts, the one at ``min_fail_s`` where
        it comes before ``min_pass_s``, and the one at ``min_pass_s`` (a step judged once, at its end: that one)."""
        if self.sends == "end":
            return 1
        return self.cfg.budget(self._planned, fail_look=self._fail_look)

    def _late_bound(self) -> float | None:
        """How long (ms) a window request may wait for its first token before it is a known miss of every term: the
        largest TTFT bound, where the run sends on schedule and tells first tokens as they come, and every gate is a
        certified upper bound on TTFT or an upper bound on the error rate (a request's TTFT runs from its intended
        send time, so one without a first token that long is past every bound, whatever comes next; the error rate
        counts a request not yet finished as no failure, which can only make a fail less likely); None otherwise:
        an E2E, TPOT, ITL or other point term cannot be known before the answer ends."""
        if not self.first_tokens or self.sends != "schedule":
            return None
        ttft = [g for g in self.gates if certifiable(g) and g.key == LATE_KEY and g.lower_is_better]
        rest = [g for g in self.gates if g not in ttft]
        if not ttft or not all(g.key == "error_rate" and g.lower_is_better for g in rest):
            return None
        return max(g.threshold for g in ttft)

    def _known(self, n: int) -> tuple[int, float, list[float], int]:
        """From the complete prefix of ``n``: the longer prefix whose every request's TTFT is known or a known miss,
        as (its requests, its cut, the TTFTs (ms) of those not finished: exact where the first token came, else the
        wait so far, and how many of them are such misses). A request is a known miss once the run's clock is past
        its send time by more than :meth:`_late_bound` with no first token."""
        before = self._now - (self._late_ms or 0.0) / 1e3
        if n >= len(self._slots) or self._slots[n] >= before:
            return n, self._cut(n), [], 0   # none can be late yet
        k, ttfts, late = n, [], 0
        while k < len(self._slots):
            t = self._slots[k]
            if k in self._done:
                pass
            elif k in self._answered:
                ttfts.append((self._answered[k] - t) * 1e3)
            elif t < before:
                ttfts.append((self._now - t) * 1e3)
                late += 1
            else:
                break
            k += 1
        return k, self._cut(k), ttfts, late

    def _cut(self, k: int) -> float:
        """Where a prefix of the window's first ``k`` slots ends: the next slot's send time, or the window's end."""
        return self._slots[k] if k < len(self._slots) else self.window[1]

    def first_token(self, send_s: float, at_s: float) -> None:
        """A request of the run (intended at ``send_s``) has its first token, at ``at_s`` (the run's clock): it is no
        miss of a TTFT bound it has not already passed, and the clock is at least ``at_s``."""
        self._now = max(self._now, at_s)
        if self.sends == "schedule":
            k = self._slot_of.get(_slot(send_s))
            if k is not None:
                self._answered[k] = at_s

    def _advance(self, rec: RequestRecord) -> tuple[int, float] | None:
        """Take ``rec``; the complete prefix of the window so far as (its requests, its cut), None while there is
        none to judge."""
        w0 = self.window[0]
        if self.sends == "schedule":
            k = self._slot_of.get(_slot(rec.intended_send_s))
            if k is None:
                self._warm.append(rec)
                return None
            self._done[k] = rec
            while self._pos < len(self._order) and self._pos in self._done:
                self._pos += 1
            if self._pos >= len(self._order):
                return None                  # every window request is in: the run ends anyway, judged in full
            return self._pos, self._slots[self._pos]
        self._done[rec.index] = rec
        if rec.intended_send_s < w0:
            self._warm.append(rec)
        while self._pos in self._done:
            if self._done[self._pos].intended_send_s >= w0:
                self._order.append(self._pos)
            self._pos += 1
        if not self._order:
            return None
        # every request sent before the last of the prefix has finished (index order is send order); it is the cut
        return len(self._order) - 1, self._done[self._order[-1]].intended_send_s

    def __call__(self, rec: RequestRecord) -> str | None:
        if self.sends == "end":
            return None
        self._now = max(self._now, rec.end_s or 0.0)
        prefix = self._advance(rec)
        if prefix is None or self.decided:
            return None
        n, cut = prefix
        # the fail side looks at the longer prefix whose misses are known (module docstring), the pass side at the
        # complete one; each side's test is one per look, so each keeps its share of the error budget
        known, known_cut, ttfts, late = self._known(n) if self._late_ms is not None else (n, cut, [], 0)
        if not late:   # nothing known missing: the step is looked at as before, on its complete prefix
            known, known_cut = n, cut
        at_count = self._next < len(self._looks) and known >= self._looks[self._next]
        span, known_span = cut - self.window[0], known_cut - self.window[0]
        at_window = not self._window_looked and span >= self.min_pass_s
        at_fail = not self._fail_looked and known_span >= self.min_fail_s
        if not (at_count or at_window or at_fail):
            return None
        while self._next < len(self._looks) and self._looks[self._next] <= known:
            self._next += 1
        self._window_looked |= at_window
        self._fail_looked |= at_fail
        final = span >= self.min_pass_s
        verdict, terms, saturated = self.judge([*self._warm, *(self._done[i] for i in self._order[:n])], cut,
                                               final=final)
        if late:
            verdict = "pass" if verdict == "pass" else "undecided"
            failing = self.judge([*self._warm, *(self._done[i] for i in self._order[:known] if i in self._done)],
                                 known_cut, final=final, ttfts=ttfts)
            if failing[0] == "fail":
                verdict, terms, saturated, n, cut, span = *failing, known, known_cut, known_span
        if (verdict == "pass" and span < self.min_pass_s) or (verdict == "fail" and span < self.min_fail_s):
            verdict = "undecided"   # a pass needs min_pass_s; a fail twice the warm-up
        self.history.append(Look(n, cut, verdict, saturated, late))
        if verdict == "undecided":
            return None
        self.decided, self.cut_s, self.terms = verdict, cut, terms
        return (f"certified {verdict} at {self.cfg.confidence:g} after {n} of {self.planned} window requests"
                + (f" ({late} of them past the bound still without a first token)" if late and cut == known_cut else "")
                + (f" ({binding(terms)})" if verdict == "fail" and binding(terms) else "")
                + (" (saturated)" if saturated else ""))

    def judge(self, records: list[RequestRecord], cut_s: float, *, final: bool,
              ttfts: Sequence[float] = ()) -> tuple[str, list[TermVerdict], bool]:
        """The verdict of the window ``[warm-up, cut_s)`` over ``records`` (and the saturation verdict); ``ttfts``: the
        TTFTs (ms) of its requests not finished (:meth:`_known`: a known miss at the wait so far, a lower bound past
        every term's bound), judged with the finished ones."""
        import pandas as pd

        from paasbench.metrics.summary import records_frame, summarize

        window = (self.window[0], cut_s)
        summary = summarize(records, window=window, drain_s=self.drain_s)
        frame = records_frame(r for r in records if r.error_kind is None and window[0] <= r.intended_send_s < cut_s)
        if ttfts:
            frame = pd.concat([frame, pd.DataFrame({LATE_KEY: list(ttfts)})], ignore_index=True)
            # the requests not finished count for the error rate as no failure (yet): a fail on it stays a fail
            requests = dict(summary.get("requests") or {})
            requests["total"] = int(requests.get("total") or 0) + len(ttfts)
            summary = {**summary, "requests": requests,
                       "error_rate": int(requests.get("failed") or 0) / requests["total"]}
        failed = int((summary.get("requests") or {}).get("failed") or 0)
        terms = judge_terms(self.gates, frame, failed, summary, confidence=self.cfg.confidence, looks=self.looks)
        # before min_pass_s only a clear fail may stop the step: a growth counts once it has carried the latency past
        # the SLO's bound itself (slo_share_early), not half of it (a stable queue's swing reaches half now and then)
        limits = self.saturation_limits if final else \
            dataclasses.replace(self.saturation_limits, slo_share=self.saturation_limits.slo_share_early)
        sat = detect(records, window, drain_s=self.drain_s, limits=limits, gates=self.gates)
        verdict = combine(terms, final=final)
        if sat["saturated"]:
            verdict = "fail"
        elif verdict == "pass" and not final and not sat.get("judged", True):
            verdict = "undecided"   # too few requests to see a queue grow: not yet (a full window passes as of old)
        return verdict, terms, bool(sat["saturated"])

    def record(self, terms: list[TermVerdict], verdict: str, cut_s: float, stopped_early: bool) -> dict[str, Any]:
        """The step's ``certified`` block for sweep.json."""
        n = next((t.n for t in terms if t.kind == "certified"), None)
        return {"verdict": verdict, "confidence": self.cfg.confidence, "looks": self.looks,
                "looked": [h.to_dict() for h in self.history], "stopped_early": stopped_early,
                "window_s": cut_s - self.window[0], "planned_requests": self.planned, "judged_requests": n,
                "binding": binding(terms) if verdict != "pass" else None,
                "terms": [t.to_dict() for t in terms]}


def recorded_schedule(records: Sequence[RequestRecord]) -> Trace:
    """The send schedule a run kept, as the trace a :class:`Sequential` is built on: each record's intended send time.
    A run that reached its end recorded every request it scheduled, sent or not; a step stopped once decided recorded
    those it sent before the stop, and the monitor's window is no longer than that."""
    return Trace([TraceRequest(arrival_ms=r.intended_send_s * 1e3, input_length=0, output_length=0, hash_ids=[])
                  for r in records])


def replay(monitor: Sequential, records: Sequence[RequestRecord], *, until_s: float | None = None) -> float | None:
    """Judge a recorded run again: feed ``monitor`` the run's ends, and its first tokens where the monitor is told them
    (``first_tokens``), in the order the run saw them, up to the run's clock ``until_s``; the clock when it decided, None
    if it did not. How a sweep's steps and a long run's first minutes are judged offline (benchmarks/replay_steps.py,
    benchmarks/rejudge.py)."""
    events = [(r.end_s, 1, r) for r in records if r.end_s is not None]
    if monitor.first_tokens:
        events += [(r.first_token_s, 0, r) for r in records if r.first_token_s is not None]
    for at, kind, r in sorted(events, key=lambda e: (e[0], e[1])):
        if until_s is not None and at > until_s:
            break
        if kind == 0:
            monitor.first_token(r.intended_send_s, at)
        elif monitor(r):
            return at
    return None
