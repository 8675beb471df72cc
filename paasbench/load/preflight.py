"""The ``/tokenize`` pre-flight: before any load, ask the target how long the run's own prompts are.

A run sized in the wrong tokenizer measures another workload (paasbench/metrics/verify.py says why and holds
the tolerance). A few materialized prompts of distinct lengths go to the server's ``/tokenize`` (vLLM's and
SGLang's shape: ``{"prompt", "add_special_tokens"}`` → ``{"count", "tokens", "max_model_len"}``), counted
without special tokens, so the count is of the text alone; one more call in the API's own form (``messages``
for chat) gives the constant overhead the server adds (chat template, BOS). ``max_model_len``, where the
server says it, refuses requests that cannot fit (exit 2) before anything is sent. A target without
``/tokenize`` is not an error: the check is deferred to the requests' ``usage.prompt_tokens``.

It lives with the load because it talks to the target over the run's own session settings and builds the
run's own prompts; what its answer means is :mod:`paasbench.metrics.verify`'s to say.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from paas_common.errors import InputError
from paasbench.metrics.verify import LENGTH_TOLERANCE, TOKENIZER_FIX

PREFLIGHT_SAMPLE = 6      # prompts sent to /tokenize before the load
TOKENIZE_TIMEOUT_S = 60.0 # per /tokenize call (a 400K-token prompt takes a server about a second)


@dataclass(slots=True)
class Preflight:
    """What ``/tokenize`` said before the load (``meta.prompt_preflight``)."""

    status: str                           # checked | unavailable (no /tokenize) | failed (an error) | skipped
    detail: str = ""
    sampled: int = 0
    ratio: float | None = None            # sum server count / sum intended, text only (no special tokens)
    exact_share: float | None = None
    overhead_tokens: int | None = None    # API form (chat template, BOS) less the text alone
    max_model_len: int | None = None

    @property
    def off(self) -> bool:
        return self.ratio is not None and abs(self.ratio - 1.0) > LENGTH_TOLERANCE

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "off": self.off}

    def text(self) -> str:
        if self.status != "checked":
            return self.detail
        if self.ratio is None:
            return f"/tokenize: max_model_len {self.max_model_len}" if self.max_model_len else self.detail
        return (f"/tokenize pre-flight: {self.ratio:.3f}x server/intended, {self.exact_share:.0%} exact of "
                f"{self.sampled} sampled prompts"
                + (f", overhead {self.overhead_tokens} tokens" if self.overhead_tokens is not None else "")
                + (f", max_model_len {self.max_model_len:,}" if self.max_model_len else ""))

    def warning(self) -> str | None:
        if not self.off:
            return None
        return (f"PROMPT LENGTHS OFF before any load: the server's /tokenize counts {self.ratio:.3f}x the "
                f"intended tokens ({self.exact_share:.0%} of {self.sampled} sampled prompts exact): the load "
                f"would not be the workload it names; {TOKENIZER_FIX}.")


def _sample(requests: Sequence[Any], k: int) -> list[Any]:
    """Up to ``k`` requests of distinct intended lengths, the shortest and the longest among them."""
    by_len: dict[int, Any] = {}
    for r in requests:
        by_len.setdefault(r.input_length, r)
    lengths = sorted(n for n in by_len if n > 0)
    if len(lengths) <= k:
        return [by_len[n] for n in lengths]
    picks = sorted({lengths[round(i * (len(lengths) - 1) / (k - 1))] for i in range(k)})
    return [by_len[n] for n in picks]


def check_context(requests: Sequence[Any], max_model_len: int | None, overhead: int | None,
                  where: str | None = None) -> None:
    """Exit 2 when a request cannot fit the server's context: prompt (+ its overhead) + output tokens."""
    if not max_model_len or not requests:
        return
    worst = max(requests, key=lambda r: r.input_length + r.output_length)
    need = worst.input_length + (overhead or 0) + worst.output_length
    if need > max_model_len:
        raise InputError(f"the longest request needs {worst.input_length:,} prompt"
                         + (f" + {overhead} template" if overhead else "")
                         + f" + {worst.output_length:,} output tokens = {need:,}, more than the server's "
                         f"max_model_len of {max_model_len:,} (from its /tokenize): shorten --isl/--osl, "
                         "pick a smaller context bucket, or serve a longer context", file=where)


async def _tokenize(session: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict]:
    import orjson

    import aiohttp

    async with session.post(url, data=orjson.dumps(body), headers={"content-type": "application/json", **headers},
                            timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)) as resp:
        raw = await resp.read()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return resp.status, {"message": raw.decode("utf-8", "replace").strip()[:300]} if resp.status != 200 else {}
        return resp.status, data if isinstance(data, dict) else {}


def _count(data: dict[str, Any]) -> int:
    count = data.get("count")
    if isinstance(count, list):   # some servers answer a list of counts for a list of prompts
        count = sum(count)
    return int(count) if count is not None else len(data.get("tokens") or [])


async def preflight(cfg: Any, requests: Sequence[Any], prompt_of: Any) -> Preflight:
    """Ask the target's ``/tokenize`` how long a sample of ``requests`` is (``prompt_of(request)`` → the text
    or token ids the run will send); nothing of the load is sent. ``cfg``: the run's ``ClientConfig``."""
    import aiohttp

    from paasbench.client import make_session

    base = cfg.server_url
    url = base + "/tokenize"
    headers = cfg.target_headers
    model = {"model": cfg.model} if cfg.model else {}
    token_ids = cfg.prompt_format == "token-ids"
    sample = _sample(requests, PREFLIGHT_SAMPLE)
    if not sample:
        return Preflight("skipped", "no prompt to check")
    try:
        async with make_session(cfg) as session:
            # is there a /tokenize at all? (before materializing prompts: a builder costs seconds)
            status, data = await _tokenize(session, url, {**model, "prompt": "hello"}, headers)
            if status != 200:
                return _absent(status, data)
            limit = data.get("max_model_len")
            if token_ids:  # exact by construction: only the context limit is asked for
                return Preflight("checked", "token-id prompts: lengths exact by construction",
                                 max_model_len=int(limit) if limit else None)
            counts = []
            texts = [prompt_of(r) for r in sample]
            for text in texts:
                status, data = await _tokenize(session, url, {**model, "prompt": text,
                                                              "add_special_tokens": False}, headers)
                if status != 200:
                    return _absent(status, data)
                counts.append(_count(data))
            # the API's own form of the shortest prompt, less its text alone: chat template / BOS
            form = ({"messages": [{"role": "user", "content": texts[0]}]} if cfg.api == "chat"
                    else {"prompt": texts[0]})
            status, data = await _tokenize(session, url, {**model, **form}, headers)
            overhead = _count(data) - counts[0] if status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return Preflight("failed", f"/tokenize pre-flight failed ({type(exc).__name__}: {exc}): the "
                                   "prompt-length check is deferred to the requests' usage.prompt_tokens")
    want = np.array([r.input_length for r in sample], dtype=np.int64)
    got = np.array(counts, dtype=np.int64)
    return Preflight("checked", "", sampled=len(sample), ratio=float(got.sum() / want.sum()),
                     exact_share=float(np.mean(got == want)), overhead_tokens=overhead,
                     max_model_len=int(limit) if limit else None)


# What a web framework answers for a path it has no route for (FastAPI, aiohttp, Go's net/http): no server's word.
ROUTE_ABSENT = {"", "not found", "404 not found", "404: not found", "method not allowed", "405: method not allowed",
                "404 page not found"}


def server_said(data: dict[str, Any]) -> tuple[str, str | None]:
    """The message of an error body and the parameter it blames, as OpenAI-style servers write it: vLLM
    ``{"error": {"message", "type", "param", "code"}}``, its older ``{"object": "error", "message"}``, FastAPI's
    ``{"detail"}``. ("", None) when the body says nothing."""
    err = data.get("error") if isinstance(data.get("error"), dict) else data
    message = err.get("message", data.get("detail", ""))
    param = err.get("param")
    return (message if isinstance(message, str) else str(message or "")).strip(), \
        param if isinstance(param, str) else None


def _absent(status: int, data: dict[str, Any] | None = None) -> Preflight:
    """A /tokenize that did not answer 200. A 404 or 405 whose body says nothing, or only "Not Found", is a target
    without /tokenize; any other answer is quoted, because it is the server's: vLLM serves /tokenize and answers
    404 "The model `x` does not exist" for a --model it does not serve, which is not a missing endpoint."""
    message, param = server_said(data or {})
    deferred = "the prompt-length check is deferred to the requests' usage.prompt_tokens"
    if status in (404, 405) and message.lower().rstrip(".") in ROUTE_ABSENT:
        return Preflight("unavailable", f"the target has no /tokenize (HTTP {status}): {deferred}")
    said = f": {message}" if message else ""
    blame = (" (the server does not serve the --model given; every request of the load would get the same "
             "answer)") if param == "model" else ""
    return Preflight("failed", f"/tokenize answered HTTP {status}{said}{blame}; {deferred}")


def check_before_load(trace: Any, cfg: Any, where: str | None = None) -> Preflight:
    """The pre-flight of one trace as the run will send it (the runner's prompt builder), then the context
    check (exit 2). Called by ``run`` and ``sweep`` before any load; the caller decides what an ``off``
    result means (``run`` warns, ``sweep`` stops)."""
    from paasbench.load.prompts import PromptBuilder

    builders: list[Any] = []   # made on the first prompt asked for: only a target with /tokenize pays for it

    def prompt_of(req: Any) -> Any:
        if req.prompt is not None and cfg.prompt_format != "token-ids":
            return req.prompt
        if not builders:
            builders.append(PromptBuilder(trace.block_size, cfg.tokenizer, salt=cfg.prompt_salt or 0,
                                          prompt_format=cfg.prompt_format))  # the run's own prompts
        return builders[0].token_ids(req) if cfg.prompt_format == "token-ids" else builders[0].text(req)

    result = asyncio.run(preflight(cfg, trace.requests, prompt_of))
    check_context(trace.requests, result.max_model_len, result.overhead_tokens, where)
    return result
