"""The two probes that measure a pool's curves against any OpenAI-compatible target (:mod:`paasbench.plan.curves`).

Both are made of sweep steps (:func:`paasbench.sweep.step.run_step`: a warm-up, a window, the drain, the same
judgement, every step's records and summary on disk) over synthetic traces (``--isl/--osl/--prefix-hit``'s
generator), each step's prompts fresh (``fresh_prefixes``), so nothing one step sent is cached for the next.

**Prefill-bound** (``max_tokens`` 1, prompts of the bucket's context at the traffic's hit; per bucket):

1. *alone*: a closed loop of one stream -- each prompt finds nothing queued; its TTFT is ``base``;
2. *busy*: a closed loop of ``--busy-concurrency`` streams (8) keeps the instance busy; the prompts completed per
   second of the window are its service rate, ``service_s = 1 / rate``;
3. *under load*: open-loop Poisson steps at rates around the model's single-instance SLO edge (M/G/1 on
   ``service_s`` and ``base``), bisected once: the highest rate at which one instance met the TTFT SLO
   (``slo_rps``) -- what the curve is asked for, and the check of the queueing model at c = 1. Where they bound
   their TTFT percentile the steps also fit ``service_s`` (:func:`fit_service`), which then rises above the busy
   figure if Poisson arrivals made a prompt cost more, never below it (:func:`service_time`).

**Decode-bound** (per context the traffic decodes at): every prompt shares all but its last block with the others,
so after the first the prefill is one block and the decode runs at that context; outputs are long
(``--decode-output``); closed loops of 1, 2, 4, ... streams until TPOT breaks the SLO or the instance stops
admitting more (fewer streams decode at once than are offered), then one bisection. Each step gives the streams
actually decoding at once (time-averaged over the window, from the records), TPOT at the SLO's percentile and the
output tokens per second. Streams that share a prefix share its KV, the traffic's do not: where the instance's KV
is known (the twin's profile, or ``--kv-tokens``), the most streams it holds is also capped at ``KV / (context +
output / 2)``.

On the twin every wall-clock figure is divided by ``--sim-time-scale`` (recorded in the curves).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from paasbench.client import ClientConfig
from paasbench.metrics.certify import requests_to_pass
from paasbench.metrics.records import RequestRecord, read_records
from paasbench.metrics.slo import parse_gates
from paasbench.plan.curves import DecodePoint, PrefillPoint
from paasbench.plan.queueing import mgc_wait, ttft_quantile
from paasbench.plan.sizing import PlanSLO
from paasbench.plan.twin import scaled_limits
from paasbench.sweep.search import Outcome, SearchConfig, run_search
from paasbench.sweep.step import StepPlan, run_step, step_timeouts

FIT_CONFIDENCE = 0.95   # a step sets the service fit only if it bounds its TTFT quantile from above at this confidence


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    warmup_s: float = 5.0
    duration_s: float = 20.0          # each step's window (the rate steps': at most, holding ~window_requests)
    window_requests: int = 40
    busy_concurrency: int = 8         # streams that keep one instance busy (its queue never empties)
    rate_steps: int = 3               # open-loop steps per prefill bucket (0: the model's edge is not checked)
    decode_output: int = 256
    max_concurrency: int = 64
    decode_steps: int = 8             # closed-loop steps per decode context at most
    sim_time_scale: float = 1.0       # the twin's: wall seconds / device seconds
    seed: int = 0
    kv_tokens: int | None = None      # KV one instance holds (caps the streams at a context); None: unknown


class Prober:
    """Runs the probes' steps against ``client.target``, each into its own directory under ``out``."""

    def __init__(self, client: ClientConfig, settings: ProbeSettings, slo: PlanSLO, out: Path, block_size: int,
                 log: Callable[[str], None] = print) -> None:
        import secrets

        if client.prompt_salt is None:     # one prompt text per probe: the shared prefixes stay cached across steps
            client = dataclasses.replace(client, prompt_salt=secrets.randbits(64))
        self.client, self.s, self.slo, self.out, self.block = client, settings, slo, Path(out), block_size
        self.log = log
        self._index = 0

    # ------------------------------------------------------------------------------------------ steps

    def _step(self, name: str, trace: Any, plan: StepPlan, value: float, gates: list[str]) -> tuple[dict[str, Any], list[RequestRecord]]:
        self._index += 1
        step_dir = self.out / f"{self._index:03d}-{name}"
        trace = fresh_tails(trace, self._index)
        client = dataclasses.replace(self.client, **step_timeouts(plan.total_s))
        entry = run_step(trace, plan, value, client, step_dir, gates=parse_gates(gates),
                         meta={"probe": name, "sim_time_scale": self.s.sim_time_scale},
                         saturation_limits=scaled_limits(self.s.sim_time_scale))
        entry["dir"] = str(step_dir)
        return entry, list(read_records(step_dir / "records.jsonl"))

    def _closed(self, name: str, make: Callable[[int], Any], plan: StepPlan, n: int, gates: list[str],
                per_stream: float) -> tuple[dict[str, Any], list[RequestRecord], Any]:
        """A closed-loop step over ``make(requests)``; a trace the loop ran dry (faster requests than guessed) is made
        4x longer and the step rerun, twice at most: a closed loop that ran out idles the rest of its window."""
        for _ in range(3):
            trace = make(plan.trace_size(n, per_stream))
            entry, recs = self._step(name, trace, plan, n, gates)
            if not entry.get("trace_exhausted"):
                break
            per_stream *= 4
        return entry, recs, trace

    def _synthetic(self, isl: int, osl: int, requests: int, *, prefix_hit: float | None = None,
                   prefix_tokens: int | None = None) -> Any:
        from paasbench.workload.synthetic import Synthetic, synthetic_trace

        syn = Synthetic(isl=str(isl), osl=str(osl), requests=max(2, requests), prefix_hit=prefix_hit or None,
                        prefix_tokens=prefix_tokens, block_size=self.block)
        return synthetic_trace(syn, self.s.seed)

    def _scaled_gate(self, metric: str, q: float | None, limit_s: float | None) -> list[str]:
        if limit_s is None or q is None:
            return []
        stat = {0.5: "p50", 0.9: "p90", 0.95: "p95", 0.99: "p99", 0.999: "p99.9"}.get(q, "p50")
        return [f"{stat}({metric}) <= {limit_s * self.s.sim_time_scale * 1e3:.6g}ms"]

    # ---------------------------------------------------------------------------------------- prefill

    def prefill_point(self, context: int, hit: float) -> PrefillPoint:
        s, scale = self.s, self.s.sim_time_scale
        tag = f"prefill-{context}"
        closed = StepPlan(axis="concurrency", warmup_s=s.warmup_s, duration_s=s.duration_s, seed=s.seed)

        shared = min(context - self.block, int(context * hit) // self.block * self.block)

        def make(n: int) -> Any:     # every prompt after the first hits the shared prefix: its hit is the asked one
            return self._synthetic(context, 1, n, prefix_tokens=shared)

        alone, recs, trace = self._closed(f"{tag}-alone", make, closed, 1, ["error_rate <= 1%"], 20.0)
        cached = trace.meta["synthetic"]["prefix_tokens_shared"]
        w0, w1 = closed.window
        base = [(r.first_token_s - r.intended_send_s) / scale for r in recs
                if r.ok and r.first_token_s is not None and w0 <= r.intended_send_s < w1]
        per_stream = 2.0 / max(1e-3, float(np.mean(base)) * scale) if base else 4.0
        busy, recs, _ = self._closed(f"{tag}-busy", make, closed, s.busy_concurrency, ["error_rate <= 1%"], per_stream)
        rate = busy_rate(recs) * scale                               # prompts per device second
        if not base or rate <= 0:
            raise RuntimeError(f"the prefill probe at {context:,} tokens got no answer (see {alone['dir']}, "
                               f"{busy['dir']}): {alone['summary'].get('errors')}")
        point = PrefillPoint(context=context, hit=cached / context, uncached=float(context - cached),
                             service_s=1.0 / rate, base_ttft_s=[float(x) for x in base],
                             steps=[_brief(alone, "alone", scale), _brief(busy, "busy", scale)],
                             busy_service_s=1.0 / rate)
        self.log(f"  prefill {context:,} tokens, hit {point.hit:.2f}: alone TTFT {np.mean(base) * 1e3:,.0f} ms, "
                 f"busy {rate:.3g} prompts/s -> {point.uncached * rate:,.0f} uncached tokens/s per instance")
        if s.rate_steps > 0 and self.slo.ttft_s is not None:
            self._under_load(point, trace, tag)
        return point

    def _under_load(self, point: PrefillPoint, trace: Any, tag: str) -> None:
        s, scale, slo = self.s, self.s.sim_time_scale, self.slo
        base = np.array(point.base_ttft_s)
        q = slo.ttft_q or 0.5

        def model_ttft(rps: float) -> float:
            return ttft_quantile(mgc_wait(1, rps, point.service_s, 0.0), base, q)

        lo, hi = 0.0, 1.0 / point.service_s
        for _ in range(50):
            lo, hi = ((lo + hi) / 2, hi) if model_ttft((lo + hi) / 2) <= slo.ttft_s else (lo, (lo + hi) / 2)
        edge = lo
        if edge <= 0:
            self.log(f"  prefill {point.context:,}: even one prompt alone misses the TTFT SLO; no load steps")
            return
        gates = self._scaled_gate("ttft", q, slo.ttft_s) + ["error_rate <= 1%"]
        plan = StepPlan(axis="rate", warmup_s=s.warmup_s, duration_s=s.duration_s, seed=s.seed,
                        window_requests=s.window_requests)

        def measure(phase: str, load: float) -> Outcome:                 # load: device req/s
            step_plan = plan.for_load(load / scale)
            entry, _ = self._step(f"{tag}-rate-{load:.4g}", trace_for(step_plan, load / scale), step_plan,
                                  load / scale, gates)
            brief = _brief(entry, phase, scale)
            brief.update(device_rps=load, model_ttft_s=model_ttft(load))
            point.steps.append(brief)
            self.log(f"  prefill {point.context:,} at {load:.3g} req/s: p{q * 100:g} TTFT "
                     f"{_fmt_s(brief['ttft_q_s'])} (model {_fmt_s(brief['model_ttft_s'])}) "
                     f"{'pass' if entry['passed'] else 'FAIL'}")
            return Outcome(entry["slo_passed"], entry["summary"].get("input_tpm") or 0.0,
                           bool(entry["saturation"].get("saturated")), bool(entry.get("trace_exhausted")))

        def trace_for(step_plan: StepPlan, rps: float) -> Any:
            need = step_plan.trace_size(rps)
            if len(trace) >= need:
                return trace
            return self._synthetic(point.context, 1, need, prefix_tokens=int(point.context - point.uncached))

        result = run_search(SearchConfig(start=edge * 0.9, factor=1.3, max_steps=s.rate_steps,
                                         descend_steps=s.rate_steps - 1, bisect_steps=max(0, s.rate_steps - 2)), measure)
        point.fit = fit_service(point, q)
        if point.fit.get("service_s"):
            point.service_s = service_time(point.busy_service_s, point.fit["service_s"])
            self.log(f"  prefill {point.context:,}: service time fitted to {point.fit['steps']} step(s) under load "
                     f"{point.fit['service_s'] * 1e3:,.1f} ms, busy closed loop {point.busy_service_s * 1e3:,.1f} ms: "
                     f"{point.service_s * 1e3:,.1f} ms")
        if result.best is not None:
            point.slo_rps = result.best.load
        if result.bracket is not None:
            point.slo_failed_rps = result.bracket[1]
        elif result.best is None and result.trials:
            point.slo_failed_rps = min(t.load for t in result.trials)

    # ----------------------------------------------------------------------------------------- decode

    def decode_point(self, context: int, start: int = 1) -> DecodePoint:
        """The decode curve at ``context``: closed loops from ``start`` streams (the rapid model's guess on the twin),
        doubling until TPOT breaks the SLO or the streams decoding at once stop growing (the instance admits no more:
        doubling the streams added under 20%), then one bisection below a TPOT failure."""
        s, scale, slo = self.s, self.s.sim_time_scale, self.slo
        out_tokens = s.decode_output
        prompt = max(2 * self.block, int(context - out_tokens / 2) // self.block * self.block)
        plan = StepPlan(axis="concurrency", warmup_s=s.warmup_s, duration_s=s.duration_s, seed=s.seed)
        cap = s.max_concurrency
        if s.kv_tokens:
            cap = max(1, min(cap, int(s.kv_tokens // (context + out_tokens / 2))))
        gates = self._scaled_gate("tpot", slo.tpot_q, slo.tpot_s) + ["error_rate <= 1%"]
        q = slo.tpot_q or 0.5
        table: list[tuple[float, float]] = []
        steps: list[dict[str, Any]] = []
        passing: list[float] = []

        def make(k: int) -> Any:
            return self._synthetic(prompt, out_tokens, k, prefix_tokens=prompt - self.block)

        def step(n: int) -> tuple[bool, float]:
            per_stream = 1.0 / (out_tokens * 0.005 * scale)       # a stream's requests per second at a 5 ms TPOT
            entry, recs, _ = self._closed(f"decode-{context}-c{n}", make, plan, n, gates, per_stream)
            active = decoding_at_once(recs, plan.window)
            gaps, burst = window_tpot(recs, plan.window)
            t_q = float(np.quantile(gaps, q)) / scale if len(gaps) else math.nan
            itl_ms = ((entry.get("server_metrics") or {}).get("means_ms") or {}).get("itl")
            tpot_from = "client"
            if not len(gaps) and itl_ms:     # every stream came in one read: the engine's own mean is all there is
                t_q, tpot_from = itl_ms / 1e3 / scale, "engine mean ITL"
            brief = {**_brief(entry, f"c{n}", scale), "streams": n, "active": active, "tpot_q_s": t_q,
                     "tpot_p50_s": float(np.median(gaps)) / scale if len(gaps) else math.nan, "tpot_streams": len(gaps),
                     "tpot_burst_streams": burst, "engine_itl_mean_s": itl_ms / 1e3 / scale if itl_ms else None,
                     "tpot_from": tpot_from,
                     "output_tokens_per_s": (entry["summary"].get("output_tokens_per_s") or 0.0) * scale}
            steps.append(brief)
            errors_ok = all(g["passed"] for g in entry["verdict"]["gates"] if g["metric"] == "error_rate")
            ok = errors_ok and math.isfinite(t_q) and (slo.tpot_s is None or t_q <= slo.tpot_s)
            if math.isfinite(t_q) and active > 0:
                table.append((active, t_q))
            if ok:
                passing.append(active)
            said = [f"engine's mean ITL {_fmt_s(brief['engine_itl_mean_s'])}"] if itl_ms else []
            if burst:
                said.append(f"{burst} of {burst + len(gaps)} streams came in one read: no TPOT from them"
                            + (", TPOT is the engine's mean ITL" if tpot_from != "client" else ""))
            self.log(f"  decode {context:,} tokens, {n} streams: {active:.1f} decoding at once, p{q * 100:g} TPOT "
                     f"{_fmt_s(t_q)}, {brief['output_tokens_per_s']:,.0f} output tokens/s {'pass' if ok else 'FAIL'}"
                     + (f" ({'; '.join(said)})" if said else ""))
            return ok, active

        n, lo, hi, why, prev = max(1, min(start, cap)), 0, 0, "probe", 0.0
        for _ in range(s.decode_steps):
            ok, active = step(n)
            if not ok:
                hi, why = n, "tpot"
                break
            if prev and active < 1.2 * prev:
                why = "admission"
                break
            lo, prev = n, active
            if n >= cap:
                why = "admission" if cap < s.max_concurrency else "probe"
                break
            n = min(cap, n * 2)
        if hi and lo and hi - lo > 1 and len(steps) < s.decode_steps:
            step((lo + hi) // 2)
        table = _monotone(sorted(table))
        # what the instance admits: its KV and batch cap where they are known (the twin, --kv-tokens), or where the
        # streams decoding at once stopped growing; otherwise unknown
        admits = float(cap) if s.kv_tokens else (max(a for a, _ in table) if why == "admission" and table else None)
        if not passing:
            first = table[0] if table else (1.0, math.nan)
            return DecodePoint(context, out_tokens, 1.0, first[1], "tpot", table, steps, admits)
        best = max(passing)
        if slo.tpot_s is None and admits:                # no TPOT bound: every stream admitted is a batch place
            best = max(best, admits)
        if why == "tpot" and slo.tpot_s is not None:      # between the last passing and the first failing streams
            best = max(best, DecodePoint(context, out_tokens, float(cap), 0.0, why, table).active_at(slo.tpot_s))
        best = min(best, float(cap))
        return DecodePoint(context, out_tokens, best, float(np.interp(best, *zip(*table))), why, table, steps, admits)


def _monotone(table: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The measured (streams, TPOT) pairs, TPOT made non-decreasing in the streams (a running maximum): more streams
    never decode faster, and a noisy dip would let the plan read a larger batch off the curve than was measured."""
    out: list[tuple[float, float]] = []
    top = 0.0
    for b, t in table:
        top = max(top, t)
        out.append((b, top))
    return out


def service_time(busy_s: float | None, fitted_s: float | None) -> float:
    """The service time the queueing model uses: the fit to the open-loop steps, never under the busy closed loop's.
    A busy instance (its queue never empty) packs each step with the most chunks it can; Poisson arrivals leave it
    fewer to pack, so a prompt costs at least as much under them, and a fit below the busy figure is the noise of a
    few requests: the white paper's twin fitted 2,208 ms at 400K on one 7-request step where the busy loop read
    2,584, and 180 and 803 ms at 64K and 192K against 202 and 855; with the fits the plan put two S5000 machines'
    capacity at 0.85 req/s, and the verification failed at 0.81 and 0.74."""
    if fitted_s is None:
        return busy_s or 0.0
    return max(fitted_s, busy_s or 0.0)


def fit_service(point: PrefillPoint, q: float) -> dict[str, Any]:
    """The one free parameter of the single-instance queueing model, fitted to the measured TTFT under load.

    The M/G/1 model of one instance (``scv`` 0: the probe's prompts are all one shape) has the no-queue TTFTs
    (``base``, measured alone) and the service time ``S``. A busy closed loop measures ``S`` as the inverse of its
    throughput, but under a closed loop the instance's queue can run dry between completions and its chunks pack
    differently than under Poisson arrivals. So for each open-loop step that did not saturate, the ``S`` at which
    the model's TTFT quantile equals the measured one is solved for (bisection; the quantile rises with ``S``), and
    the median over the steps is the fit. A step whose TTFT shows no queueing (at or under the base's own quantile)
    or more than any stable ``S`` gives (``S -> 1 / rate``) bounds it only and is left out, and so is a step too small
    to bound its quantile from above at 95% (``FIT_CONFIDENCE``; p90: 36 requests): the ci-small twin's one 18-request
    step read p90 141 ms and fitted 44 ms where the busy loop measured 55; the plan from the fit gave two prefill
    instances 47.0 req/s, the busy figure 36.4, and the verification saturated at 35.6."""
    base = np.array(point.base_ttft_s)
    floor = float(np.quantile(base, q))
    least = requests_to_pass(q, (1.0 - FIT_CONFIDENCE) / 2)
    per_step = []
    for st in point.steps:
        rps, measured = st.get("device_rps"), st.get("ttft_q_s")
        if not rps or measured is None or not math.isfinite(measured) or st.get("saturated") or measured <= floor:
            continue
        if (st.get("requests") or 0) < least:
            continue
        hi = 0.999 / rps

        def model(s: float) -> float:
            return ttft_quantile(mgc_wait(1, rps, s, 0.0), base, q)

        if model(hi) < measured:
            continue
        lo = 0.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if model(mid) < measured else (lo, mid)
        per_step.append({"device_rps": rps, "ttft_q_s": measured, "service_s": hi})
    out: dict[str, Any] = {"steps": len(per_step), "per_step": per_step, "quantile": q}
    if per_step:
        out["service_s"] = float(np.median([p["service_s"] for p in per_step]))
    return out


def fresh_tails(trace: Any, index: int) -> Any:
    """``trace`` with every hash id after the shared prefix moved into a range of step ``index``'s own: the shared
    prefix (the blocks the trace's first two prompts share) stays the one the server cached in earlier steps of the
    probe, so a step does not begin with every prompt missing it at once (concurrent cold prefills of the same
    prefix, each computed in full, are a queue the traffic never has); the rest of each prompt is new to it."""
    from paasbench.trace.loop import id_span
    from paasbench.trace.model import Trace

    reqs = trace.requests
    keep = 0
    if len(reqs) >= 2:
        for a, b in zip(reqs[0].hash_ids, reqs[1].hash_ids):
            if a != b:
                break
            keep += 1
    offset = id_span(reqs) * index
    moved = [dataclasses.replace(r, hash_ids=r.hash_ids[:keep] + [h + offset for h in r.hash_ids[keep:]]) for r in reqs]
    return Trace(moved, block_size=trace.block_size, source=trace.source, meta={**trace.meta, "hash_id_offset": offset})


def busy_rate(records: list[RequestRecord]) -> float:
    """Prompts per second a busy closed loop completed: ``(n - 1)`` completions over the time from its first to its
    last. The loop's streams keep the instance's queue full from the first wave to the end (the last requests are
    followed to their ends), so every completion gap is a service time; over the whole step rather than its window
    more of them are counted and one stall of the shared box weighs less (a 6 s window once counted 8 completions,
    6.7 prompts/s, where the same probe rerun at once gave 17.5)."""
    ends = sorted(r.end_s for r in records if r.ok and r.end_s is not None)
    return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) >= 2 and ends[-1] > ends[0] else 0.0


def window_tpot(records: list[RequestRecord], window: tuple[float, float]) -> tuple[np.ndarray, int]:
    """Each stream's mean time per output token over the tokens that arrived inside ``window`` (streams with at least
    two there), and how many streams had all of theirs arrive in one read. A request's own TPOT covers its whole
    life, so a short step that judges only the requests sent in its window sees the ones that finished by the drain
    -- the faster ones; the tokens inside the window are every stream's, whenever it began.

    A stream whose tokens all came at one instant says nothing of the time per token: the server held them and
    wrote them together (vLLM's API process, starved of CPU beside its engine on a 2-core box, delivered a 16-token
    decode of 38 ms in one read). Counted as 0 ms it would read as a free decode, so it is left out and counted."""
    w0, w1 = window
    out = []
    burst = 0
    for r in records:
        if not r.ok or len(r.chunk_times_s) < 2:
            continue
        times, toks = np.asarray(r.chunk_times_s), np.asarray(r.chunk_tokens)
        inside = (times >= w0) & (times < w1)
        idx = np.flatnonzero(inside)
        if len(idx) < 2:
            continue
        first, last = idx[0], idx[-1]
        tokens = int(toks[first + 1:last + 1].sum())
        if tokens > 0 and not came_in_one_read(times[first:last + 1]):
            out.append((times[last] - times[first]) / tokens)
        elif tokens > 0:
            burst += 1
    return np.array(out), burst


def came_in_one_read(chunk_times: Sequence[float]) -> bool:
    """Did these token-carrying chunks all arrive at one instant (the server held them and wrote them together)?"""
    return len(chunk_times) > 1 and chunk_times[0] == chunk_times[-1]


def decoding_at_once(records: list[RequestRecord], window: tuple[float, float]) -> float:
    """The streams an instance decoded at once: streams between their first token and their end, averaged over the
    part of ``window`` (run clock) in which at least one was decoding -- the batch the window's TPOT was measured at.

    Time the instance spent on no stream's decode (a stream's prefill, the client's turnaround between a stream's
    requests) is the probe's, not a smaller batch: averaged over the whole window, a closed loop of one stream read
    0.91 streams on a server that decodes one at a time, and CI's vLLM wrote a ``max_active`` below one, which
    ``plan`` refuses. A stream whose tokens all came in one read (:func:`window_tpot`) hid its first token: the server
    decoded it at some time between the send and that read, so it counts from its send (an upper bound by its
    one-block prefill; counted from the read, a closed loop of one such stream read 0.18 streams where vLLM ran ~1)."""
    w0, w1 = window
    spans: list[tuple[float, float]] = []
    for r in records:
        if r.first_token_s is None or r.end_s is None or not r.ok:
            continue
        one_read = came_in_one_read(r.chunk_times_s)
        start = r.actual_send_s if one_read and r.actual_send_s is not None else r.first_token_s
        a, b = max(w0, start), min(w1, r.end_s)
        if b > a:
            spans.append((a, b))
    busy, reach = 0.0, -math.inf
    for a, b in sorted(spans):          # the union of the spans: the time some stream was decoding
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return sum(b - a for a, b in spans) / busy if busy > 0 else 0.0


def _brief(entry: dict[str, Any], phase: str, scale: float) -> dict[str, Any]:
    """What the curves keep of a step: its load, verdict and latency figures in device seconds, and where it is."""
    summ = entry["summary"]
    ttft = summ.get("ttft_ms") or {}
    q_key = next((g["stat"] for g in entry["verdict"]["gates"] if g["metric"] == "ttft_ms"), "p50")
    return {"phase": phase, "load": entry["load"], "passed": entry["passed"], "slo_passed": entry["slo_passed"],
            "saturated": bool(entry["saturation"].get("saturated")), "dir": entry["dir"],
            "requests": (summ.get("requests") or {}).get("total"), "errors": summ.get("errors") or {},
            "ttft_p50_s": (ttft.get("p50") or math.nan) / 1e3 / scale,
            "ttft_q_s": (ttft.get(q_key) or math.nan) / 1e3 / scale,
            "rps": (summ.get("request_throughput_rps") or 0.0) * scale,
            "host_bound_share": summ.get("host_bound_share")}


def _fmt_s(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x * 1e3:,.0f} ms"
