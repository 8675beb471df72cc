"""The trace model: what one request of a workload is, independent of any file format.

A trace is the hand-off between workload generation and replay. Everything the client needs to
rebuild a prompt byte-for-byte lives here (``hash_ids`` + ``block_size``); prompt text is never
stored, so a 400K-token trace stays small and prompts are materialized lazily at send time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_BLOCK_SIZE = 512  # tokens per hash id, as in the Mooncake traces


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace.

    ``hash_ids`` are prefix-chained: id ``k`` at position ``i`` means "the same ``block_size`` tokens
    with the same full prefix before them", so two requests share a KV-cacheable prefix exactly as
    long as their ``hash_ids`` agree from the start. The last block may be partial:
    ``len(hash_ids) == ceil(input_length / block_size)``.
    """

    arrival_ms: float                 # offset from the trace start (Mooncake ``timestamp``)
    input_length: int                 # prompt tokens
    output_length: int                # tokens to generate (sent as ``max_tokens``)
    hash_ids: list[int]
    session_id: str | None = None     # agent session / conversation this turn belongs to
    turn: int | None = None           # 0-based turn index within the session
    prompt: str | None = None         # literal prompt (HF dataset prompts); None: build from hash_ids
    extra: dict[str, Any] = field(default_factory=dict)  # unknown fields, kept for round-trips


@dataclass(slots=True)
class Trace:
    requests: list[TraceRequest]
    block_size: int = DEFAULT_BLOCK_SIZE
    source: str | None = None         # file it came from, for reports and error messages
    meta: dict[str, Any] = field(default_factory=dict)  # generator spec, seed, ...

    def __len__(self) -> int:
        return len(self.requests)
