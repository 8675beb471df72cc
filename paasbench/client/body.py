"""The request body: the OpenAI completions / chat request a run sends, as the JSON bytes put on the wire.

Why a module of its own: a 128K-token prompt is ~0.5 MB, and building its body is most of what the client does
per request. The prompt builder (:mod:`paasbench.load.prompts`) hands the prompt over already as a JSON
string's contents (:class:`JsonText`, cut from the tape's bytes), and :func:`build_body` joins those bytes into
the rest of the body: one copy, no string built, decoded or escaped per request. The bytes are the same as
serializing the whole request with ``orjson`` (tests/test_client_body.py holds it to that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from paasbench.client.config import ClientConfig

class JsonText(bytes):
    """A prompt written as a JSON string's contents: UTF-8, escaped, without its quotes. The body takes these
    bytes as they are (:meth:`paasbench.load.prompts.PromptBuilder.json_text` makes them)."""

    __slots__ = ()

    def text(self) -> str:
        return orjson.loads(b'"' + self + b'"')


_MARK = "\x00paasbench-prompt\x00"      # stands where the prompt goes while the rest is serialized
_QUOTED_MARK = orjson.dumps(_MARK)


def build_body(cfg: ClientConfig, model: str | None, prompt: str | list[int] | JsonText, max_tokens: int) -> bytes:
    """``orjson.dumps`` of the request: model, prompt (or chat messages), max_tokens, streaming with usage,
    ``ignore_eos``, then ``--extra-body`` merged over it. A :class:`JsonText` prompt is joined in as bytes."""
    put: Any = _MARK if isinstance(prompt, JsonText) else prompt
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": put}]
    else:
        body["prompt"] = put
    body["max_tokens"] = max_tokens
    body["stream"] = True
    opts: dict[str, Any] = {"include_usage": True}
    if cfg.continuous_usage:
        opts["continuous_usage_stats"] = True
    body["stream_options"] = opts
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    raw = orjson.dumps(body)
    if put is prompt:
        return raw
    parts = raw.split(_QUOTED_MARK)
    if len(parts) == 1:   # --extra-body replaced the prompt: it is not sent
        return raw
    if len(parts) > 2:    # the marker is in --extra-body too: serialize the whole, the plain way
        assert isinstance(prompt, JsonText)
        return build_body(cfg, model, prompt.text(), max_tokens)
    return b"".join((parts[0], b'"', prompt, b'"', parts[1]))
