"""The traffic a plan is for: a rate (input TPM or requests/s) of a workload's request mix.

The mix is what a server that has served the workload for a while sees -- the sweep's steady-state mix
(:func:`paasbench.sweep.step.conditioned_poisson`: sessions in flight by Little's law, each turn after its
predecessor) -- and each request's prefix reuse is counted the one way paasbench counts it (an infinite cache fed by
every request sent before it, ``trace inspect``'s definition): a request of ``input`` tokens has ``cached`` of them
in a cache and needs ``input - cached`` prefilled. That is where the plan sizes with prefix reuse: prefill work is
the uncached tokens at their positions, not the prompt. ``--traffic`` in TPM counts every input token, cached or
not (the white paper's 5.8M input TPM), as a sweep's ``input_tpm`` does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from paas_common.errors import InputError

MIX_REQUESTS = 512          # requests of the steady mix a plan averages over


@dataclass(frozen=True, slots=True)
class Request:
    input: int
    cached: int                # of the input, in a prefix cache when it arrives (infinite cache)
    output: int

    @property
    def uncached(self) -> int:
        return max(1, self.input - self.cached)   # the last prompt token is always computed


@dataclass(frozen=True)
class Traffic:
    name: str                   # the workload or trace
    requests: tuple[Request, ...]
    rps: float                  # arrivals per second (Poisson)
    asked: str = ""             # --traffic as given
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_input(self) -> float:
        return float(np.mean([r.input for r in self.requests]))

    @property
    def mean_output(self) -> float:
        return float(np.mean([r.output for r in self.requests]))

    @property
    def hit(self) -> float:
        """Token-weighted prefix hit of the mix: cached / input tokens."""
        return sum(r.cached for r in self.requests) / max(1, sum(r.input for r in self.requests))

    @property
    def input_tpm(self) -> float:
        return self.rps * self.mean_input * 60.0

    @property
    def output_tpm(self) -> float:
        return self.rps * self.mean_output * 60.0

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """input, cached, uncached, output of every request of the mix (float arrays)."""
        cached = self.__dict__.get("_arrays")
        if cached is None:
            cached = {k: np.array([getattr(r, k) for r in self.requests], dtype=float)
                      for k in ("input", "cached", "uncached", "output")}
            object.__setattr__(self, "_arrays", cached)
        return cached

    def at_rps(self, rps: float) -> "Traffic":
        return replace(self, rps=rps)

    def at_tpm(self, tpm: float) -> "Traffic":
        return replace(self, rps=tpm / 60.0 / self.mean_input)

    def to_dict(self) -> dict[str, Any]:
        ins = np.array([r.input for r in self.requests])
        return {"name": self.name, "asked": self.asked, "rps": self.rps, "input_tpm": self.input_tpm,
                "output_tpm": self.output_tpm, "hit": self.hit, "mean_input": self.mean_input,
                "mean_output": self.mean_output, "requests": len(self.requests),
                "input_p10": float(np.percentile(ins, 10)), "input_p50": float(np.percentile(ins, 50)),
                "input_p90": float(np.percentile(ins, 90)), "mean_uncached": float(np.mean([r.uncached for r in self.requests])),
                **self.meta}


_RATE = re.compile(r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*(?P<mult>[kKmMgG]?)\s*(?P<unit>[A-Za-z/]*)\s*$")


def parse_traffic(text: str) -> tuple[float, str]:
    """``5.8M`` / ``5.8M TPM`` / ``5800000tpm`` -> (5.8e6, "tpm"); ``2 req/s`` / ``2rps`` -> (2.0, "rps")."""
    m = _RATE.match(str(text))
    unit = (m.group("unit").lower() if m else "") or "tpm"
    if not m or unit not in ("tpm", "rps", "req/s", "r/s"):
        raise InputError(f"{text!r} is not a traffic: input tokens per minute (5.8M, 5.8M TPM) or requests per "
                         "second (2 req/s)", field="--traffic")
    value = float(m.group("num")) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group("mult").lower()]
    if not value > 0 or not math.isfinite(value):
        raise InputError(f"must be > 0, got {text!r}", field="--traffic")
    return value, "tpm" if unit == "tpm" else "rps"


def traffic_mix(source: Any, rps: float, seed: int = 0, requests: int = MIX_REQUESTS) -> list[Request]:
    """``requests`` requests of ``source``'s steady mix at ``rps`` (a :class:`paasbench.sweep.source.Source`), each
    with the tokens a cache fed by everything sent before it holds. A turn is sent only after its session's previous
    turn has ended (:class:`paasbench.load.schedule.Turns`), so that turn's prefix is in the cache when it comes."""
    from paasbench.sweep.step import StepPlan, conditioned_poisson
    from paasbench.trace.inspect import prefix_hits

    warm = max(1, requests // 4)
    plan = StepPlan(axis="rate", warmup_s=warm / rps, duration_s=requests / rps, seed=seed)
    trace = plan.trace(source, None, plan.trace_size(rps), rps)
    sent = conditioned_poisson(trace, rps, plan.total_s, seed, plan.window)
    hits, _ = prefix_hits(sent)
    lo, hi = plan.window
    out = [Request(r.input_length, int(h), r.output_length) for r, h in zip(sent.requests, hits)
           if lo * 1e3 <= r.arrival_ms < hi * 1e3]
    if not out:
        raise InputError("the workload has no requests to plan for", field="--workload")
    return out


def traffic_for(source: Any, asked: str, seed: int = 0) -> Traffic:
    """The traffic ``--traffic asked`` names over ``source``'s steady mix. The mix depends a little on the rate (the
    sessions in flight), so a TPM is turned into a rate on a first mix and the mix drawn again at that rate."""
    value, unit = parse_traffic(asked)
    rps = value if unit == "rps" else None
    mix = traffic_mix(source, rps or 1.0, seed)
    if rps is None:
        rps = value / 60.0 / float(np.mean([r.input for r in mix]))
        mix = traffic_mix(source, rps, seed)
        rps = value / 60.0 / float(np.mean([r.input for r in mix]))
    return Traffic(source.name, tuple(mix), rps, asked)
