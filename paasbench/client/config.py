"""What the client sends and how long it waits: one immutable config shared by every request of a run."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from paas_common.errors import InputError
from paas_common.tokenizer import DEFAULT_TOKENIZER

APIS = ("completions", "chat")
PROMPT_FORMATS = ("text", "token-ids")


@dataclass(slots=True)
class ClientConfig:
    target: str                               # base URL (http://host:port) or a full .../v1/... endpoint
    api: str | None = None                    # completions | chat; None: the one the target URL names (api_of),
                                              # else completions
    model: str | None = None                  # None: the first id from GET /v1/models, if the server answers
    api_key: str | None = None                # sent as "Authorization: Bearer KEY" (target_headers)
    headers: dict[str, str] = field(default_factory=dict)   # --header NAME:VALUE, on every request to the target
    extra_body: dict[str, Any] = field(default_factory=dict)   # merged last into every request body
    prompt_format: str = "text"               # text | token-ids (completions only)
    tokenizer: str = DEFAULT_TOKENIZER        # prompt materialization; output-token fallback count
    prompt_salt: int | None = None            # prompt content salt (paasbench.load.prompts); None: run_load draws one
    connect_timeout_s: float = 10.0           # TCP connect
    first_byte_timeout_s: float = 600.0       # send -> first output token (a TTFT cap: long prefills are slow)
    idle_timeout_s: float = 60.0              # after the first token: longest silence between reads
    total_timeout_s: float = 1800.0           # send -> end of stream
    ignore_eos: bool = True                   # vLLM/SGLang: generate exactly max_tokens
    continuous_usage: bool = False            # ask for cumulative usage on every chunk (vLLM/SGLang
                                              # stream_options.continuous_usage_stats): exact per-chunk counts

    def __post_init__(self) -> None:
        if self.api is None:
            self.api = api_of(self.target) or "completions"

    def validate(self) -> None:
        if not self.target.startswith(("http://", "https://")):
            raise InputError(f"target must be an http(s) URL, got {self.target!r}", field="target")
        if self.api not in APIS:
            raise InputError(f"api must be one of {', '.join(APIS)}, got {self.api!r}", field="api")
        named = api_of(self.target)
        if named is not None and named != self.api:   # the bodies would be of the other API: every one a 400
            raise InputError(f"--target {self.target} is the {named} endpoint, but --api is {self.api}: drop "
                             f"--api (the URL names it) or give the server's base URL", field="--api")
        if self.prompt_format not in PROMPT_FORMATS:
            raise InputError(f"prompt format must be one of {', '.join(PROMPT_FORMATS)}", field="prompt_format")
        if self.prompt_format == "token-ids" and self.api != "completions":
            raise InputError("token-id prompts need the completions API (--api completions)",
                             field="prompt_format")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "total_timeout_s"):
            if not getattr(self, name) > 0:
                raise InputError(f"must be > 0, got {getattr(self, name)}", field=name)

    @property
    def endpoint(self) -> str:
        """The URL requests are POSTed to."""
        base = self.target.rstrip("/")
        if "/v1/" in base + "/" and base.endswith(("/completions", "/chat/completions")):
            return base
        if base.endswith("/v1"):
            base = base[:-3]
        return base + ("/v1/chat/completions" if self.api == "chat" else "/v1/completions")

    @property
    def server_url(self) -> str:
        """The server's root (what ``/v1/...``, ``/health``, ``/metrics`` and ``/tokenize`` hang off)."""
        base = self.endpoint
        return base[: base.index("/v1/")]

    @property
    def models_url(self) -> str:
        return self.server_url + "/v1/models"

    @property
    def target_headers(self) -> dict[str, str]:
        """What every request to the target carries, whatever it asks for (the load, ``/v1/models``,
        ``/tokenize``, ``/metrics``, ``/health``): the user's ``--header`` values and, with ``api_key``, the
        Bearer key, which replaces a user ``Authorization`` header (names are case-insensitive). One place, so a
        gateway that admits only requests carrying a header admits the look-ups around the load too."""
        if not self.api_key:
            return dict(self.headers)
        return {**{k: v for k, v in self.headers.items() if k.lower() != "authorization"},
                "authorization": f"Bearer {self.api_key}"}


def api_of(target: str) -> str | None:
    """The API a full endpoint URL names: ``.../v1/chat/completions`` chat, ``.../v1/completions`` completions;
    None for a base URL (``http://host:port``, ``.../v1``)."""
    path = target.split("?", 1)[0].rstrip("/")
    if "/v1/" not in path + "/":
        return None
    if path.endswith("/chat/completions"):
        return "chat"
    return "completions" if path.endswith("/completions") else None


def headers_from(values: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``--header NAME:VALUE`` values -> :attr:`ClientConfig.headers`."""
    out = {}
    for v in values:
        name, sep, value = v.partition(":")
        if not sep or not name.strip():
            raise InputError(f"expected NAME:VALUE, got {v!r}", field="--header")
        out[name.strip()] = value.strip()
    return out


def extra_body_from(text: str | None) -> dict[str, Any]:
    """``--extra-body`` JSON -> :attr:`ClientConfig.extra_body`."""
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not JSON: {exc}", field="--extra-body") from None
    if not isinstance(body, dict):
        raise InputError("must be a JSON object", field="--extra-body")
    return body
