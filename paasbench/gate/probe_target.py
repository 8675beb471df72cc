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
client is: ``GET /probe/stats`` returns when the first completion request's body had been read, when the load
phase started and ended (``time.monotonic``, one clock for every process on Linux), and the tokens and requests
served. Told the client's pid (``POST /probe/watch``), it reads the client's CPU itself at those moments — the
first request read, the first responses written, the client's last connection closed with every response
answered (a closed-loop client closes its connections once it has read them all; the last response *written* is
too early: up to one a stream may still be unread) — so the phase's CPU is exact, not interpolated between
samples. For an A/B pair it can also hold every response until ``POST /probe/go`` and stop the client
(SIGSTOP) at the phase's end until ``POST /probe/resume``: both sides' phases then cover the same seconds
(:class:`paasbench.gate.client_probe._LoadPhase`).

It lives in the package, not in tests/, because ``scripts/perf_gate.sh`` runs it on every A/B. Run standalone::

    python -m paasbench.gate.probe_target [--port 0]      # prints "READY http://127.0.0.1:PORT"

Prompt tokens (``usage.prompt_tokens``) are whitespace words: the harness's prompts are a word a token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
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



def process_sched(pid: int) -> tuple[float, float, int] | None:
    """A process's scheduler account so far, summed over its threads (``/proc/PID/task/*/schedstat``): seconds on
    a CPU (exact to the last context switch, where ``/proc/PID/stat`` counts 10 ms ticks), seconds runnable but
    waiting for one, and timeslices run; None once it is gone. A thread that has exited drops out of the sums (the
    client's threads live as long as it does)."""
    run = wait = slices = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                r, w, n = f.read().split()[:3]
        except (OSError, ValueError):
            continue   # the thread ended between the listing and the read
        run, wait, slices = run + int(r), wait + int(w), slices + int(n)
    return run / 1e9, wait / 1e9, slices


class Stats:
    """What the target saw, and the measured client's CPU at the load phase's ends (``POST /probe/watch``)."""

    def __init__(self) -> None:
        self.first_request: float | None = None   # time.monotonic() when the first completion body was read
        self.load_start: float | None = None      # when the first response was written (held ones: at the release)
        self.last_end: float | None = None        # when the last stream's final bytes were written
        self.load_end: float | None = None        # when the client, all answered, closed its last connection
        self.answered = 0
        self.open_conns = 0                        # connections that carried a completion, still open
        self.tokens = 0
        self.requests = 0
        self.watch_pid: int | None = None         # the measured client
        self.expect: int | None = None            # the completions it will send
        self.hold = False                          # answer nothing until POST /probe/go
        self.freeze = False                        # SIGSTOP the client once its last response is written
        self.frozen = False
        self.held: list[tuple[_Conn, int, int]] = []   # completions waiting for POST /probe/go: (conn, out, prompt)
        # the client's CPU (process_sched) read by this process at the moment each event happened
        self.cpu_at_first: float | None = None
        self.sched_at_start: tuple[float, float, int] | None = None   # process_sched at the phase's ends (their
        self.sched_at_last: tuple[float, float, int] | None = None    # [0]: the client's CPU then)
        self.cpu_at_last_write: float | None = None   # when the last response was written (the phase's end before)

    def client_cpu(self) -> float | None:
        sched = self.client_sched()
        return sched[0] if sched is not None else None

    def start_phase(self) -> None:
        self.load_start, self.sched_at_start = time.monotonic(), self.client_sched()

    def client_sched(self) -> tuple[float, float, int] | None:
        return process_sched(self.watch_pid) if self.watch_pid is not None else None

    def as_json(self) -> bytes:
        return orjson.dumps({"first_request_monotonic": self.first_request, "load_start_monotonic": self.load_start,
                             "last_end_monotonic": self.last_end, "load_end_monotonic": self.load_end,
                             "tokens": self.tokens, "requests": self.requests,
                             "client_cpu_at_first_s": self.cpu_at_first,
                             "client_cpu_at_start_s": self.sched_at_start[0] if self.sched_at_start else None,
                             "client_cpu_at_last_s": self.sched_at_last[0] if self.sched_at_last else None,
                             "client_cpu_at_last_write_s": self.cpu_at_last_write,
                             "client_sched_at_start": self.sched_at_start, "client_sched_at_last": self.sched_at_last,
                             "frozen": self.frozen})


class _Conn(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection: requests parsed from the bytes as they come, answered in order."""

    def __init__(self, stats: Stats) -> None:
        self.stats, self.buf, self.tr = stats, b"", None
        self.completions = False

    def connection_made(self, transport: Any) -> None:
        self.tr = transport

    def connection_lost(self, exc: Exception | None) -> None:
        st = self.stats
        if self.completions:
            st.open_conns -= 1
            # the load phase ends when the client has read every response: a closed-loop client closes its
            # connections once its last stream is done (before that, responses written may still be unread)
            if st.watch_pid is not None and st.answered == st.expect and st.open_conns == 0 and st.load_end is None:
                st.load_end, st.sched_at_last = time.monotonic(), st.client_sched()
                if st.freeze and _signal(st.watch_pid, signal.SIGSTOP):
                    st.frozen = True

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
        st = self.stats
        if method == "POST" and path.endswith("/completions"):
            if st.first_request is None:
                st.first_request = time.monotonic()
                st.cpu_at_first = st.client_cpu()
            if not self.completions:
                self.completions = True
                st.open_conns += 1
            req = orjson.loads(body)
            prompt = req.get("prompt")
            if prompt is None:
                prompt = " ".join(str(m.get("content", "")) for m in req.get("messages") or [])
            n = int(req.get("max_tokens") or 16)
            p = len(prompt) if isinstance(prompt, list) else count_words(prompt)
            st.requests += 1
            if st.hold:
                st.held.append((self, n, p))
                return
            if st.load_start is None:
                st.start_phase()
            self._complete(n, p)
        elif method == "GET" and path == "/probe/stats":
            self._json(st.as_json())
        elif method == "POST" and path == "/probe/watch":
            watch = orjson.loads(body)
            st.watch_pid, st.expect = int(watch["pid"]), int(watch["requests"])
            st.hold, st.freeze = bool(watch.get("hold")), bool(watch.get("freeze"))
            self._json(b"{}")
        elif method == "POST" and path == "/probe/go":
            st.hold = False
            st.start_phase()
            held, st.held = st.held, []
            for conn, n, p in held:
                conn._complete(n, p)
            self._json(b"{}")
        elif method == "POST" and path == "/probe/resume":
            if st.frozen and st.watch_pid is not None:
                _signal(st.watch_pid, signal.SIGCONT)
                st.frozen = False
            self._json(b"{}")
        elif method == "GET" and path == "/v1/models":
            self._json(b'{"object":"list","data":[{"id":"probe","object":"model"}]}')
        else:
            self._json(b'{"error":{"message":"not found"}}', b"404 Not Found")

    def _complete(self, n: int, p: int) -> None:
        st = self.stats
        usage = orjson.dumps({"id": "probe", "object": "text_completion", "model": "probe", "choices": [],
                              "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}})
        self.tr.write(_HEAD + _chunk(_TOKEN * n) + _chunk(b"data: " + usage + b"\n\ndata: [DONE]\n\n")
                      + b"0\r\n\r\n")
        st.tokens += n
        st.answered += 1
        st.last_end = time.monotonic()
        if st.answered == st.expect and st.watch_pid is not None:
            st.cpu_at_last_write = st.client_cpu()

    def _json(self, payload: bytes, status: bytes = b"200 OK") -> None:
        self.tr.write(b"HTTP/1.1 %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                      % (status, len(payload), payload))


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


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

    def _post(self, path: str, body: dict[str, Any] | None = None) -> None:
        req = urllib.request.Request(self.url + path, data=orjson.dumps(body or {}), method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def watch(self, pid: int, requests: int, *, hold: bool = False, freeze: bool = False) -> None:
        """Read client ``pid``'s CPU when its first completion request arrives, when the first response goes out
        and when the ``requests``-th has been written. ``hold``: answer nothing until :meth:`go`; ``freeze``: stop
        the client (SIGSTOP) once its last response is written, until :meth:`resume`."""
        self._post("/probe/watch", {"pid": pid, "requests": requests, "hold": hold, "freeze": freeze})

    def go(self) -> None:
        """Answer the held requests: the load phase starts now."""
        self._post("/probe/go")

    def resume(self) -> None:
        """SIGCONT the client if it was frozen."""
        self._post("/probe/resume")

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
