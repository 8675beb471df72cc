"""Hugging Face checkpoints (Llama / Qwen2 / Qwen3, sharded or not, F32 or BF16) load onto the one model:
greedy tokens and logits match a plain numpy forward written from the HF formulas, and — when
``transformers`` is installed (extra ``hf-parity``) — transformers itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reference_server.engine import SeqStep, create_engine
from reference_server.engine.checkpoint import CheckpointError, load_checkpoint
from tests.checkpoint_fixture import VOCAB, make_checkpoint, reference_logits

BS = 8
PROMPT = [5, 17, 123, 4, 250, 9, 77, 31, 200, 11, 3, 150, 42]


def greedy_reference(t, cfg, prompt, n):
    ids, logits = list(prompt), []
    for _ in range(n):
        lg = reference_logits(t, cfg, ids)[-1]
        logits.append(lg)
        ids.append(int(np.argmax(lg)))
    return ids[len(prompt):], np.array(logits)


def engine_greedy(eng, prompt, n, chunk=5):
    table = list(range(eng.num_blocks))[::-1]   # scattered order: the table defines the sequence
    logits = None
    for s in range(0, len(prompt), chunk):
        logits = eng.forward([SeqStep("a", prompt[s:s + chunk], s, table)])
    out, all_logits = [], [logits[0]]
    tok = int(np.argmax(logits[0]))
    for i in range(n - 1):
        out.append(tok)
        lg = eng.forward([SeqStep("a", [tok], len(prompt) + i, table)])[0]
        all_logits.append(lg)
        tok = int(np.argmax(lg))
    out.append(tok)
    return out, np.array(all_logits)


@pytest.mark.parametrize("family,shards,bf16", [("llama", 1, False), ("qwen2", 2, False),
                                                pytest.param("qwen3", 3, True, marks=pytest.mark.torch)])
def test_checkpoint_matches_reference_forward(tmp_path, family, shards, bf16):
    if bf16:
        pytest.importorskip("torch", reason="writing a BF16 test checkpoint needs torch")
    t = make_checkpoint(tmp_path, family, shards=shards, bf16=bf16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    want_tokens, want_logits = greedy_reference(t, cfg, PROMPT, 8)
    eng = create_engine("cpu", block_size=BS, num_blocks=8, model=str(tmp_path))
    assert eng.shape.vocab_size == VOCAB
    got_tokens, got_logits = engine_greedy(eng, PROMPT, 8)
    np.testing.assert_allclose(got_logits, want_logits, rtol=2e-4, atol=2e-4)
    assert got_tokens == want_tokens
    assert len(set(want_tokens)) > 1


def test_checkpoint_config_detected(tmp_path):
    make_checkpoint(tmp_path / "q2", "qwen2")
    make_checkpoint(tmp_path / "q3", "qwen3", shards=2)
    q2, q3 = load_checkpoint(tmp_path / "q2").config, load_checkpoint(tmp_path / "q3").config
    assert (q2.qkv_bias, q2.qk_norm, q2.tied_head, q2.rope_theta, q2.norm_eps) == (True, False, True, 1e6, 1e-6)
    assert (q3.qkv_bias, q3.qk_norm, q3.tied_head, q3.head_dim) == (False, True, False, 24)
    # the prefix-cache key follows the files: the same tensors in another sharding is another key
    v1 = load_checkpoint(tmp_path / "q2").version
    make_checkpoint(tmp_path / "q2b", "qwen2", shards=2)
    assert load_checkpoint(tmp_path / "q2b").version != v1


def test_bad_checkpoints_name_the_file(tmp_path):
    make_checkpoint(tmp_path, "llama", shards=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"config.json: model_type 'gpt2'"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(CheckpointError, match="field 'hidden_size' missing"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="index.json: lists model-00002"):
        load_checkpoint(tmp_path)


@pytest.mark.torch
def test_transformers_agrees(tmp_path):
    """Optional: the same checkpoints through transformers (pip install '.[hf-parity]')."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", reason="transformers not installed (extra hf-parity)")
    for family in ("llama", "qwen2", "qwen3", "llama3-rope"):
        d = tmp_path / family
        make_checkpoint(d, family.removesuffix("3-rope"), shards=2)
        if family == "llama3-rope":   # Llama 3.1's long-context RoPE rescaling (short context: most bands move)
            cfg = json.loads((d / "config.json").read_text())
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
            (d / "config.json").write_text(json.dumps(cfg))
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        with torch.no_grad():
            want = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
        eng = create_engine("cpu", block_size=BS, num_blocks=8, model=str(d))
        got = eng.forward([SeqStep("a", PROMPT, 0, list(range(2)))])[0]
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4, err_msg=family)


def _llama31_apply_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's published Llama 3.1 ``apply_scaling`` (llama-models, reference implementation), frequency by
    frequency: keep the high frequencies (wavelength under old_context_len / high_freq_factor), divide the low
    ones (over old_context_len / low_freq_factor) by the factor, blend linearly in 1/wavelength between."""
    import math

    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_llama3_rope_scaling_by_hand():
    """Runs on every submission (no transformers): the scaled RoPE frequencies against hand-worked values and the
    published formula, and the engine built from a checkpoint that asks for it really uses them."""
    from reference_server.engine.checkpoint import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    # head_dim 8, theta 10^4: frequencies 1, 0.1, 0.01, 0.001, wavelengths 2π/f = 6.28, 62.8, 628, 6283.
    # Bands: under 64/4 = 16 kept; over 64/1 = 64 divided by 8; 62.8 in between, smooth = (64/62.83 - 1)/3
    # = 0.0061972, so 0.1 × (0.9938028 / 8 + 0.0061972) = 0.1 × (0.1242254 + 0.0061972) = 0.01304226.
    got = rope_inv_freq(8, 10_000.0, scaling)
    np.testing.assert_allclose(got, [1.0, 0.01304226, 0.00125, 0.000125], rtol=1e-6)
    assert rope_inv_freq(8, 10_000.0, None).tolist() == pytest.approx([1.0, 0.1, 0.01, 0.001])
    # Llama 3.1 8B's own setting (head_dim 128, theta 5e5, factor 8, window 8192): all three bands occur
    llama31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base = 500_000.0 ** (-np.arange(0, 128, 2) / 128)
    want = _llama31_apply_scaling(base.tolist(), 8.0, 1.0, 4.0, 8192)
    got = rope_inv_freq(128, 500_000.0, llama31)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert (got == base).any() and np.isclose(got, base / 8).any() and ((got < base) & (got > base / 8)).any()


@pytest.mark.parametrize("nested", [False, True])
def test_checkpoint_rope_scaling_reaches_the_engine(tmp_path, nested):
    make_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    if nested:   # transformers >= 5 writes rope_parameters (theta inside)
        cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta", 10_000.0), **scaling}
    else:
        cfg["rope_scaling"] = scaling
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    eng = create_engine("cpu", block_size=BS, num_blocks=8, model=str(tmp_path))
    hd, theta = eng.model.cfg.head_dim, eng.model.cfg.rope_theta
    base = theta ** (-np.arange(0, hd, 2) / hd)
    np.testing.assert_allclose(eng.model.inv_freq, _llama31_apply_scaling(base.tolist(), 8.0, 1.0, 4.0, 64), rtol=1e-12)
    assert not np.allclose(eng.model.inv_freq, base)          # a dropped rope_scaling would leave these
