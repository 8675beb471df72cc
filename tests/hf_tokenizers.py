"""Small Hugging Face tokenizers the tests train themselves (no hub, no download): one per decoder family.

Each is trained in well under a second on generated text (syllable words, CJK, emoji, punctuation) and saved
as ``DIR/tokenizer.json``, the layout of a model checkpoint directory. Kinds:

* ``bytelevel``  byte-level BPE (GPT-2 / Llama 3 / Qwen / DeepSeek style: ``Ġword`` tokens, bytes for CJK)
* ``metaspace``  sentencepiece-style BPE (``▁word`` tokens, byte fallback ``<0xE6>``, metaspace decoder)
* ``wordpiece``  WordPiece with a whitespace pre-tokenizer (``##`` continuations; spaces are not tokens)
* ``legacy-sp``  Llama 2 / Mistral v0.1 style: the metaspace vocabulary, but no pre-tokenizer; a normalizer
                  prepends ``▁`` to the whole text and turns spaces into ``▁`` (so a leading space doubles)
* ``nosplit``    byte-level BPE with no pre-tokenizer: its tokens end in spaces (``kariĠ``)
* ``ws-isolated`` BPE whose pre-tokenizer makes every run of whitespace a piece of its own (a ``Split``
                  on whitespace runs, isolated): words carry no space, the space is a token of its own (``karito``, `` ``)
* ``unigram``    Unigram (sentencepiece's model) with a Metaspace pre-tokenizer (``▁word`` pieces)
* ``wordlevel``  WordLevel (one id per whole word, ``[UNK]`` otherwise), each single space isolated as a token
* ``crossmerge``  hand-made BPE, no pre-tokenizer: `` xy`` alone is one token, but a letter followed by a
                  space merges first, so words next to each other split differently (a BPE across spaces)
"""

from __future__ import annotations

import random
from pathlib import Path

_SYLLABLES = ["ka", "to", "ri", "mo", "ne", "sa", "lu", "pe", "di", "go", "ba", "chi", "zen", "qu", "ix", "ho",
              "we", "fa", "ly", "or", "tha", "mi", "su", "vo"]


def corpus(n_lines: int = 1500, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    words = ["".join(rnd.choice(_SYLLABLES) for _ in range(rnd.randint(1, 4))) for _ in range(2500)]
    extra = ["数据模型", "推理服务", "😀", "naïve", "Über", "e.g.", "42", "!?"]
    return [" ".join(rnd.choice(words) for _ in range(40)) + " " + " ".join(rnd.sample(extra, 3))
            for _ in range(n_lines)]


def build(kind: str, out_dir: Path, vocab_size: int = 3000) -> Path:
    """Train a ``kind`` tokenizer and save ``out_dir/tokenizer.json``; returns ``out_dir``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "crossmerge":
        return _crossmerge(out_dir)
    text = corpus()
    specials = ["<|endoftext|>", "<s>"]
    if kind in ("bytelevel", "nosplit"):
        tok = Tokenizer(models.BPE())
        if kind == "bytelevel":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        if kind == "nosplit":  # byte-level alphabet without a splitting pre-tokenizer: merges cross spaces
            from tokenizers import normalizers
            tok.normalizer = normalizers.Replace(" ", "Ġ")
            tok.decoder = decoders.Replace("Ġ", " ")
    elif kind in ("metaspace", "legacy-sp"):
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=[f"<0x{b:02X}>" for b in range(256)])
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", *specials],
                                           show_progress=False)
    elif kind == "ws-isolated":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+"), "isolated")
        tok.decoder = decoders.Fuse()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                          unk_token="<unk>")
    elif kind == "wordlevel":
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
        tok.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", *specials],
                                            show_progress=False)
    else:
        raise ValueError(kind)
    tok.train_from_iterator(text, trainer)
    if kind == "legacy-sp":  # trained split at spaces (as sentencepiece does), then exported without a splitter
        from tokenizers import normalizers
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = None
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir


def _crossmerge(out_dir: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models

    letters = "abcdefghijklmnopq"
    tokens = [" ", *letters, *(c + " " for c in letters), *(" " + c for c in letters),
              *(" " + c + d for c in letters for d in letters)]
    merges = [(c, " ") for c in letters] + [(" ", c) for c in letters] + \
             [(" " + c, d) for c in letters for d in letters]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.decoder = decoders.Fuse()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir
