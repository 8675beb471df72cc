"""Prompt materialization: a trace's hash ids → prompt text (or token ids) of exactly ``input_length`` tokens.

Counted in the run's tokenizer (``--tokenizer``: cl100k by default, or the target model's own tokenizer.json).
A block is two windows of the tokenizer's *tape* (:mod:`paasbench.load.prompt_units`: text that tokenizer reads back
token for token, whatever sits next to it) whose start offsets are a hash of (salt, hash id), so:

* every block is exactly ``block_size`` tokens, blocks concatenate without merging, and a server with the same
  tokenizer sees block boundaries exactly where the trace put them: the same hash-id prefix is the same token
  prefix, in every request, process and run with the same salt;
* building a prompt is two byte slices of the tape per block, joined once (:meth:`PromptBuilder.json_text`: the
  bytes go into the request body as they are, since the tape's words need no JSON escaping): nothing is cached
  per block, memory stays constant whatever the trace, and prompts are assembled at send time, never all held;
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
import re
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from paas_common.errors import InputError
from paas_common.hashing import mix64, mix64_array
from paas_common.tokenizer import DEFAULT_TOKENIZER, encode, is_hf_path, load_tokenizer
from paasbench.client.body import JsonText
from paasbench.load.prompt_units import TAPE_TOKENS, Tape, id_pool, tape
from paasbench.trace.model import DEFAULT_BLOCK_SIZE, TraceRequest

_M64 = (1 << 64) - 1
_SCALAR_BLOCKS = 24   # up to this many blocks a prompt's windows are computed in Python, beyond it in numpy
_NEEDS_ESCAPE = re.compile(rb'["\\\x00-\x1f\x7f]')  # what a JSON writer may escape in ASCII; the tape has none


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
        self._raw: bytes | None = None        # the text tape's UTF-8 (``_tape_bytes``)
        self._byte_offsets: array = array("q")
        self._json_safe = False
        self._id_tape: array | None = None
        if prompt_format == "token-ids":
            self._ids()
        else:
            self._tape_bytes()

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
    def _windows(self, hash_ids: list[int], last: int, unit: int) -> tuple[list[int], list[int], list[bool]]:
        """Tape token windows of blocks ``hash_ids`` (every one ``block_size`` tokens but the last, ``last``): two
        a block, ``starts[2k]`` / ``widths[2k]`` and ``starts[2k+1]`` / ``widths[2k+1]`` (the second empty when
        the block fits in the first), and whether the block's one-token filler closes it (a full block whose size
        is not a multiple of ``unit``). Every block but the last has the same two widths, so only the offsets
        differ from block to block (:meth:`_offsets`)."""
        bs, n_blocks = self.block_size, len(hash_ids)
        body = bs - bs % unit
        half = unit * math.ceil(body / unit / 2)      # half <= body <= bs: a full block's widths are half, body - half
        first = min(last, half)
        widths = [half, body - half] * (n_blocks - 1) + [first, min(last, body) - first]
        starts = self._offsets(hash_ids, unit, (TAPE_TOKENS - half) // unit + 1)
        return starts, widths, [bs > body] * (n_blocks - 1) + [last > body]

    def _offsets(self, hash_ids: list[int], unit: int, span: int) -> list[int]:
        """The two windows' tape offsets of each block, in order: unit-aligned, below ``unit * span``, a hash of
        ``(salt, hash id)`` (``h = mix64(id ^ salt)``, then ``h`` and ``mix64(h)``). Python ints for a short prompt
        (numpy's per-call overhead costs more than a few blocks), numpy for many (a 128K-token prompt is 256)."""
        if len(hash_ids) <= _SCALAR_BLOCKS:
            out: list[int] = []
            for hash_id in hash_ids:
                h = mix64(_fold(hash_id) ^ self._salt_key)
                out += (unit * (h % span), unit * (mix64(h) % span))
            return out
        if 0 <= min(hash_ids) and max(hash_ids) <= _M64:
            folded = np.array(hash_ids, dtype=np.uint64)
        else:
            folded = np.fromiter((_fold(h) for h in hash_ids), dtype=np.uint64, count=len(hash_ids))
        h = mix64_array(folded ^ np.uint64(self._salt_key))
        return ((np.stack((h, mix64_array(h)), axis=1).ravel() % np.uint64(span)).astype(np.int64) * unit).tolist()

    def _pieces(self, hash_ids: list[int], last: int) -> list[Any]:
        """The prompt's bytes (UTF-8 of the tape's text) as slices of the tape, in order, fillers included."""
        tp, raw = self._tape(), self._tape_bytes()
        offsets = self._byte_offsets
        mv = memoryview(raw)
        starts, widths, filled = self._windows(hash_ids, last, tp.unit)
        if not any(filled):
            return [mv[offsets[s]:offsets[s + w]] for s, w in zip(starts, widths)]
        filler = tp.filler.encode()
        out: list[Any] = []
        for k, fill in enumerate(filled):
            a, b = starts[2 * k], starts[2 * k + 1]
            out += (mv[offsets[a]:offsets[a + widths[2 * k]]], mv[offsets[b]:offsets[b + widths[2 * k + 1]]])
            if fill:
                out.append(filler)
        return out

    def _tape_bytes(self) -> bytes:
        """The text tape's bytes (ASCII: its token offsets are byte offsets), the tape's own, not a copy: prompts
        are joined from byte slices, so a 128K-token prompt costs one copy, not a string built and encoded."""
        if self._raw is None:
            tp = self._tape()
            self._byte_offsets = tp.chars
            # JSON writes these bytes as they are (no quote, backslash or control character to escape)
            self._json_safe = _NEEDS_ESCAPE.search(tp.text) is None
            self._raw = tp.text
        return self._raw

    def _bytes(self, hash_ids: list[int], last: int, lead: bool) -> bytes:
        pieces = self._pieces(hash_ids, last)
        if lead:  # drop the prompt's first character (the tokenizer adds its own space)
            first = bytes(pieces[0])
            pieces[0] = first[len(first.decode("utf-8", "ignore")[:1].encode()):]
        return b"".join(pieces)

    def block_text(self, hash_id: int) -> str:
        """The full ``block_size``-token text of ``hash_id``."""
        return self._bytes([hash_id], self.block_size, False).decode("utf-8")

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
        return self.text_bytes(req).decode("utf-8")

    def text_bytes(self, req: TraceRequest) -> bytes:
        """``text(req)`` encoded in UTF-8, joined from the tape's bytes without building the string."""
        if req.prompt is not None:
            return req.prompt.encode("utf-8")
        last = self._check(req)
        if not req.hash_ids:
            return b""
        return self._bytes(req.hash_ids, last, self._tape().lead)

    def json_text(self, req: TraceRequest) -> JsonText:
        """``text(req)`` as a JSON string's contents: the bytes ``orjson.dumps(text(req))`` writes between its
        quotes, ready for the request body (:func:`paasbench.client.request.build_body`). For the tape's text
        they are ``text_bytes(req)`` themselves: nothing is escaped, so nothing is re-encoded per request."""
        if req.prompt is None:
            self._tape_bytes()
            if self._json_safe:
                return JsonText(self.text_bytes(req))
        return JsonText(orjson.dumps(self.text(req))[1:-1])

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
        if not req.hash_ids:
            return []
        starts, widths, filled = self._windows(req.hash_ids, last, unit)
        for k, fill in enumerate(filled):
            a, b = starts[2 * k], starts[2 * k + 1]
            out += ids[a:a + widths[2 * k]]
            out += ids[b:b + widths[2 * k + 1]]
            if fill:
                out.append(filler_id)
        return out.tolist()
