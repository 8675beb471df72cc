"""Pool curves: what one instance of a pool does, measured (or, in rapid mode, computed), kept as JSON.

A plan is sized from two curves per card, the ones the probes measure (:mod:`paasbench.plan.probes`):

* the **prefill curve**, one point per context bucket at the traffic's prefix hit: the instance-seconds one prompt
  takes (``service_s``: one over the prompts per second a busy instance completes), its TTFT with nothing queued
  (``base_ttft_s``), and, measured under increasing open-loop load, the highest rate at which one instance still met
  the TTFT SLO (``slo_rps``, the check of the queueing model at one instance). A prompt's cost is carried as seconds
  per uncached token at the mean position of those tokens (``context - uncached / 2``): the linear layers cost the
  same per token anywhere, attention grows with the position, so a cold 80K first turn and a warm 6K append to a
  200K context are both priced where their tokens sit;
* the **decode curve**, one point per context the traffic decodes at: TPOT against the streams decoding at once,
  and the most streams (``max_active``) one instance holds with TPOT within the SLO -- or, with no TPOT SLO, the most
  it admits (its KV and batch cap).

Every time is in the device's own seconds: curves measured on the twin at ``--sim-time-scale s`` are divided by
``s`` when they are written (the scale is recorded), so a plan never mixes a slowed twin's seconds with the
traffic's. The file keeps the command that made it, the box's load average while it ran, and each probe step.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from paas_common.errors import InputError

SCHEMA = "paasbench.plan-curves/1"
POOLS = ("prefill", "decode", "mixed")


@dataclass(slots=True)
class Instance:
    """What one instance of the pool is: the card, how many cards, how many fit a machine."""

    machine_type: str                  # the card's name (a device profile's, or what the user called it)
    cards_per_instance: int
    cards_per_machine: int
    model: str | None = None
    kv_tokens: int | None = None       # KV one instance holds, when known
    chunk_tokens: int | None = None    # prefill tokens per step beside running decodes (mixed and decode workers)

    @property
    def instances_per_machine(self) -> float:
        return self.cards_per_machine / self.cards_per_instance

    def machines(self, instances: int) -> int:
        """Machines ``instances`` instances occupy: whole machines, several instances to one when they fit."""
        return math.ceil(instances * self.cards_per_instance / self.cards_per_machine - 1e-9) if instances else 0

    def held(self, machines: int) -> int:
        """Instances ``machines`` machines hold."""
        return int(machines * self.cards_per_machine // self.cards_per_instance)


@dataclass(slots=True)
class PrefillPoint:
    context: int                       # prompt tokens of the probe's requests
    hit: float                         # cached / prompt tokens they were sent at
    uncached: float                    # mean uncached tokens per prompt
    service_s: float                   # instance-seconds per prompt the queueing model uses (busy_service_s, or
                                       # its fit to the steps under load when there are any: ``fit``)
    base_ttft_s: list[float]           # TTFT of prompts sent one at a time (nothing queued), seconds
    slo_rps: float | None = None       # highest open-loop rate one instance met the TTFT SLO at (None: not probed)
    slo_failed_rps: float | None = None  # the lowest rate above it that failed
    steps: list[dict[str, Any]] = field(default_factory=list)
    busy_service_s: float | None = None  # 1 / prompts per second a busy instance completed (closed loop)
    fit: dict[str, Any] | None = None  # the service time fitted to the open-loop steps: per step, and the median

    @property
    def position(self) -> float:
        """Mean position of the uncached tokens: where their attention cost sits."""
        return self.context - self.uncached / 2

    @property
    def seconds_per_token(self) -> float:
        return self.service_s / max(1.0, self.uncached)

    @property
    def fixed_s(self) -> float:
        """TTFT with nothing queued beyond the prefill's own busy time: KV transfer, first decode step, HTTP."""
        base = sum(self.base_ttft_s) / len(self.base_ttft_s) if self.base_ttft_s else self.service_s
        return max(0.0, base - self.service_s)


@dataclass(slots=True)
class DecodePoint:
    context: int                       # tokens in context while decoding (prompt + half the output)
    output_tokens: int                 # the probe's output length
    max_active: float                  # streams one instance holds within the TPOT SLO (or admits, without one)
    tpot_s: float                      # TPOT at max_active
    limit: str                         # why max_active stops there: "tpot" | "admission" | "probe"
    table: list[tuple[float, float]] = field(default_factory=list)   # (streams decoding, TPOT s), ascending
    steps: list[dict[str, Any]] = field(default_factory=list)
    admits: float | None = None        # streams the instance admits at this context at all (its KV and batch cap),
                                       # whatever their TPOT; None: not known (max_active stands in for it)

    def tpot_at(self, active: float) -> float:
        """TPOT at ``active`` streams, linear between the measured ones (clamped at the ends)."""
        return interpolate(self.table or [(self.max_active, self.tpot_s)], active)

    def active_at(self, tpot_limit_s: float) -> float:
        """The most streams whose TPOT is within ``tpot_limit_s`` (linear between measured ones), never more than
        ``max_active``; 0 when even one stream is slower."""
        table = sorted(self.table or [(self.max_active, self.tpot_s)])
        if table[0][1] > tpot_limit_s:
            return 0.0
        best = table[0][0]
        for (b0, t0), (b1, t1) in zip(table, table[1:]):
            if t1 <= tpot_limit_s:
                best = b1
                continue
            best = b0 + (b1 - b0) * (tpot_limit_s - t0) / (t1 - t0) if t1 > t0 else b0
            break
        return min(best, self.max_active)


@dataclass(slots=True)
class PoolCurve:
    instance: Instance
    prefill: list[PrefillPoint] = field(default_factory=list)
    decode: list[DecodePoint] = field(default_factory=list)

    # ---- the prefill curve, for prompts of ``uncached`` tokens after ``cached`` cached ones (arrays)
    def service_s(self, cached: Any, uncached: Any) -> np.ndarray:
        """Instance-seconds of each prompt: its uncached tokens at the seconds per token of their mean position
        (linear between the curve's points; below the first, the first's; past the last, along the last segment)."""
        pts = sorted(self.prefill, key=lambda p: p.position)
        if not pts:
            raise InputError("this pool has no prefill curve", field="--curves")
        u = np.maximum(np.asarray(uncached, dtype=float), 0.0)
        pos = np.asarray(cached, dtype=float) + u / 2
        return u * _linear(np.array([p.position for p in pts]), np.array([p.seconds_per_token for p in pts]), pos)

    def fixed_s(self, contexts: Any) -> np.ndarray:
        pts = sorted(self.prefill, key=lambda p: p.context)
        return np.interp(np.asarray(contexts, dtype=float), [p.context for p in pts], [p.fixed_s for p in pts])

    # ---- the decode curve, for streams at ``contexts`` (arrays: one value per stream)
    def _decode_points(self) -> list[DecodePoint]:
        pts = sorted(self.decode, key=lambda p: p.context)
        if not pts:
            raise InputError("this pool has no decode curve", field="--curves")
        return pts

    def max_active(self, contexts: Any, tpot_limit_s: float | None = None) -> np.ndarray:
        """Streams one instance holds at each of ``contexts`` (with ``tpot_limit_s``: those whose TPOT is within it,
        from each point's table): between measured contexts linear; past the longest, scaled down as KV is
        (``B* x c_max / c``, one at least); below the shortest, the shortest's (never more than measured)."""
        pts = self._decode_points()
        xs = np.array([p.context for p in pts], dtype=float)
        ys = np.array([p.max_active if tpot_limit_s is None else p.active_at(tpot_limit_s) for p in pts])
        c = np.asarray(contexts, dtype=float)
        # past the longest context measured: fewer, as its KV would allow, but one stream at least (it was measured
        # holding more at a shorter context; a curve cannot say one does not fit)
        beyond = np.maximum(np.minimum(1.0, ys[-1]), ys[-1] * xs[-1] / np.maximum(c, 1.0))
        return np.where(c > xs[-1], beyond, np.interp(c, xs, ys))

    def admits(self, contexts: Any) -> np.ndarray:
        """Streams one instance admits at each of ``contexts`` (beyond them a stream waits for its first token):
        interpolated like :meth:`max_active`, each point's ``admits`` or, unknown, its ``max_active``."""
        pts = self._decode_points()
        xs = np.array([p.context for p in pts], dtype=float)
        ys = np.array([p.admits if p.admits else p.max_active for p in pts])
        c = np.asarray(contexts, dtype=float)
        return np.where(c > xs[-1], ys[-1] * xs[-1] / np.maximum(c, 1.0), np.interp(c, xs, ys))

    def tpot_s(self, contexts: Any, active: Any = None) -> np.ndarray:
        """TPOT at each of ``contexts`` with ``active`` streams each (default: the most the instance holds there):
        linear in the streams along each point's table, then linear in the context between points, continued past
        the longest context along its last segment."""
        pts = self._decode_points()
        c = np.asarray(contexts, dtype=float)
        per_point = np.array([np.full(c.shape, p.tpot_s) if active is None else
                              np.interp(np.asarray(active, dtype=float), *zip(*sorted(p.table or [(p.max_active, p.tpot_s)])))
                              for p in pts])                                  # [points, streams]
        if len(pts) == 1:
            return per_point[0]
        xs = np.array([p.context for p in pts], dtype=float)
        k = np.clip(np.searchsorted(xs, c) - 1, 0, len(xs) - 2)             # the segment each stream falls in
        w = (c - xs[k]) / (xs[k + 1] - xs[k])
        w = np.where(c < xs[0], 0.0, w)                                     # clamped below, extrapolated above
        idx = np.arange(c.size).reshape(c.shape)
        y0, y1 = per_point[k, idx], per_point[k + 1, idx]
        return np.maximum(y0 + (y1 - y0) * w, np.where(c > xs[-1], y1, 0.0))


@dataclass(slots=True)
class Curves:
    made_by: dict[str, Any]            # command, mode (probe | twin | rapid), target or profiles, loadavg, when
    slo: list[str]                     # the gates the probes judged by
    pools: dict[str, PoolCurve]
    schema: str = SCHEMA

    def pool(self, name: str) -> PoolCurve:
        if name not in self.pools:
            raise InputError(f"no {name} pool in these curves (pools: {', '.join(self.pools) or 'none'}); measure it "
                             f"with `paasbench plan-curves --pools {name}`", field="--curves")
        return self.pools[name]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _linear(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """np.interp, clamped below, continued past the last point along the last segment (never below its value)."""
    y = np.interp(x, xs, ys)
    if len(xs) >= 2 and xs[-1] > xs[-2]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        y = np.where(x > xs[-1], np.maximum(ys[-1], ys[-1] + slope * (x - xs[-1])), y)
    return y


def interpolate(points: list[tuple[float, float]], x: float, *, extrapolate_above: bool = False) -> float:
    """Piecewise-linear through ``points`` (sorted by x); clamped at both ends, or, with ``extrapolate_above``,
    continued past the last point along the last segment (costs that grow with the context keep growing)."""
    if not points:
        raise ValueError("no points")
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    if not extrapolate_above:
        return points[-1][1]
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return max(y1, y1 + (y1 - y0) * (x - x1) / (x1 - x0)) if x1 > x0 else y1


def save(curves: Curves, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(curves.to_dict(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def load(path: str | os.PathLike[str]) -> Curves:
    """Curves from their JSON; a file that is not one names the file and the field at fault (exit 2)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read curves: {exc.strerror or exc}", file=str(path)) from None
    except ValueError as exc:
        raise InputError(f"not JSON: {exc}", file=str(path)) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise InputError(f"not a curves file (schema {SCHEMA}); make one with `paasbench plan-curves`",
                         file=str(path), field="schema")
    pools: dict[str, PoolCurve] = {}
    for name, pool in (data.get("pools") or {}).items():
        where = f"pools.{name}"
        try:
            inst = Instance(**pool["instance"])
            pre = [PrefillPoint(**p) for p in pool.get("prefill") or []]
            dec = [DecodePoint(**{**p, "table": [tuple(t) for t in p.get("table") or []]}) for p in pool.get("decode") or []]
        except (KeyError, TypeError) as exc:
            raise InputError(f"malformed pool curve: {exc}", file=str(path), field=where) from None
        if name not in POOLS:
            raise InputError(f"unknown pool (known: {', '.join(POOLS)})", file=str(path), field=where)
        for p in pre:
            if not (p.service_s > 0 and p.uncached >= 1 and p.context >= 1):
                raise InputError("a prefill point needs service_s > 0, uncached >= 1 and context >= 1",
                                 file=str(path), field=f"{where}.prefill")
        for d in dec:
            if not (d.max_active >= 1 and d.tpot_s > 0):
                raise InputError("a decode point needs max_active >= 1 and tpot_s > 0", file=str(path),
                                 field=f"{where}.decode")
        pools[name] = PoolCurve(inst, pre, dec)
    return Curves(made_by=data.get("made_by") or {}, slo=list(data.get("slo") or []), pools=pools)
