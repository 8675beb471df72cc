"""``--model DIR`` end to end: the server encodes text with the checkpoint's own tokenizer.json, runs the
checkpoint's weights (prefill worker -> KV transfer -> decode worker) and streams the text of the
greedy tokens — the same tokens the engine computes in-process."""

from __future__ import annotations

import json

import numpy as np
import pytest

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
    # generation_config.json names two stop ids (as Qwen2.5-Instruct does); a later greedy token is one
    stop = next((t for t in want if t != want[0]), want[0])
    assert VOCAB - 1 not in want
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [VOCAB - 1, stop]}))
    args = ["--model", str(tmp_path), "--workers", "2", "--block-size", "16", "--kv-budget-mb", "1",
            "--remote-prefill-threshold", "0"]
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        r = stream(s.url, {"prompt": TEXT, "max_tokens": 6, "ignore_eos": True, "stream_options": {"include_usage": True}})
        stopped = stream(s.url, {"prompt": TEXT, "max_tokens": 6, "stream_options": {"include_usage": True}})
    assert r.status == 200 and r.done
    assert r.usage["prompt_tokens"] == len(ids)           # counted in the checkpoint's tokens, not cl100k's
    assert r.text == tok.decode(want, skip_special_tokens=True)
    assert r.text and np.all(np.array(want) < VOCAB)
    assert stopped.usage["completion_tokens"] == want.index(stop) + 1   # stopped at the second EOS id
    assert r.events[0]["model"] == str(tmp_path)          # served under its --model path, as vLLM does


@pytest.mark.torch
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_serves_with_a_low_precision_kv_pool(tmp_path, kv_dtype):
    """--backend torch with a bf16 / FP8 pool: KV crosses prefill -> decode (and the host KV store) and the
    text equals the in-process engine's with the same pool."""
    pytest.importorskip("torch")
    make_checkpoint(tmp_path, "qwen3", shards=2)
    _tokenizer(tmp_path)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    eng = create_engine("cpu", block_size=16, num_blocks=8, model=str(tmp_path), backend="torch", kv_dtype=kv_dtype)
    want = [eng.step([SeqStep("a", ids, 0, list(range(8)))])[0]]
    for i in range(5):
        want.append(eng.step([SeqStep("a", [want[-1]], len(ids) + i, list(range(8)))])[0])
    args = ["--model", str(tmp_path), "--backend", "torch", "--kv-dtype", kv_dtype, "--workers", "2",
            "--block-size", "16", "--kv-budget-mb", "1", "--remote-prefill-threshold", "0", "--kv-store-gb", "0.01"]
    with EmbeddedServer(args, startup_timeout_s=120) as s:
        texts = [stream(s.url, {"prompt": TEXT, "max_tokens": 6, "ignore_eos": True}).text for _ in range(2)]
    assert texts[0] == tok.decode(want, skip_special_tokens=True)
    assert texts[1] == texts[0]         # the second time its prefix comes from the cache / store
