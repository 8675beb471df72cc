"""One streaming request → one :class:`RequestRecord`, whatever happens on the wire.

Every failure becomes a record with an ``error_kind`` (never an exception out of :meth:`Client.send`), so one
bad request cannot stop a run. Timeouts are enforced by one watchdog timer per request that re-arms only when
it fires, not per chunk: the hot loop just stores the last read time.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Callable

import aiohttp
from aiohttp.client_proto import ResponseHandler

from paasbench.client import debug, rxstamp
from paasbench.client.body import JsonText, build_body
from paasbench.client.config import ClientConfig
from paasbench.client.sse import StreamParser
from paasbench.client.tokens import settle
from paasbench.metrics.records import RequestRecord

clock = time.monotonic  # the event loop's clock too, so timer deadlines and timestamps compare directly
READ_BUFSIZE = 1 << 20  # aiohttp's 64 KiB default starves multi-MB responses (vLLM #39963)
DRAIN_S = 1.0  # after [DONE], how long to wait for the body's end before dropping the connection


class _StampedHandler(ResponseHandler):
    """aiohttp's connection protocol, stamping when each read's bytes arrived and when the request's
    first and last bytes were handed to it.

    A chunk's arrival time is when the kernel received the packet that completed the read
    (:mod:`paasbench.client.rxstamp`), not when the task reading the stream next ran: with 32 streams bursting
    at once, the last task runs a millisecond or more after its data arrived, and while the loop is busy
    (writing another request's body) the data waits in the socket; either delay would be the client's error,
    not the server's latency. Where kernel stamps are not available, the read is stamped when the event loop
    took the bytes off the socket.

    The request's write: the transport's write calls are stamped (the first one of a request is its first
    byte), and with a zero write-buffer limit the transport calls ``resume_writing`` exactly when the socket
    has taken the last buffered byte, so a multi-MB prompt's last byte is stamped when the kernel took it,
    not when aiohttp queued it. The first bytes of the response close the request's write: its two stamps
    move to ``sent``, where :meth:`Client.send` finds them, and the connection's next request stamps anew.
    """

    last_rx = 0.0                   # when the last read's bytes arrived
    last_rx_kernel = False          # ... by the kernel's stamp (else: stamped here, when the loop read them)
    kernel_rx = False               # reads carry the kernel's receive time (else: stamped here, at the read)
    rx_stamp: float | None = None   # the kernel's time for the read being handed over (rxstamp)
    tx_start: float | None = None   # the request being written: its first byte handed to the socket
    tx_end = 0.0                    # its last byte handed to the socket (so far)
    sent: tuple[float, float] | None = None  # (first, last) byte of the last request whose response began

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        tr: Any = transport
        tr.set_write_buffer_limits(high=0)  # resume_writing fires when the buffer is empty, not a quarter full
        self.kernel_rx = rxstamp.install(transport, self, clock)  # sets rx_stamp before each data_received

        def stamped(write: Any) -> Any:
            def call(data: Any) -> None:
                if self.tx_start is None:
                    self.tx_start = clock()
                write(data)
                if not tr.get_write_buffer_size():  # the socket took all of it now; else resume_writing says
                    self.tx_end = clock()
            return call

        tr.write, tr.writelines = stamped(tr.write), stamped(tr.writelines)

    def resume_writing(self) -> None:
        self.tx_end = clock()
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        if data:  # aiohttp also calls this with b"" from resume_reading, when a task reads the stream: no arrival
            stamp = self.rx_stamp
            if stamp is None:   # no kernel stamp came with this read
                self.last_rx, self.last_rx_kernel = clock(), False
            else:
                self.last_rx, self.last_rx_kernel, self.rx_stamp = stamp, True, None
            if self.tx_start is not None:  # the response began: the request's write is over
                self.sent, self.tx_start = (self.tx_start, self.tx_end), None
        super().data_received(data)


def make_session(cfg: ClientConfig) -> aiohttp.ClientSession:
    """The run's one shared session. Its connection pool has no cap: the schedule (closed-loop slots,
    ``--max-concurrency``) bounds the requests in flight, and a cap here would also count connections
    still draining a finished response, delaying the next request behind them."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=None)
    if hasattr(connector, "_factory"):  # aiohttp's protocol factory; without it reads are stamped at wake-up
        connector._factory = functools.partial(_StampedHandler, loop=asyncio.get_running_loop())
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=cfg.connect_timeout_s,
                                    sock_read=None)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=READ_BUFSIZE,
                                 auto_decompress=False)


class _Watchdog:
    """Cancels the request's task when a deadline passes: first token, idle gap, or total."""

    __slots__ = ("loop", "task", "start", "cfg", "last", "streaming", "kind", "handle")

    def __init__(self, start: float, cfg: ClientConfig) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.start, self.cfg, self.last = start, cfg, start
        self.streaming = False  # True once the first token arrived: idle deadlines from then on
        self.kind: str | None = None
        self.handle = self.loop.call_at(self._deadline()[0], self._fire)

    def _deadline(self) -> tuple[float, str]:
        total = self.start + self.cfg.total_timeout_s
        if self.streaming:
            d, kind = self.last + self.cfg.idle_timeout_s, "idle_timeout"
        else:
            d, kind = self.start + self.cfg.first_byte_timeout_s, "first_byte_timeout"
        return (total, "total_timeout") if total <= d else (d, kind)

    def _fire(self) -> None:
        d, kind = self._deadline()
        if self.loop.time() >= d - 1e-4:
            self.kind = kind
            assert self.task is not None
            self.task.cancel()
        else:
            self.handle = self.loop.call_at(d, self._fire)

    def streaming_phase(self) -> None:
        """The first token arrived: the idle deadline can be earlier than the armed one, so re-arm (once)."""
        self.streaming = True
        self.handle.cancel()
        self.handle = self.loop.call_at(self._deadline()[0], self._fire)

    def stop(self) -> None:
        self.handle.cancel()


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read a finished response to the body's end, so its connection goes back to the pool; a server that
    keeps the body open after ``[DONE]`` for longer than ``DRAIN_S`` gets the connection closed instead."""
    try:
        await asyncio.wait_for(resp.content.read(), DRAIN_S)
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
        pass
    finally:
        resp.release()  # at the body's end the connection is reused; before it, closed


class Client:
    def __init__(self, cfg: ClientConfig, session: aiohttp.ClientSession, model: str | None) -> None:
        self.cfg, self.session, self.model = cfg, session, model
        self._drains: set[asyncio.Task[None]] = set()
        # told (the record, its first token's time on the run clock) when a stream's first token arrives, for a
        # monitor that judges requests still streaming (paasbench.sweep.sequential); None: nobody asked
        self.on_first_token: Callable[[RequestRecord, float], None] | None = None
        self.url = cfg.endpoint
        self.headers = {"content-type": "application/json", "accept": "text/event-stream", **cfg.target_headers}

    def body(self, prompt: str | list[int] | JsonText, max_tokens: int) -> bytes:
        return build_body(self.cfg, self.model, prompt, max_tokens)

    async def aclose(self) -> None:
        """Stop the drains still running (before the session closes under them)."""
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)

    async def send(self, rec: RequestRecord, body: bytes, t0: float) -> RequestRecord:
        """Stream one request, filling ``rec`` (times relative to ``t0``). Never raises except on cancel."""
        headers = dict(self.headers)
        headers["x-request-id"] = rec.request_id
        start = clock()
        rec.actual_send_s = start - t0
        wd = _Watchdog(start, self.cfg)
        parser = StreamParser()
        resp: aiohttp.ClientResponse | None = None
        try:
            resp = await self.session.post(self.url, data=body, headers=headers)
            rec.status = resp.status
            # A response that ended before this task ran has given its connection back already; its protocol
            # (aiohttp keeps it on the response) still holds this request's write stamps and its reads' arrival.
            # Without it such a stream was stamped when this task read it, every event at once (against a real
            # vLLM on the loaded box, 6 of 20 short streams).
            proto = resp.connection.protocol if resp.connection is not None else getattr(resp, "_protocol", None)
            stamped = isinstance(proto, _StampedHandler)
            sent = getattr(proto, "sent", None) if stamped else None
            if sent is not None:
                rec.request_write_start_s = sent[0] - t0
                rec.request_write_end_s = sent[1] - t0 if sent[1] >= sent[0] else None
            if not 200 <= resp.status < 300:
                detail = (await resp.content.read(300)).decode("utf-8", "replace")
                _fail(rec, "http_status", f"HTTP {resp.status}: {detail}", clock() - t0)
                return rec
            read = resp.content.readany
            rec.loop_stamped_reads = 0
            slowdown = debug.slowdown   # the A/B's slowed client (a test hook); off: None
            while True:
                data = await read()
                if not data:
                    break
                now = proto.last_rx if stamped else clock()  # type: ignore[union-attr]
                if not (stamped and proto.last_rx_kernel):  # type: ignore[union-attr]
                    rec.loop_stamped_reads += 1  # type: ignore[operator]
                wd.last = now
                parser.feed(data, now - t0)
                if not wd.streaming and parser.times:   # the first token (alone, or with the whole answer)
                    wd.streaming_phase()
                    if self.on_first_token is not None:
                        self.on_first_token(rec, parser.times[0])
                if slowdown is not None:
                    slowdown()
                if parser.error is not None:
                    break
                if parser.done:
                    # the request is over at [DONE]; the body's end (normally in the same packet) is read
                    # off the request's path, so a closed-loop slot's next request is not held up by it
                    rec.end_s = now - t0
                    if not resp.content.is_eof():
                        task = asyncio.create_task(_drain(resp))
                        self._drains.add(task)
                        task.add_done_callback(self._drains.discard)
                        resp = None
                    break
            if rec.end_s is None:
                rec.end_s = clock() - t0
        except asyncio.CancelledError:
            if wd.kind is None:  # the run is stopping: keep what arrived, the caller records why
                rec.chunk_times_s, rec.chunk_tokens = parser.times, parser.counts
                rec.first_token_s = parser.times[0] if parser.times else None
                rec.error_kind, rec.end_s = "cancelled", clock() - t0
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            what = {"first_byte_timeout": self.cfg.first_byte_timeout_s, "idle_timeout": self.cfg.idle_timeout_s,
                    "total_timeout": self.cfg.total_timeout_s}[wd.kind]
            _fail(rec, wd.kind, f"{wd.kind.replace('_', ' ')} after {what:g} s", clock() - t0)
        except aiohttp.ConnectionTimeoutError:
            _fail(rec, "connect_timeout", f"connect timeout after {self.cfg.connect_timeout_s:g} s", clock() - t0)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            if not parser.done:  # a server dropping the connection after [DONE] completed the stream
                _fail(rec, "connection", f"{type(exc).__name__}: {exc}", clock() - t0)
        except aiohttp.ClientError as exc:
            if not parser.done:
                _fail(rec, "protocol", f"{type(exc).__name__}: {exc}", clock() - t0)
        finally:
            wd.stop()
            if resp is not None:
                resp.release()  # back to the pool at the body's end, else closed
        self._account(rec, parser)
        return rec

    def _account(self, rec: RequestRecord, parser: StreamParser) -> None:
        """Token accounting and the stream-level verdicts (error event, no [DONE], zero tokens)."""
        st = settle(parser, self.cfg.tokenizer)
        rec.chunk_times_s, rec.chunk_tokens = st.times, st.counts
        rec.first_token_s = st.times[0] if st.times else None
        rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens = (st.prompt_tokens, st.completion_tokens,
                                                                       st.cached_tokens)
        rec.output_tokens_method = st.method
        rec.chunk_tokens_estimated = st.estimated
        rec.server_timings = st.server_timings
        if rec.error_kind is not None:
            return
        if parser.error is not None:
            rec.error_kind, rec.error_message = parser.error
        elif not parser.done and parser.usage_event is None:
            if parser.raw and not parser.times and not any(b"data:" in r for r in parser.raw):
                # a complete 2xx body that is not SSE (e.g. a server ignoring "stream": true)
                head = b"".join(parser.raw)[:120]
                rec.error_kind, rec.error_message = "protocol", f"2xx response is not an SSE stream: {head!r}"
            else:
                rec.error_kind, rec.error_message = "connection", "stream ended before data: [DONE]"
        elif not st.times:
            rec.error_kind, rec.error_message = "zero_tokens", "2xx stream with no output token"


def _fail(rec: RequestRecord, kind: str, message: str, at: float) -> None:
    rec.error_kind, rec.error_message, rec.end_s = kind, message, at
