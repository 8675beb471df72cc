"""Traces: the model (``model.py``), file formats, ``inspect`` statistics and the ``trace`` CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

from paas_common.errors import InputError
from paasbench.trace.model import DEFAULT_BLOCK_SIZE, Trace, TraceRequest

__all__ = ["DEFAULT_BLOCK_SIZE", "Trace", "TraceRequest", "is_mooncake", "load_trace"]


def is_mooncake(path: str | os.PathLike[str]) -> bool:
    """True when the first non-blank line is a JSON object that looks like Mooncake's: ``hash_ids``, or
    ``input_length`` with a ``timestamp`` -- so a Mooncake line missing a field gets the reader's located
    error, not a prompt file's "no prompt column"."""
    p = Path(path)
    if p.suffix == ".parquet":
        return False
    try:
        with open(p, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    obj = json.loads(line)
                    return isinstance(obj, dict) and ("hash_ids" in obj or {"input_length", "timestamp"} <= obj.keys())
    except OSError as exc:
        raise InputError(f"cannot read trace: {exc.strerror or exc}", file=str(path)) from exc
    except (json.JSONDecodeError, UnicodeDecodeError):
        return p.suffix == ".jsonl"  # a broken Mooncake file should get the line-precise error
    return True  # empty file: an empty trace


def load_trace(path: str | os.PathLike[str], *, block_size: int = DEFAULT_BLOCK_SIZE, lenient: bool = False,
               prompt_column: str | None = None, tokenizer: str | None = None) -> Trace:
    """Any trace file: Mooncake JSONL, or a local prompt file (JSON/JSONL/parquet) via HF ``datasets``."""
    if prompt_column is None and is_mooncake(path):
        from paasbench.trace.mooncake import read_trace

        return read_trace(path, block_size=block_size, lenient=lenient)
    from paas_common.tokenizer import DEFAULT_TOKENIZER
    from paasbench.trace.hf import read_prompt_file

    return read_prompt_file(path, block_size=block_size, prompt_column=prompt_column,
                            tokenizer=tokenizer or DEFAULT_TOKENIZER)
