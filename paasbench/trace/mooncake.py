"""Mooncake JSONL: the trace interchange format shared with AIPerf, GuideLLM, vLLM and SGLang.

One JSON object per line: ``timestamp`` (ms from the trace start), ``input_length``, ``output_length``
(tokens) and ``hash_ids`` (one id per ``block_size``-token block, prefix-chained). We also read and
write ``session_id``, ``turn`` and a literal ``prompt``; any other field is kept in ``TraceRequest.extra`` and written back
unchanged, so a trace survives a round trip through paasbench and still replays in the other tools.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from paas_common.errors import InputError
from paasbench.trace.model import DEFAULT_BLOCK_SIZE, Trace, TraceRequest

_REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")
_OPTIONAL = ("session_id", "turn", "prompt")
MAX_SKIP_REASONS = 20  # kept in meta so a lenient run can still say what it dropped


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def parse_line(obj: Any, *, block_size: int, last_ms: float) -> TraceRequest:
    """Validate one decoded line. Raises ``InputError`` (field only; the caller adds file and line)."""
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {type(obj).__name__}")
    for name in _REQUIRED:
        if name not in obj:
            raise InputError("missing required field", field=name)
    ts, n_in, n_out, ids = (obj[k] for k in _REQUIRED)
    if not _is_num(ts) or ts < 0:
        raise InputError(f"must be a non-negative number of milliseconds, got {ts!r}", field="timestamp")
    if ts < last_ms:
        raise InputError(f"goes backwards ({ts} after {last_ms}); timestamps must not decrease",
                         field="timestamp")
    if not _is_int(n_in) or n_in < 1:
        raise InputError(f"must be an integer >= 1, got {n_in!r}", field="input_length")
    if not _is_int(n_out) or n_out < 0:
        raise InputError(f"must be an integer >= 0, got {n_out!r}", field="output_length")
    if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
        raise InputError("must be a list of integers", field="hash_ids")
    want = math.ceil(n_in / block_size)
    if len(ids) != want:
        raise InputError(f"has {len(ids)} ids but input_length {n_in} needs ceil({n_in}/{block_size}) = "
                         f"{want} (wrong --block-size?)", field="hash_ids")
    session = obj.get("session_id")
    if session is not None and not isinstance(session, (str, int)):
        raise InputError(f"must be a string, got {session!r}", field="session_id")
    turn = obj.get("turn")
    if turn is not None and (not _is_int(turn) or turn < 0):
        raise InputError(f"must be an integer >= 0, got {turn!r}", field="turn")
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InputError(f"must be a string, got {type(prompt).__name__}", field="prompt")
    extra = {k: v for k, v in obj.items() if k not in _REQUIRED and k not in _OPTIONAL}
    return TraceRequest(arrival_ms=float(ts), input_length=n_in, output_length=n_out, hash_ids=ids,
                        session_id=None if session is None else str(session), turn=turn,
                        prompt=prompt, extra=extra)


def read_trace(path: str | os.PathLike[str], *, block_size: int = DEFAULT_BLOCK_SIZE,
               lenient: bool = False) -> Trace:
    """Read a Mooncake JSONL trace, validating every line.

    Strict (default): the first bad line raises ``InputError`` with file, line and field.
    ``lenient=True``: bad lines are skipped; ``trace.meta["skipped_lines"]`` counts them and
    ``trace.meta["skip_reasons"]`` keeps the first few messages.
    """
    if block_size < 1:
        raise InputError(f"block size must be >= 1, got {block_size}", field="block_size")
    src = str(path)
    requests: list[TraceRequest] = []
    skipped, reasons = 0, []
    last_ms = 0.0
    try:
        fh = open(path, "rb")  # decoded per line, so a non-UTF-8 line is a located error, not a traceback
    except OSError as exc:
        raise InputError(f"cannot read trace: {exc.strerror or exc}", file=src) from exc
    with fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputError(f"not UTF-8 text: {exc.reason} at byte {exc.start + 1}") from None
                line = line.rstrip("\r\n")  # with its newline, a cut line's error fell on the parser's line 2
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"malformed JSON: {json_error_at(exc, line)}") from exc
                req = parse_line(obj, block_size=block_size, last_ms=last_ms)
            except InputError as exc:
                located = InputError(exc.reason, file=src, line=lineno, field=exc.field)
                if not lenient:
                    raise located from None
                skipped += 1
                if len(reasons) < MAX_SKIP_REASONS:
                    reasons.append(located.located())
                continue
            last_ms = req.arrival_ms
            requests.append(req)
    meta: dict[str, Any] = {"format": "mooncake", "skipped_lines": skipped}
    if reasons:
        meta["skip_reasons"] = reasons
    return Trace(requests=requests, block_size=block_size, source=src, meta=meta)


def json_error_at(exc: json.JSONDecodeError, line: str) -> str:
    """Where in one JSONL line the parser gave up, in characters from the line's start (1-based), and said so
    when that is the line's end: a line cut short (a truncated copy, a write that died) ends mid-value."""
    if exc.pos >= len(line.rstrip()):
        return f"{exc.msg} at column {exc.pos + 1:,}, the end of the line ({len(line):,} characters): is it cut short?"
    return f"{exc.msg} at column {exc.pos + 1:,}"


def request_to_json(req: TraceRequest) -> dict[str, Any]:
    """The Mooncake line for ``req`` (integral timestamps stay integers, as other tools expect)."""
    ts = req.arrival_ms
    out: dict[str, Any] = {
        "timestamp": int(ts) if float(ts).is_integer() else round(ts, 3),
        "input_length": req.input_length,
        "output_length": req.output_length,
        "hash_ids": req.hash_ids,
    }
    if req.session_id is not None:
        out["session_id"] = req.session_id
    if req.turn is not None:
        out["turn"] = req.turn
    if req.prompt is not None:
        out["prompt"] = req.prompt
    for k, v in req.extra.items():
        out.setdefault(k, v)
    return out


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` as Mooncake JSONL (a literal prompt goes in a ``prompt`` field)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            for req in trace.requests:
                fh.write(json.dumps(request_to_json(req), separators=(", ", ": ")))
                fh.write("\n")
    except OSError as exc:  # a bad -o is the user's input: exit 2 with the path, not a traceback
        raise InputError(f"cannot write trace: {exc.strerror or exc}", file=str(path)) from exc
