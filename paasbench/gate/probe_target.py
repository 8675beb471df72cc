"""The client probe's target: a zero-latency OpenAI-style streaming server that costs the client nothing to reach.

The A/B's ``client`` probe (:mod:`paasbench.gate.client_probe`) measures the load generator itself — its CPU per
streamed token, its memory, its launch time and its pacing — so the server it talks to must add nothing that
varies: no model, no queue, no latency. This one answers every completion at once with ``max_tokens`` tokens,
one token per SSE event (like vLLM), the whole response in one write. Fixed chunking matters more than realism
here: when a target writes a response in pieces, a client that falls behind reads several pieces at once, so its
reads per token — and its CPU per token — depend on how busy the machine was (on the shared 2-core box, 16 events
a write moved the same code's CPU per token by ±12% between the two sides of a round). One write a response makes
the client's reads per token the same in every run: one read (rarely two) and 128 events to scan. The events are
pre-encoded, so a token costs the target a few bytes of copying.

It also says what it saw, so the probe can measure the client from outside, whatever version of paasbench the
client is: ``GET /probe/stats`` returns when the first completion request's body had been read and when the last
stream ended (``time.monotonic``, one clock for every process on Linux), and the tokens and requests served.

It lives in the package, not in tests/, because ``scripts/perf_gate.sh`` runs it on every A/B. Run standalone::

    python -m paasbench.gate.probe_target [--port 0]      # prints "READY http://127.0.0.1:PORT"

Prompt tokens (``usage.prompt_tokens``) are whitespace words: the harness's prompts are a word a token.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import urllib.request
from typing import Any

import orjson

from paas_common.lifetime import die_with_parent, stop, tether
from paas_common.tokenizer import count_words

_TOKEN = b'data: {"id":"probe","object":"text_completion","model":"probe","choices":[{"index":0,"text":" tok",' \
         b'"finish_reason":null}]}\n\n'
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)



class Stats:
    def __init__(self) -> None:
        self.first_request: float | None = None   # time.monotonic() when the first completion body was read
        self.last_end: float | None = None        # when the last stream's final bytes were written
        self.tokens = 0
        self.requests = 0

    def as_json(self) -> bytes:
        return orjson.dumps({"first_request_monotonic": self.first_request, "last_end_monotonic": self.last_end,
                             "tokens": self.tokens, "requests": self.requests})


class _Conn(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection: requests parsed from the bytes as they come, answered in order."""

    def __init__(self, stats: Stats) -> None:
        self.stats, self.buf, self.tr = stats, b"", None

    def connection_made(self, transport: Any) -> None:
        self.tr = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
            method, path = (head[0].split(" ") + ["", ""])[:2]
            self._answer(method, path, body)

    def _answer(self, method: str, path: str, body: bytes) -> None:
        if method == "POST" and path.endswith("/completions"):
            if self.stats.first_request is None:
                self.stats.first_request = time.monotonic()
            req = orjson.loads(body)
            prompt = req.get("prompt")
            if prompt is None:
                prompt = " ".join(str(m.get("content", "")) for m in req.get("messages") or [])
            n = int(req.get("max_tokens") or 16)
            p = len(prompt) if isinstance(prompt, list) else count_words(prompt)
            self.stats.requests += 1
            usage = orjson.dumps({"id": "probe", "object": "text_completion", "model": "probe", "choices": [],
                                  "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}})
            self.tr.write(_HEAD + _chunk(_TOKEN * n) + _chunk(b"data: " + usage + b"\n\ndata: [DONE]\n\n")
                          + b"0\r\n\r\n")
            self.stats.tokens += n
            self.stats.last_end = time.monotonic()
        elif method == "GET" and path == "/probe/stats":
            self._json(self.stats.as_json())
        elif method == "GET" and path == "/v1/models":
            self._json(b'{"object":"list","data":[{"id":"probe","object":"model"}]}')
        else:
            self._json(b'{"error":{"message":"not found"}}', b"404 Not Found")

    def _json(self, payload: bytes, status: bytes = b"200 OK") -> None:
        self.tr.write(b"HTTP/1.1 %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                      % (status, len(payload), payload))


async def serve(host: str, port: int) -> None:
    stats = Stats()
    server = await asyncio.get_running_loop().create_server(lambda: _Conn(stats), host, port, backlog=4096)
    sock = server.sockets[0].getsockname()
    print(f"READY http://{sock[0]}:{sock[1]}", flush=True)
    await server.serve_forever()


class ProbeTarget:
    """The target in its own process (its CPU never competes inside the measured client's event loop)::

        with ProbeTarget() as target:   # target.url == "http://127.0.0.1:PORT"
            ...
            target.stats()              # what it saw so far
    """

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> "ProbeTarget":
        self.proc = subprocess.Popen([self.python, "-m", "paasbench.gate.probe_target"], stdout=subprocess.PIPE,
                                     text=True, **tether().popen_kwargs())   # it dies with us, however we end
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.__exit__()
            raise RuntimeError(f"the probe target did not start (said {line!r})")
        self.url = line.split()[1]
        return self

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/probe/stats", timeout=10) as resp:
            return orjson.loads(resp.read())

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop(self.proc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    die_with_parent()   # a no-op unless started with a tether (ProbeTarget)
    try:
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
