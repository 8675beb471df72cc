"""The public HTTP surface (aiohttp): OpenAI-compatible completions and chat completions with SSE,
``/v1/models``, ``/health`` and ``/metrics``.

Sampling is greedy (temperature and friends are accepted and ignored: the reference server exists to
measure serving, and greedy output is what makes the three modes comparable token for token).
Chat messages are flattened with a fixed template, ``"<role>: <content>\\n"`` per message followed
by ``"assistant:"``; the template is plain text, so the token count a client computes is the
server's. Keys and tenants: :mod:`reference_server.auth` (the tenant comes from the key, not from the
``x-tenant`` header, unless the server was told to trust it).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any

from aiohttp import web

from reference_server.auth import Auth
from reference_server.detok import Detokenizer
from reference_server.engine.vocab import Vocab, get_vocab
from reference_server.metrics import render
from reference_server.router import Completion, Overloaded, RequestFailed, Router

ROUTER = web.AppKey("router", Router)
AUTH = web.AppKey("auth", Auth)
_seq = itertools.count()


class BadRequest(Exception):
    pass


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


@web.middleware
async def auth_middleware(request: web.Request, handler):
    auth = request.app[AUTH]
    if auth.required and request.path != "/health" and auth.check(_bearer(request)) is None:
        return _error(401, "missing or invalid API key", "authentication_error")
    return await handler(request)


def _tenant(request: web.Request) -> str:
    return request.app[AUTH].tenant(_bearer(request), request.headers.get("x-tenant"))


def _int_field(body: dict[str, Any], name: str, default: int, lo: int = 1) -> int:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise BadRequest(f"'{name}' must be an integer >= {lo}")
    return v


def _prompt_ids(prompt: Any, vocab: Vocab) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]    # a batch of one
    if isinstance(prompt, str):
        return vocab.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        n = vocab.size
        if any(t < 0 or t >= n for t in prompt):
            raise BadRequest(f"token ids must be in [0, {n})")
        return list(prompt)
    raise BadRequest("'prompt' must be a string or a list of token ids (batches of more than one are not supported)")


def chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m['role']}: {content}\n")
    return "".join(parts) + "assistant:"


class _Stream:
    """Formats one response's SSE chunks (completions or chat)."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat = chat
        self.base = {"id": ("chatcmpl-" if chat else "cmpl-") + rid,
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.first = True

    def delta(self, text: str, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            d: dict[str, Any] = {"content": text}
            if self.first:
                d["role"] = "assistant"
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        self.first = False
        return {**self.base, "choices": [choice]}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    router = request.app[ROUTER]
    cfg = router.cfg
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "request body is not valid JSON")
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != cfg.served_model_name:
        return _error(404, f"model '{model}' does not exist; this server serves '{cfg.served_model_name}'",
                      "not_found_error")
    vocab = get_vocab(cfg.model if cfg.engine == "cpu" else "tiny")   # the model's own tokens (sim: cl100k)
    try:
        if chat:
            prompt = vocab.encode(chat_prompt(body.get("messages")))
            max_tokens = _int_field(body, "max_completion_tokens", _int_field(body, "max_tokens", 256))
        else:
            if "prompt" not in body:
                raise BadRequest("'prompt' is required")
            prompt = _prompt_ids(body["prompt"], vocab)
            max_tokens = _int_field(body, "max_tokens", 16)
        if _int_field(body, "n", 1) != 1:
            raise BadRequest("only n=1 is supported")
        if not prompt:
            raise BadRequest("the prompt is empty")
    except BadRequest as exc:
        return _error(400, str(exc))
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    internal_rid = f"{rid}#{next(_seq)}"      # unique even if a client reuses an id
    req = Completion(internal_rid, _tenant(request), prompt, max_tokens, bool(body.get("ignore_eos", False)))
    limit = router.max_context()
    if len(prompt) + max_tokens > limit:
        return _error(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds this server's "
                           f"context of {limit} tokens (its KV budget)")
    stream = bool(body.get("stream", False))
    opts = body.get("stream_options") or {}
    include_usage = bool(opts.get("include_usage", False))
    continuous = bool(opts.get("continuous_usage_stats", False))   # vLLM: cumulative usage on every chunk
    fmt = _Stream(chat, rid, cfg.served_model_name)
    detok = Detokenizer(vocab.tokenizer)
    events = router.generate(req)
    headers = {"x-request-id": rid}
    try:
        first = await events.__anext__()        # 429 / errors before any byte is sent
    except Overloaded:
        return _error(429, "server overloaded; retry later", "rate_limit_error", {"Retry-After": "1", **headers})
    except RequestFailed as exc:
        return _error(exc.status, str(exc), "server_error", headers)
    except StopAsyncIteration:
        return _error(500, "no output", "server_error", headers)

    if not stream:
        texts: list[str] = []
        ev = first
        try:
            while ev["op"] != "done":
                texts.append(detok.feed(ev["ids"]))
                ev = await events.__anext__()
        except RequestFailed as exc:
            return _error(exc.status, str(exc), "server_error", headers)
        finally:
            await events.aclose()
        texts.append(detok.flush())
        text = "".join(texts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": ev["finish_reason"]}
                  if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": ev["finish_reason"]})
        out = {**fmt.base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
               "usage": ev["usage"], "paasbench_timings": ev["timings"]}
        return web.json_response(out, headers=headers)

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    ev = first
    produced = 0
    try:
        while ev["op"] != "done":
            chunk = fmt.delta(detok.feed(ev["ids"]))
            if continuous:
                produced += len(ev["ids"])
                chunk["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": produced,
                                  "total_tokens": len(prompt) + produced}
            await resp.write(_sse(chunk))
            ev = await events.__anext__()
        final = fmt.delta(detok.flush(), ev["finish_reason"])
        if continuous:
            final["usage"] = ev["usage"]
        if include_usage:
            await resp.write(_sse(final))
            final = {**fmt.base, "choices": [], "usage": ev["usage"]}
        final["paasbench_timings"] = ev["timings"]
        await resp.write(_sse(final))
        await resp.write(b"data: [DONE]\n\n")
    except RequestFailed as exc:      # after HTTP 200: an error event, then the stream ends properly
        await resp.write(_sse({"error": {"message": str(exc), "type": "server_error", "code": exc.status}}))
        await resp.write(b"data: [DONE]\n\n")
    finally:
        await events.aclose()     # client gone or done: the router aborts the request on its workers
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def models(request: web.Request) -> web.Response:
    cfg = request.app[ROUTER].cfg
    return web.json_response({"object": "list", "data": [
        {"id": cfg.served_model_name, "object": "model", "created": 0, "owned_by": "paasbench",
         "max_model_len": request.app[ROUTER].max_context()}]})


async def health(request: web.Request) -> web.Response:
    """``ok`` / ``degraded`` (a worker is down or restarting; still serving) -> 200, ``unavailable`` -> 503.
    Which workers, their pids and ports only for a caller who may see them (:func:`_trusted`)."""
    router = request.app[ROUTER]
    state = router.sup.health()
    body: dict[str, Any] = {"status": state["status"]}
    if _trusted(request):
        body.update(mode=router.cfg.mode, down=state["down"], restarts=state["restarts"],
                    workers={h.name: {"port": h.port, "pid": h.process.pid, "up": not h.dead} for h in router.workers})
    return web.json_response(body, status=503 if state["status"] == "unavailable" else 200)


def _trusted(request: web.Request) -> bool:
    """An authenticated caller; with no key configured, a caller on this host."""
    auth = request.app[AUTH]
    if auth.required:
        return auth.check(_bearer(request)) is not None
    return request.remote in ("127.0.0.1", "::1")


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    text = render(router.metrics, await router.worker_stats(), router.store.stats() if router.store else None)
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


def build_app(router: Router, auth: Auth | None = None) -> web.Application:
    app = web.Application(middlewares=[auth_middleware], client_max_size=64 << 20)
    app[ROUTER] = router
    app[AUTH] = auth or Auth()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
