"""Fault injection for the reference server: off unless ``--fault-spec`` is given.

Why it lives in the server: a benchmark harness is only trustworthy if every way a real server can
misbehave ends in the right error record, and the server's own recovery paths (KV integrity checks,
worker supervision) are only trustworthy if they are exercised by real requests. This module decides
*which* request gets *which* fault; the layer that owns the behaviour applies it:

* HTTP layer (:mod:`reference_server.api`): ``http_500``, ``http_503``, ``http_429`` (with
  ``Retry-After``), and, on a streaming response, ``reset`` (TCP RST after ``after_tokens`` chunks),
  ``stall`` (stop sending for ``seconds``, the socket kept open), ``malformed_sse`` (a ``data:`` line
  that is not JSON), ``truncated_json`` (a JSON chunk cut short), ``zero_tokens`` (a 200 stream with
  no token, then ``[DONE]``), ``slow_drip`` (``seconds`` between chunks);
* router (:mod:`reference_server.router`): ``kv_corrupt`` (the prefill worker flips one byte of the
  request's KV transfer), ``kv_range`` (it ships a block range the decode worker did not ask for),
  ``kv_delay`` (its KV is held ``seconds`` in flight: written to the transport, not yet announced),
  ``kill_prefill`` (SIGKILL of the request's prefill worker while it prefills), ``kill_decode`` /
  ``pause_decode`` (SIGKILL / SIGSTOP of its decode worker after ``after_tokens`` chunks; a paused one
  gets SIGCONT after ``seconds``), ``pause_prefill``.

A spec is JSON (inline or a file): ``{"seed": 0, "rules": [{"kind": "http_503", "every": 10},
{"kind": "stall", "prob": 0.02, "seconds": 30}]}``. Per request, in arrival order: a rule with
``every: N`` fires on every N-th request; otherwise one seeded uniform draw picks at most one ``prob``
rule (their probabilities stack, so they must sum to <= 1). ``times`` caps how often a rule fires.
The same spec and the same arrival order give the same faults. ``POST /admin/faults`` (registered only
when the flag is set; behind the API key like every route) replaces the plan; ``GET`` shows it with
the counts of what fired.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any

HTTP_KINDS = ("http_500", "http_503", "http_429")
STREAM_KINDS = ("reset", "stall", "malformed_sse", "truncated_json", "zero_tokens", "slow_drip")
WORKER_KINDS = ("kv_corrupt", "kv_range", "kv_delay", "kill_prefill", "kill_decode", "pause_prefill", "pause_decode")
KINDS = HTTP_KINDS + STREAM_KINDS + WORKER_KINDS


class FaultSpecError(ValueError):
    """A spec that cannot be applied; the message names the rule and field."""


@dataclass(frozen=True, slots=True)
class FaultRule:
    kind: str
    prob: float = 0.0            # per-request probability (ignored when ``every`` is set)
    every: int = 0               # fire on every N-th request (1-based count of requests seen)
    times: int | None = None     # fire at most this many times
    after_tokens: int = 2        # mid-stream faults: output chunks sent first
    seconds: float = 1.0         # stall / pause / kv_delay duration, slow_drip delay per chunk

    def check(self, where: str) -> None:
        if self.kind not in KINDS:
            raise FaultSpecError(f"{where}: field 'kind': unknown fault {self.kind!r} (one of {', '.join(KINDS)})")
        if not 0.0 <= self.prob <= 1.0:
            raise FaultSpecError(f"{where}: field 'prob': must be in [0, 1], got {self.prob}")
        if self.every < 0 or (self.times is not None and self.times < 0) or self.after_tokens < 0:
            raise FaultSpecError(f"{where}: 'every', 'times' and 'after_tokens' must be >= 0")
        if not self.seconds >= 0:
            raise FaultSpecError(f"{where}: field 'seconds': must be >= 0, got {self.seconds}")
        if not self.every and not self.prob:
            raise FaultSpecError(f"{where}: a rule needs 'every' or 'prob'")


@dataclass(frozen=True, slots=True)
class FaultPlan:
    rules: tuple[FaultRule, ...] = ()
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> "FaultPlan":
        """``text`` is a JSON object, or the path of a file holding one."""
        src = "fault spec"
        if not text.lstrip().startswith("{") and os.path.exists(text):
            src = text
            with open(text, encoding="utf-8") as fh:
                text = fh.read()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FaultSpecError(f"{src}: not JSON: {exc}") from None
        return cls.from_obj(obj, src)

    @classmethod
    def from_obj(cls, obj: Any, src: str = "fault spec") -> "FaultPlan":
        if not isinstance(obj, dict) or not isinstance(obj.get("rules", []), list):
            raise FaultSpecError(f"{src}: must be an object {{\"seed\": N, \"rules\": [...]}}")
        unknown = set(obj) - {"seed", "rules"}
        if unknown:
            raise FaultSpecError(f"{src}: unknown field(s) {', '.join(sorted(unknown))}")
        names = {f for f in FaultRule.__slots__}  # type: ignore[attr-defined]
        rules = []
        for i, r in enumerate(obj.get("rules", [])):
            where = f"{src}: rules[{i}]"
            if not isinstance(r, dict):
                raise FaultSpecError(f"{where}: must be an object")
            if set(r) - names:
                raise FaultSpecError(f"{where}: unknown field(s) {', '.join(sorted(set(r) - names))}")
            try:
                rule = FaultRule(**r)
            except TypeError as exc:
                raise FaultSpecError(f"{where}: {exc}") from None
            rule.check(where)
            rules.append(rule)
        if sum(r.prob for r in rules if not r.every) > 1.0 + 1e-9:
            raise FaultSpecError(f"{src}: the 'prob' rules sum to more than 1")
        seed = obj.get("seed", 0)
        if not isinstance(seed, int):
            raise FaultSpecError(f"{src}: field 'seed': must be an integer")
        return cls(tuple(rules), seed)

    def to_obj(self) -> dict[str, Any]:
        return {"seed": self.seed, "rules": [asdict(r) for r in self.rules]}


@dataclass
class FaultInjector:
    """Draws the fault (or none) for each request, deterministically from the plan's seed."""

    plan: FaultPlan = field(default_factory=FaultPlan)
    seen: int = 0
    fired: dict[str, int] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _counts: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.reset(self.plan)

    def reset(self, plan: FaultPlan) -> None:
        self.plan, self.seen, self.fired = plan, 0, {}
        self._rng = random.Random(plan.seed)
        self._counts = [0] * len(plan.rules)

    def draw(self) -> FaultRule | None:
        self.seen += 1
        u = self._rng.random()        # drawn for every request, so a rule's cap never shifts the others
        chosen = None
        for i, r in enumerate(self.plan.rules):
            if r.every and self.seen % r.every == 0 and self._room(i):
                chosen = i
                break
        if chosen is None:
            acc = 0.0
            for i, r in enumerate(self.plan.rules):
                if r.every:
                    continue
                acc += r.prob
                if u < acc:
                    chosen = i if self._room(i) else None
                    break
        if chosen is None:
            return None
        rule = self.plan.rules[chosen]
        self._counts[chosen] += 1
        self.fired[rule.kind] = self.fired.get(rule.kind, 0) + 1
        return rule

    def _room(self, i: int) -> bool:
        t = self.plan.rules[i].times
        return t is None or self._counts[i] < t

    def state(self) -> dict[str, Any]:
        return {**self.plan.to_obj(), "requests_seen": self.seen, "fired": dict(self.fired)}
