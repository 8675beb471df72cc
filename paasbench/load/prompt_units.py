"""The tape prompts are cut from: text whose tokens a given tokenizer reads back exactly, one per position.

A prompt of ``n`` tokens must encode to exactly ``n`` tokens in the *server's* tokenizer, and a block of a
prefix-chained trace must encode to the same ids wherever it appears, so nothing may merge across a block
boundary. What makes that possible is the tokenizer's pre-tokenizer: it cuts text into pieces before the model
(BPE, Unigram, WordPiece, WordLevel) sees it, and the model never joins two pieces. So prompts are written from
*units* that are whole pieces, each of a known token count, and any sequence of units encodes to the
concatenation of their ids. Two layouts cover the pre-tokenizers in use:

* ``spaced`` -- units are `` word``, one token each. A space followed by letters is one piece in tiktoken's
  (cl100k, o200k), byte-level BPE's (GPT-2, Llama 3, Qwen, DeepSeek), Metaspace's (sentencepiece-style BPE and
  Unigram) and Whitespace's (WordPiece, WordLevel). A legacy sentencepiece export that prepends ``▁`` to the
  whole text reads the first word without its space (``lead``: the prompt drops its first character).
* ``isolated`` -- units are ``word`` + `` ``, two tokens, for a pre-tokenizer that makes whitespace a piece of
  its own (``Split(" ")``, ``Split(\\s+)``, isolated): there `` word`` is two tokens and a run of words written
  without spaces would be one piece. A block of an odd token count ends with one more `` `` (the *filler*),
  which works where two spaces stay two tokens and is refused, with that reason, where they become one.

Units are found in the vocabulary by *encoding* candidates (a token's lone decoding is not what it encodes
from), and the layout is verified, not assumed: windows spread over the finished tape, junctions and fillers
included, must re-encode to the tape's own ids. A tokenizer for which neither layout holds (no pre-tokenizer:
its merges run across spaces) is refused with what was measured.

Why it is fast: the tape (2^20 tokens, a fixed hash of position picking among the 4,096 shortest words, about
4.5 bytes per token as English text has) is built once per tokenizer and cached on disk under the user cache
directory (``$XDG_CACHE_HOME/paasbench``), keyed by the tokenizer's content (:func:`fingerprint`), written to a
temporary file and renamed into place so concurrent runs never read half a file. Scanning a vocabulary takes
seconds; loading the cached tape takes milliseconds, so a run's launch does not pay for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import re
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paas_common.errors import InputError
from paas_common.hashing import mix64_array
from paas_common.tokenizer import (DEFAULT_TOKENIZER, Tokenizer, cache_dir, fingerprint, load_tokenizer,
                                  per_tokenizer, write_atomic)

TAPE_TOKENS = 1 << 20
_TAPE_VOCAB = 4096   # distinct words on the tape (the shortest that many; all if a vocabulary has fewer)
_MIN_WORDS = 256
_WORD = re.compile(r"[a-z]{2,12}")  # ASCII keeps text width predictable
_FORMAT = 3                          # bump when the tape's construction changes: old cache files are ignored


@dataclass(frozen=True, slots=True)
class Tape:
    """``text[chars[i]:chars[j]]`` encodes to ``ids[i:j]`` whenever ``i`` and ``j`` are multiples of ``unit``.

    The text is kept as its ASCII bytes (its words are ASCII, so a character is a byte and ``chars`` are byte
    offsets too): prompts go into request bodies as byte slices of it, and a ``str`` kept beside them would hold
    the 4.6 MB twice for the whole run (``PromptBuilder`` kept an encoded copy before)."""

    text: bytes           # ASCII
    chars: array          # len(ids) + 1 character offsets ('i'; array indexing is cheaper than numpy's)
    ids: array            # token ids ('i')
    layout: str = "spaced"
    unit: int = 1         # tokens per unit: windows start (and, inside a prompt, end) at multiples of it
    lead: bool = False    # the tokenizer prepends a space itself: a prompt starts without its first character
    filler: str = ""      # one-token unit that closes a block whose size is not a multiple of ``unit``
    filler_id: int = -1   # its id; -1 when no such unit stays one token (odd blocks refused)


# -- finding units ------------------------------------------------------------------------------------
def _candidates(enc: Tokenizer) -> tuple[list[int], list[str]]:
    """Tokens that decode to a lowercase ASCII word, with or without one leading space (a sentencepiece or
    WordPiece decoder drops the space of a lone token), in id order."""
    ids, words = [], []
    for tid, text in enc.token_texts():
        word = text[1:] if text.startswith(" ") else text
        if _WORD.fullmatch(word):
            ids.append(tid)
            words.append(word)
    return ids, words


def _one_token(enc: Tokenizer, ids: list[int], words: list[str], texts: list[str]) -> list[int]:
    """Indices ``i`` where ``texts[i]`` encodes to exactly ``[ids[i]]``, each word once."""
    keep, seen = [], set()
    for i, (tid, got) in enumerate(zip(ids, enc.encode_batch(texts))):
        if got == [tid] and words[i] not in seen:
            seen.add(words[i])
            keep.append(i)
    return keep


def _shortest(keep: list[int], words: list[str]) -> list[int]:
    """The shortest words, as many lengths as it takes to have ``_TAPE_VOCAB`` of them (id order kept).

    Fewer bytes per token is what real text has (about 4-4.5 for English; all single-token words average 7.5
    in cl100k): the server reads, parses and tokenizes that much per token, so long words would make every
    request costlier to the target than the traffic it stands for."""
    by_len = sorted({len(words[i]) for i in keep})
    limit = next((n for n in by_len if sum(len(words[i]) <= n for i in keep) >= _TAPE_VOCAB), by_len[-1])
    return [i for i in keep if len(words[i]) <= limit]


def _lay(units: list[str], tok_ids: np.ndarray, tok_lens: np.ndarray, **kw) -> Tape:
    """A tape of ``TAPE_TOKENS`` tokens: unit ``k`` is a fixed hash of ``k`` over ``units`` (each ``unit`` tokens,
    ids ``tok_ids[u]``, character lengths ``tok_lens[u]``)."""
    unit = tok_ids.shape[1]
    pick = (mix64_array(np.arange(TAPE_TOKENS // unit)) % np.uint64(len(units))).astype(np.int64)
    table = np.asarray([u.encode("ascii") for u in units], dtype=object)
    chars = np.zeros(TAPE_TOKENS + 1, dtype=np.int64)
    np.cumsum(tok_lens[pick].reshape(-1), out=chars[1:])
    return _tape(b"".join(table[pick]), chars, tok_ids[pick].reshape(-1), unit=unit, **kw)


def _tape(text: bytes, chars: np.ndarray, ids: np.ndarray, **kw) -> Tape:
    c, i = array("i"), array("i")  # 32 bits: half the memory and cache file of 64, room for any tape
    c.frombytes(np.ascontiguousarray(chars, dtype=np.int32).tobytes())
    i.frombytes(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
    return Tape(text, c, i, **kw)


def _mismatch(enc: Tokenizer, tp: Tape) -> str | None:
    """What the tokenizer reads differently from the tape, or None. Checked on 64 windows of 256 tokens spread
    over the tape (random neighbours), and for a filler on windows closed by it, as blocks are."""
    n_win, width = 64, 256
    starts = [(k * (TAPE_TOKENS - 4 * width)) // (n_win - 1) // tp.unit * tp.unit for k in range(n_win)]
    texts = [tp.text[tp.chars[s]:tp.chars[s + width]].decode("ascii") for s in starts]
    want = [tp.ids[s:s + width].tolist() for s in starts]
    if tp.lead:
        texts = [t[1:] for t in texts]
    if tp.filler_id >= 0:  # three windows of unit-aligned widths, each closed by the filler
        for s in starts:
            parts = [(s + k * width, s + k * width + 2 * k + 2) for k in range(3)]
            texts.append("".join(tp.text[tp.chars[a]:tp.chars[b]].decode("ascii") + tp.filler for a, b in parts))
            want.append([t for a, b in parts for t in [*tp.ids[a:b].tolist(), tp.filler_id]])
    for text, exp, got in zip(texts, want, enc.encode_batch(texts)):
        if got != exp:
            return f"{len(exp)} tokens of them re-encode as {len(got)}"
    return None


def build_tape(tokenizer: str = DEFAULT_TOKENIZER) -> Tape:
    """Find a layout whose units ``tokenizer`` reads back exactly (module docstring) and lay the tape; an
    InputError naming what each layout measured when none does."""
    enc = load_tokenizer(tokenizer)
    cand_ids, words = _candidates(enc)
    bare = _one_token(enc, cand_ids, words, words)
    tried: list[str] = []
    for lead in (False, True):
        keep = bare if lead else _one_token(enc, cand_ids, words, [" " + w for w in words])
        if len(keep) < _MIN_WORDS:
            tried.append(f"{len(keep)} words are one token as ' word'" + (" or 'word'" if lead else ""))
            continue
        keep = _shortest(keep, words)
        tp = _lay([" " + words[i] for i in keep], np.asarray([[cand_ids[i]] for i in keep], dtype=np.int64),
                  np.asarray([[len(words[i]) + 1] for i in keep], dtype=np.int64), layout="spaced", lead=lead)
        why = _mismatch(enc, tp)
        if why is None:
            return tp
        tried.append(f"' word' units{' (first space dropped)' if lead else ''}: {why}")
        break  # a tokenizer that prepends its own space and merges across words is not fixed by isolating
    space = enc.encode(" ")
    if len(bare) < _MIN_WORDS or len(space) != 1:
        tried.append(f"{len(bare)} words are one token as 'word', ' ' is {len(space)} token(s)")
    else:
        keep = _shortest(bare, words)
        sp = space[0]
        tp = _lay([words[i] + " " for i in keep], np.asarray([[cand_ids[i], sp] for i in keep], dtype=np.int64),
                  np.asarray([[len(words[i]), 1] for i in keep], dtype=np.int64), layout="isolated")
        why = _mismatch(enc, tp)
        if why is None:
            with_filler = Tape(tp.text, tp.chars, tp.ids, tp.layout, tp.unit, filler=" ", filler_id=sp)
            return with_filler if _mismatch(enc, with_filler) is None else tp
        tried.append(f"'word' + ' ' units: {why}")
    unsplit = getattr(enc.raw, "pre_tokenizer", "") is None  # a tokenizer.json with no pre-tokenizer at all
    raise InputError(f"tokenizer '{tokenizer}' cannot be given text prompts of an exact token count: no text layout "
                     f"it reads back token for token ({'; '.join(tried)}). "
                     + ("It has no pre-tokenizer, so its " if unsplit else "Its ")
                     + "BPE merges tokens across spaces, and a word's tokens depend on its neighbours; "
                     "--prompt-format token-ids needs no text", field="--tokenizer")


# -- the disk cache -----------------------------------------------------------------------------------
def _cache_file(tokenizer: str) -> Path:
    return cache_dir() / f"tape-v{_FORMAT}-{fingerprint(tokenizer)}.npz"


def _save(tp: Tape, path: Path) -> None:
    meta = {"layout": tp.layout, "unit": tp.unit, "lead": tp.lead, "filler": tp.filler, "filler_id": tp.filler_id}
    write_atomic(path, lambda f: np.savez(
        f, text=np.frombuffer(tp.text, dtype=np.uint8), chars=np.frombuffer(tp.chars, dtype=np.int32),
        ids=np.frombuffer(tp.ids, dtype=np.int32), meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)))


def _load(path: Path) -> Tape | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes())
            text = z["text"].tobytes()
            return _tape(text, z["chars"], z["ids"], **meta) if text.isascii() else None
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None  # absent, or not ours: rebuild


@per_tokenizer(maxsize=4)
def tape(tokenizer: str = DEFAULT_TOKENIZER) -> Tape:
    """The tokenizer's tape: from the disk cache when present, else built (seconds) and cached."""
    path = _cache_file(tokenizer)
    tp = _load(path)
    if tp is None:
        tp = build_tape(tokenizer)
        _save(tp, path)
    return tp


@per_tokenizer(maxsize=4)
def id_pool(tokenizer: str = DEFAULT_TOKENIZER) -> np.ndarray:
    """The ordinary (non-special) token ids of ``tokenizer``, for token-id prompts: ids need no text layout,
    so this path works for every tokenizer, including those no text can be made exact for."""
    return load_tokenizer(tokenizer).ordinary_ids()


def release() -> None:
    """Forget every tape and tokenizer this process loaded and hand the freed pages back to the kernel: for a
    process whose sending is over (``paasbench run`` once its load ends) they are ~60 MB of the ~115 MB it held
    while sending (cl100k: the vocabulary ~40 MB, its tape ~20 MB) — memory the summary and export (pandas,
    pyarrow: ~110 MB more) would otherwise stack on top of, the run's peak RSS. glibc keeps freed small
    blocks in its heap, so they leave the resident set only through ``malloc_trim`` (absent elsewhere: skipped).
    Whatever is asked for later loads again (the disk caches: milliseconds for a tape, ~0.3 s a vocabulary)."""
    tape.cache_clear()
    id_pool.cache_clear()
    load_tokenizer.cache_clear()
    gc.collect()
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)
