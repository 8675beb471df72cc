"""Bad CLI values (docs/bad-input.md, "CLI values"): each exits 2 with a message naming the flag, before
anything is sent. The target is a closed port: a row that got past validation would show up as a run
failure (exit 1), not as a pass."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from paasbench.cli import main

RUN = ["run", "--target", "http://127.0.0.1:9", "--no-live", "--isl", "10", "--osl", "2"]

CASES = [  # (extra args, what the message says)
    (["--rate", "0"], "field 'rate': mode 'poisson' needs a request rate > 0"),
    (["--concurrency", "0"], "field 'concurrency': mode 'concurrency' needs concurrency >= 1"),  # before: replayed
    (["--rate", "nan"], "Invalid value for '--rate': must be a finite number, got 'nan'"),  # before: ValueError, 1
    (["--rate", "1", "--duration", "inf"], "Invalid value for '--duration': must be a finite number"),
    (["--rate", "1", "--seed", "-1"], "Invalid value for '--seed': -1 is not in the range x>=0"),  # before: exit 1
    (["--rate", "1", "--burstiness", "0"], "field 'burstiness': must be > 0"),
    (["--rate", "1", "--warmup", "-1"], "field 'warmup_s': must be >= 0"),
    (["--rate", "1", "--max-requests", "0"], "field 'max_requests': must be >= 1"),
    (["--rate", "1", "--max-concurrency", "0"], "field 'max_concurrency': must be >= 1"),
    (["--rate", "1", "--first-byte-timeout", "0"], "field 'first_byte_timeout_s': must be > 0"),
    (["--rate", "1", "--goodput", "ttft:abc"], "field '--goodput': not a number of ms: 'abc'"),
    (["--rate", "1", "--goodput", "foo:10"], "field '--goodput': expected METRIC:MS"),
    (["--rate", "1", "--extra-body", "nope"], "field '--extra-body': not JSON"),
    (["--rate", "1", "--header", "nocolon"], "field '--header': expected NAME:VALUE"),
    (["--rate", "1", "--tokenizer", "nope"], "field '--tokenizer': unknown tokenizer 'nope'"),
    (["--rate", "1", "--prompt-format", "token-ids", "--api", "chat"], "field 'prompt_format': token-id prompts need"),
    (["--rate", "1", "--isl", "bogus:1"], "field '--isl': unknown distribution 'bogus'"),
    (["--rate", "1", "--slo", "p50(ttft) <= fast"], "SLO 'p50(ttft) <= fast': malformed"),
]


@pytest.mark.parametrize("extra, says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_run_value_exits_2_naming_the_flag(tmp_path, extra, says):
    res = CliRunner().invoke(main, RUN + ["--out", str(tmp_path / "o"), *extra])
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert says in res.output, res.output


def test_bad_target_url(tmp_path):
    res = CliRunner().invoke(main, ["run", "--target", "ftp://x", "--out", str(tmp_path), "--isl", "10", "--osl", "2",
                                    "--rate", "1"])
    assert res.exit_code == 2 and "field 'target': target must be an http(s) URL, got 'ftp://x'" in res.output


@pytest.mark.parametrize("spec, says", [
    ('{"rules": [{"kind": "explode", "every": 1}]}', "rules[0]: field 'kind': unknown fault 'explode'"),
    ("{nope", "fault spec: not JSON"),
])
def test_bad_fault_spec_exits_2(spec, says):
    res = CliRunner().invoke(main, ["serve", "--port", "0", "--fault-spec", spec])
    assert res.exit_code == 2 and "--fault-spec" in res.output and says in res.output, res.output


@pytest.mark.parametrize("value, says", [
    ("redis", "expected builtin, mooncake or mooncake://HOST:PORT"),
    ("mooncake://host", "the master address must be HOST:PORT"),
    ("mooncake://host:99999", "the master address must be HOST:PORT"),
])
def test_bad_kv_store_exits_2(value, says):
    res = CliRunner().invoke(main, ["serve", "--port", "0", "--kv-store", value])
    assert res.exit_code == 2 and "--kv-store" in res.output and says in res.output, res.output


def test_gpu_check_without_torch_exits_2_naming_the_extra(tmp_path):
    # before: a raw ModuleNotFoundError traceback, exit 1. torch is shadowed by a module that is not there.
    import os
    import subprocess

    (tmp_path / "torch.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--quick", "--device", "cpu"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "pip install 'paasbench[torch]'" in r.stderr, r.stderr
