"""Workload specs: YAML → ``WorkloadSpec``, strictly (an unknown or mistyped key is an error that names it).

A spec has two parts. The generator parameters describe agent sessions (see ``generator.py`` and
docs/traces.md). The pass-through sections are for other commands and are only shape-checked here:
``server`` (embedded reference-server settings), ``slo`` (gate expressions), ``sweep`` (load axis and
steps), ``context_buckets`` (context lengths of the cost-table rows), ``claim`` (published figures a sweep is
read against: :mod:`paasbench.cost.claim`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from paas_common.errors import InputError
from paasbench.trace.model import DEFAULT_BLOCK_SIZE
from paasbench.workload.dist import Dist

PACKAGE = "workloads"  # shipped specs live in the top-level ``workloads`` package (pip-installed)
PROCESSES = ("poisson", "gamma", "rate")


@dataclass(frozen=True)
class Arrivals:
    """When sessions start. ``poisson``/``gamma``: ``session_rate`` starts per second (gamma's shape is
    ``burstiness``: < 1 burstier, 1 = Poisson). ``rate``: Poisson starts, time-scaled so the whole
    trace averages ``request_rate`` requests per second (inspect's ``rate_rps``)."""

    process: str = "poisson"
    session_rate: float | None = 1.0
    request_rate: float | None = None
    burstiness: float = 1.0


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    start_tokens: Dist                  # turn-0 context of a session, shared prefix included
    cap_tokens: int                     # contexts never exceed this; a session at the cap ends
    turns: Dist                         # requests per session (the session-length mix)
    tool_output_tokens: Dist            # appended per turn, besides the previous answer; scaled to hit target
    output_tokens: Dist                 # max_tokens of each request
    description: str = ""
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: int = 0
    sessions: int = 16
    shared_prefix_tokens: int = 0       # system prompt + tool definitions, common to every session
    extended_prefix_share: float = 0.0  # share of sessions whose shared prefix is one block longer (a tool
                                        # definition only some carry): a hit between whole blocks
    think_time_s: Dist = field(default_factory=lambda: Dist("fixed", {"value": 0.0}))
    response_time_s: float = 0.0        # assumed per-turn latency when spacing a session's timestamps
    cold_fraction: float = 0.0          # share of requests with no shared prefix at all
    cold_tokens: Dist | None = None     # their lengths (default: start_tokens)
    target_hit_ratio: float | None = None
    hit_tolerance: float = 0.01
    arrivals: Arrivals = field(default_factory=Arrivals)
    server: dict[str, Any] = field(default_factory=dict)
    slo: list[str] = field(default_factory=list)
    sweep: dict[str, Any] = field(default_factory=dict)
    context_buckets: list[int] = field(default_factory=list)
    claim: dict[str, Any] = field(default_factory=dict)
    source: str | None = None           # the YAML it came from

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for trace meta and run metadata)."""
        out = dataclasses.asdict(self)
        for key, value in list(out.items()):
            if isinstance(value, dict) and set(value) == {"kind", "params"}:
                out[key] = {"dist": value["kind"], **value["params"]}
        return out


_DISTS = {"start_tokens", "turns", "tool_output_tokens", "output_tokens", "think_time_s", "cold_tokens"}
_REQUIRED = {"name", "start_tokens", "cap_tokens", "turns", "tool_output_tokens", "output_tokens"}
_FIELDS = {f.name for f in dataclasses.fields(WorkloadSpec)} - {"source"}


class _Located:
    """YAML line numbers by dotted key path, so errors can point at the offending line."""

    def __init__(self, node: yaml.Node | None) -> None:
        self.root = node

    def line(self, path: str) -> int | None:
        node, best = self.root, None
        for part in path.split("."):
            if not isinstance(node, yaml.MappingNode):
                break
            for key, value in node.value:
                if key.value == part:
                    best, node = key.start_mark.line + 1, value
                    break
            else:
                break
        return best


def parse_spec(raw: Any, *, source: str | None = None, text: str | None = None) -> WorkloadSpec:
    where = _Located(yaml.compose(text) if text is not None else None)

    def bad(msg: str, key: str) -> InputError:
        return InputError(msg, file=source, line=where.line(key), field=key)

    if not isinstance(raw, dict):
        raise InputError("a workload spec must be a YAML mapping", file=source)
    for key in raw:
        if key not in _FIELDS:
            raise bad(f"unknown key (allowed: {', '.join(sorted(_FIELDS))})", str(key))
    for key in sorted(_REQUIRED):
        if key not in raw:
            raise InputError("missing required key", file=source, field=key)
    kw: dict[str, Any] = {"source": source}
    for key, value in raw.items():
        if key in _DISTS:
            kw[key] = None if value is None and key == "cold_tokens" else \
                Dist.parse(value, where=key, file=source, line=where.line(key))
        elif key == "arrivals":
            kw[key] = _arrivals(value, bad)
        else:
            kw[key] = value
    spec = WorkloadSpec(**kw)
    _validate(spec, bad)
    return spec


def _arrivals(raw: Any, bad: Any) -> Arrivals:
    if not isinstance(raw, dict):
        raise bad("must be a mapping with 'process'", "arrivals")
    allowed = {f.name for f in dataclasses.fields(Arrivals)}
    for key in raw:
        if key not in allowed:
            raise bad(f"unknown key (allowed: {', '.join(sorted(allowed))})", f"arrivals.{key}")
    arr = Arrivals(**raw)
    if arr.process not in PROCESSES:
        raise bad(f"must be one of {', '.join(PROCESSES)}, got {arr.process!r}", "arrivals.process")
    need = "request_rate" if arr.process == "rate" else "session_rate"
    value = getattr(arr, need)
    if not _pos(value):
        raise bad(f"process '{arr.process}' needs a positive number, got {value!r}", f"arrivals.{need}")
    if not _pos(arr.burstiness):
        raise bad(f"must be a positive number, got {arr.burstiness!r}", "arrivals.burstiness")
    return arr


def _pos(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _int(v: Any, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def longest_prefix(s: WorkloadSpec) -> int:
    """The longest shared prefix a session starts with: ``shared_prefix_tokens``, or its whole blocks plus one
    where ``extended_prefix_share`` gives some sessions one block more."""
    if not s.extended_prefix_share:
        return s.shared_prefix_tokens
    return (s.shared_prefix_tokens // s.block_size + 1) * s.block_size


def _validate(s: WorkloadSpec, bad: Any) -> None:
    if not isinstance(s.name, str) or not s.name:
        raise bad("must be a non-empty string", "name")
    if not isinstance(s.description, str):
        raise bad("must be a string", "description")
    for key, lo in (("block_size", 1), ("sessions", 1), ("cap_tokens", 1), ("shared_prefix_tokens", 0),
                    ("seed", 0)):
        if not _int(getattr(s, key), lo):
            raise bad(f"must be an integer >= {lo}, got {getattr(s, key)!r}", key)
    share = s.extended_prefix_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise bad(f"must be a fraction in [0, 1], got {share!r}", "extended_prefix_share")
    lo, hi = s.start_tokens.bounds()
    longest = longest_prefix(s)
    if lo <= longest or hi > s.cap_tokens:
        what = (f"shared_prefix_tokens={s.shared_prefix_tokens}" if longest == s.shared_prefix_tokens else
                f"the extended shared prefix={longest}")
        raise bad(f"turn-0 contexts must lie in ({what}, cap_tokens={s.cap_tokens}]; this distribution spans "
                  f"[{lo}, {hi}]", "start_tokens")
    if s.cold_tokens is not None:
        lo, hi = s.cold_tokens.bounds()
        if lo < 1 or hi > s.cap_tokens:
            raise bad(f"must lie in [1, cap_tokens={s.cap_tokens}]; spans [{lo}, {hi}]", "cold_tokens")
    for key in ("turns", "output_tokens"):
        if getattr(s, key).bounds()[0] < 1:
            raise bad("must never go below 1 (set min: 1)", key)
    for key in ("tool_output_tokens", "think_time_s"):
        if getattr(s, key).bounds()[0] < 0:
            raise bad("must never go below 0 (set min: 0)", key)
    if not isinstance(s.response_time_s, (int, float)) or s.response_time_s < 0:
        raise bad("must be a number >= 0", "response_time_s")
    if not isinstance(s.cold_fraction, (int, float)) or not 0 <= s.cold_fraction < 1:
        raise bad("must be in [0, 1)", "cold_fraction")
    if s.target_hit_ratio is not None and (not isinstance(s.target_hit_ratio, (int, float))
                                           or not 0 <= s.target_hit_ratio < 1):
        raise bad("must be in [0, 1)", "target_hit_ratio")
    if not _pos(s.hit_tolerance):
        raise bad("must be a positive number", "hit_tolerance")
    if not isinstance(s.server, dict):
        raise bad("must be a mapping (e.g. {engine: cpu, model: tiny})", "server")
    if not isinstance(s.sweep, dict):
        raise bad("must be a mapping", "sweep")
    if not isinstance(s.slo, list) or not all(isinstance(g, str) for g in s.slo):
        raise bad("must be a list of gate expressions (strings)", "slo")
    if not isinstance(s.context_buckets, list) or not all(_int(b, 1) for b in s.context_buckets):
        raise bad("must be a list of positive integers (tokens)", "context_buckets")
    from paasbench.cost.claim import parse_claim

    try:
        parse_claim(s.claim, s.source)
    except InputError as exc:
        raise bad(exc.reason, exc.field or "claim") from None


def load_spec_file(path: str | Path) -> WorkloadSpec:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read workload spec: {exc.strerror or exc}", file=str(path)) from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text: {exc.reason} at byte {exc.start + 1}", file=str(path)) from None
    return _from_text(text, str(path))


def _from_text(text: str, source: str) -> WorkloadSpec:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise InputError(f"malformed YAML: {getattr(exc, 'problem', exc)}", file=source,
                         line=mark.line + 1 if mark else None) from exc
    return parse_spec(raw, source=source, text=text)


def list_workloads() -> list[str]:
    """Names of the specs shipped in the ``workloads`` package."""
    return sorted(p.name[:-5] for p in resources.files(PACKAGE).iterdir() if p.name.endswith(".yaml"))


def load_workload(name_or_path: str | Path) -> WorkloadSpec:
    """A shipped spec by name (``ci-small``), or a YAML file by path."""
    text_name = str(name_or_path)
    path = Path(text_name)
    if path.suffix in (".yaml", ".yml") or path.exists() or "/" in text_name:
        return load_spec_file(path)
    res = resources.files(PACKAGE) / f"{text_name}.yaml"
    if not res.is_file():
        raise InputError(f"unknown workload '{text_name}' (shipped: {', '.join(list_workloads())}; "
                         "or give a path to a YAML file)", field="workload")
    return _from_text(res.read_text(encoding="utf-8"), f"workloads/{text_name}.yaml")
