"""Prompt materialization: a trace's hash ids → prompt text (or token ids) of exactly ``input_length`` tokens.

Counted in the run's tokenizer (``--tokenizer``: cl100k by default, or the target model's own tokenizer.json).
A block is two windows of the tokenizer's *tape* (:mod:`paasbench.load.prompt_units`: text that tokenizer reads back
token for token, whatever sits next to it) whose start offsets are a hash of (salt, hash id), so:

* every block is exactly ``block_size`` tokens, blocks concatenate without merging, and a server with the same
  tokenizer sees block boundaries exactly where the trace put them: the same hash-id prefix is the same token
  prefix, in every request, process and run with the same salt;
* building a block is two string slices (about a microsecond): nothing is cached per block, memory stays
  constant whatever the trace, and prompts are assembled at send time, never all held;
* two hash ids get the same text only if both offsets collide (~1e-12 per pair), and shifted windows differ
  token by token, so there are no false prefix hits.

The salt is the run's (``--prompt-salt``; a fresh random one per run by default): a server's prefix cache holds
a previous run's blocks, and without a salt the same seed would write the same text and hit them.

Token-id prompts (``--prompt-format token-ids``) never go through text: their tape is a hash-picked sequence of
the tokenizer's ordinary ids, laid out in blocks the same way, so they work for any tokenizer, including one no
text can be made exact for. :func:`max_token_id` is the largest id a run can send; :func:`check_token_ids_fit`
checks it against a vocabulary size (the checkpoint's config.json here, the server's own where it says).
"""

from __future__ import annotations

import json
import math
from array import array
from pathlib import Path

import numpy as np

from paas_common.errors import InputError
from paas_common.hashing import mix64, mix64_array
from paas_common.tokenizer import DEFAULT_TOKENIZER, encode, is_hf_path, load_tokenizer
from paasbench.load.prompt_units import TAPE_TOKENS, Tape, id_pool, tape
from paasbench.trace.model import DEFAULT_BLOCK_SIZE, TraceRequest

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


def max_token_id(tokenizer: str = DEFAULT_TOKENIZER, prompt_format: str = "token-ids") -> int:
    """The largest token id a synthetic prompt of ``prompt_format`` can hold in ``tokenizer`` (the id tape draws
    from every ordinary id; text uses the tape's words), to compare with the target's vocabulary."""
    return int(id_pool(tokenizer)[-1]) if prompt_format == "token-ids" else max(tape(tokenizer).ids)


def check_token_ids_fit(vocab_size: int, vocab_from: str, *, tokenizer: str = DEFAULT_TOKENIZER,
                        field: str = "--tokenizer") -> None:
    """InputError (exit 2) when token-id prompts built in ``tokenizer`` can hold ids the target cannot embed:
    ``vocab_size`` is the target's id count, ``vocab_from`` where it was learnt (a config.json, the server's
    /tokenize ...). One check and one message for every source of the size."""
    top = max_token_id(tokenizer)
    if top >= vocab_size:
        raise InputError(f"token-id prompts in tokenizer '{tokenizer}' use ids up to {top:,} (its vocabulary: "
                         f"{load_tokenizer(tokenizer).n_vocab:,}), but the target's vocabulary has {vocab_size:,} "
                         f"ids ({vocab_from}): give the model's own tokenizer with --tokenizer, or send text "
                         "(--prompt-format text)", field=field)


def check_local_vocab(tokenizer: str) -> None:
    """Before a token-id run: the ids must fit the tokenizer in use and, for a checkpoint directory, the
    model's own ``vocab_size`` (config.json), which can be smaller than a tokenizer with added tokens."""
    check_token_ids_fit(load_tokenizer(tokenizer).n_vocab, "the tokenizer's own size", tokenizer=tokenizer)
    config = Path(tokenizer) / "config.json"
    if is_hf_path(tokenizer) and config.is_file():
        try:
            size = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
        except (OSError, ValueError):
            return  # not ours to judge: the server loads it
        if isinstance(size, int) and size > 0:
            check_token_ids_fit(size, f"vocab_size in {config}", tokenizer=tokenizer)


def check_prompts(tokenizer: str, prompt_format: str, block_size: int | None = None) -> None:
    """Before anything is sent: the run's prompts can be built (the text tape exists for this tokenizer and block
    size, or the id pool) and token ids fit the model. An InputError (exit 2) here, not a failed first request
    in each load worker. What it loads is cached, so the run pays nothing twice."""
    if block_size is None:
        tape(tokenizer) if prompt_format == "text" else id_pool(tokenizer)
    else:
        PromptBuilder(block_size, tokenizer, prompt_format=prompt_format)
    if prompt_format == "token-ids":
        check_local_vocab(tokenizer)


class PromptBuilder:
    """Builds prompts of exactly ``req.input_length`` tokens from ``req.hash_ids``.

    ``salt`` changes every block's content (the run's ``--prompt-salt``; the same salt gives the same prompts).
    ``prompt_format`` says which tape to load now, before any request ("text" or "token-ids"); the other is
    loaded on first use.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, tokenizer: str = DEFAULT_TOKENIZER, *,
                 salt: int = 0, prompt_format: str = "text") -> None:
        if block_size < 1:
            raise InputError(f"block size must be >= 1, got {block_size}", field="block_size")
        if block_size > TAPE_TOKENS // 4:
            raise InputError(f"block size {block_size} is too large (max {TAPE_TOKENS // 4})",
                             field="block_size")
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.salt = salt
        self._salt_key = mix64(_fold(salt))
        self._text_tape: Tape | None = None
        self._id_tape: array | None = None
        if prompt_format == "token-ids":
            self._ids()
        else:
            self._tape()

    # -- tapes, loaded once ---------------------------------------------------------------------
    def _tape(self) -> Tape:
        if self._text_tape is None:
            tp = tape(self.tokenizer)
            if self.block_size % tp.unit and tp.filler_id < 0:
                raise InputError(
                    f"tokenizer '{self.tokenizer}' makes whitespace a token of its own and reads two spaces as one "
                    f"token, so a block of an odd number of tokens cannot end on a boundary its neighbour keeps; "
                    f"use an even block size (got {self.block_size}) or --prompt-format token-ids",
                    field="block_size")
            self._text_tape = tp
        return self._text_tape

    def _ids(self) -> array:
        if self._id_tape is None:
            pool = id_pool(self.tokenizer)
            out = array("i")
            out.frombytes(pool[(mix64_array(np.arange(TAPE_TOKENS)) % np.uint64(len(pool))).astype(np.int64)]
                          .astype(np.int32).tobytes())
            self._id_tape = out
        return self._id_tape

    # -- blocks -----------------------------------------------------------------------------------
    def _windows(self, hash_id: int, n: int, unit: int) -> tuple[list[tuple[int, int]], bool]:
        """Tape ranges [start, end) of the first ``n`` tokens of block ``hash_id``, and whether the block's
        one-token filler closes them (a full block whose size is not a multiple of ``unit``)."""
        body = self.block_size - self.block_size % unit
        half = unit * math.ceil(body / unit / 2)
        span = (TAPE_TOKENS - half) // unit + 1            # unit-aligned starts that fit either window
        h = mix64(_fold(hash_id) ^ self._salt_key)
        a = unit * (h % span)
        first = min(n, half)
        out = [(a, a + first)]
        if n > first:
            b = unit * (mix64(h) % span)
            out.append((b, b + min(n, body) - first))
        return out, n > body

    def _text(self, hash_id: int, n: int) -> str:
        tp = self._tape()
        c, t = tp.chars, tp.text
        windows, filled = self._windows(hash_id, n, tp.unit)
        return "".join(t[c[s]:c[e]] for s, e in windows) + (tp.filler if filled else "")

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
        return "".join(parts)[self._tape().lead:]

    def text_ids(self, req: TraceRequest) -> list[int]:
        """What ``text(req)`` encodes to, from the tape (no tokenizer call): for checks."""
        if req.prompt is not None:
            return encode(req.prompt, self.tokenizer)
        tp = self._tape()
        return self._gather(req, tp.ids, tp.unit, tp.filler_id)

    def token_ids(self, req: TraceRequest) -> list[int]:
        """Prompt as token ids (``--prompt-format token-ids``): ``req.prompt`` encoded when the trace carries
        one, else blocks of the id tape (never text: :func:`paasbench.load.prompt_units.id_pool`)."""
        if req.prompt is not None:
            return encode(req.prompt, self.tokenizer)
        return self._gather(req, self._ids(), 1, -1)

    def _gather(self, req: TraceRequest, ids: array, unit: int, filler_id: int) -> list[int]:
        last = self._check(req)
        out = array("i")  # array slices append as memcpy; one tolist() at the end
        n_blocks = len(req.hash_ids)
        for i, h in enumerate(req.hash_ids):
            windows, filled = self._windows(h, self.block_size if i < n_blocks - 1 else last, unit)
            for s, e in windows:
                out += ids[s:e]
            if filled:
                out.append(filler_id)
        return out.tolist()
