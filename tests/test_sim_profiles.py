"""Profiles load from package data, match the engines they describe, and fail loudly on bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from paas_common.errors import InputError
from paasbench.cli import main
from reference_server.engine import SeqStep, create_engine
from reference_server.engine.config import get_config
from reference_server.sim.profiles import (device_profile_names, load_device_profile, load_model_profile,
                                           model_profile_names)


def test_bundled_profiles_load():
    assert {"glm-5.2-fp8", "dense-7b", "tiny"} <= set(model_profile_names())
    assert {"cpu-local", "h100", "h200", "mtt-s5000"} <= set(device_profile_names())
    for name in model_profile_names():
        load_model_profile(name)
    for name in device_profile_names():
        d = load_device_profile(name)
        assert d.peak_flops("fp32") > 0 and d.hbm_tbps > 0
    s5000 = load_device_profile("mtt-s5000")
    assert (s5000.tflops["fp8"], s5000.hbm_gb, s5000.hbm_tbps, s5000.cards) == (1000, 80, 1.6, 8)
    assert s5000.sources


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_cpu_model_profiles_match_the_cpu_engine(name):
    cfg, prof = get_config(name), load_model_profile(name)
    assert (prof.layers, prof.hidden, prof.heads, prof.kv_heads, prof.head_dim) == \
        (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim)
    assert prof.active_params == prof.total_params == cfg.block_params()


def test_unknown_profile_lists_valid_names(tmp_path):
    with pytest.raises(InputError, match="valid: .*h100"):
        load_device_profile("b200")
    bad = tmp_path / "x.yaml"
    bad.write_text("name: x\nlayers: 2\nbogus: 1\n")
    with pytest.raises(InputError, match="bogus"):
        load_model_profile(str(bad))
    bad.write_text("name: x\ntflops: {fp32: 1}\nhbm_tbps: fast\nhbm_gb: 1\n")
    with pytest.raises(InputError, match="hbm_tbps"):
        load_device_profile(str(bad))


def test_kv_size_7b_fp16_128k_is_68_7_gb():
    res = CliRunner().invoke(main, ["kv-size", "--model-profile", "dense-7b", "--dtype", "fp16",
                                    "--context", "131072", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["kv_bytes_per_token"] == 2 * 32 * 4096 * 2
    assert out["kv_bytes_per_request"] == 68_719_476_736  # ~68.7 GB
    res = CliRunner().invoke(main, ["kv-size", "--model-profile", "dense-7b", "--dtype", "fp8", "--json"])
    assert json.loads(res.output)["kv_bytes_per_request"] == 68_719_476_736 // 2


def test_kv_size_names_the_attention_alike_in_text_and_json():
    # before: the text said MHA (32 KV heads = 32 heads) and --json said "gqa"
    text = CliRunner().invoke(main, ["kv-size", "--model-profile", "dense-7b"]).output
    as_json = json.loads(CliRunner().invoke(main, ["kv-size", "--model-profile", "dense-7b", "--json"]).output)
    assert "(MHA, KV" in text and as_json["attention"] == "mha"
    mla = json.loads(CliRunner().invoke(main, ["kv-size", "--model-profile", "glm-5.2-fp8", "--json"]).output)
    assert mla["attention"] == "mla"


def test_kv_size_mla_counts_the_latent_once():
    res = CliRunner().invoke(main, ["kv-size", "--model-profile", "glm-5.2-fp8", "--context", "1000", "--json",
                                    "--device-profile", "mtt-s5000"])
    out = json.loads(res.output)
    assert out["kv_bytes_per_token"] == 78 * (512 + 64) * 1 + 78 * 128
    assert out["instance_cards"] == 16 and out["requests_fitting"] > 0
    res = CliRunner().invoke(main, ["kv-size", "--model-profile", "nope"])
    assert res.exit_code == 2 and "valid:" in res.output


@pytest.mark.parametrize("model", ["glm-5.2-fp8", "dense-7b", "tiny"])
def test_sim_shape_reports_the_profile_kv_bytes(model):
    eng = create_engine("sim", block_size=64, num_blocks=4, model_profile=model, device_profile="h200", time_scale=0)
    assert eng.shape.kv_bytes_per_token() == load_model_profile(model).kv_bytes_per_token()
    kv = eng.read_blocks([0, 3])
    assert kv.nbytes == 2 * 64 * eng.shape.kv_bytes_per_token()
    eng.write_blocks([1, 2], kv)
    with pytest.raises(ValueError):
        eng.write_blocks([1], kv)


def test_sim_tokens_are_deterministic_and_mode_independent():
    def run(chunks):
        eng = create_engine("sim", block_size=16, num_blocks=32, model="tiny", time_scale=0, seed=3)
        prompt = list(range(1000, 1100))
        for a, b in chunks:
            tok = eng.step([SeqStep("a", prompt[a:b], a, list(range(8)))])[0]
        out = [tok]
        for i in range(5):
            out.append(eng.step([SeqStep("a", [out[-1]], 100 + i, list(range(8)))])[0])
        return out

    one, chunked = run([(0, 100)]), run([(0, 30), (30, 64), (64, 100)])
    assert one == chunked and len(set(one)) > 1
