"""Prompt materialization: a trace's hash ids → prompt text (or token ids) of exactly ``input_length`` tokens.

Why this works: tiktoken's pre-tokenizer (cl100k, o200k, gpt2 alike) cuts text into pieces before BPE, and
a space followed by letters (`` word``) is one piece. So a run of space-prefixed lowercase words that are
each a single vocabulary token encodes to exactly one token per word, whatever words come before or
after. Each hash id seeds an RNG that picks ``block_size`` such words; the block's text is therefore
exactly ``block_size`` tokens, blocks concatenate without merging, and a server with the same tokenizer
sees block boundaries exactly where the trace put them. Same hash id → same text, in every request and
every run (the word table is derived from the vocabulary itself, not from any random state).

Lazy: prompts are assembled at send time from an LRU cache of block texts; a trace's prompts are never
all held in memory. A 400K-token prompt is ~2.4 MB of text and is built in about a millisecond from
cached blocks.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from paasbench.errors import InputError
from paasbench.tokenizer import DEFAULT_TOKENIZER, encode, get_tokenizer
from paasbench.trace.model import DEFAULT_BLOCK_SIZE, TraceRequest

_WORD = re.compile(rb" [a-z]{2,12}")  # one pre-tokenizer piece; ASCII keeps text width predictable


@dataclass(frozen=True, slots=True)
class WordTable:
    """Single-token space-prefixed words of one encoding: ``words[i]`` encodes to ``[ids[i]]``."""

    ids: np.ndarray      # int64 token ids
    words: np.ndarray    # object array of str, index-aligned with ids


@lru_cache(maxsize=4)
def word_table(tokenizer: str = DEFAULT_TOKENIZER) -> WordTable:
    enc = get_tokenizer(tokenizer)
    ids: list[int] = []
    words: list[str] = []
    for tid in range(enc.n_vocab):
        try:
            raw = enc.decode_single_token_bytes(tid)
        except KeyError:  # holes in the id space (special tokens live above the ranks)
            continue
        if _WORD.fullmatch(raw):
            word = raw.decode("ascii")
            if enc.encode_ordinary(word) == [tid]:  # BPE must not prefer a split of it
                ids.append(tid)
                words.append(word)
    if len(ids) < 256:
        raise InputError(f"tokenizer '{tokenizer}' has too few single-token words ({len(ids)}) "
                         "to build exact-length prompts", field="tokenizer")
    return WordTable(np.asarray(ids, dtype=np.int64), np.asarray(words, dtype=object))


class PromptBuilder:
    """Builds prompts of exactly ``req.input_length`` tokens from ``req.hash_ids``.

    ``salt`` changes every block's text (e.g. to defeat a server's prefix cache between two runs of the
    same trace); the default 0 keeps texts identical across runs and processes.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, tokenizer: str = DEFAULT_TOKENIZER, *,
                 cache_blocks: int = 4096, salt: int = 0) -> None:
        if block_size < 1:
            raise InputError(f"block size must be >= 1, got {block_size}", field="block_size")
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.salt = salt
        self._table = word_table(tokenizer)
        self._cache: OrderedDict[int, tuple[np.ndarray, str]] = OrderedDict()
        self._cache_blocks = max(1, cache_blocks)

    # -- one block -------------------------------------------------------------------------------
    def _choice(self, hash_id: int) -> np.ndarray:
        """Indices into the word table for block ``hash_id``: a pure function of (salt, hash id)."""
        key = [self.salt, hash_id] if hash_id >= 0 else [self.salt, 1, -hash_id]
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(key)))
        return rng.integers(0, len(self._table.ids), size=self.block_size)

    def _block(self, hash_id: int) -> tuple[np.ndarray, str]:
        hit = self._cache.get(hash_id)
        if hit is not None:
            self._cache.move_to_end(hash_id)
            return hit
        choice = self._choice(hash_id)
        entry = (choice, "".join(self._table.words[choice]))
        self._cache[hash_id] = entry
        if len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return entry

    def block_text(self, hash_id: int) -> str:
        """The full ``block_size``-token text of ``hash_id``."""
        return self._block(hash_id)[1]

    # -- one request -----------------------------------------------------------------------------
    def _check(self, req: TraceRequest) -> int:
        """Tokens in the request's last (possibly partial) block."""
        n = len(req.hash_ids)
        if n != math.ceil(req.input_length / self.block_size):
            raise InputError(
                f"{n} hash ids do not cover input_length {req.input_length} at block size "
                f"{self.block_size} (expected {math.ceil(req.input_length / self.block_size)}); "
                "is the prompt builder's block size the trace's?", field="hash_ids")
        return req.input_length - (n - 1) * self.block_size if n else 0

    def text(self, req: TraceRequest) -> str:
        """Prompt text; ``req.prompt`` verbatim when the trace carries one."""
        if req.prompt is not None:
            return req.prompt
        last = self._check(req)
        if not req.hash_ids:
            return ""
        parts = [self._block(h)[1] for h in req.hash_ids[:-1]]
        choice, full = self._block(req.hash_ids[-1])
        parts.append(full if last == self.block_size else "".join(self._table.words[choice[:last]]))
        return "".join(parts)

    def token_ids(self, req: TraceRequest) -> list[int]:
        """Prompt as token ids (for ``--prompt-format token-ids``); equals ``encode(self.text(req))``."""
        if req.prompt is not None:
            return encode(req.prompt, self.tokenizer)
        last = self._check(req)
        if not req.hash_ids:
            return []
        choices = [self._block(h)[0] for h in req.hash_ids]
        choices[-1] = choices[-1][:last]
        return self._table.ids[np.concatenate(choices)].tolist()
