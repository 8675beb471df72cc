"""The public HTTP surface (aiohttp): OpenAI-compatible completions and chat completions with SSE,
``/v1/models``, vLLM's ``/tokenize``, ``/health`` and ``/metrics``.

Sampling is greedy (temperature and friends are accepted and ignored: the reference server exists to
measure serving, and greedy output is what makes the three modes comparable token for token).
Request bodies are validated and tokenized off the event loop by :mod:`reference_server.parse`. Keys and tenants: :mod:`reference_server.auth` (the tenant comes from the key, not from the
``x-tenant`` header, unless the server was told to trust it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import struct
import time
import uuid
from typing import Any

from aiohttp import web

from reference_server.auth import Auth
from reference_server.detok import Detokenizer
from reference_server.engine.vocab import get_vocab
from reference_server.faults import HTTP_KINDS, STREAM_KINDS, FaultPlan, FaultRule, FaultSpecError
from reference_server.metrics import render
from reference_server.parse import BadRequest, parse
from reference_server.router import Completion, Overloaded, RequestFailed, Router

ROUTER = web.AppKey("router", Router)
AUTH = web.AppKey("auth", Auth)
_seq = itertools.count()


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


def _vocab(cfg: Any) -> Any:
    """The model's own tokens (cpu, vllm: its tokenizer.json; sim: cl100k), loaded once per process."""
    return get_vocab(cfg.model if cfg.engine in ("cpu", "vllm") else "tiny")


async def _parsed(request: web.Request, chat: bool | None) -> Any:
    """The request's body parsed and tokenized as the completions path does (``chat`` None: chat when the body
    has ``messages``, as vLLM's /tokenize takes either), or the error response to send instead."""
    cfg = request.app[ROUTER].cfg
    try:
        raw = await request.read()                    # refused past --max-body-mb before it is read
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"request body too large (limit {request.client_max_size} bytes, --max-body-mb)")
    vocab = _vocab(cfg)
    if chat is None:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        chat = isinstance(body, dict) and "messages" in body
    try:   # JSON and tokenization off the event loop: a multi-MB prompt must not stall other streams
        parsed = await asyncio.get_running_loop().run_in_executor(None, parse, raw, chat, vocab)
    except BadRequest as exc:
        return _error(400, str(exc))
    if parsed.model is not None and parsed.model != cfg.served_model_name:
        return _error(404, f"model '{parsed.model}' does not exist; this server serves '{cfg.served_model_name}'",
                      "not_found_error")
    return parsed


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    router = request.app[ROUTER]
    cfg = router.cfg
    parsed = await _parsed(request, chat)
    if isinstance(parsed, web.StreamResponse):
        return parsed
    prompt, max_tokens = parsed.prompt, parsed.max_tokens
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    internal_rid = f"{rid}#{next(_seq)}"      # unique even if a client reuses an id
    req = Completion(internal_rid, _tenant(request), prompt, max_tokens, parsed.ignore_eos)
    limit = router.max_context()
    if limit is not None and len(prompt) + max_tokens > limit:
        return _error(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds this server's "
                           f"context of {limit} tokens (its KV budget)")
    stream, include_usage, continuous = parsed.stream, parsed.include_usage, parsed.continuous_usage
    fault = router.faults.draw() if router.faults is not None else None
    if fault is not None and fault.kind in HTTP_KINDS:
        status = int(fault.kind[5:])
        return _error(status, f"injected fault: HTTP {status}", "rate_limit_error" if status == 429 else "server_error",
                      {"Retry-After": f"{max(1, round(fault.seconds))}", "x-request-id": rid} if status == 429
                      else {"x-request-id": rid})
    if fault is not None and fault.kind in STREAM_KINDS and not stream:
        fault = None                 # stream faults apply to streaming responses only
    elif fault is not None and fault.kind not in STREAM_KINDS:
        req.fault, fault = fault, None   # a worker fault: the router applies it
    fmt = _Stream(chat, rid, cfg.served_model_name)
    detok = Detokenizer(_vocab(cfg).tokenizer)
    headers = {"x-request-id": rid}
    if fault is not None and fault.kind == "zero_tokens":
        return await _zero_tokens(request, fmt, len(prompt), headers)
    events = router.generate(req)
    try:
        return await _respond(request, events, stream, chat, fmt, detok, fault, headers, len(prompt),
                              include_usage, continuous)
    except ConnectionResetError:
        # The client left and a write found its connection closing before aiohttp cancelled this handler
        # (handler_cancellation, reference_server.server; the cancellation itself just propagates).
        # Nothing can reach it any more: aiohttp drops this answer without a word.
        return web.Response(status=499, reason="Client Closed Request")
    finally:
        await events.aclose()     # done, failed or client gone: the router aborts an unfinished request


async def _respond(request: web.Request, events: Any, stream: bool, chat: bool, fmt: "_Stream", detok: Detokenizer,
                   fault: FaultRule | None, headers: dict[str, str], prompt_tokens: int, include_usage: bool,
                   continuous: bool) -> web.StreamResponse:
    """The response to one accepted request from its router events: JSON, or an SSE stream."""
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
    produced = chunks = 0
    try:
        while ev["op"] != "done":
            if fault is not None:
                if fault.kind == "slow_drip":
                    await asyncio.sleep(fault.seconds)
                elif chunks >= fault.after_tokens:
                    await events.aclose()          # the server's work for it stops here
                    await _break_stream(fault, request, resp, fmt)
                    return resp
            chunks += 1
            chunk = fmt.delta(detok.feed(ev["ids"]))
            if continuous:
                produced += len(ev["ids"])
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": produced,
                                  "total_tokens": prompt_tokens + produced}
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
    return resp


async def _zero_tokens(request: web.Request, fmt: _Stream, prompt_tokens: int,
                       headers: dict[str, str]) -> web.StreamResponse:
    """Injected fault: a 200 stream that carries no token, then ``[DONE]``."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    final = fmt.delta("", "stop")
    final["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    await resp.write(_sse(final))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _break_stream(fault: FaultRule, request: web.Request, resp: web.StreamResponse, fmt: _Stream) -> None:
    """Injected mid-stream faults (``after_tokens`` chunks were sent)."""
    if fault.kind == "reset":            # RST, not FIN: SO_LINGER 0, then drop the connection
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if transport is not None:
            transport.abort()
        raise ConnectionResetError("injected fault: connection reset")
    if fault.kind == "stall":            # silence, the socket kept open; then it closes without [DONE]
        end = time.monotonic() + fault.seconds
        while time.monotonic() < end and request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.1)     # (a client that gave up ends it early)
        return
    if fault.kind == "malformed_sse":
        await resp.write(b"data: {not json\n\n")
    else:                                # truncated_json: a chunk cut mid-object
        whole = json.dumps(fmt.delta(" cut"), separators=(",", ":")).encode()
        await resp.write(b"data: " + whole[:len(whole) // 2] + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")


async def admin_faults(request: web.Request) -> web.Response:
    """``GET``: the fault plan and what fired; ``POST`` a spec (see :mod:`reference_server.faults`) to
    replace it. Registered only when the server was started with ``--fault-spec``."""
    faults = request.app[ROUTER].faults
    assert faults is not None
    if request.method == "POST":
        try:
            faults.reset(FaultPlan.from_obj(await request.json(), "body"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        except FaultSpecError as exc:
            return _error(400, str(exc))
    return web.json_response(faults.state())


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize`` (``prompt``, or chat ``messages``): the tokens this server counts for that prompt,
    from the completions path's own parse (its tokenizer and chat template: what ``usage.prompt_tokens`` will
    say, whatever engine runs it), and ``max_model_len``, the context ``/v1/models`` reports, so a client can
    check its prompts before sending any (the harness's pre-flight)."""
    parsed = await _parsed(request, None)
    if isinstance(parsed, web.StreamResponse):
        return parsed
    return web.json_response({"count": len(parsed.prompt), "tokens": parsed.prompt,
                              "max_model_len": request.app[ROUTER].max_context()})


async def models(request: web.Request) -> web.Response:
    cfg = request.app[ROUTER].cfg
    return web.json_response({"object": "list", "data": [
        {"id": cfg.served_model_name, "object": "model", "created": 0, "owned_by": "paasbench",
         "max_model_len": request.app[ROUTER].max_context(), "block_size": request.app[ROUTER].block_size()}]})


async def health(request: web.Request) -> web.Response:
    """``ok`` / ``degraded`` (a worker is down or restarting, a pool has no worker up, or part of the shared KV
    store does not answer; still serving) -> 200, ``unavailable`` (no decode worker up) -> 503.
    Which workers, their pids and ports only for a caller who may see them (:func:`_trusted`)."""
    router = request.app[ROUTER]
    state = router.sup.health()
    store_down = await router.store_down()
    if store_down and state["status"] == "ok":      # the store is best effort: misses are recomputed
        state["status"] = "degraded"
    body: dict[str, Any] = {"status": state["status"]}
    if _trusted(request):
        body.update(mode=router.cfg.mode, down=state["down"] + store_down, empty_pools=state["empty_pools"],
                    restarts=state["restarts"], dropped=state["dropped"], dropped_total=state["dropped_total"],
                    join_refused=state["join_refused"], hardware=router.hardware(),
                    workers={h.name: _worker(h) for h in router.workers})
    return web.json_response(body, status=503 if state["status"] == "unavailable" else 200)


def _worker(h: Any) -> dict[str, Any]:
    """One worker in /health: a child (pid; restarted by the router when it dies) or a worker that joined
    from another host (its host; dropped, not restarted, when it stops answering)."""
    if h.joined:
        return {"host": h.host, "port": h.port, "up": not h.dead, "joined": True, "restarted_by_router": False}
    return {"port": h.port, "pid": h.process.pid, "up": not h.dead, "joined": False, "restarted_by_router": True}


def _trusted(request: web.Request) -> bool:
    """An authenticated caller; with no key configured, a caller on this host."""
    auth = request.app[AUTH]
    if auth.required:
        return auth.check(_bearer(request)) is not None
    return request.remote in ("127.0.0.1", "::1")


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    stats = await router.worker_stats()
    # --engine vllm: each instance's own exposition, passed through with a worker label on every series
    engines = [(f"{s['role']}-{s['index']}", s.pop("engine_metrics")) for s in stats if "engine_metrics" in s]
    text = render(router.metrics, stats, await router.store_report(stats))
    if engines:
        from reference_server.vllm_worker import merge_expositions

        text += merge_expositions(engines)
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


def build_app(router: Router, auth: Auth | None = None) -> web.Application:
    app = web.Application(middlewares=[auth_middleware], client_max_size=int(router.cfg.max_body_mb * 2**20))
    app[ROUTER] = router
    app[AUTH] = auth or Auth()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if router.faults is not None:
        app.router.add_route("*", "/admin/faults", admin_faults)
    return app
