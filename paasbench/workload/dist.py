"""Small, strict distributions for workload specs (lengths, turn counts, think times).

YAML forms: a bare number (fixed), or a mapping with ``dist`` and that kind's parameters:
``fixed {value}``, ``uniform {min, max}``, ``normal {mean, std}``, ``lognormal {mean, sigma}``,
``exponential {mean}``, ``choice {values, weights?}``. ``min``/``max`` clamp every kind. ``lognormal``'s
``mean`` is the mean of the samples (not of the log), so a spec reads in the units it produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paas_common.errors import InputError

_PARAMS: dict[str, tuple[set[str], set[str]]] = {  # kind -> (required, optional)
    "fixed": ({"value"}, set()),
    "uniform": ({"min", "max"}, set()),
    "normal": ({"mean", "std"}, {"min", "max"}),
    "lognormal": ({"mean", "sigma"}, {"min", "max"}),
    "exponential": ({"mean"}, {"min", "max"}),
    "choice": ({"values"}, {"weights", "min", "max"}),
}


@dataclass(frozen=True)
class Dist:
    kind: str
    params: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def parse(raw: Any, *, where: str, file: str | None = None, line: int | None = None) -> "Dist":
        def bad(msg: str, sub: str | None = None) -> InputError:
            return InputError(msg, file=file, line=line, field=f"{where}.{sub}" if sub else where)

        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return Dist("fixed", {"value": float(raw)})
        if not isinstance(raw, dict):
            raise bad(f"expected a number or a mapping with 'dist', got {raw!r}")
        kind = raw.get("dist")
        if kind not in _PARAMS:
            raise bad(f"unknown distribution {kind!r} (one of: {', '.join(_PARAMS)})", "dist")
        required, optional = _PARAMS[kind]
        for key in raw:
            if key != "dist" and key not in required | optional:
                raise bad(f"unknown key for a {kind} distribution (allowed: "
                          f"{', '.join(sorted(required | optional))})", key)
        for key in required:
            if key not in raw:
                raise bad(f"missing for a {kind} distribution", key)
        params = {k: v for k, v in raw.items() if k != "dist"}
        for key, v in params.items():
            if key in ("values", "weights"):
                if not isinstance(v, list) or not v or not all(_num(x) for x in v):
                    raise bad("must be a non-empty list of numbers", key)
            elif not _num(v):
                raise bad(f"must be a number, got {v!r}", key)
        if kind == "choice" and "weights" in params:
            w = params["weights"]
            if len(w) != len(params["values"]) or min(w) < 0 or sum(w) <= 0:
                raise bad("needs one non-negative weight per value, not all zero", "weights")
        for key in ("std", "sigma", "mean"):
            if key in params and params[key] < 0:
                raise bad("must be >= 0", key)
        lo, hi = params.get("min"), params.get("max")
        if lo is not None and hi is not None and lo > hi:
            raise bad(f"min {lo} > max {hi}", "min")
        return Dist(kind, params)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = self.params
        if self.kind == "fixed":
            x = np.full(n, float(p["value"]))
        elif self.kind == "uniform":
            x = rng.uniform(p["min"], p["max"], n)
        elif self.kind == "normal":
            x = rng.normal(p["mean"], p["std"], n)
        elif self.kind == "lognormal":
            sigma = float(p["sigma"])
            mu = math.log(max(p["mean"], 1e-12)) - sigma * sigma / 2
            x = rng.lognormal(mu, sigma, n)
        elif self.kind == "exponential":
            x = rng.exponential(p["mean"], n) if p["mean"] > 0 else np.zeros(n)
        else:  # choice
            values = np.asarray(p["values"], dtype=np.float64)
            w = np.asarray(p.get("weights", [1.0] * len(values)), dtype=np.float64)
            x = values[rng.choice(len(values), size=n, p=w / w.sum())]
        if self.kind != "uniform" and ("min" in p or "max" in p):
            x = np.clip(x, p.get("min", -np.inf), p.get("max", np.inf))
        return x

    def bounds(self) -> tuple[float, float]:
        """Smallest and largest value a sample can take (inf when unbounded)."""
        p = self.params
        if self.kind == "fixed":
            return float(p["value"]), float(p["value"])
        if self.kind == "choice":
            lo, hi = float(min(p["values"])), float(max(p["values"]))
        elif self.kind == "uniform":
            return float(p["min"]), float(p["max"])
        else:
            lo, hi = (0.0 if self.kind != "normal" else -math.inf), math.inf
        return max(lo, p.get("min", -math.inf)), min(hi, p.get("max", math.inf))


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
