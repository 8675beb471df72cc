"""Where each context bucket's load search starts: from what is already known, not from ``start``.

A white-paper step lasts minutes, so a search that climbs 0.05 -> 1.6 req/s spends its budget on loads nobody
doubted and never reaches the larger buckets (issue #20: 30 minutes, one bucket, and that one only a lower
bound). A bucket's first load is instead:

* on the rate and session-rate axes, after a bucket with results: half a search step below that bucket's
  measured capacity (the geometric middle of its bracket) scaled to this bucket. With two buckets measured the
  scale is a power law in the mean input tokens fitted to the last two, ``c1 * (t1 / t) ** alpha`` (alpha kept in
  [0, 2]): what was measured beats any model. With one, on the twin, it is the ratio of the twin's roofline bounds
  (the capacity taken as the same share of its bound), and elsewhere the same input TPM (``alpha = 1``). On the
  twin the capacity fell with the context slower than input TPM, at a rate of its own per workload: white-paper
  64K -> 128K about 2.97 -> 1.80 req/s (x0.61; the bounds x0.83, input TPM x0.50), and the 4K -> 8K agent workload
  of tests/test_sweep_e2e.py 11.5 -> 12.4 (x1.08; the bounds x0.84, input TPM x0.50) (reports/start-estimate/).
  The bounds' ratio was off by 1.36x at most, the same input TPM by up to 2.2x. Half a step below, so that one
  step either side brackets it;
* for the first bucket on the twin (rate axis, no ``--start`` given): a search step below the twin's roofline
  bound (:mod:`reference_server.sim.capacity`), the most its roofline allows with no queueing and the largest batch
  its KV holds. It is no strict bound (the 8K bucket above held 12.4 req/s against a bound of 10.8) but it is close:
  3.14 req/s at 64K, where the twin holds 2.95 for 30 minutes and not 3.0; 12.9 at 4K against 11.5. A step below
  passes on all three (0.62-0.79 of the capacity), and a first step that passes is cheaper than one that fails.
  Two steps below, as when the bound ran 1.4-4x above a twin slowed by its host, every white-paper 64K sweep spent
  its first step, 128-158 s, at about half the capacity;
* for the first bucket of a certified search elsewhere (rate axis, no ``--start``): a step below the most a
  short closed-loop throughput probe served (:mod:`paasbench.sweep.probe`);
* otherwise ``start`` (the command line's, the workload's, or the default).

The estimate only places the first step: the search still measures, brackets geometrically from there in
finer steps than a climb from ``start`` and bisects (:mod:`paasbench.sweep.search`), so a poor estimate costs
steps, never a wrong figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from paasbench.sweep.search import SearchResult

ESTIMATE_REQUESTS = 512   # requests of a bucket's trace that its cost figures average over


@dataclass(slots=True)
class Start:
    load: float
    why: str                       # how it was found, for the console and sweep.json
    estimated: bool = True         # False: the configured start


@dataclass
class BucketStarts:
    """``start(bucket, earlier)``: the first load of ``bucket``'s search, given the searches before it."""

    axis: str
    default: float                 # the configured start
    explicit: bool                 # --start was given: the first bucket starts there
    trace_for: Callable[[int | None], Any]            # bucket -> a trace of it (ESTIMATE_REQUESTS or more)
    server: Mapping[str, Any] | None = None           # the embedded server's section; None for a --target
    step: float = 2 ** 0.5                            # the search's factor from an estimate: the first bucket
                                                      # starts one such step below the twin's bound
    probe: Callable[[int | None], Any] | None = None  # bucket -> a ProbeResult (or None); None: no probe
    _twin: dict[int | None, float | None] = field(default_factory=dict)
    _tokens: dict[int | None, float] = field(default_factory=dict)

    def start(self, bucket: int | None, earlier: Mapping[int | None, SearchResult]) -> Start:
        known = [(b, c) for b, c in ((b, measured_capacity(r, self.step)) for b, r in earlier.items()) if c]
        if known and self.axis in ("rate", "session-rate"):
            (b1, (c1, how)) = known[-1]
            ratio, fit = self._scale(known, bucket)
            load = _nice(c1 * ratio / self.step ** 0.5)
            if load > 0:
                return Start(load, f"half a step below {_label(b1)}'s capacity {c1:.3g} ({how}) x {ratio:.3g} "
                                   f"({fit}; {_label(b1)} -> {_label(bucket)})")
        if not self.explicit and self.axis == "rate":
            est = self.twin_rps(bucket)
            if est:
                return Start(_nice(est / self.step), f"a step (/{self.step:.3g}) below the twin's "
                                                     f"roofline bound {est:.3g} req/s at {_label(bucket)}")
            probed = self.probe(bucket) if self.probe is not None else None
            if probed is not None:
                peak = probed.peak
                return Start(_nice(peak.served_rps / self.step),
                             f"a step (/{self.step:.3g}) below the {peak.served_rps:.3g} req/s "
                             f"{peak.streams} closed loops served at {_label(bucket)} (throughput probe: "
                             f"{len(probed.levels)} levels, {probed.window_s:g} s of windows)")
        return Start(self.default, "the configured start", estimated=False)

    def _scale(self, known: list[tuple[int | None, tuple[float, str]]], bucket: int | None) -> tuple[float, str]:
        """How capacity scales from the last bucket measured (``known``: (bucket, (capacity, how)) in order) to
        ``bucket``, and how that is known: the power law fitted to the last two buckets measured; with one, the twin's
        roofline bounds' ratio (the measured capacity is taken as the same share of the bound); with neither, the
        same input TPM."""
        b1, (c1, _) = known[-1]
        t1, t = self.mean_tokens(b1), self.mean_tokens(bucket)
        if len(known) >= 2:
            b0, (c0, _) = known[-2]
            spread = math.log(t1 / self.mean_tokens(b0))
            if abs(spread) > 1e-6:
                alpha = min(2.0, max(0.0, math.log(c0 / c1) / spread))
                return (t1 / t) ** alpha, f"mean input tokens^-{alpha:.2f}, fitted to {_label(b0)} and {_label(b1)}"
        here, there = self.twin_rps(b1), self.twin_rps(bucket)
        if here and there:
            return there / here, f"the twin's roofline bounds {here:.3g} -> {there:.3g} req/s"
        return t1 / t, "mean input tokens^-1.00, constant input TPM"

    def twin_rps(self, bucket: int | None) -> float | None:
        """The embedded sim twin's capacity estimate in req/s at ``bucket``; None for another target."""
        if self.server is None or self.server.get("engine") != "sim":
            return None
        if bucket not in self._twin:
            from paasbench.sweep.embedded import server_args
            from reference_server.options import parse_flags, server_config
            from reference_server.sim.capacity import estimate_capacity

            est = estimate_capacity(server_config(parse_flags(server_args(self.server))),
                                    request_work(self.trace_for(bucket)))
            self._twin[bucket] = est.rps if est is not None and math.isfinite(est.rps) and est.rps > 0 else None
        return self._twin[bucket]

    def mean_tokens(self, bucket: int | None) -> float:
        if bucket not in self._tokens:
            reqs = self.trace_for(bucket).requests[:ESTIMATE_REQUESTS]
            self._tokens[bucket] = max(1.0, sum(r.input_length for r in reqs) / max(1, len(reqs)))
        return self._tokens[bucket]


def measured_capacity(result: SearchResult, step: float) -> tuple[float, str] | None:
    """Where a bracketed search puts the capacity, and how it knows: the geometric middle of its bracket; the best
    passing load when nothing failed above it (a lower bound); a step below the lowest tried load when nothing
    passed; None before any step."""
    if result.bracket is not None:
        lo, hi = result.bracket
        return math.sqrt(lo * hi), f"between {lo:.3g} and {hi:.3g}"
    if result.best is not None:
        return result.best.load, "its best passing load; nothing failed above it"
    low = result.anchor
    return (low / step, f"a step below {low:.3g}, where nothing passed") if low else None


def request_work(trace: Any) -> list[Any]:
    """The first ``ESTIMATE_REQUESTS`` requests of ``trace`` as the twin's estimate wants them: input tokens,
    the tokens an infinite prefix cache fed by the requests before holds (as ``trace inspect`` counts the
    hit), and output tokens."""
    from paasbench.trace.inspect import prefix_hits
    from paasbench.trace.model import Trace
    from reference_server.sim.capacity import RequestWork

    head = Trace(trace.requests[:ESTIMATE_REQUESTS], block_size=trace.block_size)
    hits, _ = prefix_hits(head)
    return [RequestWork(r.input_length, int(h), r.output_length) for r, h in zip(head.requests, hits)]


def _nice(x: float) -> float:
    return float(f"{x:.3g}") if x > 0 and math.isfinite(x) else 0.0


def _label(bucket: int | None) -> str:
    return f"{bucket // 1024}K" if bucket else "the workload"
