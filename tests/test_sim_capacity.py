"""The twin's capacity bound (reference_server/sim/capacity.py) against the roofline it is built from."""

from __future__ import annotations

import pytest

from reference_server.config import ServerConfig
from reference_server.hardware import sim_profiles
from reference_server.sim.capacity import RequestWork, estimate_capacity
from reference_server.sim.roofline import compute_bound_chunk, instance_cards, step_seconds

TWIN = ServerConfig(engine="sim", model_profile="glm-5.2-fp8", device_profile="mtt-s5000")


def test_bound_is_the_roofline_work_of_the_requests_over_the_workers():
    model, device = sim_profiles(TWIN)
    cards = instance_cards(model, device)
    chunk = compute_bound_chunk(model, device, cards, TWIN.block_size)
    req = RequestWork(input_tokens=60_000, cached_tokens=54_000, output_tokens=101)
    est = estimate_capacity(TWIN, [req])
    prefill = sum(step_seconds(model, device, [(min(chunk, 60_000 - s), s)], cards) for s in range(54_000, 60_000, chunk))
    assert est.prefill_s == pytest.approx(prefill)
    assert est.decode_s > 0 and est.workers == {"prefill": 1, "decode": 1}
    assert est.rps == pytest.approx(min(1 / est.decode_s, 2 / (est.prefill_s + est.decode_s)))


def test_longer_contexts_and_colder_prompts_lower_the_bound():
    def rps(ctx: int, hit: float, **cfg) -> float:
        conf = ServerConfig(**{"engine": "sim", "model_profile": "glm-5.2-fp8", "device_profile": "mtt-s5000", **cfg})
        return estimate_capacity(conf, [RequestWork(ctx, int(ctx * hit), 500)]).rps

    assert rps(64_000, 0.9) > rps(128_000, 0.9) > rps(256_000, 0.9) > rps(400_000, 0.9)
    assert rps(64_000, 0.9) > rps(64_000, 0.5)
    assert rps(64_000, 0.9, sim_time_scale=0.5) == pytest.approx(2 * rps(64_000, 0.9))   # a 2x faster twin
    assert rps(64_000, 0.9, mode="chunked") > 0


def test_no_bound_for_a_real_engine_or_a_twin_that_does_not_sleep():
    work = [RequestWork(1000, 0, 10)]
    assert estimate_capacity(ServerConfig(engine="cpu"), work) is None
    assert estimate_capacity(ServerConfig(engine="sim", model_profile="glm-5.2-fp8", device_profile="mtt-s5000",
                                          sim_time_scale=0.0), work) is None
    assert estimate_capacity(TWIN, []) is None
