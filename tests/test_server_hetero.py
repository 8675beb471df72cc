"""A sim twin whose prefill pool is another card than its decode pool (``--prefill-device-profile``): the white
paper's S5000 prefill machines beside a decode pool of another card, run as one server, so a heterogeneous plan can
be verified (paasbench/plan/verify.py). Each prefill worker steps on its own card's roofline; the machines of each
card are counted apart."""

from __future__ import annotations

import json
import urllib.request

import pytest
from click.testing import CliRunner

from reference_server.cli import serve
from reference_server.config import ServerConfig
from reference_server.hardware import server_hardware
from reference_server.launcher import EmbeddedServer
from reference_server.sim.profiles import load_device_profile, load_model_profile
from reference_server.sim.roofline import compute_bound_chunk, instance_cards, step_seconds

GLM = {"engine": "sim", "model_profile": "glm-5.2-fp8", "mode": "disaggregated"}


def test_each_card_on_machines_of_its_own():
    hw = server_hardware(ServerConfig(**GLM, device_profile="h200", prefill_device_profile="mtt-s5000",
                                      prefill_workers=2, decode_workers=3))
    assert hw.prefill_pool["cards_per_worker"] == 16 and hw.cards_per_worker == 8   # 16 x S5000, 8 x H200
    assert (hw.cards, hw.machines) == (2 * 16 + 3 * 8, 2 * 2 + 3)
    assert hw.to_dict()["prefill_pool"]["device"]["name"] == "mtt-s5000"
    same = server_hardware(ServerConfig(**GLM, device_profile="h200", prefill_workers=2, decode_workers=3))
    assert same.prefill_pool is None and (same.cards, same.machines) == (40, 5)


def test_a_prefill_card_outside_a_disaggregated_twin_is_refused():
    res = CliRunner().invoke(serve, ["--engine", "sim", "--mode", "colocated", "--prefill-device-profile", "h200"])
    assert res.exit_code == 2 and "--prefill-device-profile" in res.output and "disaggregated" in res.output


@pytest.mark.timeout(120)
def test_remote_prefills_step_on_the_prefill_card():
    """A 16K prompt prefilled remotely on S5000 cards beside an H200 decode pool: its modeled prefill time is the
    S5000 roofline's in S5000 compute-bound chunks, not the H200's (which is 9% shorter)."""
    model, s5000, h200 = load_model_profile("glm-5.2-fp8"), load_device_profile("mtt-s5000"), load_device_profile("h200")

    def modeled(device) -> float:
        cards = instance_cards(model, device)
        chunk = compute_bound_chunk(model, device, cards, 512)
        return sum(step_seconds(model, device, [(min(chunk, 16384 - s), s)], cards) for s in range(0, 16384, chunk))

    assert modeled(h200) < 0.95 * modeled(s5000)
    args = ["--engine", "sim", "--model-profile", "glm-5.2-fp8", "--device-profile", "h200",
            "--prefill-device-profile", "mtt-s5000", "--mode", "disaggregated", "--prefill-workers", "1",
            "--decode-workers", "1", "--routing", "threshold", "--remote-prefill-threshold", "0",
            "--sim-time-scale", "0", "--kv-store-gb", "1"]
    with EmbeddedServer(args, startup_timeout_s=90) as s:
        body = json.dumps({"prompt": list(range(1000, 1000 + 16384)), "max_tokens": 2}).encode()
        req = urllib.request.Request(s.url + "/v1/completions", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            timings = json.loads(resp.read())["paasbench_timings"]
        health = json.loads(urllib.request.urlopen(s.url + "/health", timeout=10).read())
    assert timings["prefill_location"] == "remote"
    assert timings["prefill_modeled_ms"] == pytest.approx(1e3 * modeled(s5000), rel=1e-6)
    assert health["hardware"]["machines"] == 2 + 1 and health["hardware"]["cards"] == 16 + 8
