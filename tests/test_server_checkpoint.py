"""``--model DIR`` end to end: the server encodes text with the checkpoint's own tokenizer.json, runs the
checkpoint's weights (prefill worker -> KV transfer -> decode worker) and streams the text of the
greedy tokens — the same tokens the engine computes in-process."""

from __future__ import annotations

import numpy as np

from reference_server.engine import SeqStep, create_engine
from reference_server.launcher import EmbeddedServer
from tests.checkpoint_fixture import VOCAB, make_checkpoint
from tests.server_client import stream

TEXT = "the quick brown fox jumps over the lazy dog " * 3


def _tokenizer(root) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<pad>", "<s>", "</s>"])
    tok.train_from_iterator([TEXT, "pack my box with five dozen liquor jugs"], trainer)
    tok.save(str(root / "tokenizer.json"))


def test_serves_a_checkpoint_in_its_own_tokens(tmp_path):
    make_checkpoint(tmp_path, "qwen2", shards=2)
    _tokenizer(tmp_path)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    eng = create_engine("cpu", block_size=16, num_blocks=8, model=str(tmp_path))
    table, want, last = list(range(8)), [], None
    last = eng.step([SeqStep("a", ids, 0, table)])[0]
    want.append(last)
    for i in range(5):
        last = eng.step([SeqStep("a", [last], len(ids) + i, table)])[0]
        want.append(last)
    args = ["--model", str(tmp_path), "--workers", "2", "--block-size", "16", "--kv-budget-mb", "1",
            "--remote-prefill-threshold", "0"]
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        r = stream(s.url, {"prompt": TEXT, "max_tokens": 6, "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert r.status == 200 and r.done
    assert r.usage["prompt_tokens"] == len(ids)           # counted in the checkpoint's tokens, not cl100k's
    assert r.text == tok.decode(want, skip_special_tokens=True)
    assert r.text and np.all(np.array(want) < VOCAB)
