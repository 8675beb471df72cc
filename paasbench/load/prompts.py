"""Prompt materialization: a trace's hash ids → prompt text (or token ids) of exactly ``input_length`` tokens.

Counted in the run's tokenizer (``--tokenizer``: cl100k by default, or the target model's own tokenizer.json).

Why the counts are exact: a tokenizer's pre-tokenizer cuts text into pieces before BPE, and a space
followed by letters (`` word``) is one piece in tiktoken's (cl100k, o200k, gpt2), in byte-level BPE's (GPT-2,
Llama 3, Qwen, DeepSeek, GLM), in Metaspace's (sentencepiece-style) and in Whitespace's (WordPiece/WordLevel);
a legacy sentencepiece export that prepends ``▁`` to the whole text gets its first word without the space.
So a run of space-prefixed lowercase words that are each a single vocabulary token encodes to exactly one
token per word, whatever comes before or after. Blocks made of such words are exactly ``block_size`` tokens,
concatenate without merging, and a server with the same tokenizer sees block boundaries exactly where the
trace put them. Words are chosen by encoding them (never by how a decoder prints a lone token), and the
no-merging property is checked on the tape, not assumed: a tokenizer whose BPE runs across spaces is refused
with an error rather than given prompts of the wrong length.

Why it is fast and small: once per tokenizer we lay down a *tape* of 2^20 such words chosen by a fixed
hash among the 4,096+ shortest (about 4.5 bytes per token, as real English text has; about 21 MB: the text,
its word offsets, the token ids). A block is two windows of the tape whose
start offsets are a hash of (salt, hash id): building it is two string slices, about a microsecond,
so there is nothing worth caching per block and memory stays constant whatever the trace. Prompts are
assembled at send time and never all held. Two different hash ids get the same text only if both
offsets collide (probability ~1e-12 per pair); shifted windows differ token by token, so no false
prefix hits. Same (salt, hash id) → same text in every request, process and run (the tape depends only
on the vocabulary and our own hash, not on numpy's RNG streams).
"""

from __future__ import annotations

import math
import re
from array import array
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from paas_common.errors import InputError
from paas_common.hashing import mix64
from paas_common.tokenizer import DEFAULT_TOKENIZER, encode, load_tokenizer
from paasbench.trace.model import DEFAULT_BLOCK_SIZE, TraceRequest

_WORD = re.compile(r" [a-z]{2,12}")  # one pre-tokenizer piece; ASCII keeps text width predictable
_TAPE_WORDS = 1 << 20
_TAPE_VOCAB = 4096  # distinct words on the tape (the shortest that many; all if a vocabulary has fewer)
_M64 = (1 << 64) - 1


def _fold(x: int) -> int:
    """Any Python int → 64 bits; ids in [0, 2^64) map to themselves, larger or negative ones are hashed."""
    if 0 <= x <= _M64:
        return x
    h, v = (0x51ED if x < 0 else 0xB16), abs(x)
    while v:
        h = mix64(h ^ (v & _M64))
        v >>= 64
    return h


def _mix64_array(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True, slots=True)
class Tape:
    """``text[chars[i]:chars[j]]`` is words ``i..j-1``; it encodes to ``ids[i:j]``."""

    text: str
    chars: array         # len(words) + 1 character offsets ('q'; array indexing is cheaper than numpy's)
    ids: array           # token id of each word ('q')
    lead: bool = False   # the tokenizer prepends a space itself: a prompt starts without its first space


def single_token_words(tokenizer: str = DEFAULT_TOKENIZER) -> tuple[list[int], list[str], bool]:
    """Every `` word`` (lowercase ASCII) that is exactly one token of ``tokenizer``, in id order, and whether
    the tokenizer puts a space before a text's first word itself.

    A token is taken for what it encodes from, not for what it decodes to on its own: a sentencepiece-style
    decoder drops a lone token's leading space and a WordPiece one never shows it, so each candidate word is
    checked by encoding `` word``, which must give exactly that one token (BPE must not prefer a split).
    A legacy sentencepiece export (Llama 2, Mistral v0.1) prepends ``▁`` to every text, so `` word`` at the
    start of a text would be two tokens (``▁``, ``▁word``) there: for those the check is on ``word`` and the
    prompt's first word is written without its space (``lead`` is True)."""
    enc = load_tokenizer(tokenizer)
    cand_ids: list[int] = []
    cand: list[str] = []
    for tid, text in enc.token_texts():
        word = " " + text.lstrip(" ")
        if _WORD.fullmatch(word) and len(text) + 1 >= len(word):  # "word" or " word", not "  word"
            cand_ids.append(tid)
            cand.append(word)
    for lead in (False, True):
        ids: list[int] = []
        words: list[str] = []
        seen: set[str] = set()
        got = enc.encode_batch([w[1:] for w in cand] if lead else cand)
        for tid, word, g in zip(cand_ids, cand, got):
            if g == [tid] and word not in seen:
                seen.add(word)
                ids.append(tid)
                words.append(word)
        if len(ids) >= 256:
            return ids, words, lead
    raise InputError(f"tokenizer '{tokenizer}' has too few single-token words ({len(ids)}) "
                     "to build exact-length prompts", field="--tokenizer")


def _check_tape(tp: Tape, tokenizer: str) -> None:
    """Words must also stay one token each next to each other: true when the tokenizer's pre-tokenizer splits
    text before each space (tiktoken's, byte-level BPE's, Metaspace's, Whitespace's), false when BPE runs
    across words. Checked on windows spread over the tape (random neighbours), not assumed."""
    n_win, width = 64, 256
    starts = [(i * (_TAPE_WORDS - width)) // (n_win - 1) for i in range(n_win)]
    texts = [tp.text[tp.chars[s] + tp.lead:tp.chars[s + width]] for s in starts]
    for s, text, got in zip(starts, texts, load_tokenizer(tokenizer).encode_batch(texts)):
        if got != tp.ids[s:s + width].tolist():
            raise InputError(f"tokenizer '{tokenizer}' merges tokens across spaces (text of {width} "
                             f"single-token words encodes to {len(got)} tokens), so exact-length prompts "
                             "cannot be built from it", field="--tokenizer")


def _shortest(ids: list[int], words: list[str]) -> tuple[list[int], list[str]]:
    """The shortest words, as many lengths as it takes to have ``_TAPE_VOCAB`` of them (id order kept).

    Fewer bytes per token is what real text has (about 4-4.5 for English in these vocabularies; all
    single-token words average 7.5 in cl100k): the server reads, parses and tokenizes that much per token, so
    long words would make every request costlier to the target than the traffic it stands for."""
    by_len = sorted({len(w) for w in words})
    limit = next((n for n in by_len if sum(len(w) <= n for w in words) >= _TAPE_VOCAB), by_len[-1])
    keep = [i for i, w in enumerate(words) if len(w) <= limit]
    return [ids[i] for i in keep], [words[i] for i in keep]


@lru_cache(maxsize=4)
def tape(tokenizer: str = DEFAULT_TOKENIZER) -> Tape:
    ids, words, lead = single_token_words(tokenizer)
    ids, words = _shortest(ids, words)
    pick = (_mix64_array(np.arange(_TAPE_WORDS)) % np.uint64(len(ids))).astype(np.int64)
    table = np.asarray([w.encode("ascii") for w in words], dtype=object)
    lengths = np.asarray([len(w) for w in words], dtype=np.int64)
    chars = np.zeros(_TAPE_WORDS + 1, dtype=np.int64)
    np.cumsum(lengths[pick], out=chars[1:])
    text = b"".join(table[pick]).decode("ascii")
    offsets, token_ids = array("q"), array("q")
    offsets.frombytes(chars.tobytes())
    token_ids.frombytes(np.asarray(ids, dtype=np.int64)[pick].tobytes())
    tp = Tape(text, offsets, token_ids, lead)
    _check_tape(tp, tokenizer)
    return tp


class PromptBuilder:
    """Builds prompts of exactly ``req.input_length`` tokens from ``req.hash_ids``.

    ``salt`` changes every block's text (e.g. to keep a server's prefix cache from carrying over between
    two runs of the same trace); the default 0 gives the same texts in every run.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, tokenizer: str = DEFAULT_TOKENIZER, *,
                 salt: int = 0) -> None:
        if block_size < 1:
            raise InputError(f"block size must be >= 1, got {block_size}", field="block_size")
        if block_size > _TAPE_WORDS // 4:
            raise InputError(f"block size {block_size} is too large (max {_TAPE_WORDS // 4})",
                             field="block_size")
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.salt = salt
        self._salt_key = mix64(_fold(salt))
        self._tape = tape(tokenizer)
        self._half = (block_size + 1) // 2            # tokens from the first window
        self._span = _TAPE_WORDS - self._half + 1     # window starts that fit in the tape

    def _windows(self, hash_id: int, n: int) -> list[tuple[int, int]]:
        """Tape word ranges [start, end) of the first ``n`` tokens of block ``hash_id``."""
        h = mix64(_fold(hash_id) ^ self._salt_key)
        a = h % self._span
        first = min(n, self._half)
        if n <= first:
            return [(a, a + first)]
        b = mix64(h) % self._span
        return [(a, a + first), (b, b + n - first)]

    def _text(self, hash_id: int, n: int) -> str:
        c, t = self._tape.chars, self._tape.text
        return "".join(t[c[s]:c[e]] for s, e in self._windows(hash_id, n))

    def block_text(self, hash_id: int) -> str:
        """The full ``block_size``-token text of ``hash_id``."""
        return self._text(hash_id, self.block_size)

    def _check(self, req: TraceRequest) -> int:
        """Tokens in the request's last (possibly partial) block."""
        n = len(req.hash_ids)
        want = math.ceil(req.input_length / self.block_size)
        if n != want:
            raise InputError(
                f"{n} hash ids do not cover input_length {req.input_length} at block size "
                f"{self.block_size} (expected {want}); is the prompt builder's block size the trace's?",
                field="hash_ids")
        return req.input_length - (n - 1) * self.block_size if n else 0

    def text(self, req: TraceRequest) -> str:
        """Prompt text; ``req.prompt`` verbatim when the trace carries one."""
        if req.prompt is not None:
            return req.prompt
        last = self._check(req)
        if not req.hash_ids:
            return ""
        bs = self.block_size
        parts = [self._text(h, bs) for h in req.hash_ids[:-1]]
        parts.append(self._text(req.hash_ids[-1], last))
        return "".join(parts)[self._tape.lead:]

    def token_ids(self, req: TraceRequest) -> list[int]:
        """Prompt as token ids (``--prompt-format token-ids``); equals ``encode(self.text(req))``."""
        if req.prompt is not None:
            return encode(req.prompt, self.tokenizer)
        last = self._check(req)
        if not req.hash_ids:
            return []
        ids, bs = self._tape.ids, self.block_size
        out = array("q")  # array slices append as memcpy; one tolist() at the end
        n_blocks = len(req.hash_ids)
        for i, h in enumerate(req.hash_ids):
            for s, e in self._windows(h, bs if i < n_blocks - 1 else last):
                out += ids[s:e]
        return out.tolist()
