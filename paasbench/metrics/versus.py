"""Client vs engine: the client's TTFT and prefix hit beside the engine's own, over the same requests.

The comparison is only worth printing when both sides count the same requests: a difference between a mean
over one set and a mean over another is not the time outside the engine, and can be negative (the quick start
once read client − engine −239 ms, because the engine's counters, read at the window start, took in the
warm-up's queued requests, slow, and left out the window's last ones). So the set is chosen first:

* **per request** -- when every request the summary's TTFT covers carries its own engine-side TTFT
  (``ttft_ms`` in ``paasbench_timings``: the bundled server's router, from accepting the request to its first
  token leaving), both sides cover exactly the summary's requests: TTFT over the window's successful requests,
  prefix hit over those served by the deadline (``metrics.summary``), the engine's from each request's usage
  (cached / prompt tokens), which is what the router's counters count;
* **counters** -- otherwise (vLLM, SGLang) the engine says only what its counters summed, and they cover
  every request sent between two idle scrapes (``prometheus.Watch``): so does the client's side here, warm-up
  included: TTFT over every request that got a first token (the histogram counts those), hit over the
  successful ones.

Either way both request counts are kept, and ``note`` says why the two sides may still differ (unequal
counts, an edge where the engine was not idle, failed requests whose prompts only the engine counted); a
negative difference always carries one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from paasbench.metrics.records import RequestRecord

TOLERANCE_MS = 1.0     # a negative difference smaller than this is the clocks' resolution


@dataclass(frozen=True, slots=True)
class Side:
    requests: int                    # the TTFT mean's requests
    ttft_mean_ms: float | None
    prefix_hit: float | None


@dataclass(frozen=True, slots=True)
class Versus:
    covers: str                      # "window" (per request) | "every request sent" (counters)
    client: Side
    engine: Side
    note: str | None = None

    @property
    def gap_ms(self) -> float | None:
        c, e = self.client.ttft_mean_ms, self.engine.ttft_mean_ms
        return c - e if c is not None and e is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gap_ms": self.gap_ms}


@dataclass(frozen=True, slots=True)
class _Row:
    """What the comparison needs of one record: a few numbers, so a run's records are read as a stream and
    never held whole (their chunk times are most of their size; docs/performance.md)."""

    ok: bool
    sent_s: float
    first_token_s: float | None
    own_ttft_ms: float | None
    prompt_tokens: int
    cached_tokens: int | None

    @classmethod
    def of(cls, r: RequestRecord) -> "_Row":
        return cls(r.error_kind is None, r.intended_send_s, r.first_token_s, _own_ttft(r),
                   r.prompt_tokens if r.prompt_tokens is not None else r.input_tokens_sent, r.cached_tokens)

    @property
    def ttft_ms(self) -> float:
        assert self.first_token_s is not None
        return 1e3 * (self.first_token_s - self.sent_s)


def _hit(rows: list[_Row]) -> float | None:
    """Σ cached / Σ prompt tokens, as the summary's ``prefix_hit_ratio``: a request that did not report its cached
    tokens counts as uncached; None when none did."""
    if not any(r.cached_tokens is not None for r in rows):
        return None
    total = sum(r.prompt_tokens for r in rows)
    return sum(r.cached_tokens or 0 for r in rows) / total if total else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _own_ttft(r: RequestRecord) -> float | None:
    v = (r.server_timings or {}).get("ttft_ms")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def compare(records: Iterable[RequestRecord], figures: dict[str, Any] | None, *,
            window: tuple[float, float] | None = None, drain_s: float = 0.0) -> dict[str, Any] | None:
    """The comparison for a run or a sweep step (``window``/``drain_s``: the summary's), as a dict for
    ``server_metrics.versus``; None when the engine gave no TTFT at all."""
    recs = [_Row.of(r) for r in records]
    w0, w1 = window if window is not None else (-math.inf, math.inf)
    deadline = w1 + drain_s if math.isfinite(w1) else math.inf
    measured = [r for r in recs if r.ok and w0 <= r.sent_s < w1 and r.first_token_s is not None]
    own = [r.own_ttft_ms for r in measured]
    if measured and all(v is not None for v in own):
        served = [r for r in measured if r.first_token_s is not None and r.first_token_s <= deadline]
        hit = _hit(served)
        out = Versus("window", Side(len(measured), _mean([r.ttft_ms for r in measured]), hit),
                     Side(len(own), _mean([v for v in own if v is not None]), hit))
        return _noted(out, []).to_dict()
    fig = figures or {}
    engine_ttft = (fig.get("means_ms") or {}).get("ttft")
    if engine_ttft is None:
        return None
    started = [r for r in recs if r.first_token_s is not None]
    ok = [r for r in recs if r.ok]
    out = Versus("every request sent", Side(len(started), _mean([r.ttft_ms for r in started]), _hit(ok)),
                 Side(int(round((fig.get("observations") or {}).get("ttft", 0.0))), engine_ttft,
                      fig.get("prefix_hit_ratio")))
    reasons = []
    w = fig.get("window") if isinstance(fig.get("window"), dict) else {}
    if w.get("idle_before") is False:
        reasons.append("the engine was busy when the first request was sent: its counters include earlier requests")
    if w.get("idle_after") is False:
        reasons.append(f"the engine was still busy {w.get('settle_s', 0):g} s after the last response: its counters "
                       "include requests the client no longer waited for, or another client's")
    if w.get("idle_before") is None or w.get("idle_after") is None:
        reasons.append("the engine reports no running/waiting gauges: whether it was idle at the edges is unknown")
    failed = len(recs) - len(ok)
    if failed:
        reasons.append(f"{failed} request(s) failed: the engine counted the prompts it scheduled for them, "
                       "the client's hit only the successful requests' usage")
    return _noted(out, reasons).to_dict()


def _noted(v: Versus, reasons: list[str]) -> Versus:
    """``v`` with its note: the reasons given, unequal counts, and a word for any negative difference."""
    if v.client.requests != v.engine.requests:
        reasons = [f"different requests: the client's mean is over {v.client.requests}, the engine's over "
                   f"{v.engine.requests}", *reasons]
    gap = v.gap_ms
    if gap is not None and gap < 0 and not reasons:
        reasons = ["within the clocks' resolution" if gap > -TOLERANCE_MS else
                   f"unexplained: the same {v.client.requests} requests on both sides, the engine's TTFT the longer"]
    return Versus(v.covers, v.client, v.engine, "; ".join(reasons) or None)
