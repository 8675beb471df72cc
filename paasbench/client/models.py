"""What a target's ``GET /v1/models`` says, read once per command.

Two things come from it: the model name a request carries when ``--model`` is not given (the first id), and,
for the bundled reference server, the KV block size synthetic load sizes its shared prefix in
(``data[0].block_size``). ``run`` and ``sweep`` want both, and a sweep makes one run per step, so within one
command (:func:`asked_once`) the answer is kept per URL and headers: one request per target, not one per use.
Each embedded server a sweep starts opens its own scope (:func:`paasbench.sweep.embedded.embedded_server`).

Not longer than the command: a process outlives the servers it measures (a test suite, a notebook, a script
starting a server per configuration), and ports are reused. An answer kept per URL for the life of the process
gave a second server, on a port a first one had served from, the first one's model name in every request (all
refused, 404). Outside :func:`asked_once` every call asks. Only a good answer is kept; a target that did not
answer (not up yet, or no such route) is asked again next time.

A plain blocking read (urllib): it happens before any load, once. The load's own session is not open yet when the
trace is sized, and this keeps the client's request path free of it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Mapping

from paasbench.client.config import ClientConfig

TIMEOUT_S = 10.0

# The answers of the command in progress (a ContextVar: asyncio.to_thread carries it into the thread that asks).
_answers: ContextVar[dict[tuple[str, frozenset[tuple[str, str]]], dict[str, Any]] | None] = ContextVar(
    "paasbench_target_answers", default=None)


@contextmanager
def asked_once() -> Iterator[None]:
    """Within this block (one command), each target is asked once and its answer reused."""
    token = _answers.set({})
    try:
        yield
    finally:
        _answers.reset(token)


def http_get(url: str, headers: Mapping[str, str] | None = None, timeout_s: float = TIMEOUT_S) -> str | None:
    """The body of a 200 answer to ``GET url`` (at most 1 MiB), or None on any failure. ``headers``: the run's
    :attr:`ClientConfig.target_headers`, as every request to the target carries them."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})),
                                    timeout=timeout_s) as resp:
            return resp.read(1 << 20).decode("utf-8", "replace") if resp.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def first_model(client: ClientConfig) -> dict[str, Any] | None:
    """``data[0]`` of the target's ``/v1/models`` answer (its first model), or None if it does not say."""
    headers = client.target_headers
    key = (client.models_url, frozenset(headers.items()))
    kept = _answers.get()
    if kept is not None and key in kept:
        return kept[key]
    body = http_get(client.models_url, headers)
    try:
        first = json.loads(body)["data"][0] if body else None
    except (ValueError, KeyError, IndexError, TypeError):
        first = None
    if not isinstance(first, dict):
        return None
    if kept is not None:
        kept[key] = first
    return first


def model_id(client: ClientConfig) -> str | None:
    """The target's first model id: what requests name when ``--model`` is not given."""
    first = first_model(client)
    return str(first["id"]) if first and first.get("id") is not None else None
