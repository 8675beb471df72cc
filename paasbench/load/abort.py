"""Abort-on-fail (k6's ``abortOnFail``): stop a run as soon as an SLO gate is breached for good.

Only verdicts that more requests cannot overturn stop a run (see :func:`paasbench.metrics.slo.gates_breached_early`):
a ``max`` bound exceeded, a ``min`` bound undercut, or more failures than an ``error_rate`` bound allows for
the planned request count. Percentiles and means could still recover, so they are judged at the end only.
The monitor keeps running extremes per finished record, so it costs O(1) per request, not a re-summary.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from paasbench.metrics.records import RequestRecord
from paasbench.metrics.slo import Gate, gates_breached_early
from paasbench.metrics.summary import token_itls_ms


class AbortMonitor:
    """Callable for ``run_load(stop_when=...)``: a finished record in, a reason to stop (or None) out.

    Requests intended before ``warmup_s`` are ignored, as the summary ignores them.
    """

    def __init__(self, gates: Iterable[Gate], *, planned_requests: int | None, warmup_s: float = 0.0) -> None:
        self.gates = list(gates)
        self.planned, self.warmup_s = planned_requests, warmup_s
        self.failed = 0
        self.blocks: dict[str, dict[str, Any]] = {}

    def _see(self, key: str, value: float | None) -> None:
        if value is None or math.isnan(value):
            return
        b = self.blocks.setdefault(key, {"count": 0, "max": value, "min": value})
        b["count"] += 1
        b["max"], b["min"] = max(b["max"], value), min(b["min"], value)

    def __call__(self, rec: RequestRecord) -> str | None:
        if rec.intended_send_s < self.warmup_s:
            return None
        if not rec.ok:
            self.failed += 1
        elif rec.first_token_s is not None and rec.end_s is not None:
            ttft = (rec.first_token_s - rec.intended_send_s) * 1e3
            e2e = (rec.end_s - rec.intended_send_s) * 1e3
            self._see("ttft_ms", ttft)
            self._see("e2e_ms", e2e)
            if rec.actual_send_s is not None:
                self._see("schedule_lag_ms", (rec.actual_send_s - rec.intended_send_s) * 1e3)
            if rec.completion_tokens and rec.completion_tokens >= 2:
                self._see("tpot_ms", (e2e - ttft) / (rec.completion_tokens - 1))
            itl = token_itls_ms(rec.chunk_times_s, rec.chunk_tokens)
            if itl.size:  # the summary's ITL block is over every token: its extremes are per-token extremes
                self._see("itl_ms", float(itl.max()))
                self._see("itl_ms", float(itl.min()))
        partial = {**self.blocks, "requests": {"failed": self.failed}}
        if not gates_breached_early(self.gates, partial, planned_requests=self.planned):
            return None
        broken = [g.label for g in self.gates if gates_breached_early([g], partial, planned_requests=self.planned)]
        return "SLO breached for good: " + "; ".join(broken)
