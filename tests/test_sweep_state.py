"""sweep.json persistence: atomic rewrites, resume checks, leftovers of a killed step."""

from __future__ import annotations

import json
import os

import pytest

from paas_common.errors import InputError
from paasbench.sweep.state import SweepState, step_key, write_json_atomic

CFG = {"workload": "ci-small", "axis": "rate"}


def test_fresh_state_and_steps_roundtrip(tmp_path):
    st = SweepState.open(tmp_path, config=CFG, meta={"target": "x"}, slo=["error_rate <= 1%"], resume=False)
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["schema"] == "paasbench.sweep/1" and data["steps"] == [] and data["slo"] == ["error_rate <= 1%"]
    i, d = st.new_step_dir()
    assert i == 0 and d.name == "step-000" and d.is_dir()
    st.add_step({"index": i, "key": step_key(1.5), "passed": True})
    again = SweepState.open(tmp_path, config=CFG, meta={}, slo=[], resume=True)
    assert again.finished(step_key(1.5))["passed"] is True and again.finished(step_key(3.0)) is None
    assert again.new_step_dir()[0] == 1 and again.data["meta"]["resumed"] == 1


def test_killed_step_leftovers_are_wiped(tmp_path):
    st = SweepState.open(tmp_path, config=CFG, meta={}, slo=[], resume=False)
    st.add_step({"index": 0, "key": "a"})
    half = tmp_path / "step-001"
    half.mkdir()
    (half / "records.jsonl").write_text('{"torn": ')
    again = SweepState.open(tmp_path, config=CFG, meta={}, slo=[], resume=True)
    i, d = again.new_step_dir()
    assert i == 1 and d == half and list(d.iterdir()) == []


def test_resume_with_other_settings_is_a_config_error(tmp_path):
    SweepState.open(tmp_path, config=CFG, meta={}, slo=[], resume=False)
    with pytest.raises(InputError, match="axis"):
        SweepState.open(tmp_path, config={**CFG, "axis": "concurrency"}, meta={}, slo=[], resume=True)


def test_fresh_run_replaces_an_old_sweep(tmp_path):
    st = SweepState.open(tmp_path, config=CFG, meta={}, slo=[], resume=False)
    st.new_step_dir()
    st.add_step({"index": 0, "key": "a"})
    SweepState.open(tmp_path, config=CFG, meta={}, slo=[], resume=False)
    assert not (tmp_path / "step-000").exists()
    assert json.loads((tmp_path / "sweep.json").read_text())["steps"] == []


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    p = tmp_path / "sweep.json"
    write_json_atomic(p, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(p, {"a": object()})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []
    umask = os.umask(0)
    os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~umask           # like any file written here, not mkstemp's 0600


def test_step_key_distinguishes_bucket_and_param():
    assert step_key(2.0) != step_key(2.0, bucket=65536) != step_key(2.0, param=("remote-prefill-threshold", 0))
    assert step_key(0.1 + 0.2) == step_key(0.3)
