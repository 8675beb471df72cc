"""Per-request records: the one table every metric, SLO verdict and report is computed from.

Clock convention (see docs/metrics.md): all ``*_s`` times are seconds on the client's monotonic
clock relative to the run's start ``t0``. ``intended_send_s`` comes from the schedule; every latency
is measured from it (wrk2-style), so a saturated client or a concurrency cap cannot hide queueing.
The ``*_ns`` fields put three of them on the wall clock (epoch ns), for joins with server logs.

Records are appended to ``records.jsonl`` and flushed as each request finishes, so a killed run
keeps everything that completed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Iterator

import orjson

# Error kinds (``RequestRecord.error_kind``). A closed set, so reports and the fault matrix can count them.
ERROR_KINDS = (
    "connect_timeout",      # TCP/TLS connect exceeded its timeout
    "first_byte_timeout",   # no response headers / first SSE event in time
    "idle_timeout",         # stream stalled: gap between chunks exceeded its timeout
    "total_timeout",        # whole request exceeded its timeout
    "http_status",          # non-2xx response (status in ``status``)
    "connection",           # refused, reset, closed mid-stream
    "protocol",             # unparseable SSE / JSON, error event in the stream
    "zero_tokens",          # 2xx stream that produced no output token: a failure, not a success
    "client",               # the client could not build/send the request (e.g. prompt materialization)
    "cancelled",            # in flight (streaming, or waiting for a slot) when the run was interrupted/aborted
)

# What stamps a chunk's arrival (docs/metrics.md, "chunk arrival"): the packet's kernel receive time, or the
# event loop's read of it where the kernel's stamp cannot be had (paasbench/client/rxstamp.py).
KERNEL_CLOCK, LOOP_CLOCK = "kernel receive timestamp", "event-loop read"


@dataclass(slots=True)
class RequestRecord:
    index: int                          # position in the trace
    request_id: str                     # also sent as ``x-request-id``
    session_id: str | None
    turn: int | None
    intended_send_s: float              # schedule time (relative to t0)
    actual_send_s: float | None         # when the request was handed to the connection
    first_token_s: float | None         # arrival of the first chunk carrying >= 1 output token
    end_s: float | None                 # stream end (or failure time)
    request_write_start_s: float | None = None  # the request's first byte handed to the socket
    request_write_end_s: float | None = None    # its last byte handed to the socket (the kernel took it)
    chunk_times_s: list[float] = field(default_factory=list)   # arrival of each token-carrying chunk
    chunk_tokens: list[int] = field(default_factory=list)      # output tokens in each such chunk
    input_tokens_sent: int = 0          # prompt length the client built (trace ``input_length``)
    max_tokens: int = 0                 # requested output length
    prompt_tokens: int | None = None    # server ``usage.prompt_tokens``
    completion_tokens: int | None = None  # output tokens: ``usage.completion_tokens``, else tokenizer count
    cached_tokens: int | None = None    # ``usage.prompt_tokens_details.cached_tokens``
    output_tokens_method: str = "usage"  # completion_tokens from: usage | events (one token each) | tokenizer
    chunk_tokens_estimated: bool = False  # per-chunk counts apportioned to usage by text length (docs/metrics.md)
    loop_stamped_reads: int | None = None  # reads of its stream stamped when the event loop took them, not by
                                           # the kernel (docs/metrics.md, "chunk arrival"); None: not streamed,
                                           # or recorded by a version that did not count them
    status: int | None = None           # HTTP status
    error_kind: str | None = None       # one of ERROR_KINDS, None on success
    error_message: str | None = None
    server_timings: dict[str, Any] | None = None  # server's per-stage breakdown, if it sent one
    turn_wait_s: float | None = None    # open loop: how long its send time waited for a session's previous turn to
                                        # end (load.schedule.Turns); 0 when one could go at once, None in other modes
    # wall clock: epoch ns of intended send, first token and end, from the run's one (epoch, monotonic) anchor,
    # to join records with server logs and traces; the *_s monotonic offsets stay the measurement
    intended_send_ns: int | None = None
    first_token_ns: int | None = None
    end_ns: int | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def stamp_wall_clock(self, t0_epoch_ns: int) -> None:
        """Fill the epoch-ns fields from the run's anchor (the wall clock read with the monotonic ``t0``)."""
        def ns(s: float | None) -> int | None:
            return None if s is None else t0_epoch_ns + round(s * 1e9)

        self.intended_send_ns, self.first_token_ns, self.end_ns = (
            ns(self.intended_send_s), ns(self.first_token_s), ns(self.end_s))

    def to_json(self) -> str:
        # orjson on a shallow field dict: asdict() deep-copies the per-chunk lists, json.dumps is ~10x slower
        return orjson.dumps({name: getattr(self, name) for name in _FIELD_NAMES}).decode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RequestRecord":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


_FIELD_NAMES = tuple(f.name for f in fields(RequestRecord))


class RecordWriter:
    """Append-only JSONL sink, one flushed line per finished request."""

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, record: RequestRecord) -> None:
        self._fh.write(record.to_json() + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_records(path: str | os.PathLike[str]) -> Iterator[RequestRecord]:
    """Read a records file; a torn last line (the run was killed mid-write) is skipped."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield RequestRecord.from_dict(orjson.loads(line))
            except orjson.JSONDecodeError:  # a subclass of json.JSONDecodeError
                continue
