"""An OpenAI request body -> a validated :class:`Parsed` record, or :class:`BadRequest` naming the field.

Everything the body says is checked here, before any of it is acted on: a wrong type is a 400 with an
OpenAI-style error body, never a 500 from deep inside (``stream_options: "x"``), never a silent
reinterpretation (``"stream": "false"`` is a string, not false). The API runs :func:`parse` in a thread,
because JSON parsing and tokenizing a multi-megabyte prompt take seconds of CPU, and on the event loop
they would stall every stream the router is serving; the body's size is capped before it is read.

Chat messages are flattened with a fixed template, ``"<role>: <content>\\n"`` per message followed by
``"assistant:"``; the template is plain text, so the token count a client computes is the server's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from reference_server.engine.vocab import Vocab


class BadRequest(Exception):
    """The body is malformed: HTTP 400 with this message."""


@dataclass(frozen=True, slots=True)
class Parsed:
    prompt: list[int]
    max_tokens: int
    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool          # vLLM's stream_options.continuous_usage_stats
    ignore_eos: bool


def parse(raw: bytes, chat: bool, vocab: Vocab) -> Parsed:
    try:
        body = orjson.loads(raw)         # 2.3x json's speed on a 64K-id body (bench_prompt_path.py)
    except (orjson.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    opts = body.get("stream_options")
    if opts is None:
        opts = {}
    elif not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object")
    if chat:
        max_tokens = _int(body, "max_completion_tokens", _int(body, "max_tokens", 256))
    else:
        max_tokens = _int(body, "max_tokens", 16)
    if _int(body, "n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    flags = dict(stream=_bool(body, "stream"), include_usage=_bool(opts, "include_usage", "stream_options."),
                 continuous_usage=_bool(opts, "continuous_usage_stats", "stream_options."),
                 ignore_eos=_bool(body, "ignore_eos"))
    if chat:
        prompt = vocab.encode(chat_prompt(body.get("messages")))
    elif "prompt" not in body:
        raise BadRequest("'prompt' is required")
    else:
        prompt = _prompt_ids(body["prompt"], vocab)
    if not prompt:
        raise BadRequest("the prompt is empty")
    return Parsed(prompt=prompt, max_tokens=max_tokens, model=model, **flags)


def _int(body: dict[str, Any], name: str, default: int, lo: int = 1) -> int:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise BadRequest(f"'{name}' must be an integer >= {lo}")
    return v


def _bool(body: dict[str, Any], name: str, where: str = "") -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{where}{name}' must be a boolean (true or false), got {json.dumps(v)[:40]}")
    return v


def _prompt_ids(prompt: Any, vocab: Vocab) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]    # a batch of one
    if isinstance(prompt, str):
        return vocab.encode(prompt)
    # one C-level pass for the types (bool is its own type, so true/false are refused) and one for the range,
    # instead of a Python-level test per id: 11 -> 5 ms of the router's CPU for 64K ids
    if isinstance(prompt, list) and set(map(type, prompt)) <= {int}:
        n = vocab.size
        if prompt and (min(prompt) < 0 or max(prompt) >= n):
            raise BadRequest(f"token ids must be in [0, {n})")
        return prompt
    raise BadRequest("'prompt' must be a string or a list of token ids (batches of more than one are not supported)")


def chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role' and a 'content'")
        parts.append(f"{m['role']}: {_content(m.get('content'), i)}\n")
    return "".join(parts) + "assistant:"


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or the text parts of a list of content parts (others, e.g. images,
    are skipped)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"messages[{i}].content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise BadRequest(f"messages[{i}].content[{j}] must be an object")
        if part.get("type", "text") == "text" or "text" in part:
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content[{j}].text must be a string")
            texts.append(part["text"])
    return "".join(texts)
