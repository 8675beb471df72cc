"""What a sweep replays: a workload spec (regenerated per context bucket and sized per step) or a fixed
trace file.

A context bucket retargets the spec rather than filtering a trace: sessions start at 75-100% of the
bucket and grow up to it, so every request of the bucket's steps has a context near the bucket size and
the spec's prefix-hit target still holds (the generator scales the per-turn appends to meet it). The
number of sessions is raised so a step has enough requests to fill its duration at the offered load;
traces are cached by (bucket, sessions) since consecutive steps mostly need the same one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from paas_common.errors import InputError
from paasbench.trace.model import DEFAULT_BLOCK_SIZE, Trace
from paasbench.workload.dist import Dist


@dataclass
class Source:
    name: str
    spec: Any | None = None              # WorkloadSpec, or None for a trace file
    trace: Trace | None = None           # the fixed trace (--trace)
    seed: int = 0
    _cache: dict[tuple[int | None, int], Trace] = field(default_factory=dict)

    @classmethod
    def from_workload(cls, name_or_path: str, seed: int | None) -> "Source":
        from paasbench.workload import load_workload

        spec = load_workload(name_or_path)
        return cls(name=spec.name, spec=spec, seed=spec.seed if seed is None else seed)

    @classmethod
    def from_trace(cls, path: str, seed: int | None, *, tokenizer: str | None = None,
                   block_size: int | None = None) -> "Source":
        from paasbench.trace import load_trace

        trace = load_trace(path, block_size=block_size or DEFAULT_BLOCK_SIZE, tokenizer=tokenizer)
        return cls(name=str(path), trace=trace, seed=seed or 0)

    # ------------------------------------------------------------------ what the spec says for the sweep

    @property
    def server(self) -> dict[str, Any]:
        return dict(self.spec.server) if self.spec is not None else {}

    @property
    def slo(self) -> list[str]:
        return list(self.spec.slo) if self.spec is not None else []

    @property
    def sweep_defaults(self) -> dict[str, Any]:
        return dict(self.spec.sweep) if self.spec is not None else {}

    @property
    def claim(self) -> Any:
        """The published figures this workload reproduces (:class:`paasbench.cost.claim.Claim`), or None."""
        from paasbench.cost.claim import parse_claim

        return parse_claim(self.spec.claim, self.spec.source) if self.spec is not None else None

    @property
    def context_buckets(self) -> list[int]:
        return list(self.spec.context_buckets) if self.spec is not None else []

    def max_context_tokens(self) -> int:
        if self.spec is not None:
            return int(self.spec.cap_tokens)
        assert self.trace is not None
        return max((r.input_length for r in self.trace.requests), default=0)

    # ------------------------------------------------------------------------------------- traces

    def trace_for(self, bucket: int | None, *, requests: int | None = None, sessions: int | None = None) -> Trace:
        """A trace with at least ``requests`` requests / ``sessions`` sessions (workloads only; a trace
        file is replayed as it is and simply runs out)."""
        if self.spec is None:
            assert self.trace is not None
            return self.trace
        spec = self.spec if bucket is None else retarget(self.spec, bucket)
        # Sessions can end early (at the context cap), so the drawn turn count over-estimates requests:
        # start from that estimate, then double until the trace is long enough (bounded).
        want = max(spec.sessions, sessions or 0, math.ceil((requests or 0) / max(1.0, _mean(spec.turns))))
        n = 1 << max(0, math.ceil(math.log2(want)))     # powers of two: neighbouring steps share a trace
        for _ in range(8):
            trace = self._generate(spec, bucket, n)
            if len(trace) >= (requests or 0):
                break
            n *= 2
        return trace

    def _generate(self, spec: Any, bucket: int | None, sessions: int) -> Trace:
        key = (bucket, sessions)
        if key not in self._cache:
            from paasbench.workload import generate_trace

            self._cache[key] = generate_trace(dataclasses.replace(spec, sessions=sessions), self.seed)
        return self._cache[key]


def fresh_prefixes(trace: Trace, step_index: int) -> Trace:
    """The trace with every hash id moved into a range no other step uses.

    Every step replays the start of the same trace; without this, step k+1 would find step k's prompts
    in the server's prefix cache and report a hit ratio (and a TTFT) the workload does not have. The
    shift keeps each request's prefix structure (ids are prefix-chained, a constant offset preserves
    equality) and so the workload's own hit ratio, while making the text distinct across steps. Hash ids
    are the prompt (PromptBuilder seeds each block's text with its id), so this is the whole change.
    Literal prompts (HF datasets) cannot be shifted and are replayed as they are.
    """
    from paasbench.trace.loop import id_span, shift  # the same shift gives `run --loop` its fresh prefixes

    if step_index == 0:
        return trace
    offset = id_span(trace.requests) * step_index
    reqs = [shift(r, offset) for r in trace.requests]
    return Trace(reqs, block_size=trace.block_size, source=trace.source,
                 meta={**trace.meta, "hash_id_offset": offset})


def retarget(spec: Any, bucket: int) -> Any:
    """The spec with contexts moved into ``[0.75 * bucket, bucket]``."""
    lo = int(bucket * 0.75)
    shared = min(spec.shared_prefix_tokens, lo // 2)
    kw: dict[str, Any] = {"start_tokens": Dist("uniform", {"min": lo, "max": bucket}), "cap_tokens": bucket,
                          "shared_prefix_tokens": shared, "name": f"{spec.name}@{bucket}"}
    if spec.cold_tokens is not None:
        kw["cold_tokens"] = Dist("uniform", {"min": lo, "max": bucket})
    return dataclasses.replace(spec, **kw)


def _mean(d: Dist) -> float:
    p = d.params
    if d.kind == "fixed":
        return float(p["value"])
    if d.kind == "uniform":
        return (p["min"] + p["max"]) / 2
    if d.kind == "choice":
        w = p.get("weights") or [1.0] * len(p["values"])
        return sum(v * x for v, x in zip(p["values"], w)) / sum(w)
    return float(p.get("mean", 1.0))


def parse_buckets(text: str | None) -> list[int]:
    """``64K,128K,256K,400K`` (K = 1024 tokens, as context lengths are quoted) -> token counts."""
    if not text:
        return []
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        mult = 1024 if part[-1] in "kK" else (1024 * 1024 if part[-1] in "mM" else 1)
        digits = part[:-1] if mult != 1 else part
        try:
            value = int(float(digits) * mult)
        except ValueError:
            raise InputError(f"'{part}' is not a context length (e.g. 64K or 65536)", field="--context-buckets") from None
        if value <= 0:
            raise InputError(f"'{part}' must be positive", field="--context-buckets")
        out.append(value)
    return out
