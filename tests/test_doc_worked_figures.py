"""The worked figures the docs state, recomputed from the code that produces them (issue #19, item 1).

docs/engines.md, docs/reference_server.md and docs/kv.md quote figures worked out from the twin's roofline, the
routing rule and the KV codec: weights and card counts, modeled prefill times and throughputs, the all-reduce's
share, a routing decision's two estimates, the FP8 wire's size. docs/figures.yaml names the test below as the
source of each, so a change to the roofline, a profile or the codec that moves a figure fails here and the page
is rewritten with it. Each assertion holds the figure as the doc rounds it.
"""

from __future__ import annotations

import numpy as np

from reference_server.engine import create_engine
from reference_server.engine.config import get_config
from reference_server.engine.vocab import vocab_size
from reference_server.kv.codec import TransferMeta
from reference_server.routing import Offer, PrefillEstimator, cost_rule
from reference_server.sim.profiles import load_device_profile, load_model_profile
from reference_server.sim.roofline import (KV_FLOOR, compute_bound_chunk, instance_cards, prefill_seconds,
                                           step_cost, weight_bytes_total)

GLM = load_model_profile("glm-5.2-fp8")
S5000, H200, H100 = (load_device_profile(d) for d in ("mtt-s5000", "h200", "h100"))


def test_engines_md_cards_and_weights():
    """'Cards and machines': GLM-5.2-FP8 is 743 GB of weights, needs >= 929 GB with the 20% KV floor, so 16
    S5000 cards (8 x 80 GB = 640 GB < 743 GB) but 8 H200 (8 x 141 GB); dense-7b is 13 GB on one H100."""
    assert KV_FLOOR == 0.2
    assert round(weight_bytes_total(GLM) / 1e9) == 743
    assert round(weight_bytes_total(GLM) / 1e9 / (1 - KV_FLOOR)) == 929
    assert (S5000.cards, S5000.hbm_gb, H200.hbm_gb) == (8, 80, 141)
    assert (instance_cards(GLM, S5000), instance_cards(GLM, H200), instance_cards(GLM, H100)) == (16, 8, 16)
    dense = load_model_profile("dense-7b")
    assert round(weight_bytes_total(dense) / 1e9) == 13 and instance_cards(dense, H100) == 1


def test_engines_md_prefill_chunk_figures():
    """'Prefill chunk of prefill-only workers': a 512-token chunk on 16 x S5000 is memory 41 ms vs compute 6 ms;
    the smallest compute-bound chunk is 4,096 tokens on S5000 and H200, ~4x the throughput of 512-token chunks
    (42.4K vs 10.7K tokens/s per instance)."""
    c = step_cost(GLM, S5000, [(512, 0)], 16)
    assert (round(c.memory_s * 1e3), round(c.compute_s * 1e3)) == (41, 6)
    assert compute_bound_chunk(GLM, S5000, 16, 512) == compute_bound_chunk(GLM, H200, 8, 512) == 4096
    tps = {n: n / step_cost(GLM, S5000, [(n, 0)], 16).seconds for n in (512, 4096)}
    assert (round(tps[4096] / 1e3, 1), round(tps[512] / 1e3, 1)) == (42.4, 10.7)
    assert round(tps[4096] / tps[512]) == 4


def test_engines_md_400k_prompt_and_cross_check():
    """A 400K prompt in 8K chunks: ~17.6 s on 16 x S5000, 16.3 s on 8 x H200, 9.7 s on 16 x H100; 8K prompts
    give 2,606 tokens/s per card on S5000 and 4,425 on H100 (ratio 0.59); the all-reduce is ~36% of a 4K or 8K
    chunk's modeled time on S5000 and 53% of an 8K chunk's on H100."""
    assert [round(prefill_seconds(GLM, d, 400_000, 8192), 1) for d in (S5000, H200, H100)] == [17.6, 16.3, 9.7]
    per_card = {d.name: 8192 / prefill_seconds(GLM, d, 8192, 8192) / instance_cards(GLM, d) for d in (S5000, H100)}
    assert (round(per_card["mtt-s5000"]), round(per_card["h100"])) == (2606, 4425)
    assert round(per_card["mtt-s5000"] / per_card["h100"], 2) == 0.59

    def comm_share(n: int, d) -> float:
        c = step_cost(GLM, d, [(n, 0)], instance_cards(GLM, d))
        return c.comm_s / c.seconds

    assert [round(100 * comm_share(n, d)) for n, d in ((4096, S5000), (8192, S5000), (8192, H100))] == [36, 36, 53]


def test_engines_md_cpu_model_sizes():
    """`tiny`: 100,277 x hidden for the tied embedding (12.8 M parameters), i.e. a 51 MB float32 LM head."""
    tiny = get_config("tiny")
    assert vocab_size() == 100_277
    assert round(vocab_size() * tiny.hidden / 1e6, 1) == 12.8
    assert round(vocab_size() * tiny.hidden * 4 / 1e6) == 51


def test_reference_server_md_routing_example():
    """'Routing': the 398K-context + 2K turn on the twin with 512-token chunks: local 0.19 s, remote 28.3 s (the
    prefill worker would recompute 298K tokens); and a 32K prompt prefilled in 512-token chunks takes ~3.6x as
    long as in the prefill worker's compute-bound 4,096-token chunks."""
    bs = 512
    eng = create_engine("sim", block_size=bs, num_blocks=1, model_profile="glm-5.2-fp8", device_profile="mtt-s5000")
    est = PrefillEstimator(eng, 512)
    n, d_hit, p_hit = 400_000, 778 * bs, 200 * bs
    d = Offer("decode-0", d_hit, prefill_s=est.prefill_s(n - d_hit, d_hit), running=0)
    p = Offer("prefill-0", p_hit, prefill_s=est.prefill_s(n - p_hit, p_hit))
    c = cost_rule(n, d, [p], threshold=1000, queue_bound=2, backlog={}, block_size=bs,
                  block_nbytes=bs * eng.shape.kv_bytes_per_token(), wire_bytes_per_s=eng.device.network_gbps * 1e9)
    assert c.location == "local" and (round(c.local_s, 2), round(c.remote_s, 1)) == (0.19, 28.3)
    assert round((n - p_hit) / 1e3) == 298
    ratio = prefill_seconds(GLM, S5000, 32768, 512, 16) / prefill_seconds(GLM, S5000, 32768, 4096, 16)
    assert round(ratio, 1) == 3.6


def test_kv_md_fp8_wire_size():
    """'KV transfers': at the benchmark's shape (4 layers x 4 heads x 64 dims, 64-token blocks) FP8 is 32.01 MiB
    for 128 MiB of float32, the per-block scales 0.02 % of it."""
    mib, block_f32 = 128, 4 * 2 * 64 * 4 * 64 * 4
    n_blocks = mib * 2**20 // block_f32
    meta = TransferMeta("r", "bench", "1", layers=4, kv_heads=4, head_dim=64, block_size=64, n_blocks=n_blocks,
                        num_tokens=64 * n_blocks, dtype="fp8_e4m3")
    fp8 = meta.payload_len()
    assert round(fp8 / 2**20, 2) == 32.01
    scales = 4 * 4 * 2 * n_blocks
    assert round(100 * scales / (fp8 - scales), 2) == 0.02
    assert np.isclose((fp8 - scales) * 4, mib * 2**20)
