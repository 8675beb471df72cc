"""Cards and machines a server configuration occupies, as the sweep records them and the cost table charges them."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from paas_common.errors import InputError
from paasbench.sweep.embedded import section_hardware, server_section
from reference_server.cli import serve
from reference_server.config import ServerConfig
from reference_server.hardware import server_hardware
from reference_server.sim.profiles import load_device_profile, with_overrides

GLM_S5000 = {"engine": "sim", "model_profile": "glm-5.2-fp8", "device_profile": "mtt-s5000"}


def test_default_glm_on_s5000_is_32_cards_on_4_machines():
    hw = section_hardware(server_section(GLM_S5000, 65536))
    assert (hw["cards_per_worker"], hw["cards"], hw["machines"]) == (16, 32, 4)   # 1P+1D x 16 cards
    assert hw["workers"] == {"prefill": 1, "decode": 1} and hw["cards_per_machine"] == 8
    assert hw["prefill_worker_chunk_tokens"] == 4096                           # compute-bound, not 512
    assert hw["device"]["hbm_gb"] == 80 and hw["model"]["weight_bytes"] == pytest.approx(742.95e9, rel=1e-3)
    hw = section_hardware(server_section({**GLM_S5000, "workers": 4, "prefill_workers": 3}, 65536))
    assert (hw["cards"], hw["machines"]) == (64, 8)


def test_what_if_card_memory_fits_one_machine():
    hw = section_hardware(server_section({**GLM_S5000, "device_set": "hbm_gb=141"}, 65536))
    assert (hw["cards_per_worker"], hw["cards"], hw["machines"]) == (8, 16, 2)
    hw = section_hardware(server_section({**GLM_S5000, "device_set": "hbm_gb=141", "cards_per_worker": "16"}, 65536))
    assert (hw["cards_per_worker"], hw["cards"], hw["machines"]) == (16, 32, 4)


def test_cards_that_do_not_fit_are_an_input_error_before_start():
    with pytest.raises(InputError, match="8 cards of mtt-s5000 hold 640 GB; glm-5.2-fp8 needs 16 cards"):
        section_hardware(server_section({**GLM_S5000, "cards_per_worker": 8}, 65536))
    res = CliRunner().invoke(serve, ["--engine", "sim", "--model-profile", "glm-5.2-fp8",
                                     "--device-profile", "mtt-s5000", "--cards-per-worker", "8"])
    assert res.exit_code == 2 and "needs 16 cards" in res.output


def test_cpu_engine_is_one_machine_without_cards():
    hw = server_hardware(ServerConfig(engine="cpu", workers=3))
    assert (hw.cards, hw.machines, hw.prefill_worker_chunk_tokens) == (None, 1, 512)


def test_profile_overrides_are_checked_like_yaml_fields():
    d = with_overrides(load_device_profile("mtt-s5000"), "hbm_gb=141, mfu=0.5,tflops.fp8=900")
    assert (d.hbm_gb, d.mfu, d.tflops["fp8"], d.tflops["bf16"]) == (141, 0.5, 900, 500)
    with pytest.raises(InputError, match="unknown key 'hbm'"):
        with_overrides(d, "hbm=1")
    with pytest.raises(InputError, match="hbm_gb"):
        with_overrides(d, "hbm_gb=lots")
    with pytest.raises(InputError, match="KEY=VALUE"):
        with_overrides(d, "hbm_gb")


def test_prefill_only_workers_run_compute_bound_chunks():
    from reference_server.config import WorkerSpec
    from reference_server.engine import create_engine
    from reference_server.worker import chunk_tokens_for

    cfg = ServerConfig(**GLM_S5000)
    eng = create_engine("sim", block_size=512, num_blocks=1, model_profile="glm-5.2-fp8", device_profile="mtt-s5000",
                        time_scale=0)
    assert chunk_tokens_for(WorkerSpec("prefill", 0, cfg, "t"), eng) == 4096      # weight-bound below 4K
    assert chunk_tokens_for(WorkerSpec("decode", 0, cfg, "t"), eng) == 512        # decode stalls stay short
    explicit = ServerConfig(**GLM_S5000, prefill_worker_chunk_tokens=8192)
    assert chunk_tokens_for(WorkerSpec("prefill", 0, explicit, "t"), eng) == 8192
    cpu = ServerConfig(engine="cpu", prefill_chunk_tokens=256)
    assert chunk_tokens_for(WorkerSpec("prefill", 0, cpu, "t"), None) == 256


def test_joined_workers_count_on_the_machines_of_their_hosts():
    cfg = ServerConfig(engine="sim", model_profile="glm-5.2-fp8", device_profile="mtt-s5000", device_set="hbm_gb=141",
                       prefill_workers=1, decode_workers=0, join_port=0)
    alone = server_hardware(cfg)              # 8 cards per worker, 8 per machine: the router host's one prefill
    assert (alone.cards, alone.machines) == (8, 1)
    hw = server_hardware(cfg, {"10.0.0.2": {"prefill": 1}, "10.0.0.3": {"decode": 2}})
    assert hw.workers == {"prefill": 2, "decode": 2} and (hw.cards, hw.machines) == (32, 1 + 1 + 2)
    # the cpu engine: one machine per host that carries workers; a router whose workers all joined carries none
    # (before: the router's host was counted, with 0 cards: "machines 3" for two joined hosts, issue 30)
    cpu = server_hardware(ServerConfig(prefill_workers=0, decode_workers=0, join_port=0), {"h2": {"decode": 1}})
    assert (cpu.cards, cpu.machines) == (None, 1)
    sim = server_hardware(dataclasses.replace(cfg, prefill_workers=0), {"10.0.0.2": {"prefill": 1},
                                                                        "10.0.0.3": {"decode": 1}})
    assert (sim.cards, sim.machines) == (16, 2)


def test_router_works_its_hardware_out_once_per_set_of_joined_workers(monkeypatch: pytest.MonkeyPatch):
    """The trusted ``/health`` carries ``hardware``: the profiles are loaded when the joined workers change,
    not on every call (before: 3 calls, 3 loads)."""
    from reference_server import hardware
    from reference_server.router import Router

    loads = []
    real = hardware.sim_profiles
    monkeypatch.setattr(hardware, "sim_profiles", lambda cfg: loads.append(1) or real(cfg))
    router = Router(ServerConfig(engine="sim", model_profile="glm-5.2-fp8", device_profile="mtt-s5000",
                                 prefill_workers=1, decode_workers=1))
    first = router.hardware()
    assert router.hardware() == router.hardware() == first and len(loads) == 1
    monkeypatch.setattr(router.sup, "joined_hosts", lambda: {"10.0.0.2": {"decode": 1}})
    joined = router.hardware()
    assert len(loads) == 2 and joined["workers"]["decode"] == first["workers"]["decode"] + 1
    router.hardware()
    assert len(loads) == 2
