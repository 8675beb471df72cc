"""The performance gate: a regression judged between two *distributions* of results (``paasbench gate``,
:mod:`paasbench.commands.gate`).

Each side is one or more runs or sweeps (directories, files or globs). Per headline metric
(``paasbench.report.headline.CATALOG``) the gate takes one value per result, compares the medians of the two
sides and puts a Student-t confidence interval on the change (``paasbench/gate/stats.py``). Each metric is read in
its own direction (latency up is worse, TPM down is worse); a **regression is called only when the change is beyond
the tolerance in the worse direction with the confidence asked for, held across all the metrics judged together
(Holm)**, so run-to-run noise that the runs themselves show does not fail a build, and neither does one metric in
twenty crossing by chance. A noisy metric with fewer than three results a side is shown but never called. With one result on a side the interval has no width: the gate still compares the two
figures, but says the verdict carries no confidence.

Sweeps are compared like for like: the headline capacity (max input TPM under the SLO), and per-run figures
*at the same load* (a reference load below capacity by default), since latency at a higher load is not a
regression. What the two sides' machines set rather than the code — across machines of different speed, or on a
machine busy with other work — is shown, not called (``paasbench/gate/environment.py``). A change beyond the
tolerance that the results cannot decide either way is undecided, with the results a side that would decide it.
Exit codes: 0 pass, 99 regression or SLO breach, 3 undecided, 2 bad input (``paas_common/errors.py``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import html
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from paas_common.errors import InputError
from paasbench.gate.environment import hold, machine_speed, normalise, other_work
from paasbench.gate.environment import tolerance as environment_tolerance
from paasbench.gate.fingerprint import Speed
from paasbench.gate.stats import (Change, fmt_interval, fmt_pct, holm, median_change, paired_change,
                                  runs_to_decide)
from paasbench.metrics import slo
from paasbench.report.best import capacity_interval
from paasbench.report.headline import BY_PATH, CATALOG, Metric, headline_values, value_at
from paasbench.report.load import Result, RunResult, SweepResult, headline, load_result
from paasbench.report.sections import group_label
from paasbench.report.tables import metric_value


@dataclass(frozen=True, slots=True)
class Comparison:
    metric: Metric
    baseline: float | None      # median over the baseline side's results
    current: float | None       # median over the current side's results
    tolerance: float
    change: Change | None       # relative change in the worse direction (positive = worse), with its interval
    status: str                 # "ok", "regression", "improved", "unclear", "held", "missing", "not in baseline"
    runs_to_decide: int | None = None   # "unclear": results to add a side that would decide it (stats.runs_to_decide)

    @property
    def worse(self) -> float | None:
        return None if self.change is None else self.change.estimate

    @property
    def regressed(self) -> bool:
        return self.status in ("regression", "missing")


@dataclass(slots=True)
class GateResult:
    comparisons: list[Comparison]
    verdict: slo.Verdict | None          # the SLO verdict of the current side (its first failing result, if any)
    notes: list[str]
    problems: list[str]                  # failures that are neither a metric regression nor a gate
    n_base: int = 1
    n_cur: int = 1
    confidence: float = 0.95
    paired: bool = False
    warnings: list[str] = field(default_factory=list)
    speed: Speed | None = None           # the two sides' machines compared (None: not known or not relevant)

    @property
    def regressions(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.regressed]

    @property
    def undecided(self) -> list[Comparison]:
        """Changes beyond the tolerance that the results could not decide either way: more results would."""
        return [c for c in self.comparisons if c.status == "unclear"]

    @property
    def held(self) -> list[Comparison]:
        """Figures the two sides' machines (their speed, their other work) set: shown, not judged."""
        return [c for c in self.comparisons if c.status == "held"]

    @property
    def has_confidence(self) -> bool:
        return self.n_base >= 2 and self.n_cur >= 2

    @property
    def failed(self) -> bool:
        """A regression, a problem or an SLO breach (exit 99)."""
        return bool(self.regressions or self.problems) or (self.verdict is not None and not self.verdict.passed)

    @property
    def passed(self) -> bool:
        """Nothing failed and nothing judged was left undecided (an undecided gate exits 3, not 0)."""
        return not self.failed and not self.undecided

    @property
    def headline(self) -> str:
        return "FAIL" if self.failed else "UNDECIDED" if self.undecided else "PASS"


def parse_tolerance(text: str, *, what: str = "tolerance") -> float:
    """``5%`` or ``0.05`` -> 0.05."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise InputError(f"{what} '{text}' is not a number or a percentage like '5%'") from None
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{what} '{text}' must be >= 0")
    return value


# Figures set by the offered load rather than by the server: comparable only between runs at the same load.
LOAD_DEPENDENT = {"input_tpm", "output_tpm", "request_throughput_rps", "goodput_rps"}


def _step_key(sweep: SweepResult, i: int) -> tuple:
    raw = sweep.data.get("steps") or []
    entry = raw[i] if i < len(raw) and isinstance(raw[i], dict) else {}
    load = sweep.step_loads[i]
    return (load.get("kind"), round(float(load.get("value") or 0.0), 9), group_label(entry))


REFERENCE_FRACTION = 0.6   # "below capacity": at most this fraction of the baseline's best load


def matched_runs(baseline: Result, current: Result, at: str = "reference"
                 ) -> tuple[RunResult | None, RunResult | None, bool, list[str]]:
    """The two runs whose per-run figures are compared, whether they ran at the same load, and notes.

    Two sweeps are compared at one load both ran (escalation loads are start · factor^k, so they share some).
    ``at="reference"`` (default) picks the highest shared load at which the baseline passed that is at most
    ``REFERENCE_FRACTION`` of its best load: below capacity queueing does not amplify run-to-run noise (measured
    on the dev box, same code: p50 TTFT +24% at half the best load, +100% at the best load), and a slower request
    path still shows. Capacity itself is compared through max input TPM. ``at="best"`` picks the baseline's best
    load. Either falls back to the other rule, then to any shared load; with none, the two best steps are
    compared and load-dependent figures (TPM, req/s, goodput) are skipped.
    """
    base, cur, notes = headline(baseline), headline(current), []
    same_load = not (isinstance(baseline, SweepResult) or isinstance(current, SweepResult))
    if isinstance(baseline, SweepResult) and isinstance(current, SweepResult):
        cur_keys = {_step_key(current, j): j for j in range(len(current.steps))}
        shared = [(i, cur_keys[_step_key(baseline, i)]) for i in range(len(baseline.steps))
                  if _step_key(baseline, i) in cur_keys]
        best_i = baseline.steps.index(base) if base is not None else None

        def value(ij: tuple[int, int]) -> float:
            return float(baseline.step_loads[ij[0]].get("value") or 0.0)

        best_pick = next(((i, j) for i, j in shared if i == best_i), None)
        passing = [ij for ij in shared if baseline.step_passed[ij[0]]]
        ref_pick = None
        if best_i is not None:
            limit = REFERENCE_FRACTION * float(baseline.step_loads[best_i].get("value") or 0.0)
            below = [ij for ij in passing if value(ij) <= limit + 1e-12]
            ref_pick = max(below, key=value) if below else None
        pick = (ref_pick or best_pick) if at == "reference" else (best_pick or ref_pick)
        which = "a reference load below capacity" if pick is not None and pick == ref_pick and at == "reference" \
            else "the baseline's best load"
        if pick is None and (passing or shared):
            pick, which = max(passing or shared, key=value), "the highest load both sweeps ran"
        if pick is not None:
            base, cur, same_load = baseline.steps[pick[0]], current.steps[pick[1]], True
            load = baseline.step_loads[pick[0]]
            notes.append(f"per-run figures compared at {which}: {load.get('kind')} = {load.get('value')} "
                         f"({base.name} vs {cur.name}); capacity through max input TPM")
        else:
            notes.append("the sweeps share no load: latencies compared between the two best steps; "
                         "load-dependent figures (TPM, req/s, goodput) skipped")
    if base is None:
        notes.append("the baseline has no passing step: only capacity is compared")
    if cur is None:
        notes.append("the current result has no passing step")
    return base, cur, same_load, notes


def _matched_run(result: Result, key: tuple | None, first: RunResult | None) -> RunResult | None:
    """The run whose per-run figures stand for ``result``: a sweep's step at the matched load (None if it never
    ran it), else the run itself or ``first`` (the matched run of a side's first result)."""
    if isinstance(result, SweepResult) and key is not None:
        return next((s for i, s in enumerate(result.steps) if _step_key(result, i) == key), None)
    if first is not None:
        return first
    return result if isinstance(result, RunResult) else headline(result)


# Per-sweep rather than per-step: engine CPU per prefill token is a cost of the code, not of the load (every step
# of a sweep offers the same mix of prompts, and prefill chunks are one prompt's), so a sweep measures it at each
# passing step and the gate reads the median of those. One step's figure (7-30 requests) moved by a sd of 14-17%
# (log) between eight fresh ci-small sweeps of the same code on the dev box; the median over passing steps was
# 263-347 µs, seven of the eight within 310-347 (docs/slo.md, "Across machines"). CPU per decode token is not a
# cost of the code alone: a step's CPU is split over its batch, so it is read at the matched load.
PER_SWEEP = ("cpu_us_per_prefill_token",)
# The fewest requests (ok, in the passing steps' windows) a single sweep's PER_SWEEP figure is judged on, when a
# side has only that one sweep: one request's prefill CPU per token ran ×4 to ×14 above the same request's in
# another sweep of the same code on the busy dev box (e.g. 598.6 ms against 120.7 ms for one 271-token prefill),
# and a sweep the box held to 0.25-0.5 req/s passed steps of 2-6 requests: 16-19 in all, and its median moved
# +79% and +180% with the code unchanged. Sweeps that passed 42 or more read within 310-347 µs.
MIN_REQUESTS = 30


def _values(result: Result, key: tuple | None, first: RunResult | None) -> dict[str, float | None]:
    """One result's catalogue values: a run's own; a sweep's capacity plus its step at the matched load (and the
    median over its passing steps of what :data:`PER_SWEEP` names)."""
    if not isinstance(result, SweepResult):
        return headline_values(result, first)
    if key is None:
        values = headline_values(result, first)
    else:
        step = _matched_run(result, key, first)
        values = headline_values(result, step)
        if step is None:   # this sweep never ran the matched load: only its capacity counts
            values = {p: (v if p == "max_input_tpm" else None) for p, v in values.items()}
    for path in PER_SWEEP:
        passed = [value_at(s.summary, path) for s, ok in zip(result.steps, result.step_passed) if ok]
        passed = [v for v in passed if v is not None]
        values[path] = statistics.median(passed) if passed else values.get(path)
    return values


def select_metrics(patterns: list[str] | None) -> list[Metric]:
    """``--metric`` names or globs (``modeled_*``); default: every gated catalogue metric."""
    if not patterns:
        return [m for m in CATALOG if m.gated]
    chosen: list[Metric] = []
    for pat in patterns:
        hits = [m for m in CATALOG if fnmatch.fnmatchcase(m.path, pat)]
        if not hits:
            raise InputError(f"--metric '{pat}' matches no metric; known: {', '.join(BY_PATH)}")
        chosen += [m for m in hits if m not in chosen]
    return chosen


def _change(m: Metric, bs: list[float], cs: list[float], confidence: float, paired: bool) -> Change:
    """The change in the metric's worse direction (positive = worse)."""
    ch = (paired_change if paired else median_change)(bs, cs, confidence=confidence)
    return ch.flipped() if m.higher_is_better else ch


def _verdicts(changes: list[Change], tolerances: list[float], confidence: float) -> list[str]:
    """Status per metric. A regression (improvement) is called only where Holm's correction across every metric
    judged rejects "no worse (no better) than the tolerance", one-sided, familywise at ``1 − confidence``;
    a change beyond the tolerance that the family cannot back is "unclear"; a noisy metric with fewer than
    ``stats.MIN_RUNS`` results a side is never called."""
    alpha = 1 - confidence
    idx = [i for i, ch in enumerate(changes) if ch.judgeable]
    worse = holm([changes[i].p_beyond(tolerances[i]) for i in idx], alpha)
    better = holm([changes[i].flipped().p_beyond(tolerances[i]) for i in idx], alpha)
    status = [_point_status(ch, tol) for ch, tol in zip(changes, tolerances)]
    for k, i in enumerate(idx):
        if worse[k]:
            status[i] = "regression"
        elif better[k]:
            status[i] = "improved"
    return status


def _point_status(ch: Change, tol: float) -> str:
    """Before any test: one result on a side compares the two figures as they are (the gate warns that such a
    verdict carries no confidence); otherwise a change beyond the tolerance is "unclear" until the test backs it."""
    if not ch.has_confidence:
        return "regression" if ch.estimate > tol else ("improved" if ch.estimate < -tol else "ok")
    return "unclear" if ch.estimate > tol else "ok"


def _requests_behind(result: Result) -> int | None:
    """Requests behind a sweep's PER_SWEEP figures: the ok requests of its passing steps (None: not a sweep)."""
    if not isinstance(result, SweepResult):
        return None
    return sum(int(((s.summary.get("requests") or {}).get("ok")) or 0)
               for s, ok in zip(result.steps, result.step_passed) if ok)


def _thin(c: Comparison, bases: list[Result], curs: list[Result], notes: list[str]) -> Comparison:
    """A PER_SWEEP figure of a side's only sweep that rests on fewer than :data:`MIN_REQUESTS` requests is not
    called (``held``): its noise is the few requests', not the code's; several sweeps a side give it an interval."""
    if c.metric.path not in PER_SWEEP or c.status not in ("regression", "improved"):
        return c
    thin = [f"{side} {n}" for side, rs in (("baseline", bases), ("current", curs)) if len(rs) == 1
            for n in [_requests_behind(rs[0])] if n is not None and n < MIN_REQUESTS]
    if not thin:
        return c
    notes.append(f"{c.metric.label}: {fmt_pct(c.worse)} not called: a single sweep's figure rests on the ok requests "
                 f"of its passing steps, here {' and '.join(thin)}, fewer than {MIN_REQUESTS} (one request's prefill "
                 "CPU can be several times another run's): give more sweeps a side, or rerun on a quieter machine")
    return dataclasses.replace(c, status="held")


def _floored(c: Comparison, bases: list[Result], curs: list[Result], notes: list[str]) -> Comparison:
    """A sweep's capacity that is a lower bound (``SweepResult.capacity_is_floor``) cannot be called worse
    (current) or beaten (baseline): the true figure may lie anywhere above it. Such a verdict becomes
    ``held`` (no number of sweeps like it would decide it) and the note says why."""
    if c.metric.path != "max_input_tpm" or c.status not in ("regression", "improved"):
        return c
    side, results = ("current", curs) if c.status == "regression" else ("baseline", bases)
    floors = [r.name for r in results if isinstance(r, SweepResult) and r.capacity_is_floor]
    if not floors:
        return c
    notes.append(f"max input TPM: the {side} sweep's capacity is a lower bound ({', '.join(floors)}: every load it "
                 f"tried passed before its time budget or step limit ended it), so the {c.status} of "
                 f"{fmt_pct(c.worse)} cannot be called; rerun it with a larger --time-budget or --max-steps")
    return dataclasses.replace(c, status="held")


def certified_bracket(result: Result, bucket: Any) -> tuple[float, float, str] | None:
    """A certified sweep's capacity interval for one bucket, in its load axis (:func:`capacity_interval`: the
    certified pass less what its window could hold by chance, to the certified fail above it), and the axis's
    unit. None for a point-verdict sweep, a run, or a sweep without that bucket. A verification that held stands
    for the pass (``buckets[].certified``)."""
    if not isinstance(result, SweepResult):
        return None
    row = next((r for r in result.data.get("buckets") or [] if r.get("bucket") == bucket), None)
    cert = (row or {}).get("certified")
    if not isinstance(cert, dict):
        return None
    unit = next((l.get("unit") or l.get("kind") or "" for l in result.step_loads), "")
    return (*capacity_interval(cert), unit)


def _certified(c: Comparison, bases: list[Result], curs: list[Result], notes: list[str]) -> Comparison:
    """Capacity between certified sweeps is judged on their intervals, not their point figures: a regression is a
    current interval wholly below the baseline's (every current sweep's certified fail at or below every baseline
    sweep's certified pass), an improvement the reverse, and overlapping intervals are no call either way, however
    far apart the two best steps' TPM lie. Each side's verdicts already carry their confidence (docs/sweep.md,
    "Certified verdicts"), so Holm's family does not apply. The baseline's best bucket is the one compared."""
    if c.metric.path != "max_input_tpm" or c.baseline is None or c.current is None:
        return c
    bucket = (bases[0].data.get("best") or {}).get("bucket") if isinstance(bases[0], SweepResult) else None
    base = [certified_bracket(r, bucket) for r in bases]
    cur = [certified_bracket(r, bucket) for r in curs]
    if any(b is None for b in base + cur) or len({b[2] for b in base + cur}) != 1:
        return c
    unit = base[0][2]
    b_lo, b_hi = min(b[0] for b in base), max(b[1] for b in base)
    c_lo, c_hi = min(b[0] for b in cur), max(b[1] for b in cur)
    status = "regression" if c_hi <= b_lo else "improved" if c_lo >= b_hi else "ok"

    def span(lo: float, hi: float) -> str:
        return f"[{lo:g}, {hi:g}) {unit}" if math.isfinite(hi) else f"[{lo:g} {unit}, no certified fail above)"

    where = f" ({bucket})" if bucket is not None else ""
    said = {"regression": "wholly below the baseline's: a regression", "improved": "wholly above the baseline's",
            "ok": "overlapping the baseline's: no call at this confidence, whatever the point change"}[status]
    notes.append(f"max input TPM{where} judged on the certified capacity intervals: current {span(c_lo, c_hi)}, "
                 f"baseline {span(b_lo, b_hi)}; {said} ({fmt_pct(c.worse)} between the best steps)")
    return dataclasses.replace(c, status=status, runs_to_decide=None)


def compare(baseline: Result | list[Result], current: Result | list[Result], tolerance: float, *,
            per_metric: dict[str, float] | None = None, metrics: list[str] | None = None,
            gates: list[slo.Gate] | None = None, at: str = "reference", confidence: float = 0.95,
            paired: bool = False) -> GateResult:
    """Judge CURRENT against BASELINE (each one result or several). ``paired``: the i-th results of the two sides
    ran back to back (interleaved A/B rounds) and are compared round by round (``paasbench.gate.stats.paired_change``)."""
    bases = baseline if isinstance(baseline, list) else [baseline]
    curs = current if isinstance(current, list) else [current]
    if not bases or not curs:
        raise InputError("each side of the gate needs at least one result")
    if paired and len(bases) != len(curs):
        raise InputError(f"--paired needs as many baseline as current results ({len(bases)} vs {len(curs)})")
    per_metric = per_metric or {}
    base_run, cur_run, same_load, notes = matched_runs(bases[0], curs[0], at)
    key = None
    if isinstance(bases[0], SweepResult) and base_run is not None and base_run in bases[0].steps:
        key = _step_key(bases[0], bases[0].steps.index(base_run))
    bv = [_values(r, key, base_run if i == 0 else None) for i, r in enumerate(bases)]
    cv = [_values(r, key, cur_run if i == 0 else None) for i, r in enumerate(curs)]
    speed = machine_speed(bases[0].meta, curs[0].meta, paired)
    work = other_work(bases, curs, [_matched_run(r, key, base_run if i == 0 else None) for i, r in enumerate(bases)],
                      [_matched_run(r, key, cur_run if i == 0 else None) for i, r in enumerate(curs)], paired)
    normalise(cv, speed)
    if speed is not None:
        notes.append(speed.reason)
    chosen = select_metrics(metrics)
    if not same_load:
        skipped = [m.path for m in chosen if m.path in LOAD_DEPENDENT]
        chosen = [m for m in chosen if m.path not in LOAD_DEPENDENT]
        if skipped and metrics:
            notes.append(f"not compared (the runs ran at different loads): {', '.join(skipped)}")
    rows, partial, judged = [], [], []
    for m in chosen:
        tol = environment_tolerance(m.path, per_metric.get(m.path, tolerance), speed)
        bs = [v[m.path] for v in bv if v[m.path] is not None]
        cs = [v[m.path] for v in cv if v[m.path] is not None]
        if paired:   # only rounds in which both sides have the figure
            both = [(x[m.path], y[m.path]) for x, y in zip(bv, cv) if x[m.path] is not None and y[m.path] is not None]
            if both:
                bs, cs = [p[0] for p in both], [p[1] for p in both]
        if not bs and not cs:
            continue
        if bs and cs and (len(bs) < len(bases) or len(cs) < len(curs)):
            partial.append(f"{m.path} ({len(bs)}/{len(bases)} vs {len(cs)}/{len(curs)})")
        b = statistics.median(bs) if bs else None
        c = statistics.median(cs) if cs else None
        if not bs:
            rows.append(Comparison(m, None, c, tol, None, "not in baseline"))
        elif not cs:
            rows.append(Comparison(m, b, None, tol, None, "missing"))
        else:
            judged.append((len(rows), m, tol, _change(m, bs, cs, confidence, paired and len(bs) == len(cs)), bs, cs))
            rows.append(Comparison(m, b, c, tol, None, "ok"))
    statuses = _verdicts([j[3] for j in judged], [j[2] for j in judged], confidence)
    family = max(1, sum(j[3].judgeable for j in judged))
    for (k, m, tol, change, bs, cs), status in zip(judged, statuses):
        more = None
        if status == "unclear":   # what would decide it: Holm's strictest step over the family
            more = runs_to_decide(bs, cs, tol, (1 - confidence) / family, paired=paired and len(bs) == len(cs),
                                  worse_is_lower=m.higher_is_better)
        rows[k] = Comparison(m, rows[k].baseline, rows[k].current, tol, change, status, more)
    if partial:
        notes.append("compared over the results that have them: " + ", ".join(partial))
    rows = hold([_thin(_floored(_certified(c, bases, curs, notes), bases, curs, notes), bases, curs, notes)
                 for c in rows], speed, work, notes, fmt_pct)
    # --slo judges each current result's own headline run (a sweep's best step: the load its capacity figure
    # stands for), not the matched reference step, which runs below capacity and would pass gates the best breaches.
    verdict = None
    if gates:
        verdicts = [slo.evaluate(gates, run.summary if run is not None else {}) for run in map(headline, curs)]
        verdict = next((v for v in verdicts if not v.passed), verdicts[0])
    problems = []
    if any(isinstance(r, SweepResult) and r.best is None for r in curs):
        problems.append("no step of the current sweep met its SLO: no capacity to compare")
    elif not any(c.baseline is not None for c in rows):
        problems.append("no metric could be compared: a gate that compares nothing is not a pass")
    result = GateResult(rows, verdict, notes, problems, len(bases), len(curs), confidence, paired=paired, speed=speed)
    if not result.has_confidence:
        one = "one result per side" if len(bases) < 2 and len(curs) < 2 else \
            ("one baseline result" if len(bases) < 2 else "one current result")
        result.warnings.append(
            f"The verdict carries no confidence: {one}. A single run cannot show run-to-run noise (two runs of the "
            "same code on a shared 2-core box differed by +24% in p50 TTFT), so a change beyond the tolerance may be "
            "noise and a real regression may hide in it. Give several runs per side (e.g. --baseline 'runs/a-*' "
            "--current 'runs/b-*'; scripts/perf_gate.sh ab runs them interleaved).")
    return result


# ----------------------------------------------------------------------------------------------- output

STATUS_MARK = {"regression": "❌ regression", "missing": "❌ missing", "improved": "✅ improved",
               "unclear": "⚠️ undecided", "held": "⏸ not called"}


def _undecided_notes(result: GateResult) -> list[str]:
    """Per undecided metric: its change, why it is undecided, and what would decide it."""
    out = []
    for c in result.undecided:
        more = (f"about {c.runs_to_decide} more result{'s' * (c.runs_to_decide != 1)} a side would decide it"
                if c.runs_to_decide is not None else "no number of results up to 1000 a side would decide it")
        interval = f" {fmt_interval(c.change)}" if c.change is not None and c.change.has_confidence else ""
        out.append(f"{c.metric.label}: {fmt_pct(c.worse)}{interval}, beyond the {c.tolerance * 100:g}% tolerance "
                   f"but not decided at {result.confidence * 100:g}% (Holm, {len(result.comparisons)} metrics); "
                   f"{more}, if the change and the run-to-run spread stay as measured")
    return out


def _title(result: GateResult) -> str:
    held = f" ({len(result.held)} of {len(result.comparisons)} metrics not called: see the notes)" if result.held else ""
    return f"paasbench performance gate: {result.headline}{held}"


def _row(c: Comparison) -> list[str]:
    change = "—" if c.change is None else fmt_pct(c.change.estimate)
    interval = "—" if c.change is None or not c.change.has_confidence else fmt_interval(c.change)
    return [c.metric.label, metric_value(c.metric.path, c.baseline), metric_value(c.metric.path, c.current),
            change, interval, f"{c.tolerance * 100:g}%", STATUS_MARK.get(c.status, c.status)]


def _header(result: GateResult) -> list[str]:
    return ["metric", f"baseline (median of {result.n_base})", f"current (median of {result.n_cur})",
            "change (worse +)", f"{result.confidence * 100:g}% interval", "tolerance", "status"]


def _lead(result: GateResult, baseline: str, current: str) -> str:
    how = ("the mean round-by-round change (paired: the i-th results of both sides ran back to back)"
           if result.paired else "the change of the (geometric) mean")
    return (f"Baseline `{baseline}` ({result.n_base} result{'s' * (result.n_base != 1)}) vs current `{current}` "
            f"({result.n_cur} result{'s' * (result.n_cur != 1)}). Per metric: {how} in the worse direction, with a "
            f"{result.confidence * 100:g}% Student-t interval over the results (log scale); a regression is called "
            "only when the change is beyond the tolerance at that confidence with Holm's correction across the "
            f"{len(result.comparisons)} metrics, and never for a noisy metric with fewer than 3 results a side; a "
            "change beyond the tolerance that the results cannot back is undecided (exit 3).")


def markdown(result: GateResult, baseline: str, current: str) -> str:
    lines = [f"## {_title(result)}", "", _lead(result, baseline, current), ""]
    lines += [f"- ⚠️ **{w}**" for w in result.warnings]
    lines += [f"- **{p}**" for p in result.problems]
    lines += [f"- ⚠️ **undecided: {u}**" for u in _undecided_notes(result)]
    lines += [f"- {n}" for n in result.notes]
    head_row = _header(result)
    lines += ["", "| " + " | ".join(head_row) + " |", "|---|" + "---:|" * (len(head_row) - 2) + "---|"]
    lines += ["| " + " | ".join(_row(c)) + " |" for c in result.comparisons]
    if result.verdict is not None:
        lines += ["", f"### SLO: {'PASS' if result.verdict.passed else 'FAIL'}", "",
                  "| gate | measured | margin | result |", "|---|---:|---:|---|"]
        for r in result.verdict.results:
            lines.append(f"| `{r.gate.label}` | {slo.format_value(r.gate.key, r.measured)} | "
                         f"{slo.format_value(r.gate.key, r.margin) if r.margin is not None else '—'} | "
                         f"{'✅ pass' if r.passed else '❌ ' + r.reason} |")
    return "\n".join(lines) + "\n"


def html_page(result: GateResult, baseline: str, current: str) -> str:
    """A self-contained page (inline CSS, no script) with the same table as the Markdown."""
    e = html.escape
    cls = {"regression": "bad", "missing": "bad", "improved": "good", "unclear": "warn", "held": "held"}
    rows = "".join(
        f"<tr class='{cls.get(c.status, '')}'>" + "".join(f"<td>{e(x)}</td>" for x in _row(c)) + "</tr>"
        for c in result.comparisons)
    items = "".join(f"<li class='warn'><b>{e(w)}</b></li>" for w in result.warnings)
    items += "".join(f"<li class='bad'><b>{e(p)}</b></li>" for p in result.problems)
    items += "".join(f"<li class='warn'><b>undecided: {e(u)}</b></li>" for u in _undecided_notes(result))
    items += "".join(f"<li>{e(n)}</li>" for n in result.notes)
    slo_rows = ""
    if result.verdict is not None:
        slo_rows = "<h2>SLO: " + ("PASS" if result.verdict.passed else "FAIL") + "</h2><table><tr><th>gate</th>" \
            "<th>measured</th><th>result</th></tr>" + "".join(
                f"<tr class='{'' if r.passed else 'bad'}'><td>{e(r.gate.label)}</td>"
                f"<td>{e(slo.format_value(r.gate.key, r.measured))}</td>"
                f"<td>{'pass' if r.passed else e(r.reason)}</td></tr>" for r in result.verdict.results) + "</table>"
    head = "".join(f"<th>{e(h)}</th>" for h in _header(result))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>paasbench gate</title><style>"
            "body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child{text-align:left}"
            ".bad{background:#fde2e2}.good{background:#e2f6e2}.warn{background:#fff4d6}.held{color:#666}</style></head><body>"
            f"<h1>{e(_title(result))}</h1>"
            f"<p>{e(_lead(result, baseline, current))}</p><ul>{items}</ul>"
            f"<table><tr>{head}</tr>{rows}</table>{slo_rows}</body></html>\n")


def annotations(result: GateResult) -> list[str]:
    """GitHub workflow commands (``::error``) for each regression and failed gate, ``::warning`` for no confidence."""
    out = []
    for c in result.regressions:
        if c.status == "missing":
            msg = (f"{c.metric.label}: missing from the current result "
                   f"(baseline {metric_value(c.metric.path, c.baseline)})")
        else:
            interval = f", interval {fmt_interval(c.change)}" if c.change and c.change.has_confidence else ""
            msg = (f"{c.metric.label} worse by {_pct(c.worse)}{interval} ({metric_value(c.metric.path, c.baseline)} "
                   f"-> {metric_value(c.metric.path, c.current)}), tolerance {c.tolerance * 100:g}%")
        out.append(f"::error title=paasbench regression::{_escape(msg)}")
    for p in result.problems:
        out.append(f"::error title=paasbench gate::{_escape(p)}")
    for u in _undecided_notes(result):
        out.append(f"::error title=paasbench gate undecided::{_escape(u)}")
    for r in (result.verdict.failures if result.verdict else []):
        msg = f"SLO {r.gate.label}: measured {slo.format_value(r.gate.key, r.measured)} ({r.reason})"
        out.append(f"::error title=paasbench SLO breach::{_escape(msg)}")
    for w in result.warnings:
        out.append(f"::warning title=paasbench gate::{_escape(w)}")
    return out


def _pct(v: float | None) -> str:
    return "—" if v is None else ("∞" if math.isinf(v) else f"{v * 100:.1f}%")


def _escape(msg: str) -> str:
    return msg.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def metric_tolerances(specs: tuple[str, ...]) -> dict[str, float]:
    """``METRIC=TOL`` or ``GLOB=TOL`` (``modeled_*=5%``); later specs win."""
    out = {}
    for spec in specs:
        name, sep, tol = spec.partition("=")
        name = name.strip()
        hits = [p for p in BY_PATH if fnmatch.fnmatchcase(p, name)] if sep else []
        if not hits:
            raise InputError(f"--metric-tolerance '{spec}': expected METRIC=TOL with METRIC one of "
                             f"{', '.join(BY_PATH)} (or a glob such as 'modeled_*')")
        value = parse_tolerance(tol, what=f"tolerance for {name}")
        out.update({p: value for p in hits})
    return out


def expand(patterns: tuple[str, ...], what: str) -> list[Path]:
    """Paths and globs -> result paths, in order; a pattern that matches nothing is an input error."""
    paths: list[Path] = []
    for pat in patterns:
        if glob.has_magic(pat):
            hits = sorted(glob.glob(pat))
            if not hits:
                raise InputError(f"no result matches '{pat}'", field=f"--{what}")
            paths += [Path(h) for h in hits]
        elif not os.path.exists(pat):
            raise InputError("no such result file or directory", file=pat, field=f"--{what}")
        else:
            paths.append(Path(pat))
    return paths


def load_side(patterns: tuple[str, ...], what: str) -> list[Result]:
    paths = expand(patterns, what)
    return [load_result(p, what if i == 0 else f"{what}-{i + 1}") for i, p in enumerate(paths)]
