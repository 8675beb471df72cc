"""One model implementation: numpy and torch-cpu run the same code and must agree."""

from __future__ import annotations

import numpy as np
import pytest

from reference_server.engine import SeqStep, create_engine

pytest.importorskip("torch")


def test_numpy_and_torch_cpu_agree():
    prompt = np.random.default_rng(3).integers(0, 100_000, 300).tolist()
    engines = [create_engine("cpu", block_size=32, num_blocks=16, backend=b) for b in ("numpy", "torch")]
    assert engines[0].shape == engines[1].shape
    outs = []
    for eng in engines:
        logits = eng.forward([SeqStep("a", prompt[:200], 0, list(range(10))), SeqStep("b", prompt[200:], 0, [12, 13, 14, 15])])
        toks = [int(t) for t in logits.argmax(-1)]
        tok = toks[0]
        for i in range(5):
            tok = eng.step([SeqStep("a", [tok], 200 + i, list(range(10)))])[0]
            toks.append(tok)
        outs.append((logits, toks, eng.read_blocks([0, 12])))
    (ln, tn, kn), (lt, tt, kt) = outs
    finite = np.isfinite(ln)
    np.testing.assert_allclose(ln[finite], lt[finite], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(kn, kt, rtol=1e-4, atol=1e-4)
    assert tn == tt


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match="device"):
        create_engine("cpu", block_size=8, num_blocks=2, backend="torch", device="tpu")
    with pytest.raises(ValueError, match="numpy"):
        create_engine("cpu", block_size=8, num_blocks=2, backend="numpy", device="cuda")
