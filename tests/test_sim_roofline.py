"""The roofline: each term checked against numbers worked out by hand from the profile YAML."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from paas_common.errors import InputError
from reference_server.engine import SeqStep, VirtualKV, create_engine
from reference_server.sim.profiles import load_device_profile, load_model_profile
from reference_server.sim.roofline import (attended_pairs, compute_bound_chunk, instance_cards, instance_sizes,
                                           kv_transfer_seconds, step_cost, touched_params)


def test_attended_pairs_dense_and_sparse():
    assert attended_pairs(5, 0) == 15                       # 1+2+3+4+5
    assert attended_pairs(3, 10) == 11 + 12 + 13
    assert attended_pairs(5, 0, topk=3) == 1 + 2 + 3 + 3 + 3
    assert attended_pairs(4, 10, topk=3) == 12
    for n, p, k in [(7, 2, 4), (100, 0, 33), (1, 50, 60), (9, 3, 5)]:
        assert attended_pairs(n, p, k) == sum(min(c, k) for c in range(p + 1, p + n + 1))


def test_moe_reads_only_touched_experts():
    m = load_model_profile("glm-5.2-fp8")
    assert touched_params(m, 1) == pytest.approx(m.active_params)
    assert touched_params(m, 100_000) == pytest.approx(m.total_params)
    assert m.active_params < touched_params(m, 32) < m.total_params


def test_decode_batching_amortises_weights():
    m, d = load_model_profile("dense-7b"), load_device_profile("h100")
    one = step_cost(m, d, [(1, 1000)], tp=1).seconds
    many = step_cost(m, d, [(1, 1000)] * 32, tp=1).seconds
    assert many < 4 * one  # 32 sequences share one pass over 13 GB of weights


def test_prefill_attention_is_quadratic():
    m, d = load_model_profile("dense-7b"), load_device_profile("h100")
    a = step_cost(m, d, [(4096, 0)], tp=1).attn_flops
    b = step_cost(m, d, [(4096, 4096)], tp=1).attn_flops  # same chunk, after 4K of context
    assert a == pytest.approx(4 * 32 * 128 * 32 * 4096 * 4097 / 2)
    assert b / a == pytest.approx((4096 * 4096 + 4096 * 4097 / 2) / (4096 * 4097 / 2))


def test_kv_transfer_time():
    d = load_device_profile("mtt-s5000")
    assert kv_transfer_seconds(400e9, d) == pytest.approx(1.0 + 1e-5)
    assert kv_transfer_seconds(392e9, d, link="interconnect") == pytest.approx(1.0 + 1e-5)


def expected_chunk_seconds(n: int, p: int) -> float:
    """GLM-5.2-FP8 on MTT S5000, written out from the two YAML files (16 cards: 742 GB FP8 > 80% of 640 GB)."""
    L, hidden, heads, vocab = 78, 6144, 64, 154880
    linear = 2 * 38.0e9 * n + 2 * hidden * vocab
    ctx = np.arange(p + 1, p + n + 1, dtype=np.float64)
    attn = np.minimum(ctx, 2048).sum() * 2 * heads * (256 + 256) * L
    indexer = ctx.sum() * 2 * 32 * 128 * L
    cards = 16
    compute = (linear / (1000e12 * 0.4 * cards) + attn / (500e12 * 0.4 * cards) + indexer / (1000e12 * 0.4 * cards))
    expert = (742.0e9 - 38.0e9) / (256 - 8)
    weights = (38.0e9 - 8 * expert) + expert * 256 * (1 - (1 - 8 / 256) ** n) + hidden * vocab
    kv = min(p + n, 2048 * n) * L * 576 + (p + n) * L * 128 + n * L * 576
    memory = (weights + kv) / (1.6e12 * cards * 0.7)
    act = n * hidden * 2
    comm = L * 2 * (2 * 7 / 8) * act / 392e9 + act / 400e9   # TP over 8 cards, one machine-to-machine hop
    return max(compute, memory) + comm + 0.002


def test_400k_prompt_on_mtt_s5000_glm_has_its_modeled_ttft():
    eng = create_engine("sim", block_size=512, num_blocks=1000, model_profile="glm-5.2-fp8",
                        device_profile="mtt-s5000", time_scale=0)
    assert eng.tp == 16
    prompt, chunk = 400_000, 8192
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 100_000, prompt)]
    table = list(range(-(-prompt // 512)))
    t0 = time.perf_counter()
    first = None
    for s in range(0, prompt, chunk):
        first = eng.step([SeqStep("long", ids[s:s + chunk], s, table)])[0]
    assert time.perf_counter() - t0 < 5  # time_scale=0 accounts, never sleeps
    want = sum(expected_chunk_seconds(min(chunk, prompt - s), s) for s in range(0, prompt, chunk))
    assert eng.modeled_seconds_total == pytest.approx(want, rel=1e-9)
    assert 10 < want < 60, want  # tens of seconds: long-context prefill is what PrfaaS offloads
    kv = eng.read_blocks(table)
    assert kv == VirtualKV(n_blocks=782, nbytes=782 * 512 * 54912)
    assert 0 <= first < 100277


def test_sim_sleeps_the_modeled_time():
    dev = dataclasses.replace(load_device_profile("cpu-local"), step_overhead_s=0.4, seq_overhead_s=0.0)
    from reference_server.engine.sim import SimEngine

    eng = SimEngine(block_size=16, num_blocks=8, model_profile="tiny", device_profile=dev, time_scale=0.25)
    t0 = time.perf_counter()
    eng.step([SeqStep("a", [1, 2, 3], 0, [0])])
    elapsed = time.perf_counter() - t0
    assert eng.last_cost.seconds >= 0.4
    # the scaled time (0.1 s), not the unscaled (>= 0.4 s, 0.3 s more); 0.15 s of slack is for a loaded
    # 2-core box waking the sleeper late, and still catches a sleep that ignores the time scale
    assert 0.25 * eng.last_cost.seconds <= elapsed < 0.25 * eng.last_cost.seconds + 0.15


def test_instance_size_holds_the_weights():
    glm = load_model_profile("glm-5.2-fp8")
    assert instance_cards(glm, load_device_profile("h200")) == 8      # 8 x 141 GB: 743 GB + 20% floor fit
    assert instance_cards(glm, load_device_profile("h100")) == 16     # 8 x 80 GB = 640 GB < 743 GB: two machines
    assert instance_cards(glm, load_device_profile("mtt-s5000")) == 16
    assert instance_cards(load_model_profile("dense-7b"), load_device_profile("h100")) == 1   # 13 GB: one card
    assert instance_sizes(load_device_profile("h100"))[:6] == [1, 2, 4, 8, 16, 24]
    assert instance_cards(glm, load_device_profile("h100"), 24) == 24  # explicit and big enough: kept


def test_cards_that_cannot_hold_the_model_name_both_numbers():
    glm, s5000 = load_model_profile("glm-5.2-fp8"), load_device_profile("mtt-s5000")
    with pytest.raises(InputError) as err:
        instance_cards(glm, s5000, 8)
    msg = str(err.value)
    assert "8 cards" in msg and "needs 16 cards" in msg and "743 GB" in msg and "640 GB" in msg
    assert err.value.field == "--cards-per-worker"
    with pytest.raises(InputError, match="divisor of the mtt-s5000 machine's 8 cards"):
        instance_cards(glm, s5000, 12)                     # 1.5 machines is no instance size
    with pytest.raises(InputError, match="does not fit"):
        instance_cards(glm, dataclasses.replace(s5000, hbm_gb=0.01))


def test_instance_roofline_scales_with_cards():
    """Compute and memory time divide by the cards; communication is the stated all-reduce / pipeline hop."""
    m, d = load_model_profile("glm-5.2-fp8"), load_device_profile("h200")
    c8, c16 = step_cost(m, d, [(4096, 0)], tp=8), step_cost(m, d, [(4096, 0)], tp=16)
    assert c16.compute_s == pytest.approx(c8.compute_s / 2) and c16.memory_s == pytest.approx(c8.memory_s / 2)
    act = 4096 * 6144 * 2
    assert c16.comm_s - c8.comm_s == pytest.approx(act / 400e9)   # one machine-to-machine hop more


def test_prefill_worker_chunk_is_the_smallest_compute_bound_one():
    m, d = load_model_profile("glm-5.2-fp8"), load_device_profile("mtt-s5000")
    chunk = compute_bound_chunk(m, d, 16, 512)
    assert chunk == 4096
    at, below = step_cost(m, d, [(chunk, 0)], tp=16), step_cost(m, d, [(chunk // 2, 0)], tp=16)
    assert at.compute_s >= at.memory_s and below.compute_s < below.memory_s
    # at 512 tokens the MoE step streams ~every expert: weight-bound, a quarter of the compute-bound throughput
    small = step_cost(m, d, [(512, 0)], tp=16)
    assert small.memory_s > 5 * small.compute_s
    assert 4096 / at.seconds > 3.5 * 512 / small.seconds
