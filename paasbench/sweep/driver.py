"""The sweep's outer loop: groups (context bucket x server-parameter value), a load search in each,
the embedded server's lifetime, the time budget, and the results that end up in sweep.json.

Everything the loop learns goes to :class:`SweepState` the moment a step finishes; the summary parts
(``best``, ``buckets``, ``server_param``, ``cost``) are recomputed from the recorded steps, so a resumed
sweep reports exactly what a straight one would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape

from paas_common.errors import InputError
from paasbench.client import ClientConfig
from paasbench.client.models import http_get
from paasbench.cost.table import CostInputs, cost_row
from paasbench.metrics.slo import Gate
from paasbench.metrics.verify import TOKENIZER_FIX, warnings as verify_warnings
from paasbench.sweep.embedded import embedded_server, prime_concurrency, section_hardware
from paasbench.sweep.estimate import ESTIMATE_REQUESTS, BucketStarts
from paasbench.sweep.horizon import answer_horizon
from paasbench.sweep.probe import PROBE_INDEX, Level, ProbeResult, level_of, probe_plan, run_probe
from paasbench.sweep.saturation import step_limits
from paasbench.sweep.sequential import CertifyConfig
from paasbench.sweep.search import BudgetExhausted, Outcome, SearchConfig, SearchResult, run_searches
from paasbench.sweep.source import Source, fresh_prefixes
from paasbench.sweep.state import SweepState, step_key
from paasbench.sweep.step import (AXIS_UNITS, PRIME_CONCURRENCY, StepPlan, mean_e2e_s, response_near, run_step,
                                  step_timeouts)
from paasbench.sweep.view import QuietView, SweepView

STEP_OVERHEAD = 0.25    # first guess at a step's time beyond warm-up + window, as a share of them (drain, summary)


@dataclass
class SweepConfig:
    out: Path
    target: str | None                   # None: embedded reference server
    search: SearchConfig
    plan: StepPlan
    client: ClientConfig                 # its target is filled in per step
    time_budget_s: float
    server_section: dict[str, Any] = field(default_factory=dict)
    server_param: str | None = None      # e.g. "remote-prefill-threshold"
    param_values: list[str] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)
    cost_inputs: CostInputs = field(default_factory=CostInputs)
    allow_length_mismatch: bool = False  # go on when the server counts prompts >2% off (verify.py)
    start_given: bool = False            # --start on the command line: the first bucket starts there
    certify: CertifyConfig | None = None  # certified step verdicts (--confidence); None: point verdicts
    verify_for: float = 5.0              # the certified max runs once more, this many times a step's window, at most
    probe_streams: int = 0               # closed loops of the throughput probe that places the first bucket's
                                         # start (probe.py); 0: no probe


def target_hardware(client: ClientConfig) -> dict[str, Any] | None:
    """``hardware`` from the target's ``/health`` (the reference server's: docs/reference_server.md); None when
    the server does not say (another engine, no access, not answering)."""
    body = http_get(client.server_url + "/health", client.target_headers, timeout_s=5)
    try:
        hw = json.loads(body).get("hardware") if body else None
    except (ValueError, AttributeError):
        return None
    return hw if isinstance(hw, dict) and isinstance(hw.get("machines"), int) else None


class _Targets:
    """The target URL for a step; starts (and restarts, when the server overrides change) the embedded
    server lazily, so a resumed sweep whose steps are all done never starts one."""

    def __init__(self, fixed: str | None, section: dict[str, Any], console: Console, view: SweepView,
                 client: ClientConfig | None = None) -> None:
        self.fixed, self.section, self.console, self.client = fixed, section, console, client
        self.view = view
        self._stack = contextlib.ExitStack()
        self._overrides: dict[str, Any] | None = None
        self._url: str | None = None
        self._fixed_hw: dict[str, Any] | None = None   # a --target's /health hardware: asked once (_fixed_asked)
        self._fixed_asked = False

    def url(self, overrides: dict[str, Any]) -> str:
        if self.fixed:
            return self.fixed
        if self._url is None or overrides != self._overrides:
            self.close()
            shown = " ".join(f"{k}={v}" for k, v in {**self.section, **overrides}.items())
            self.console.print(f"[dim]starting embedded reference server: {shown}[/]")
            with self.view.waiting("starting the embedded server"):
                server = self._stack.enter_context(embedded_server(self.section, overrides))
            self._url = server.url
            pids = ", ".join(f"{name} {p['pid']}" + (f" ({' '.join(map(str, p['ports']))})" if p["ports"] else "")
                             for name, p in server.procs.items())
            self.console.print(f"[dim]embedded server {server.url}  pids: {pids}[/]")
            self._overrides = dict(overrides)
        return self._url

    def hardware(self, overrides: dict[str, Any]) -> dict[str, Any] | None:
        """What the step's server occupies (``cards``, ``machines``, ``cards_per_worker``): the embedded server's
        from its flags; a ``--target``'s as its ``/health`` reports it (the reference server counts the workers
        joined from other hosts there), else None. A ``--target`` is one server for the whole sweep: asked once,
        at the first step's end, its answer (or its silence) serves every step."""
        if not self.fixed:
            hw = section_hardware(self.section, overrides)
        else:
            if not self._fixed_asked and self.client:
                self._fixed_hw = target_hardware(dataclasses.replace(self.client, target=self.fixed))
            self._fixed_asked = True
            hw = self._fixed_hw
        return None if hw is None else {k: hw.get(k) for k in ("cards", "machines", "cards_per_worker")}

    def close(self) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self._url = None


def most_steps(cfg: SweepConfig) -> int:
    """The most steps the sweep can take (its bar's "at most N"): every group's search bound, or one step per
    server-parameter value; the time budget usually ends it sooner."""
    if cfg.server_param:
        per_group = len(cfg.param_values)
    else:   # a search that starts from an estimate takes finer, so more, steps (SearchConfig.from_estimate)
        per_group = max(c.max_steps + c.descend_steps + c.bisect_steps
                        for c in (cfg.search, cfg.search.from_estimate(cfg.search.start)))
    return per_group * max(1, len(cfg.buckets))


def outcome_of(step: dict[str, Any]) -> Outcome:
    return Outcome(slo_passed=bool(step["slo_passed"]), input_tpm=float(step["summary"].get("input_tpm") or 0.0),
                   saturated=bool(step.get("saturation", {}).get("saturated")),
                   exhausted=bool(step.get("trace_exhausted")),
                   certified=(step.get("certified") or {}).get("verdict"))


class Sweep:
    def __init__(self, cfg: SweepConfig, source: Source, gates: Sequence[Gate], state: SweepState,
                 console: Console, meta: dict[str, Any], view: SweepView | None = None) -> None:
        self.cfg, self.source, self.gates, self.state = cfg, source, list(gates), state
        self.console, self.meta = console, meta
        self.view = view or QuietView()   # the bars: the caller enters it around run() (commands/sweep.py)
        self.targets = _Targets(cfg.target, cfg.server_section, console, self.view, cfg.client)
        self.deadline = time.monotonic() + cfg.time_budget_s
        self.stop_reason: str | None = None
        self._shown: object = ()          # the bucket whose steps the console shows now
        self.starts = BucketStarts(
            axis=cfg.plan.axis, default=cfg.search.start, explicit=cfg.start_given,
            trace_for=lambda bucket: source.trace_for(bucket, requests=ESTIMATE_REQUESTS),
            server=None if cfg.target else cfg.server_section, step=cfg.search.estimate_factor,
            probe=self._probe if cfg.probe_streams > 0 else None)

    # ------------------------------------------------------------------------------------------ run

    def run(self) -> dict[str, Any]:
        try:
            if self.cfg.server_param:
                for bucket in self.cfg.buckets or [None]:
                    self._param_group(bucket)
                    if self.stop_reason == "time_budget":
                        break
            else:
                self._searches()
        finally:
            self.targets.close()
        self.state.data["status"] = "time_budget" if self.stop_reason == "time_budget" else "done"
        self.finish()
        return self.state.data

    def _searches(self) -> None:
        """One load search per bucket: every bucket bracketed first, each from the one before it
        (estimate.py), then the bisections in turn (search.run_searches)."""
        starts: dict[int | None, dict[str, Any]] = {}

        def start_for(bucket: int | None, earlier: dict[int | None, SearchResult]) -> float | None:
            start = self.starts.start(bucket, earlier)
            starts[bucket] = {"load": start.load, "from": start.why}
            self._show(bucket, f"starting at {self._load_text(start.load)}: {start.why}")
            return start.load if start.estimated else None

        def measure(bucket: int | None, phase: str, load: float) -> Outcome:
            self._show(bucket)
            return self._measure(phase, load, bucket, None)

        results = run_searches(self.cfg.buckets or [None], self.cfg.search, start_for, measure)
        if any(r.stop_reason == "time_budget" for r in results.values()) or \
                len(results) < len(self.cfg.buckets or [None]):
            self.stop_reason = "time_budget"
        if self.cfg.certify is not None and self.cfg.verify_for > 0:
            for bucket, r in results.items():
                if r.best is not None and not self._verify_max(bucket, r.best.load):
                    break
        self.state.data["searches"] = {
            str(bucket): {"start": starts[bucket], "stop_reason": r.stop_reason, "bracket": r.bracket,
                          "best_load": r.best.load if r.best else None}
            for bucket, r in results.items()}
        self.state.save()

    def _verify_max(self, bucket: int | None, load: float) -> bool:
        """Run the bucket's certified max once more, up to ``verify_for`` times a step's window (a pass needs at
        least one step's window), certified the same way; the answer stands only if it passes again. A failed
        verification steps down, and the capacity lies between it and the search's next pass below: the
        geometric middle of that gap is verified next (while the gap is wider than the search's ``rel_tol``),
        then, if that fails too, the pass itself, and so on down the search's passes until one verifies or none
        is left (finish() reads the answer from them). Why the middle: on ci-small a failed verification at 8
        req/s stepped down to the pass at 4, half the load, with the capacity somewhere between. Why on down:
        the answer is a verified load or none; stopping after three tries left an unverified pass as the answer
        (ci-small idle, seed 2: verifications at 15, 14.49 and 14 failed, and 12 stood unverified). Each pass is
        verified once and each gap bisected once, so it ends; the time budget bounds it too. False when the
        budget had no room for it."""
        middle = True       # the next step down goes to the middle of the gap (else to the pass below)
        while True:
            self._show(bucket, f"verifying {self._load_text(load)}: up to {self.cfg.verify_for:g}x a step")
            try:
                if self._measure("verify", load, bucket, None).passed:
                    return True
            except BudgetExhausted:
                self.stop_reason = "time_budget"
                return False
            below = [s["load"]["value"] for s in self.state.steps if s.get("bucket") == bucket and s.get("passed")
                     and s.get("phase") != "verify" and s["load"]["value"] < load]
            if not below:
                self.console.print(f"[yellow]verification failed at {self._load_text(load)}: no pass below it "
                                   f"is left to verify[/]")
                return True
            self.console.print(f"[yellow]verification failed at {self._load_text(load)}: stepping down[/]")
            nxt = step_down(max(below), load, self.cfg.search) if middle else max(below)
            middle = nxt == max(below)      # after a middle, its pass; after a pass, the gap below it
            load = nxt

    def _show(self, bucket: int | None, note: str = "") -> None:
        """A rule line when the steps move to another bucket."""
        if bucket == self._shown and not note:
            return
        self._shown = bucket
        label = f" · context {bucket:,} tokens" if bucket else ""
        self.console.rule(f"load search on {self.cfg.plan.axis}{label}")
        if note:
            self.console.print(f"[dim]{escape(note)}[/]")

    def _param_group(self, bucket: int | None) -> None:
        name = self.cfg.server_param
        assert name is not None
        self.console.rule(f"server parameter {name} at {self.cfg.plan.axis} {self.cfg.search.start:g}")
        for value in self.cfg.param_values:
            try:
                self._measure("param", self.cfg.search.start, bucket, (name, value))
            except BudgetExhausted:
                self.stop_reason = "time_budget"
                return

    # -------------------------------------------------------------------------------------- one step

    def _measure(self, phase: str, load: float, bucket: int | None, param: tuple[str, str] | None) -> Outcome:
        key = step_key(load, bucket=bucket, param=param) + ("|verify" if phase == "verify" else "")
        done = self.state.finished(key)
        if done is not None:
            self.console.print(f"[dim]step {done['index']:03d} {phase:<8} {self._load_text(load)} "
                               f"(recorded, not rerun)[/]")
            return outcome_of(done)
        plan, min_pass_s = self._plan(phase, load, bucket, param)
        if time.monotonic() + self._step_estimate(plan) > self.deadline:
            self.console.print(f"[yellow]time budget: not enough left for another step at "
                               f"{self._load_text(load)}; stopping with what is measured[/]")
            raise BudgetExhausted()
        reserve = self._verify_reserve() if phase == "bisect" else 0.0
        if reserve and time.monotonic() + self._step_estimate(plan) + reserve > self.deadline:
            self.console.print(f"[yellow]time budget: a bisection step at {self._load_text(load)} would leave "
                               f"too little to verify each bucket's max ({reserve:.0f} s); verifying now[/]")
            raise BudgetExhausted()
        overrides = {param[0].replace("-", "_"): param[1]} if param else {}
        target = self.targets.url(overrides)
        index, step_dir = self.state.new_step_dir()
        meta = {**self.meta, "target": target, "bucket": bucket,
                "server_param": {"name": param[0], "value": param[1]} if param else None}
        need = plan.trace_size(load, self._per_stream())
        for attempt in range(3):
            trace = fresh_prefixes(plan.trace(self.source, bucket, need, load), index)
            began = time.monotonic()
            client = dataclasses.replace(self.cfg.client, target=target, **step_timeouts(plan.total_s))
            with self.view.step(index, phase, self._load_text(load), warmup_s=plan.warmup_s,
                                duration_s=plan.duration_s):
                entry = run_step(trace, plan, load, client, step_dir, gates=self.gates, meta=meta,
                                 saturation_limits=step_limits(phase), certify=self.cfg.certify,
                                 min_pass_s=min_pass_s, prime_concurrency=self._prime_concurrency)
            # a workload trace that ran dry (a closed loop faster than guessed) is regenerated 4x longer and
            # the step rerun; a trace file cannot grow, and its step stays flagged
            if not entry.get("trace_exhausted") or self.source.spec is None or attempt == 2:
                break
            if time.monotonic() + (time.monotonic() - began) > self.deadline:   # a rerun lasts as long again
                self.console.print(f"[yellow]step {index:03d}: the trace ran out, and no time budget is left "
                                   f"to rerun it; kept as it is[/]")
                break
            self.console.print(f"[yellow]step {index:03d}: the trace ran out ({len(trace)} requests); "
                               f"rerunning with a longer one[/]")
            need *= 4
            step_dir = self.state.new_step_dir()[1]
        entry = {"index": index, "key": key, "phase": phase, "bucket": bucket, "step_s": plan.total_s,
                 "server_param": meta["server_param"], "hardware": self.targets.hardware(overrides), **entry}
        self.state.add_step(entry)
        self._print_step(entry)
        self._verify(entry)
        return outcome_of(entry)

    @property
    def _prime_concurrency(self) -> int:
        """Closed loops a rate step primes its sessions with: the embedded server's (two per prefill instance),
        else the default."""
        return PRIME_CONCURRENCY if self.cfg.target else prime_concurrency(self.cfg.server_section)

    def _plan(self, phase: str, load: float, bucket: int | None = None,
              param: tuple[str, str] | None = None) -> tuple[StepPlan, float | None]:
        """The plan of a step at ``load`` in ``phase``, and the shortest window it may pass on (None: point
        verdicts, the whole window). A certified step runs until decided, up to ``longest`` times the configured
        window; a pass needs the configured window at least: passes claimed on a step's first seconds were
        measured wrong (docs/sweep.md, "Certified verdicts"). A verification passes only on its whole
        ``verify_for`` length. Its sessions in flight follow the target's E2E measured at the closest load below
        (:meth:`_response_s`)."""
        plan = dataclasses.replace(self.cfg.plan.for_load(load), response_s=self._response_s(load, bucket, param))
        if self.cfg.certify is None:
            return plan, None
        stretch = self.cfg.verify_for if phase == "verify" else self.cfg.certify.longest
        min_pass_s = plan.duration_s
        plan = dataclasses.replace(plan, duration_s=round(plan.duration_s * max(1.0, stretch), 1))
        return plan, (plan.duration_s if phase == "verify" else min_pass_s)

    def _response_s(self, load: float, bucket: int | None, param: tuple[str, str] | None) -> float:
        """The target's mean E2E (s) near ``load`` in this bucket's steps at the same server setting
        (``step.response_near``): a rate step plays enough sessions that one is free when a send time comes, where
        the target keeps more of them busy than the trace's turn gap allows for (``mix.lanes_wanted``)."""
        if self.cfg.plan.axis != "rate":
            return 0.0
        setting = {"name": param[0], "value": param[1]} if param else None
        steps = [s for s in self.state.steps if s.get("bucket") == bucket and s.get("server_param") == setting]
        return response_near(((s["load"]["value"], mean_e2e_s(s["summary"])) for s in steps), load)

    def _verify_reserve(self) -> float:
        """Seconds the verifications of the buckets' certified maxima would take now: one verification at each
        bucket's highest pass so far (0 without certified verdicts or verification). A bisection step runs only if
        they still fit after it: a certified max not verified is no answer, a coarser bracket verified is one. The
        default white-paper sweep, certified, spent its budget bracketing and bisecting (11 steps in 27:22) and
        verified none of its four maxima."""
        if self.cfg.certify is None or self.cfg.verify_for <= 0:
            return 0.0
        best: dict[int | None, float] = {}
        for s in self.state.steps:
            if s.get("passed") and s.get("phase") != "verify":
                best[s.get("bucket")] = max(best.get(s.get("bucket"), 0.0), s["load"]["value"])
        return sum(self._step_estimate(self._plan("verify", load, bucket)[0])
                   for bucket, load in best.items())

    def _probe(self, bucket: int | None) -> ProbeResult | None:
        """The throughput probe of ``bucket`` (probe.py): recorded in sweep.json ``probes``, read back on a resume.
        None when it served nothing or the budget had no room for a level (the search then starts where
        configured)."""
        probes = self.state.data.setdefault("probes", {})
        done = probes.get(str(bucket))
        if done is not None:
            return ProbeResult.from_dict(done)
        plan = probe_plan(self.cfg.plan)
        name = f"probe-{bucket // 1024}K" if bucket else "probe"
        target = self.targets.url({})
        client = dataclasses.replace(self.cfg.client, target=target, **step_timeouts(plan.total_s))

        def level(streams: int) -> Level | None:
            if time.monotonic() + self._step_estimate(plan) > self.deadline:
                return None
            step_dir = self.state.empty_dir(f"{name}/c{streams}")
            trace = fresh_prefixes(plan.trace(self.source, bucket, plan.trace_size(streams)), PROBE_INDEX + streams)
            with self.view.waiting(f"throughput probe, concurrency={streams}"):
                entry = run_step(trace, plan, streams, client, step_dir, gates=self.gates,
                                 meta={**self.meta, "target": target, "bucket": bucket, "probe": True})
            lv = level_of(entry, streams)
            self.console.print(f"probe    concurrency={streams:<3d} served {lv.served_rps:.3g} req/s in "
                               f"{lv.window_s:g} s ({lv.requests} requests, p50 TTFT {fmt_ms(lv.ttft_p50_ms)})")
            return lv

        self._show(bucket, f"throughput probe: closed loops doubling up to {self.cfg.probe_streams}, "
                           f"{plan.warmup_s:g} + {plan.duration_s:g} s each")
        result = run_probe(level, self.cfg.probe_streams, name)
        if result is not None:
            probes[str(bucket)] = result.to_dict()
            self.state.save()
        return result

    def _verify(self, s: dict[str, Any]) -> None:
        """Say loudly when the server did not see the workload the step names; stop the sweep (exit 2) on
        prompt lengths off by more than 2% unless ``--allow-length-mismatch``: every later step would
        measure the wrong workload too."""
        for warning in verify_warnings(s["summary"], f" (step {s['index']:03d})"):
            self.console.print(f"[bold red]WARNING[/]: {escape(warning)}")
        if (s["summary"].get("prompt_lengths") or {}).get("off") and not self.cfg.allow_length_mismatch:
            raise InputError(f"step {s['index']:03d}: the server counted the prompts "
                             f"{s['summary']['prompt_lengths']['ratio']:.3f}x their intended length; the sweep "
                             f"stops here (its results so far are in {self.state.path}); {TOKENIZER_FIX}, or "
                             "pass --allow-length-mismatch to sweep the mismatched workload anyway",
                             field="--tokenizer")

    def _per_stream(self) -> float:
        """A closed loop's requests per stream-second, for its trace's size: what the last concurrency step
        achieved (x 1.5), at least 10 (100 ms requests)."""
        return max([10.0] + [s["summary"].get("request_throughput_rps", 0) / s["load"]["value"] * 1.5
                             for s in self.state.steps[-1:] if s["load"]["kind"] == "concurrency"])

    def _step_estimate(self, plan: StepPlan) -> float:
        """What a step of ``plan`` will take.

        A certified step (search or verification) is reckoned at its whole length, since one undecided runs its
        stretched window to the end, plus the most any step so far took around its judged window, in seconds
        (its primed sessions, the answers' tail, the idle waits). Reckoned from the steps' overruns of their
        *lengths*, as a share or in seconds, the steps that stopped early hid that: once fails stopped on their
        known misses (sequential.py), a white-paper 64K search (seed 6) bisected to a pass at 3.071 req/s that ran
        its whole window, 265 s where 225 s were reckoned, and left too little to verify anything. And as a share,
        a fail at 4.24 req/s (309 s for a 150 s step, 97 s of it priming) put a 330 s verification at 680 s; it
        took 447 (seed 5). A point step takes the largest overrun so far as a share of its own length: a failing
        point step waits out first-token timeouts that scale with it (about twice its length)."""
        took = [(s["wall_s"], s.get("step_s", self.cfg.plan.total_s), s.get("window_s"))
                for s in self.state.steps if "wall_s" in s]
        if not took:
            return plan.total_s * (1 + STEP_OVERHEAD)
        if self.cfg.certify is not None:   # a verification is a certified step
            warmup = self.cfg.plan.warmup_s
            around = max(wall - warmup - (window if window is not None else length - warmup)
                         for wall, length, window in took)
            return plan.total_s + max(0.0, around)
        return plan.total_s * max(wall / length for wall, length, _ in took)

    def _load_text(self, load: float) -> str:
        return f"{self.cfg.plan.axis}={load:g} {AXIS_UNITS[self.cfg.plan.axis]}"

    def _print_step(self, s: dict[str, Any]) -> None:
        summ = s["summary"]
        ttft = (summ.get("ttft_ms") or {}).get("p50")
        sat = s["saturation"]
        cert = s.get("certified")
        verdict = "[green]PASS[/]" if s["passed"] else "[yellow]UNDECIDED[/]" if (cert or {}).get("verdict") == \
            "undecided" and not s["saturation"].get("saturated") else "[red]FAIL[/]"
        why = []
        if cert:
            late = (cert.get("looked") or [{}])[-1].get("late") if cert["stopped_early"] else 0
            verdict += (f" [dim](certified at {cert['confidence']:g}, {cert['judged_requests'] or 0} requests in "
                        f"{cert['window_s']:.0f} s" + (", stopped early" if cert["stopped_early"] else "")
                        + (f", {late} of them still without a first token past the bound" if late and not s["passed"]
                           else "") + ")[/]")
            if cert.get("binding") and not s["passed"]:
                why.append(f"binding: {cert['binding']}")
        elif not s["slo_passed"]:
            why += [g["gate"] for g in s["verdict"]["gates"] if not g["passed"]]
        if sat.get("saturated"):
            why += sat["reasons"]
        # a queue that rose but stayed far from the SLO's bound: not a reason, but the user sees it (saturation.py)
        why += [f"swing, not counted: {w}" for w in sat.get("swings") or []]
        if s.get("trace_exhausted"):
            why.append("the trace ran out before the step ended: the load was lower than named")
        req = summ.get("requests") or {}
        self.console.print(
            f"step {s['index']:03d} {s['phase']:<8} {self._load_text(s['load']['value'])}"
            + (f" (offered {s['offered_rps']:.2f} req/s)" if s.get("offered_rps") is not None else "")
            + (f" ({s['server_param']['name']}={s['server_param']['value']})" if s["server_param"] else "")
            + f"  input {fmt_tpm(summ.get('input_tpm'))} TPM  p50 TTFT {fmt_ms(ttft)}"
            + f"  goodput {summ.get('goodput_rps') or 0:.2f} req/s  ok {req.get('ok', 0)}/{req.get('total', 0)}"
            + _hit_text(summ.get("prefix_hit_ratio"), s.get("traffic_hit_ratio"))
            + _length_text(summ.get("prompt_lengths"))
            + f"  {verdict}" + (f"  ({escape('; '.join(why))})" if why else ""))

    # ------------------------------------------------------------------------------------- results

    def finish(self) -> None:
        """best / buckets / server_param / cost, from the recorded steps."""
        data = self.state.data
        steps = data["steps"]
        answers = {bucket: _claimable([s for s in steps if s.get("bucket") == bucket])
                   for bucket in self.cfg.buckets or [None]}
        judged = [s for searched, _, _ in answers.values() for s in searched]
        best = _best([b for _, b, _ in answers.values() if b is not None])
        data["best"] = _best_entry(best)
        if data["best"] is not None:
            # no step of its bucket failed above it: the capacity lies above the figure (a fixed-load
            # server-parameter sweep searches no capacity)
            data["best"]["lower_bound"] = not self.cfg.server_param and _failed_above(judged, best) is None
        rows = []
        for bucket, (searched, b, verification) in answers.items():
            ctx = bucket or _mean_context(b)
            hw = (b or {}).get("hardware") or data["meta"].get("hardware") or {}
            failed = _failed_above(searched, b) if b and not self.cfg.server_param else None
            rows.append({"context_tokens": ctx, "bucket": bucket, "max_input_tpm": _tpm(b),
                         # the share of it whose requests met every per-request SLO limit (docs/cost.md)
                         "good_input_tpm": (b or {}).get("summary", {}).get("good_input_tpm"),
                         "hit_ratio": _hit(b), "output_tpm": (b or {}).get("summary", {}).get("output_tpm"),
                         "ttft_p50_ms": ((b or {}).get("summary", {}).get("ttft_ms") or {}).get("p50"),
                         "cards": hw.get("cards"), "machines": hw.get("machines"),
                         "remote_prefill_share": (b or {}).get("remote_prefill_share"),
                         "index": b["index"] if b else None, "load": b["load"] if b else None,
                         "passed": b is not None,
                         "steps": sum(s.get("bucket") == bucket for s in steps),
                         # the lowest failing load above the best: the capacity lies between the two
                         "failed_load": failed["load"]["value"] if failed else None,
                         "lower_bound": b is not None and not self.cfg.server_param and failed is None,
                         "certified": _certified_interval(searched, b, verification) if self.cfg.certify else None})
        data["buckets"] = rows
        if self.cfg.server_param:
            data["server_param"] = _param_table(self.cfg.server_param, steps)
        # A target that reports no cached tokens has an unknown hit ratio: no row, as in the report (priced
        # as 0% hit it would bill every token at the uncached price, ~3x the white paper's blended revenue).
        data["cost"] = [
            cost_row(r["max_input_tpm"], r["hit_ratio"], r["output_tpm"] or 0.0, self.cfg.cost_inputs,
                     label=(f"{r['context_tokens'] // 1024}K" if r["bucket"] else self.source.name),
                     context_tokens=r["context_tokens"], cards=r["cards"], machines=r["machines"]).to_dict()
            for r in rows if r["max_input_tpm"] is not None and r["hit_ratio"] is not None
        ]
        data["cost_inputs"] = dataclasses.asdict(self.cfg.cost_inputs)
        claim = self.source.claim
        if claim is not None:
            from paasbench.cost.claim import compare, measured_by

            at = next((r for r in rows if r["bucket"] == claim.context_tokens), None)
            meta = data["meta"]
            data["claim"] = compare(claim, at if at and at["passed"] else None, meta.get("hardware"),
                                    self.cfg.cost_inputs, measured_by(meta.get("target"), meta.get("server")))
        self.state.save()


def least_certified_s(cfg: SweepConfig) -> float:
    """The least wall time a verified certified answer for every bucket takes, before any step is run: each bucket
    needs a pass, a fail above it and a verification, each a warm-up and a window at the shortest the plan allows
    (``StepPlan.for_load`` at an unbounded load): a pass the whole window, a fail twice the warm-up (sequential.py),
    a verification ``verify_for`` windows; no drain, no overrun, no probe, so the real cost is higher. 0 without
    certified verdicts or verification. Why: the default white-paper sweep at 0.95 needs 2,040 s by this count,
    more than its 1,800 s budget, and at b6935dc it spent the whole budget bracketing before any verification;
    a user should read that before the cluster time is spent, not after."""
    if cfg.certify is None or cfg.verify_for <= 0:
        return 0.0
    shortest = cfg.plan.for_load(math.inf)
    warmup, window = shortest.warmup_s, shortest.duration_s
    each = (warmup + window) + (warmup + min(window, 2 * warmup)) + (warmup + cfg.verify_for * window)
    return each * max(1, len(cfg.buckets))


def step_down(passed: float, failed: float, search: SearchConfig) -> float:
    """The next load to verify once a verification at ``failed`` failed and ``passed`` is the search's next pass
    below: the geometric middle of the two (whole on a concurrency axis) while the gap is wider than the
    search's ``rel_tol`` and the middle is a new load, else ``passed``."""
    mid = math.sqrt(passed * failed)
    if search.integer:
        mid = float(round(mid))
    if (failed - passed) / passed <= search.rel_tol or not passed < mid < failed:
        return passed
    return mid


def _claimable(steps: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any] | None,
                                                       dict[str, Any] | None]:
    """One bucket's answer: the search's steps it is read from, its best step and the verification behind it.
    Without verification steps the best is the highest passing input TPM of old. With them, every pass at or
    above a load whose verification failed is dropped (the answer steps down), and a passing verification is the
    answer: its window is the longest run at that load, so its figures are the ones priced."""
    checks = [s for s in steps if s.get("phase") == "verify"]
    searched = [s for s in steps if s.get("phase") != "verify"]
    for v in checks:   # a failed verification is a failing step like any other
        if not v["passed"]:
            searched = [s for s in searched if s["load"]["value"] < v["load"]["value"] or not s.get("passed")] + [v]
    held = [v for v in checks if v["passed"]]
    if held:
        return searched, held[-1], held[-1]
    return searched, _best(searched), checks[-1] if checks else None


def _certified_interval(steps: list[dict[str, Any]], best: dict[str, Any] | None,
                        verification: dict[str, Any] | None) -> dict[str, Any]:
    """A bucket's certified answer: the highest certified pass and the lowest certified fail above it (the
    capacity lies between them at the steps' confidence), the undecided loads between, the term that bound the
    failing side, the counts behind each, and the verification run's verdict. The interval's lower end is the
    pass less the overload its window could hold by chance (``horizon``, paasbench/sweep/horizon.py)."""
    def counts(s: dict[str, Any] | None) -> dict[str, Any] | None:
        if s is None:
            return None
        c = s.get("certified") or {}
        return {"index": s["index"], "load": s["load"]["value"], "verdict": c.get("verdict"),
                "requests": c.get("judged_requests"), "window_s": c.get("window_s"), "binding": c.get("binding")}

    lo = best["load"]["value"] if best else 0.0
    fails = [s for s in steps if not s.get("passed") and s["load"]["value"] > lo
             and ((s.get("certified") or {}).get("verdict") == "fail" or s.get("saturation", {}).get("saturated"))]
    fail = min(fails, key=lambda s: s["load"]["value"]) if fails else None
    hi = fail["load"]["value"] if fail else float("inf")
    undecided = sorted(s["load"]["value"] for s in steps if (s.get("certified") or {}).get("verdict") == "undecided"
                       and lo < s["load"]["value"] < hi)
    confidence = next(((s.get("certified") or {}).get("confidence") for s in steps if s.get("certified")), None)
    margin = ((best or {}).get("certified") or {}).get("horizon")
    return {"confidence": confidence, "pass": counts(best), "fail": counts(fail), "undecided_loads": undecided,
            # the lowest capacity the pass is consistent with, past the overload its window held by chance
            "horizon": None if best is None else answer_horizon(lo, margin),
            "binding": (fail.get("certified") or {}).get("binding") if fail else None,
            "verified": None if verification is None else {
                "index": verification["index"], "load": verification["load"]["value"],
                "passed": bool(verification["passed"]), **(counts(verification) or {})}}


def _failed_above(steps: list[dict[str, Any]], best: dict[str, Any]) -> dict[str, Any] | None:
    """The lowest failing step above ``best`` in its bucket (and server-parameter group): with it the capacity
    is bracketed; without it (escalation ran out of steps, or the budget cut it while every step passed) the
    best is a lower bound."""
    above = [s for s in steps if s.get("bucket") == best.get("bucket") and s.get("server_param") == best.get("server_param")
             and not s.get("passed") and s["load"]["value"] > best["load"]["value"]]
    return min(above, key=lambda s: s["load"]["value"]) if above else None


def _best(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    passing = [s for s in steps if s.get("passed")]
    return max(passing, key=lambda s: (s["summary"].get("input_tpm") or 0.0, s["load"]["value"])) if passing else None


def _best_entry(s: dict[str, Any] | None) -> dict[str, Any] | None:
    if s is None:
        return None
    summ = s["summary"]
    return {"index": s["index"], "load": s["load"], "offered_rps": s.get("offered_rps"), "bucket": s.get("bucket"),
            "input_tpm": summ.get("input_tpm"),
            "good_input_tpm": summ.get("good_input_tpm"), "traffic_hit_ratio": s.get("traffic_hit_ratio"),
            "output_tpm": summ.get("output_tpm"), "goodput_rps": summ.get("goodput_rps"),
            "prefix_hit_ratio": summ.get("prefix_hit_ratio"), "ttft_p50_ms": (summ.get("ttft_ms") or {}).get("p50")}


def _tpm(s: dict[str, Any] | None) -> float | None:
    return None if s is None else float(s["summary"].get("input_tpm") or 0.0)


def _hit(s: dict[str, Any] | None) -> float | None:
    return None if s is None else s["summary"].get("prefix_hit_ratio")


def _mean_context(s: dict[str, Any] | None) -> int | None:
    """Mean input tokens of the requests whose tokens ``input_tokens`` sums: the served ones (first token by
    the deadline), not every success — past saturation many succeed only after the window closes."""
    if s is None:
        return None
    summ = s["summary"]
    served = (summ.get("requests") or {}).get("served")
    if served is None:          # a summary written before `served` was recorded: the served rate times the window
        served = round((summ.get("request_throughput_rps") or 0.0) * (summ.get("duration_s") or 0.0))
    return int(summ.get("input_tokens", 0) / served) if served else None


def _param_table(name: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per parameter value; the best value is the one that serves the most input TPM under the
    SLO, ties (within 2%) broken by the lower p50 TTFT. With a remote-prefill threshold that value is
    the crossover: below it, shipping short prefills to the prefill pool costs more (queueing, KV
    transfer) than it saves; above it, long prefills block decode."""
    rows = []
    for s in steps:
        if not s.get("server_param") or s["server_param"]["name"] != name:
            continue
        summ = s["summary"]
        rows.append({"value": s["server_param"]["value"], "index": s["index"], "passed": s["passed"],
                     "input_tpm": summ.get("input_tpm"), "goodput_rps": summ.get("goodput_rps"),
                     "ttft_p50_ms": (summ.get("ttft_ms") or {}).get("p50"),
                     "ttft_p90_ms": (summ.get("ttft_ms") or {}).get("p90"),
                     "tpot_p50_ms": (summ.get("tpot_ms") or {}).get("p50"),
                     "remote_prefill_share": s.get("remote_prefill_share")})
    best = None
    candidates = [r for r in rows if r["passed"]]   # none met the SLO: no value is "best under the SLO"
    if candidates:
        top = max(r["input_tpm"] or 0.0 for r in candidates)
        near = [r for r in candidates if (r["input_tpm"] or 0.0) >= 0.98 * top]
        best = min(near, key=lambda r: r["ttft_p50_ms"] if r["ttft_p50_ms"] is not None else float("inf"))
    return {"name": name, "rows": rows, "best_value": best["value"] if best else None,
            "rule": "max input TPM under the SLO; ties within 2% -> lower p50 TTFT"}


def _hit_text(achieved: float | None, traffic: float | None) -> str:
    parts = ([f"traffic hit {traffic:.1%}"] if traffic is not None else []) + \
        ([f"server hit {achieved:.1%}"] if achieved is not None else [])
    return ("  " + ", ".join(parts)) if parts else ""


def _length_text(check: dict[str, Any] | None) -> str:
    if not check or not check.get("compared"):
        return ""
    return f"  prompts {check['ratio']:.3f}x ({check['exact_share']:.0%} exact)"


def fmt_tpm(v: float | None) -> str:
    if v is None:
        return "—"
    for div, suf in ((1e6, "M"), (1e3, "K")):
        if v >= div:
            return f"{v / div:.2f}{suf}"
    return f"{v:.0f}"


def fmt_ms(v: float | None) -> str:
    return "—" if v is None else (f"{v:.1f} ms" if v < 100 else f"{v:,.0f} ms")
