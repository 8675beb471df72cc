"""A sweep's headline: its best step, every headline card read from that one step, and which warnings concern it.

A sweep answers with one step, the highest load that met the SLO (``sweep.json`` ``best``). Every card of its
headline (the capacity, the load, TTFT, hit, revenue, prompt lengths) must describe that step: a card read from
another one makes the page contradict itself (the prompt-length card once showed step-000's 7 requests beside a
best step of 113). So the cards are built here from a :class:`BestStep` alone, and a figure added to the headline
later (an interval on the capacity, say) is added in :func:`headline_cards`, from the same record.

Warnings split the same way. What concerns the answer stays at the top of the page: every finding of the best
step, and prompt lengths off in any step (the sweep then ran another workload than the one it names). A finding
of another step (a step past capacity whose cache evicted under the overload, a saturated step) is a note
beside that step in the steps table, not a banner over a passing headline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from paasbench.cost.table import CostInputs, CostRow
from paasbench.metrics import slo, verify
from paasbench.report.headline import capacity_caveats
from paasbench.report.load import RunResult, SweepResult
from paasbench.report.tables import big, context_label, load_label, num, pct

ANSWER_KINDS = ("lengths",)   # a finding of these kinds concerns the answer whichever step it is in


@dataclass(frozen=True, slots=True)
class BestStep:
    """The step a sweep's headline describes, with what the headline reads from it."""

    run: RunResult
    position: int                          # in ``SweepResult.steps``
    entry: dict[str, Any]                  # its ``sweep.json`` ``steps[]`` record
    load: dict[str, Any]                   # {kind, value, unit}
    cost: CostRow | None = None            # its capacity's cost row

    @property
    def summary(self) -> dict[str, Any]:
        return self.run.summary


def best_step(sweep: SweepResult, cost_rows: list[CostRow]) -> BestStep | None:
    """The sweep's best step, or None when no step met the SLO. ``cost_rows``: the measured rows (the white
    paper's excluded); the best step's is the one at its capacity (the best bucket's, not the first one's)."""
    run = sweep.best
    if run is None:
        return None
    i = sweep.steps.index(run)
    raw = sweep.data.get("steps") or []
    entry = raw[i] if i < len(raw) and isinstance(raw[i], dict) else {}
    tpm = sweep.max_input_tpm
    cost = next((r for r in cost_rows if tpm is not None and math.isclose(r.max_input_tpm, tpm)), None)
    return BestStep(run, i, entry, sweep.step_loads[i], cost)


def capacity_text(sweep: SweepResult, gates: list[slo.Gate]) -> str:
    """The capacity as the headline and the sentence under the curve print it: marked when it is a lower bound
    (every load tried passed), with :func:`~paasbench.report.headline.capacity_caveats` beside it."""
    notes = (["a lower bound: no load above it failed, the capacity lies higher"] if sweep.capacity_is_floor else [])
    notes += capacity_caveats(sweep, gates)
    return ("≥ " if sweep.capacity_is_floor else "") + big(sweep.max_input_tpm) + (
        f" ({'; '.join(notes)})" if notes else "")


def headline_cards(sweep: SweepResult, best: BestStep | None, gates: list[slo.Gate], inputs: CostInputs,
                   hardware: str | None) -> list[tuple[str, str]]:
    """The headline cards, every one of the best step (``hardware``: the server's, which every step shares)."""
    if best is None:
        cards = [("max input TPM under SLO", "—"), ("best step", "none passed")]
        return cards[:1] + ([("hardware", hardware)] if hardware else []) + cards[1:]
    s = best.summary
    phase = best.entry.get("phase")
    cards = [("max input TPM under SLO", capacity_text(sweep, gates)),
             ("best step", best.run.name + (f" ({phase})" if phase else "")),
             ("SLO-attaining input TPM there", big(s.get("good_input_tpm"))),
             ("at load", load_label(best.load, best.entry.get("offered_rps"))),
             ("p50 TTFT there", f"{num((s.get('ttft_ms') or {}).get('p50'), 0)} ms"),
             ("prefix hit there", pct(s.get("prefix_hit_ratio"))),
             (f"revenue / day ({inputs.currency})", num(best.cost.revenue_per_day, 0) if best.cost else "—"),
             ("prompt lengths there", verify.length_text(s.get("prompt_lengths")))]
    certified = certified_text(sweep, best)
    if certified:
        cards.insert(1, ("certified", certified))
    return cards[:1] + ([("hardware", hardware)] if hardware else []) + cards[1:]


def certified_text(sweep: SweepResult, best: BestStep) -> str | None:
    """The best bucket's certified bracket (sweep.json ``buckets[].certified``); None for point verdicts."""
    row = next((r for r in sweep.data.get("buckets") or [] if r.get("index") == best.entry.get("index")), None)
    cert = (row or {}).get("certified")
    return bracket_text(cert, best.load.get("unit", "")) if cert else None


def capacity_interval(cert: dict[str, Any]) -> tuple[float, float]:
    """A bucket's certified capacity interval (``buckets[].certified``): [its lower end, the certified fail above
    it). The lower end is the pass less the overload its window could hold by chance (``horizon.low``,
    paasbench/sweep/horizon.py) where the sweep measured it, else the pass; 0 without a pass, inf without a fail."""
    lo = (cert.get("horizon") or {}).get("low", (cert.get("pass") or {}).get("load"))
    hi = (cert.get("fail") or {}).get("load")
    return (float(lo) if lo is not None else 0.0, float(hi) if hi is not None else math.inf)


def interval_text(cert: dict[str, Any], unit: str) -> str:
    """``[2.86, 3.168) req/s``, or ``at least 2.86 req/s`` without a certified fail: :func:`capacity_interval`."""
    lo, hi = capacity_interval(cert)
    return f"[{lo:.4g}, {hi:.4g}) {unit}" if math.isfinite(hi) else f"at least {lo:.4g} {unit}"


def priced_at_text(sweep: SweepResult) -> list[str]:
    """Beside the cost table, per bucket of a certified sweep: the pass its row is priced at and the certified
    capacity interval around it, so a price is never read without the interval it stands in."""
    unit = next((l.get("unit") or "" for l in sweep.step_loads), "")
    out = []
    for b in sweep.data.get("buckets") or []:
        cert = b.get("certified")
        if not cert or cert.get("pass") is None:
            continue
        where = f"{context_label(b['context_tokens'])}: " if b.get("context_tokens") else ""
        out.append(f"{where}priced at the certified pass, {cert['pass']['load']:g} {unit}; the capacity lies in "
                   f"{interval_text(cert, unit)} at {cert['confidence']:g}")
    return out


def bracket_text(cert: dict[str, Any], unit: str) -> str:
    """A bucket's certified bracket in words, with the counts behind each side and the verification run: what
    the report's headline and the sweep's last lines print."""
    def side(c: dict[str, Any] | None, word: str) -> str:
        if c is None:
            return f"no certified {word} above it" if word == "fail" else f"no certified {word}"
        return (f"{c['load']:g} {unit} {word}ed ({c.get('requests') or 0} requests in "
                f"{c.get('window_s') or 0:.0f} s" + (f", {c['binding']}" if c.get("binding") else "") + ")")

    text = f"at {cert['confidence']:g}: " + side(cert.get("pass"), "pass") + "; " + side(cert.get("fail"), "fail")
    if cert.get("undecided_loads"):
        text += "; undecided at " + ", ".join(f"{x:g}" for x in cert["undecided_loads"])
    v = cert.get("verified")
    if v is not None:
        text += f"; verification at {v['load']:g} {unit} " + ("passed" if v["passed"] else "failed")
    h = cert.get("horizon")
    if h is not None and cert.get("pass") is not None:
        text += (f"; capacity {interval_text(cert, unit)}: {h['held_s']:.0f} s can hold "
                 f"{h['overload_unseen']:.1%} overload by chance")
    return text


@dataclass(slots=True)
class Warnings:
    """A sweep's findings, split: ``top`` concerns the answer; ``beside[position]`` are another step's."""

    top: list[str] = field(default_factory=list)
    beside: dict[int, list[verify.Finding]] = field(default_factory=dict)


def split_warnings(sweep: SweepResult, best: BestStep | None) -> Warnings:
    out = Warnings()
    for i, run in enumerate(sweep.steps):
        for f in verify.findings(run.summary, f" ({run.name})"):
            if best is None or i == best.position or f.kind in ANSWER_KINDS:   # no step passed: all do
                out.top.append(f.text)
            else:
                out.beside.setdefault(i, []).append(f)
    return out
