"""Where each context bucket's load search starts: from what is already known, not from ``start``.

A white-paper step lasts 2.5 minutes, so a search that climbs 0.05 -> 1.6 req/s spends its budget on loads
nobody doubted and never reaches the larger buckets (issue #20: 30 minutes, one bucket, and that one only a
lower bound). A bucket's first load is instead:

* on the rate and session-rate axes, after a bucket with results: that bucket's best passing load (its
  lowest tried load if none passed) times the ratio of the two buckets' costs. On the embedded ``sim`` twin
  the ratio is that of the twin's own roofline capacity estimates (:mod:`reference_server.sim.capacity`:
  prefill grows linearly to quadratically with the context, and decode batches shrink as KV fills); on any
  other target it is the ratio of the buckets' mean input tokens, all the search can know of a black box;
* for the first bucket on the twin (rate axis, no ``--start`` given): one search step below the twin's
  estimate, which is a bound (no queueing, the largest batch KV allows) the capacity does not reach;
* otherwise ``start`` (the command line's, the workload's, or the default).

The anchor is the previous bucket's best passing load when its bracketing ended, else its lowest tried load: the
low end of what is known, since a step just past capacity costs about twice a passing one. The estimate
only places the first step: the search still measures, brackets geometrically from there in finer steps than
a climb from ``start`` and bisects (:mod:`paasbench.sweep.search`), so a poor estimate costs steps, never a
wrong figure.
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
    _twin: dict[int | None, float | None] = field(default_factory=dict)
    _tokens: dict[int | None, float] = field(default_factory=dict)

    def start(self, bucket: int | None, earlier: Mapping[int | None, SearchResult]) -> Start:
        prev = next(((b, r) for b, r in reversed(list(earlier.items())) if r.anchor is not None), None)
        if prev is not None and self.axis in ("rate", "session-rate"):
            b0, res = prev
            anchor = res.anchor
            assert anchor is not None
            what = "best passing load" if res.best is not None else "lowest tried load (none passed)"
            t0, t1 = self.twin_rps(b0), self.twin_rps(bucket)
            if t0 and t1:
                ratio, by = t1 / t0, "the twin's roofline capacity"
            else:
                ratio, by = self.mean_tokens(b0) / self.mean_tokens(bucket), "mean input tokens"
            load = _nice(anchor * ratio)
            if load > 0:
                return Start(load, f"{_label(b0)}'s {what} {anchor:.3g} x {ratio:.3g} ({by}, {_label(b0)} -> "
                                   f"{_label(bucket)})")
        if not self.explicit and self.axis == "rate":
            est = self.twin_rps(bucket)
            if est:
                return Start(_nice(est / self.step), f"one step (/{self.step:.3g}) below the twin's roofline bound "
                                                     f"{est:.3g} req/s at {_label(bucket)}")
        return Start(self.default, "the configured start", estimated=False)

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
