"""A fast, configurable OpenAI-compatible streaming server: the ground truth for client and fault tests.

Why its own server (not the reference server): tests need a target whose timing is *known* — time to first
token, gap between tokens, tokens per SSE chunk — and whose failures can be injected per request, with as
little server-side CPU as possible so the client is what gets measured.

Timing model (what "configured" means): the request is "received" when its body has been read (``t_recv``).
Response headers go out at once (after ``headers_delay_ms``). Output token ``i`` (0-based) is generated at
``t_recv + ttft_ms + i * itl_ms``; a chunk is written when its last token is generated. The first chunk carries
exactly one token (as after a prefill), every later chunk ``tokens_per_chunk`` tokens (the last one fewer).
So the per-token gap is exactly ``itl_ms`` whatever ``tokens_per_chunk`` is. All times are absolute (no drift),
and the event loop uses ``select()`` (microsecond timer resolution; epoll rounds timeouts up to whole ms).

Each token's text is ``" tok"`` (one token in cl100k), so text length is proportional to tokens; ``texts`` gives
each token one character of its own instead (e.g. CJK characters that cl100k splits into several tokens).

Behaviour comes from, in increasing priority: the server's defaults (``--config JSON``), a ``"sse_test"``
object in the request body, and a directive in the prompt text: ``[[sse key=value key=value]]``.
Keys: see :class:`Behaviour`. Faults: ``status`` (HTTP error), ``stall_after`` (tokens, then silence),
``reset_after`` (tokens, then TCP RST), ``error_after`` (tokens, then an in-stream error event),
``zero_tokens``, ``empty_text`` (tokens whose text is empty), ``usage=0`` (no usage chunk), ``usage_on_last``
(totals on the last content event),
``headers_delay_ms``, ``bad_json_after``, ``hold_after_done_ms`` (the body stays open after ``[DONE]``).
``serial_ms``: every request first holds one server-wide FIFO stage that long (a prefill queue: M/D/1 under Poisson
arrivals), then ``ttft_ms`` more to its first token. ``warm_requests`` / ``warm_cached_ratio``: the first ``warm_requests`` requests received report
``warm_cached_ratio`` instead of ``cached_ratio`` (a cache still cold during a run's warm-up; counted, not timed,
so the split does not move with how late a loaded machine delivers the first request).

``GET /metrics`` answers in vLLM's names (``vllm:*``), counted the way vLLM counts: prefix-cache queries/hits
and prompt tokens when a request is scheduled (at once, or with ``max_running`` when it leaves the queue),
generation tokens and finished requests when it ends, ``vllm:time_to_first_token_seconds`` from receipt to the
first token's write, and the running / waiting gauges. ``max_running`` (server-wide) makes it an engine with a
queue: past that many requests running, the others wait, first come first served, and a request's tokens are
timed from when it leaves the queue. Server-wide only: ``models_block_size`` / ``vllm_block_size``, the KV block
size it reports, as the bundled server does in ``/v1/models`` / as vLLM does in ``/metrics``
(``vllm:cache_config_info``). ``GET /debug/gets`` answers how many GETs each other path got, so a test can
count what the harness asked; ``GET /debug/headers`` answers, per path, the headers (lower-case name: value) that
every request to it carried, so a test can check what all of them sent (auth, user headers).

Prompt tokens (``usage.prompt_tokens``) are whitespace words by default: the harness's prompts are a word a
token in any tokenizer, so the counts are exact. Server-wide settings make it a server that sees another
workload (tests/test_verify_workload.py): ``prompt_count`` (``chars4``, or a tokenizer name: a model whose
tokenizer is not ``--tokenizer``), ``template_tokens`` (a chat template's overhead), ``tokenize`` (vLLM's
``POST /tokenize``, counting the same way) and ``max_model_len``.

Use from tests (run in a separate process so its CPU never competes inside the client's event loop)::

    with SSEServer(ttft_ms=20, itl_ms=5) as srv:   # srv.url == "http://127.0.0.1:PORT"
        ...

or standalone: ``python tests/sse_server.py --port 8000 --config '{"itl_ms": 5}'`` (prints ``READY URL``).
``SSEServer(record=PATH)`` (``--record PATH``) appends every completion request body it receives to PATH as one
JSON line, so tests can check what went over the wire (e.g. re-tokenize the prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import selectors
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, fields, replace
from typing import Any

from paas_common.lifetime import stop

TOKEN_TEXT = " tok"


@dataclass(slots=True)
class Behaviour:
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    serial_ms: float = 0.0               # one server-wide FIFO "prefill" of this long before each request's ttft_ms:
                                         # a request received while another holds it waits (an M/D/1 queue)
    tokens_per_chunk: int = 1
    output_tokens: int | None = None     # None: the request's max_tokens (16 if absent)
    headers_delay_ms: float = 0.0        # before the response headers (first-byte timeout tests)
    status: int = 200                    # != 200: an error response with a JSON body
    stall_after: int | None = None       # tokens sent, then the stream goes silent for stall_s
    stall_s: float = 600.0
    reset_after: int | None = None       # tokens sent, then the connection is reset (RST)
    error_after: int | None = None       # tokens sent, then an in-stream {"error": ...} event
    bad_json_after: int | None = None    # tokens sent, then a data line that is not JSON
    zero_tokens: bool = False            # a 200 stream that carries no token (usage says 0)
    usage: bool = True                   # final usage chunk (when the client asked include_usage)
    usage_on_last: bool = False          # the totals ride on the last content event: no "choices": [] chunk
    chunk_usage: bool | None = None      # cumulative usage on every chunk; None: if the client asked
    cached_ratio: float = 0.0            # usage.prompt_tokens_details.cached_tokens = ratio * prompt
    timings: bool = False                # final chunk carries "paasbench_timings" (measured by the server)
    done: bool = True                    # send "data: [DONE]"
    hold_after_done_ms: float = 0.0      # after [DONE], keep the body open this long before its end
    models_block_size: int | None = None  # server-wide: KV block size in /v1/models, as the bundled server says it
    models_delay_ms: float = 0.0          # server-wide: /v1/models answers after this long (a slow model lookup)
    vllm_block_size: int | None = None    # server-wide: in /metrics' vllm:cache_config_info, as vLLM says it
    texts: str | None = None             # token i's text is texts[i % len(texts)] (one character), not " tok"
    empty_text: bool = False             # every token's text is "" (a byte of a character not complete yet, as
                                         # vLLM streams it; usage still counts the tokens)
    warm_requests: int = 0               # see warm_cached_ratio
    warm_cached_ratio: float | None = None  # cached ratio of the first warm_requests requests received
    # how the server counts prompt tokens (server-wide, not per request): "words" (whitespace words, what the
    # harness's prompts are in any tokenizer), "chars4" (a character count / 4, as a model whose tokenizer
    # is not --tokenizer would), or a tokenizer name for paasbench.tokenizer.load_tokenizer
    prompt_count: str = "words"
    template_tokens: int = 0             # chat requests: a chat template's constant overhead on prompt_tokens
    tokenize: bool = False               # serve vLLM's POST /tokenize (else it answers 404)
    max_model_len: int | None = None     # reported by /tokenize; longer prompt + max_tokens is a 400
    max_running: int | None = None       # server-wide: at most this many requests run, the rest wait in a queue
                                         # (vllm:num_requests_waiting), first come first served; a request's
                                         # tokens are timed from when it leaves the queue, its TTFT from receipt
    machines: int | None = None          # GET /health reports "hardware" on this many machines, as the reference
                                         # server does (joined hosts included); None: status only
    strict_model: bool = False           # a request naming another model than the server's gets vLLM's 404
                                         # ("The model `x` does not exist."), /tokenize included


_FIELDS = {f.name: f.type for f in fields(Behaviour)}
_DIRECTIVE = re.compile(r"\[\[sse ([^\]]*)\]\]")


def _coerce(key: str, value: Any) -> Any:
    if key not in _FIELDS:
        raise ValueError(f"unknown sse_test key {key!r}")
    kind = _FIELDS[key]
    if isinstance(value, str):
        if value.lower() in ("none", "null"):
            return None
        if "str" in kind:
            return value
        if "bool" in kind:
            return value.lower() in ("1", "true", "yes")
        return int(value) if "int" in kind and "float" not in kind else float(value)
    return value


def behaviour_for(base: Behaviour, body: dict[str, Any], prompt_text: str) -> Behaviour:
    over: dict[str, Any] = {k: _coerce(k, v) for k, v in (body.get("sse_test") or {}).items()}
    m = _DIRECTIVE.search(prompt_text[:4096]) if prompt_text else None
    if m:
        for item in m.group(1).split():
            k, _, v = item.partition("=")
            over[k] = _coerce(k, v)
    return replace(base, **over) if over else base


def count_tokens(text: str, how: str) -> int:
    """Prompt tokens of ``text`` as this server counts them (``Behaviour.prompt_count``)."""
    if how == "words":
        from paas_common.tokenizer import count_words

        return count_words(text)
    if how == "chars4":
        return -(-len(text) // 4)
    from paas_common.tokenizer import load_tokenizer

    return len(load_tokenizer(how).encode(text))


def _prompt_text_and_tokens(body: dict[str, Any], base: Behaviour) -> tuple[str, int]:
    """Prompt text (for directives) and its token count (``prompt_count``; a chat request gets the template's
    ``template_tokens`` on top), or the token-id list length."""
    if "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body["messages"])
        return text, count_tokens(text, base.prompt_count) + base.template_tokens
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return "", len(prompt)
    return prompt, count_tokens(prompt, base.prompt_count)


class _Stream:
    """Pre-encoded chunk templates, so one chunk costs one bytes concatenation."""

    def __init__(self, chat: bool, model: str, rid: str) -> None:
        self.chat = chat
        created = int(time.time())
        if chat:
            self.head = (f'{{"id":"{rid}","object":"chat.completion.chunk","created":{created},'
                         f'"model":"{model}","choices":[{{"index":0,"delta":{{"content":"').encode()
            self.tail = b'"},"logprobs":null,"finish_reason":null}]'
        else:
            self.head = (f'{{"id":"{rid}","object":"text_completion","created":{created},'
                         f'"model":"{model}","choices":[{{"index":0,"text":"').encode()
            self.tail = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]'
        self.prefix = (f'{{"id":"{rid}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
                       f'"created":{created},"model":"{model}",').encode()

    def tokens(self, text: str, usage: bytes | None) -> bytes:
        body = self.head + text.encode() + self.tail
        body += (b',"usage":' + usage + b"}") if usage is not None else b"}"
        return b"data: " + body + b"\n\n"

    def role(self) -> bytes:
        return (b"data: " + self.prefix + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]}\n\n')

    def final(self, usage: bytes | None, extra: bytes = b"") -> bytes:
        u = b',"usage":' + usage if usage is not None else b""
        return b"data: " + self.prefix + b'"choices":[]' + u + extra + b"}\n\n"


def _usage(prompt: int, completion: int, cached: int | None) -> bytes:
    u: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                         "completion_tokens": completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return json.dumps(u, separators=(",", ":")).encode()


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


@dataclass(slots=True)
class EngineCounters:
    """What ``GET /metrics`` reports (vLLM's names)."""

    received: int = 0
    queries: int = 0
    hits: int = 0
    prompt: int = 0
    generation: int = 0
    finished: int = 0
    running: int = 0
    waiting: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0

    def text(self) -> str:
        labels = '{engine="0",model_name="sse-test"}'
        lines = []
        for name, kind, value in (
                ("vllm:num_requests_running", "gauge", self.running),
                ("vllm:num_requests_waiting", "gauge", self.waiting),
                ("vllm:prefix_cache_queries_total", "counter", self.queries),
                ("vllm:prefix_cache_hits_total", "counter", self.hits),
                ("vllm:prompt_tokens_total", "counter", self.prompt),
                ("vllm:generation_tokens_total", "counter", self.generation),
                ("vllm:request_success_total", "counter", self.finished)):
            lines += [f"# TYPE {name} {kind}", f"{name}{labels} {float(value)!r}"]
        lines += ["# TYPE vllm:time_to_first_token_seconds histogram",
                  f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="sse-test"}} '
                  f"{float(self.ttft_count)!r}",
                  f"vllm:time_to_first_token_seconds_sum{labels} {self.ttft_sum_s!r}",
                  f"vllm:time_to_first_token_seconds_count{labels} {float(self.ttft_count)!r}"]
        return "\n".join(lines) + "\n"


class Server:
    def __init__(self, base: Behaviour, model: str = "sse-test", record: str | None = None) -> None:
        self.base, self.model, self.seq, self.record = base, model, 0, record
        self.free_at = 0.0               # when the serial_ms stage is free (monotonic)
        self.engine = EngineCounters()
        self.slots = asyncio.Semaphore(base.max_running) if base.max_running else None
        self.gets: dict[str, int] = {}   # GET requests by path (``GET /debug/gets`` reads them, uncounted)
        self.common: dict[str, dict[str, str]] = {}   # path -> the headers all its requests carried (/debug/headers)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                t_recv = time.monotonic()
                if not path.startswith("/debug/"):
                    where = path.split("?")[0]
                    seen = self.common.get(where)
                    self.common[where] = dict(headers) if seen is None else \
                        {k: v for k, v in seen.items() if headers.get(k) == v}
                if method == "GET":
                    if not path.startswith("/debug/"):
                        self.gets[path.split("?")[0]] = self.gets.get(path.split("?")[0], 0) + 1
                    await self._get(writer, path)
                    continue
                keep = await self._post(writer, path, headers, body, t_recv)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            if not writer.is_closing():
                writer.close()

    async def _get(self, writer: asyncio.StreamWriter, path: str) -> None:
        if path.startswith("/debug/gets"):
            body = json.dumps(self.gets).encode()
        elif path.startswith("/debug/headers"):
            body = json.dumps(self.common).encode()
        elif path.startswith("/v1/models"):
            await asyncio.sleep(self.base.models_delay_ms / 1e3)
            model = {"id": self.model, "object": "model"}
            if self.base.models_block_size:
                model["block_size"] = self.base.models_block_size
            body = json.dumps({"object": "list", "data": [model]}).encode()
        elif path.startswith("/metrics"):
            text = self.engine.text()
            if self.base.vllm_block_size:
                text = (text.rstrip("\n") + "\n" if text else "") + \
                    f'vllm:cache_config_info{{block_size="{self.base.vllm_block_size}",cache_dtype="auto"}} 1.0\n'
            body = text.encode()
        elif self.base.machines is not None:
            body = json.dumps({"status": "ok", "hardware": {"cards": None, "machines": self.base.machines,
                                                            "cards_per_worker": None}}).encode()
        else:
            body = b'{"status":"ok"}'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                     % (len(body), body))
        await writer.drain()

    def _error(self, writer: asyncio.StreamWriter, status: int, msg: str) -> None:
        body = json.dumps({"object": "error", "message": msg, "code": status}).encode()
        writer.write(b"HTTP/1.1 %d Error\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                     % (status, len(body), body))

    async def _tokenize(self, writer: asyncio.StreamWriter, body: dict[str, Any], prompt_tokens: int) -> bool:
        """vLLM's /tokenize: ``{"count", "tokens", "max_model_len"}``; ``tokens`` are placeholders (only the
        count is this server's). ``add_special_tokens`` adds nothing: this server has no BOS."""
        out = {"count": prompt_tokens, "tokens": list(range(prompt_tokens)), "max_model_len": self.base.max_model_len}
        data = json.dumps(out).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                     % (len(data), data))
        await writer.drain()
        return True

    async def _post(self, writer: asyncio.StreamWriter, path: str, headers: dict[str, str], raw: bytes,
                    t_recv: float) -> bool:
        try:
            body = json.loads(raw)
            prompt_text, prompt_tokens = _prompt_text_and_tokens(body, self.base)
            beh = behaviour_for(self.base, body, prompt_text)
        except (ValueError, TypeError) as exc:
            self._error(writer, 400, str(exc))
            await writer.drain()
            return True
        if self.base.strict_model and body.get("model") not in (None, self.model):
            # vLLM 0.32's answer (vllm/entrypoints/serve/engine/serving.py, _check_model), on every endpoint
            err = {"error": {"message": f"The model `{body['model']}` does not exist. Valid aliases: {self.model}.",
                             "type": "NotFoundError", "param": "model", "code": 404}}
            data = json.dumps(err).encode()
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                         % (len(data), data))
            await writer.drain()
            return True
        if path == "/tokenize" and self.base.tokenize:
            return await self._tokenize(writer, body, prompt_tokens)
        chat = path.startswith("/v1/chat/completions")
        if not chat and not path.startswith("/v1/completions"):   # a path it has no route for: FastAPI's answer
            data = b'{"detail":"Not Found"}'
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                         % (len(data), data))
            await writer.drain()
            return True
        if self.record:   # completions only: what the load sent (a /tokenize call is not load)
            with open(self.record, "ab") as fh:
                fh.write(raw.replace(b"\n", b" ") + b"\n")
        limit = self.base.max_model_len
        if limit is not None and prompt_tokens + int(body.get("max_tokens") or 16) > limit:
            self._error(writer, 400, f"This model's maximum context length is {limit} tokens")
            await writer.drain()
            return True
        if beh.headers_delay_ms:
            await asyncio.sleep(beh.headers_delay_ms / 1e3)
        if beh.status != 200:
            self._error(writer, beh.status, f"injected HTTP {beh.status}")
            await writer.drain()
            return True
        eng = self.engine
        eng.received += 1
        ratio = beh.cached_ratio
        if beh.warm_cached_ratio is not None and eng.received <= beh.warm_requests:
            ratio = beh.warm_cached_ratio
        cached = int(prompt_tokens * ratio) if ratio else None
        if self.slots is not None:
            eng.waiting += 1
            try:
                await self.slots.acquire()
            finally:
                eng.waiting -= 1
        # scheduled: the prefix cache is queried now (vLLM counts its queries and hits when it schedules a prompt)
        eng.queries += prompt_tokens
        eng.prompt += prompt_tokens
        eng.hits += cached or 0
        eng.running += 1
        try:
            return await self._stream(writer, body, beh, chat, headers, prompt_tokens, cached, t_recv,
                                      time.monotonic() if self.slots is not None else t_recv)
        finally:
            eng.running -= 1
            if self.slots is not None:
                self.slots.release()

    async def _stream(self, writer: asyncio.StreamWriter, body: dict[str, Any], beh: Behaviour, chat: bool,
                      headers: dict[str, str], prompt_tokens: int, cached: int | None, t_recv: float,
                      t_start: float) -> bool:
        opts = body.get("stream_options") or {}
        want_usage = bool(opts.get("include_usage")) and beh.usage
        chunk_usage = bool(opts.get("continuous_usage_stats")) if beh.chunk_usage is None else beh.chunk_usage
        n_out = 0 if beh.zero_tokens else (beh.output_tokens if beh.output_tokens is not None
                                           else int(body.get("max_tokens") or 16))
        self.seq += 1
        s = _Stream(chat, body.get("model") or self.model, headers.get("x-request-id", f"req-{self.seq}"))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        if chat:
            writer.write(_chunked(s.role()))
        t_first = t_start + beh.ttft_ms / 1e3
        if beh.serial_ms > 0:            # FIFO in order of start: the queue's start is known now
            self.free_at = max(t_start, self.free_at) + beh.serial_ms / 1e3
            t_first = self.free_at + beh.ttft_ms / 1e3
        itl = beh.itl_ms / 1e3
        k = max(1, beh.tokens_per_chunk)
        sent = 0
        first_at = None
        first_wall_ns = None
        write_clocks: list[float] = []      # when each content chunk was handed to the socket (monotonic)
        while sent < n_out:
            if beh.stall_after is not None and sent >= beh.stall_after:
                await writer.drain()
                await asyncio.sleep(beh.stall_s)
                return False
            if beh.reset_after is not None and sent >= beh.reset_after:
                await writer.drain()
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return False
            if beh.error_after is not None and sent >= beh.error_after:
                writer.write(_chunked(b'data: {"error":{"message":"injected stream error","code":500}}\n\n'))
                writer.write(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
                return True
            if beh.bad_json_after is not None and sent >= beh.bad_json_after:
                writer.write(_chunked(b"data: {not json\n\n") + b"0\r\n\r\n")
                await writer.drain()
                return True
            n = 1 if sent == 0 else min(k, n_out - sent)
            due = t_first + (sent + n - 1) * itl
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            text = "" if beh.empty_text else TOKEN_TEXT * n if not beh.texts else "".join(
                beh.texts[j % len(beh.texts)] for j in range(sent, sent + n))
            sent += n
            last = beh.usage_on_last and want_usage and sent == n_out
            usage = _usage(prompt_tokens, sent, cached) if chunk_usage or last else None
            writer.write(_chunked(s.tokens(text, usage)))
            write_clocks.append(time.monotonic())
            if first_at is None:
                first_at, first_wall_ns = time.monotonic(), time.time_ns()
                self.engine.ttft_sum_s += first_at - t_recv
                self.engine.ttft_count += 1
            await writer.drain()
        last_at = time.monotonic()
        self.engine.generation += sent
        self.engine.finished += 1
        extra = b""
        if beh.timings:
            t = {"queue_ms": 0.0, "ttft_ms": ((first_at or last_at) - t_recv) * 1e3,
                 # time.monotonic: comparable across processes, the "wire" truth for client timing tests
                 "recv_clock": t_recv, "first_write_clock": first_at, "last_write_clock": last_at,
                 "first_write_wall_ns": first_wall_ns,  # the wall clock, for the records' epoch-ns fields
                 "write_clocks": write_clocks,          # every content chunk's write: the per-token wire truth
                 "decode_ms": (last_at - (first_at or last_at)) * 1e3, "prefill_location": "local"}
            extra = b',"paasbench_timings":' + json.dumps(t).encode()
        tail = b""
        final_usage = want_usage and not beh.usage_on_last
        if final_usage or extra:
            tail += _chunked(s.final(_usage(prompt_tokens, sent, cached) if final_usage else None, extra))
        if beh.done:
            tail += _chunked(b"data: [DONE]\n\n")
        if beh.hold_after_done_ms:
            writer.write(tail)
            await writer.drain()
            await asyncio.sleep(beh.hold_after_done_ms / 1e3)
            tail = b""
        writer.write(tail + b"0\r\n\r\n")
        await writer.drain()
        return True


async def serve(host: str, port: int, base: Behaviour, record: str | None = None) -> None:
    srv = Server(base, record=record)
    server = await asyncio.start_server(srv.handle, host, port, backlog=1024)
    url = "http://%s:%d" % server.sockets[0].getsockname()[:2]
    print(f"READY {url}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--config", default="{}", help="JSON object of Behaviour defaults")
    ap.add_argument("--record", default=None, help="append each completion request body to this file (JSON lines)")
    args = ap.parse_args(argv)
    base = Behaviour(**{k: _coerce(k, v) for k, v in json.loads(args.config).items()})
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        loop.run_until_complete(serve(args.host, args.port, base, args.record))
    except KeyboardInterrupt:
        pass


def wire_ttft_ms(rec: Any, t0: float) -> float:
    """Wire truth for a record of a request sent with ``timings=1``: intended send (client) to the server's
    first token write, on the shared monotonic clock (``t0`` is the run's ``meta.t0_monotonic``)."""
    return (rec.server_timings["first_write_clock"] - t0 - rec.intended_send_s) * 1e3


class SSEServer:
    """Runs the server in a child process; ``url`` is valid inside the ``with`` block."""

    def __init__(self, record: str | os.PathLike[str] | None = None, **defaults: Any) -> None:
        self.record = str(record) if record is not None else None
        for k in defaults:
            _coerce(k, None)  # reject typos early
        self.defaults = defaults
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self._taken = 0   # bytes of the record already returned by take_bodies

    def __enter__(self) -> "SSEServer":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--config", json.dumps(self.defaults)]
        if self.record:
            cmd += ["--record", self.record]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"sse_server did not start: {line!r}")
        self.url = line.split(" ", 1)[1]
        return self

    def take_bodies(self) -> list[dict[str, Any]]:
        """The request bodies recorded since the last take (``record=PATH``), oldest first.

        The server appends to the file while this reads it, so the file is never truncated: reading and then
        truncating dropped every body the server appended between the two (a quarter of 400 under a tight take
        loop). It reads on from where the last take stopped, whole lines only, so a line still being written is
        taken next time."""
        assert self.record, "SSEServer(record=PATH) records request bodies"
        if not os.path.exists(self.record):
            return []
        with open(self.record, "rb") as fh:
            fh.seek(self._taken)
            data = fh.read()
        whole = data[: data.rfind(b"\n") + 1]
        self._taken += len(whole)
        return [json.loads(x) for x in whole.splitlines() if x.strip()]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop(self.proc)


if __name__ == "__main__":
    main()
