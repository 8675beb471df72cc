"""Synthetic load without a trace file: ``--isl 2048 --osl 256 [--prefix-tokens N | --prefix-hit 0.9]``.

What the peers' "random dataset" offers (vLLM ``--random-input-len/--random-prefix-len``, GuideLLM
``prompt_tokens``/``prefix_tokens``), built by the agent-workload generator rather than beside it: the
options become a :class:`WorkloadSpec` of single-turn sessions, and ``generate_trace`` makes the trace. So a
synthetic trace is seeded (same options and seed, same trace), has hash ids, block-aligned prompts and
Mooncake output like any other, and ``trace inspect`` measures it with the one hit-ratio definition.

The model: every request starts with the same ``prefix_tokens`` (a system prompt), then its own tokens up to
its input length; ``--prefix-hit h`` sizes that prefix so the trace's token-weighted hit ratio
(``hit_ratio_tokens``: the first request misses, every later one hits the prefix) is ``h``. Prefixes are
whole blocks (the unit the trace shares); whole blocks shared by every request reach a hit only in steps of a
block over the mean input, so a share of the requests shares one block more (``extended_prefix_share``,
:func:`_prefix_for`) and any hit is reachable at any request count: ``run``'s 40 requests and a sweep's 256
accept the same ``h``. Input lengths are clamped to ``[longest prefix + 1, cap]``: every request has at least
one token of its own.

A server caches a prefix in whole blocks of *its own* size: a 1,872-token prefix on 512-token blocks is cached
as 1,536 tokens, and the hit it reports falls short of the one announced. So when the target's block size is
known (``--block-size``, the target's own report: ``paasbench.workload.target``, or the embedded server's
setting) the trace is made in its blocks, with or without a shared prefix; else the power of two nearest ``mean
input / 128``, at most 512 tokens. The clamp reshapes the asked distribution when the prefix is long next to the
inputs (``--isl normal:2048:256 --prefix-hit 0.9``: 87 of 298 lengths raised to 1,889): :func:`reshape_note`
says how many and how, and the trace's meta records it (``synthetic.reshaped``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from paas_common.errors import InputError
from paasbench.workload.dist import Dist
from paasbench.workload.spec import Arrivals, WorkloadSpec, longest_prefix

DEFAULT_REQUESTS = 1000
HIT_TOLERANCE = 0.01
_FORMS = {  # kind -> parameter names, in the order they are written after the kind
    "fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std"), "lognormal": ("mean", "sigma"),
    "exponential": ("mean",),
}
_MAX_TOKENS = 1 << 22   # cap for unbounded distributions (4M tokens)


def parse_length(text: str, option: str) -> Dist:
    """``2048`` | ``uniform:MIN:MAX`` | ``normal:MEAN:STD`` | ``lognormal:MEAN:SIGMA`` | ``exponential:MEAN``
    → a :class:`Dist` of token counts. Errors name ``option``."""
    parts = [p.strip() for p in str(text).split(":")]
    kind = "fixed" if len(parts) == 1 else parts[0].lower()
    if kind not in _FORMS:
        raise InputError(f"unknown distribution {parts[0]!r} in {text!r} (forms: 2048, "
                         + ", ".join(f"{k}:{':'.join(n.upper() for n in v)}" for k, v in _FORMS.items() if k != "fixed")
                         + ")", field=option)
    names = _FORMS[kind]
    values = parts if kind == "fixed" else parts[1:]
    if len(values) != len(names):
        raise InputError(f"{kind} needs {len(names)} number(s) ({':'.join(n.upper() for n in names)}), "
                         f"got {text!r}", field=option)
    try:
        nums = [float(v) for v in values]
    except ValueError:
        raise InputError(f"not a number in {text!r}", field=option) from None
    if not all(math.isfinite(x) for x in nums):
        raise InputError(f"numbers must be finite, got {text!r}", field=option)
    dist = Dist.parse({"dist": kind, **dict(zip(names, nums))}, where=option)
    lo, hi = dist.bounds()
    if kind in ("fixed", "uniform") and lo < 1:
        raise InputError(f"token counts must be >= 1, got {text!r}", field=option)
    if kind in ("normal", "lognormal", "exponential") and nums[0] < 1:
        raise InputError(f"the mean must be >= 1 token, got {text!r}", field=option)
    if hi != math.inf and hi > _MAX_TOKENS:
        raise InputError(f"at most {_MAX_TOKENS:,} tokens, got {text!r}", field=option)
    return dist


@dataclass(frozen=True)
class Synthetic:
    """What the synthetic options asked for (``trace.meta["synthetic"]`` records it)."""

    isl: str
    osl: str
    requests: int = DEFAULT_REQUESTS
    prefix_tokens: int | None = None
    prefix_hit: float | None = None
    block_size: int | None = None
    rate: float = 1.0                    # generated arrivals (req/s); run's --rate/--concurrency replace them
    block_size_source: str | None = None  # where block_size came from when the target reported it

    def describe(self) -> str:
        shape = f"prefix {self.prefix_tokens}" if self.prefix_tokens is not None else \
            f"prefix hit {self.prefix_hit:g}" if self.prefix_hit is not None else "no shared prefix"
        return f"synthetic isl={self.isl} osl={self.osl} {shape}"


def _clamped(d: Dist, lo: int) -> Dist:
    """``d`` with samples kept in ``[lo, cap]`` (fixed and uniform lengths are checked, not clamped)."""
    if d.kind in ("fixed", "uniform"):
        return d
    hi = d.bounds()[1]
    return Dist(d.kind, {**d.params, "min": float(lo), "max": float(min(hi, _MAX_TOKENS))})


def _mean_of(d: Dist, n: int, seed: int) -> float:
    """The mean of the ``n`` input lengths the generator will draw: it draws them first, from ``seed``."""
    return float(np.rint(d.sample(np.random.default_rng(seed), n)).mean())


def _block_size(mean_isl: float) -> int:
    return int(min(512, 1 << max(0, round(math.log2(max(1.0, mean_isl / 128))))))


def synthetic_spec(s: Synthetic, seed: int = 0) -> WorkloadSpec:
    """The workload spec ``generate_trace`` turns into the synthetic trace (``seed``: the run's)."""
    isl, osl = parse_length(s.isl, "--isl"), parse_length(s.osl, "--osl")
    if s.prefix_tokens is not None and s.prefix_hit is not None:
        raise InputError("give --prefix-tokens or --prefix-hit, not both", field="--prefix-hit")
    if not isinstance(s.requests, int) or s.requests < 1:
        raise InputError(f"must be >= 1, got {s.requests!r}", field="--max-requests")
    if s.prefix_tokens is not None and s.prefix_tokens < 0:
        raise InputError(f"must be >= 0, got {s.prefix_tokens}", field="--prefix-tokens")
    if s.prefix_hit is not None and not 0 <= s.prefix_hit < 1:
        raise InputError(f"must be in [0, 1), got {s.prefix_hit}", field="--prefix-hit")
    if s.block_size is not None and s.block_size < 1:
        raise InputError(f"must be >= 1, got {s.block_size}", field="--block-size")
    n = s.requests
    bs = s.block_size or _block_size(_mean_of(_clamped(isl, 1), n, seed))
    shared, share = (s.prefix_tokens or 0) // bs * bs, 0.0  # only whole blocks are shared
    if s.prefix_hit:
        if n < 2:
            raise InputError("a prefix hit needs at least 2 requests (the first one always misses)",
                             field="--prefix-hit")
        longest = 0
        for _ in range(3):  # the clamp at the longest prefix + 1 moves the mean a little: settle it
            total = _mean_of(_clamped(isl, longest + 1), n, seed) * n
            shared, share = _prefix_for(s.prefix_hit, total, n, bs)
            longest = shared + (bs if share else 0)
    lo = isl.bounds()[0]
    if share and isl.kind in ("fixed", "uniform") and shared < lo <= shared + bs:
        # the extended block would be as long as the shortest input: whole blocks alone give the closest hit
        # below the asked one (--isl 512, 32-token blocks, 20 requests, 0.9: 480 shared, 0.8906)
        share = 0.0
    longest = shared + (bs if share else 0)
    if isl.kind in ("fixed", "uniform") and lo <= longest:
        if s.prefix_hit and s.block_size_source:
            most = (int(lo) - 1) // bs * bs * (n - 1) / (n * _mean_of(isl, n, seed))
            raise InputError(f"cannot reach a prefix hit of {s.prefix_hit:g} with {bs}-token blocks: a shared "
                             f"prefix must be shorter than every input length (--isl {s.isl} goes down to {lo:g}), "
                             f"so at most {most:.3f}; the target caches whole {bs}-token blocks "
                             f"({s.block_size_source}): ask for a hit its blocks can carry or longer --isl",
                             field="--prefix-hit")
        raise InputError(f"the shared prefix ({longest} tokens) must be shorter than every input length "
                         f"(--isl {s.isl} goes down to {lo:g})",
                         field="--prefix-hit" if s.prefix_hit else "--prefix-tokens")
    start = _clamped(isl, longest + 1)
    spec = WorkloadSpec(
        name=s.describe(), start_tokens=start, cap_tokens=int(max(longest + 1, start.bounds()[1])),
        turns=Dist("fixed", {"value": 1.0}), tool_output_tokens=Dist("fixed", {"value": 0.0}),
        output_tokens=_clamped(osl, 1), block_size=bs, seed=seed, sessions=n, shared_prefix_tokens=shared,
        extended_prefix_share=share, arrivals=Arrivals(process="poisson", session_rate=s.rate),
        description="synthetic load from --isl/--osl (paasbench.workload.synthetic)")
    return spec


def _prefix_for(hit: float, total: float, n: int, bs: int) -> tuple[int, float]:
    """(tokens of the prefix every request shares, share of requests sharing one block more) that give ``n``
    single-turn requests of ``total`` input tokens the token hit ``hit``: the first request misses, every later
    one hits the shared blocks, and each extended request after the first its extra block too, so
    ``hit · total = (n − 1) · shared + (m − 1) · bs`` with ``m`` extended requests. Whole blocks alone reach a
    hit only in steps of ``bs / mean input`` (1,024-token prompts on 128-token blocks: 0.75 or 0.875, never 0.85
    but through the first request's miss at one count of requests); the extended share fills the step, so a hit
    is reachable at any count."""
    per = hit * total / (n - 1)                     # the prefix every later request would need, in tokens
    k = int(per // bs)
    extra = hit * total - (n - 1) * k * bs          # hit tokens the whole blocks leave, in tokens
    m = int(round(extra / bs)) + 1 if extra / bs >= 0.5 else 0
    return k * bs, min(m, n) / n


def _reshaped(s: Synthetic, spec: WorkloadSpec, seed: int) -> dict | None:
    """How the clamp to ``[prefix + 1, cap]`` changed the asked input lengths: the generator's own draw
    (``seed``, first from its generator) with and without it. None when nothing moved."""
    n = spec.sessions
    asked = _clamped(parse_length(s.isl, "--isl"), 1).sample(np.random.default_rng(seed), n)
    sent = spec.start_tokens.sample(np.random.default_rng(seed), n)
    lo = longest_prefix(spec) + 1
    raised, capped = int((np.rint(asked) < lo).sum()), int((np.rint(asked) > spec.cap_tokens).sum())
    if not raised and not capped:
        return None
    return {"raised": raised, "to_tokens": lo, "capped": capped, "requests": n,
            "mean_asked": float(np.rint(asked).mean()), "mean_sent": float(np.rint(sent).mean()),
            "prefix_tokens": lo - 1}


def reshape_note(synthetic: dict) -> str | None:
    """The warning for a synthetic trace whose input lengths the shared prefix reshaped (``trace.meta
    ["synthetic"]``), or None."""
    r = synthetic.get("reshaped")
    if not r:
        return None
    why = (f"--prefix-hit {synthetic['prefix_hit']:g}" if synthetic.get("prefix_hit") is not None
           else f"--prefix-tokens {synthetic.get('prefix_tokens')}")
    parts = []
    if r["raised"]:
        parts.append(f"{r['raised']:,} of {r['requests']:,} input lengths drawn from --isl {synthetic['isl']} were "
                     f"shorter than the shared prefix ({r['prefix_tokens']:,} tokens, from {why}) and were raised "
                     f"to {r['to_tokens']:,}")
    if r["capped"]:
        parts.append(f"{r['capped']:,} were cut to the cap")
    longer = (f"; the prefix is longer than the mean asked ({r['mean_asked']:,.0f})"
              if r["prefix_tokens"] >= r["mean_asked"] else "")
    return ("; ".join(parts) + f" (mean input {r['mean_asked']:,.0f} → {r['mean_sent']:,.0f}{longer}). "
            "To keep the asked lengths: a lower --prefix-hit, longer --isl, or more requests")


def blocks_text(trace_meta: dict) -> str:
    """How a synthetic trace (its ``meta``) shares its prefix, as ``run`` and ``sweep`` say it: its block size,
    whose it is, and the token-weighted hit it offers."""
    syn = trace_meta["synthetic"]
    told = syn.get("block_size_source")
    return (f"{syn['block_size']}-token blocks" + (f" (the target's, from {told})" if told else "")
            + f", prefix hit {trace_meta['hit_ratio_tokens']:.3f}")


def synthetic_trace(s: Synthetic, seed: int = 0):  # noqa: ANN201 - Trace; imported lazily by the CLI
    """The synthetic trace: ``generate_trace(synthetic_spec(s, seed), seed)``, its hit checked against
    ``--prefix-hit`` and its options recorded in its meta (:func:`synthetic_meta`)."""
    from paasbench.workload.generator import generate_trace

    spec = synthetic_spec(s, seed)
    trace = generate_trace(spec, seed)
    trace.meta.update(synthetic_meta(s, spec, trace.meta["hit_ratio_tokens"], seed))
    return trace


def synthetic_meta(s: Synthetic, spec: WorkloadSpec, hit: float, seed: int) -> dict:
    """What a synthetic trace's meta says of its options (``workload``, ``synthetic``), once its token hit
    (``hit``, of ``generate_trace(spec, seed)``) is checked against ``--prefix-hit`` (exit 2 when its blocks
    cannot carry it). ``run`` reads it off :func:`synthetic_trace`; the sweep off the first trace its steps
    replay, made once."""
    if s.prefix_hit is not None and abs(hit - s.prefix_hit) > HIT_TOLERANCE:
        advice = (f"the target caches whole {spec.block_size}-token blocks ({s.block_size_source}): ask for a hit "
                  f"its blocks can carry (e.g. --prefix-hit {math.floor(hit * 100) / 100:g}) or longer --isl"
                  if s.block_size_source else "give a smaller --block-size or more --max-requests")
        raise InputError(f"cannot reach a prefix hit of {s.prefix_hit:g} with {spec.block_size}-token blocks "
                         f"(got {hit:.3f}); {advice}", field="--prefix-hit")
    return {"workload": spec.name, "synthetic": {**dataclasses.asdict(s), "seed": seed, "block_size": spec.block_size,
                                                 "prefix_tokens_shared": spec.shared_prefix_tokens,
                                                 "prefix_extended_share": spec.extended_prefix_share,
                                                 "reshaped": _reshaped(s, spec, seed)}}
