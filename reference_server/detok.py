"""Streaming detokenization: token ids → text deltas, never splitting a UTF-8 character.

A token can end in the middle of a multi-byte character (emoji, CJK; byte-level BPE and byte-fallback tokens
alike); its bytes are held back until the character is complete, so no delta ever contains U+FFFD from a
split. Ids with no text (holes in the vocabulary, special tokens) decode to "".

The tokenizer is the harness's too (``paas_common.tokenizer.load_tokenizer``): cl100k by default, or a model's own
``tokenizer.json`` (a file, or the checkpoint directory holding it) for engines that emit that model's ids.
"""

from __future__ import annotations

from paas_common.tokenizer import DEFAULT_TOKENIZER, encode, load_tokenizer  # noqa: F401 - encode: the API's too


class Detokenizer:
    def __init__(self, tokenizer: str = DEFAULT_TOKENIZER) -> None:
        self._stream = load_tokenizer(tokenizer).stream_decoder()

    def feed(self, ids: list[int]) -> str:
        return self._stream.feed(ids)

    def flush(self) -> str:
        return self._stream.flush()
