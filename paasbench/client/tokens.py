"""End of stream: turn the scanner's provisional per-chunk counts into the record's token accounting.

The authority for a request's output length is the server's ``usage.completion_tokens``. Per-chunk counts are
exact when the server sent cumulative usage on every chunk; otherwise the scanner counted one token per
content delta, which is right for servers that stream one token per event (vLLM, SGLang by default) and wrong
for servers that pack several. When the two totals disagree, the usage total is apportioned over the chunks
in proportion to each chunk's text length (largest-remainder rounding, so the counts sum to usage exactly)
and the record is marked ``chunk_tokens_estimated``.

Without usage the count has to come from the stream itself (``output_tokens_method``):

* ``events`` — the events hold one token each, so their number is the count. The client tokenizer is not
  the server's: re-tokenizing the text would split characters the model holds as one token (45 rare CJK
  characters are 80 cl100k tokens), so it only *judges* the events: an event holds one token when the
  tokenizer finds one in it, or only one character (a character is never several of the model's tokens,
  however many the client's vocabulary needs), and most events must;
* ``tokenizer`` — the events carry several tokens each: only then the client tokenizer
  (:func:`paas_common.tokenizer.encode`) counts the streamed text, apportioned over the events as above.

This slow path parses JSON, once, only then.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import orjson

from paas_common.tokenizer import encode, load_tokenizer
from paasbench.client.sse import Event, StreamParser


@dataclass(slots=True)
class Settled:
    times: list[float]
    counts: list[int]
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    method: str          # where completion_tokens came from: usage | events | tokenizer
    estimated: bool
    server_timings: dict[str, Any] | None


def _load(ev: Event) -> Any:
    buf, s, e = ev
    return orjson.loads(buf[s:e])


def _event_text(obj: Any) -> str:
    parts: list[str] = []
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        for src in (choice, delta):
            for key in ("text", "content", "reasoning_content", "reasoning"):
                v = src.get(key)
                if isinstance(v, str):
                    parts.append(v)
        for call in delta.get("tool_calls") or ():
            fn = (call or {}).get("function") or {}
            parts.append(str(fn.get("name") or "") + str(fn.get("arguments") or ""))
    return "".join(parts)


def apportion(total: int, weights: list[float]) -> list[int]:
    """Integers proportional to ``weights`` that sum to ``total`` (largest remainder)."""
    if not weights:
        return []
    wsum = float(sum(weights))
    if wsum <= 0:
        weights, wsum = [1.0] * len(weights), float(len(weights))
    exact = [total * w / wsum for w in weights]
    out = [int(x) for x in exact]
    short = total - sum(out)
    for i in sorted(range(len(exact)), key=lambda i: out[i] - exact[i])[:short]:
        out[i] += 1
    return out


def _floor_one(counts: list[int]) -> list[int]:
    """Every content event carried at least one token, if there are enough tokens for that; at least the
    first one did (it *is* the first token, whatever its text length). Rounding by text length alone could
    give a short first event 0 tokens, drop it, and move the first token — and TTFT — to a later event.
    Each missing token is taken from the event with the most."""
    total = sum(counts)
    floor = 1 if total >= len(counts) else 0  # what a donor must keep
    zeros = [i for i in range(len(counts) if floor else min(1, total)) if counts[i] == 0]
    if zeros:
        heap = [(-c, j) for j, c in enumerate(counts) if c > floor]
        heapq.heapify(heap)
        for i in zeros:
            c, j = heapq.heappop(heap)
            counts[j], counts[i] = -c - 1, 1
            if -c - 1 > floor:
                heapq.heappush(heap, (c + 1, j))
    return counts


def settle(p: StreamParser, tokenizer: str) -> Settled:
    usage: dict[str, Any] = {}
    if p.usage_event is not None:
        try:
            usage = _load(p.usage_event).get("usage") or {}
        except orjson.JSONDecodeError:
            usage = {}
    timings = _server_timings(p)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", usage.get("cached_tokens", usage.get("prompt_cache_hit_tokens")))
    completion = usage.get("completion_tokens")
    times, counts = p.times, p.counts
    counted = sum(counts)
    method, estimated = "usage", False
    if not counts and completion and p.silent_s is not None:
        # the server made tokens, and their text is empty (vLLM's one token of max_tokens=1 can be a byte of
        # a character): they came with the first event that carried a choice
        times, counts, estimated = [p.silent_s], [int(completion)], completion > 1
    elif counts and (completion is None or completion != counted):
        texts = _chunk_texts(p)
        if completion is None:
            if _one_token_each(texts, tokenizer):
                completion, method = counted, "events"
            else:
                completion, method = len(encode("".join(texts), tokenizer)), "tokenizer"
        if completion != counted:
            counts = _floor_one(apportion(completion, [len(t) for t in texts]))
            keep = [i for i, c in enumerate(counts) if c > 0]
            times, counts = [times[i] for i in keep], [counts[i] for i in keep]
            estimated = True
    elif completion is None:
        completion, method = 0, "events"
    return Settled(times, counts, usage.get("prompt_tokens"), completion,
                   cached if isinstance(cached, int) else None, method, estimated,
                   timings if isinstance(timings, dict) else None)


def _one_token_each(texts: list[str], tokenizer: str) -> bool:
    """Do these events hold one token each? See the module docstring (``events``)."""
    tok = load_tokenizer(tokenizer)   # once per request: each lookup stats the file (its cache key)
    single = sum(1 for t in texts if len(t) <= 1 or len(tok.encode(t)) <= 1)
    return 2 * single > len(texts)


def _server_timings(p: StreamParser) -> Any:
    """The reference server's per-stage breakdown, searched once per stream rather than in every event."""
    if not p.raw:
        return None
    raw = b"".join(p.raw)
    k = raw.rfind(b'"paasbench_timings"')
    if k < 0:
        return None
    s, e = raw.rfind(b"data:", 0, k) + 5, raw.find(b"\n", k)
    try:
        return orjson.loads(raw[s:e if e >= 0 else len(raw)]).get("paasbench_timings")
    except (orjson.JSONDecodeError, AttributeError):
        return None


def _chunk_texts(p: StreamParser) -> list[str]:
    """Text of each token-carrying event, re-scanned with the same classification as the hot loop."""
    events: list[Event] = []
    again = StreamParser(keep_raw=False, collect=events)
    again.feed(b"".join(p.raw or ()), 0.0)
    out = []
    for ev in events:
        try:
            out.append(_event_text(_load(ev)))
        except orjson.JSONDecodeError:
            out.append("")
    return out
