"""Prompts from local dataset files (JSON, JSONL, parquet) read through HF ``datasets``, never the hub.

Accepted shapes, first match wins:

* ``prompt_column`` given: that column, a string (one request) or a list of chat messages;
* ShareGPT-style ``conversations`` (``[{"from": "human"|"gpt"|"system", "value": ...}]``) or OpenAI-style
  ``messages`` (``[{"role": ..., "content": ...}]``): every user turn becomes one request whose prompt is
  the conversation so far, so multi-turn chats replay as sessions that grow and share their prefix;
  ``output_length`` is the token count of the assistant reply that followed;
* a ``prompt`` (or ``text``) column.

``output_length`` / ``max_tokens`` and ``timestamp`` (ms) columns are used when present. Each prompt is
tokenized once to get ``input_length`` and prefix-chained block ``hash_ids`` (equal token blocks after an
equal prefix get the same id), so ``trace inspect`` and prefix-hit figures work on these traces too.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from paas_common.errors import InputError
from paas_common.tokenizer import DEFAULT_TOKENIZER, encode
from paasbench.trace.model import DEFAULT_BLOCK_SIZE, Trace, TraceRequest

DEFAULT_OUTPUT_LENGTH = 256  # when the file says nothing about the answer
_USER = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "chatgpt", "bard", "model"}


class BlockHasher:
    """Prefix-chained block ids: one id per distinct (previous block id, block tokens)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def hash_ids(self, tokens: list[int]) -> list[int]:
        out, parent = [], -1
        for start in range(0, len(tokens), self.block_size):
            key = (parent, tuple(tokens[start:start + self.block_size]))
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return out


def _load_rows(path: Path) -> Any:
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # local files only, even if the hub is reachable
    import datasets  # heavy (~2 s): imported only when a prompt file is actually read

    datasets.disable_progress_bars()
    builder = "parquet" if path.suffix == ".parquet" else "json"
    cache = tempfile.mkdtemp(prefix="paasbench-hf-")
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache,
                                     keep_in_memory=True).to_list()
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for unreadable files
        raise InputError(f"cannot read prompt file: {exc}", file=str(path)) from exc
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _message(msg: Any, src: str, row: int, field: str) -> tuple[str, str]:
    if not isinstance(msg, dict):
        raise InputError("chat messages must be objects", file=src, line=row, field=field)
    role = msg.get("from", msg.get("role"))
    text = msg.get("value", msg.get("content"))
    if not isinstance(role, str) or not isinstance(text, str):
        raise InputError("each message needs a role ('from'/'role') and text ('value'/'content')",
                         file=src, line=row, field=field)
    return role.lower(), text


def _turns(messages: list[Any], src: str, row: int, field: str) -> Iterator[tuple[str, str | None]]:
    """(prompt so far, the assistant reply that answered it or None) per user turn."""
    history: list[str] = []
    pending: str | None = None
    for msg in messages:
        role, text = _message(msg, src, row, field)
        if role in _ASSISTANT and pending is not None:
            yield pending, text
            pending = None
        elif role in _USER and pending is not None:
            yield pending, None
            pending = None
        history.append(text)
        if role in _USER:
            pending = "\n\n".join(history)
    if pending is not None:
        yield pending, None


def _count(row: dict[str, Any], keys: tuple[str, ...], src: str, row_no: int, *, integer: bool) -> Any:
    """The first present, non-null column of ``keys``: a non-negative number (an integer if asked), else a
    located input error rather than a ``ValueError`` traceback mid-conversion."""
    for key in keys:
        v = row.get(key)
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        if not ok or (integer and not float(v).is_integer()):  # 5.0: arrow made the column float
            kind = "an integer" if integer else "a number"
            raise InputError(f"must be {kind} >= 0, got {v!r}", file=src, line=row_no, field=key)
        return int(v) if integer else float(v)
    return None


def read_prompt_file(path: str | os.PathLike[str], *, block_size: int = DEFAULT_BLOCK_SIZE,
                     prompt_column: str | None = None, tokenizer: str = DEFAULT_TOKENIZER,
                     default_output_length: int = DEFAULT_OUTPUT_LENGTH) -> Trace:
    src = str(path)
    rows = _load_rows(Path(path))
    if not rows:
        raise InputError("no rows", file=src)
    columns = set(rows[0])
    column = prompt_column or next((c for c in ("conversations", "messages", "prompt", "text")
                                    if c in columns), None)
    if column is None or column not in columns:
        raise InputError(f"no prompt column (have: {', '.join(sorted(columns))}); pass --prompt-column",
                         file=src, field=prompt_column)
    hasher = BlockHasher(block_size)
    requests: list[TraceRequest] = []
    for row_no, row in enumerate(rows, 1):
        value = row.get(column)
        out_len = _count(row, ("output_length", "max_tokens"), src, row_no, integer=True)
        ts = _count(row, ("timestamp",), src, row_no, integer=False) or 0.0
        if isinstance(value, str):
            turns: list[tuple[str, str | None]] = [(value, None)]
        elif isinstance(value, list):
            turns = list(_turns(value, src, row_no, column))
        else:
            raise InputError(f"expected text or a list of messages, got {type(value).__name__}",
                             file=src, line=row_no, field=column)
        session = str(row.get("id", row_no)) if len(turns) > 1 else None
        for turn, (prompt, reply) in enumerate(turns):
            tokens = encode(prompt, tokenizer)
            if not tokens:
                continue
            n_out = len(encode(reply, tokenizer)) if reply else (out_len or default_output_length)
            requests.append(TraceRequest(
                arrival_ms=ts, input_length=len(tokens), output_length=max(1, int(n_out)),
                hash_ids=hasher.hash_ids(tokens), session_id=session,
                turn=turn if session is not None else None, prompt=prompt))
    requests.sort(key=lambda r: r.arrival_ms)  # stable: file order within a timestamp
    return Trace(requests=requests, block_size=block_size, source=src,
                 meta={"format": "prompts", "prompt_column": column, "tokenizer": tokenizer})
