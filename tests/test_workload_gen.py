"""Agent workload specs and the generator: targets met, contexts in range, deterministic, strict specs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from paas_common.errors import EXIT_CONFIG, InputError
from paas_common.tokenizer import encode
from paasbench.cli import main
from paasbench.load.prompts import PromptBuilder
from paasbench.trace.inspect import inspect_trace
from paasbench.trace.mooncake import read_trace, request_to_json
from paasbench.workload import Arrivals, generate_trace, list_workloads, load_workload

K = 1024


@pytest.fixture(scope="module")
def white_paper():
    spec = load_workload("white-paper-agent")
    return spec, generate_trace(spec)


def test_shipped_workloads_listed() -> None:
    assert {"white-paper-agent", "ci-small"} <= set(list_workloads())


def test_white_paper_acceptance(white_paper) -> None:
    spec, tr = white_paper
    s = inspect_trace(tr)
    assert s["input_tokens_min"] >= 64 * K and s["input_tokens_max"] <= 400 * K
    assert abs(s["hit_ratio_tokens"] - 0.90) <= 0.01
    assert s["share_ge_256k"] > 0.1 and s["input_tokens_max"] == 400 * K  # sessions do reach the cap
    assert s["sessions"] == spec.sessions and s["cold_requests"] >= 1
    assert spec.server == {"engine": "sim", "model_profile": "glm-5.2-fp8", "device_profile": "mtt-s5000"}
    assert spec.slo == ["p50(ttft) <= 6000ms"]
    assert spec.context_buckets == [65536, 131072, 262144, 409600]


def test_white_paper_sessions_grow_and_share(white_paper) -> None:
    spec, tr = white_paper
    by_session: dict[str, list] = {}
    for r in tr.requests:
        if r.session_id is not None:
            by_session.setdefault(r.session_id, []).append(r)
    bs = tr.block_size
    for turns in by_session.values():
        assert [r.turn for r in turns] == list(range(len(turns)))      # in order in the trace
        for prev, cur in zip(turns, turns[1:]):
            assert cur.input_length > prev.input_length
            full = prev.input_length // bs
            assert cur.hash_ids[:full] == prev.hash_ids[:full]           # previous context is the prefix
            assert cur.arrival_ms >= prev.arrival_ms
    shared = spec.shared_prefix_tokens // bs
    firsts = [t[0].hash_ids[:shared] for t in by_session.values()]
    assert all(f == list(range(shared)) for f in firsts)                # system prompt + tools shared


def test_materialized_generated_prompts_are_exact(white_paper) -> None:
    _, tr = white_paper
    pb = PromptBuilder(block_size=tr.block_size)
    picks = [min(tr.requests, key=lambda r: r.input_length), tr.requests[len(tr) // 2],
             max(tr.requests, key=lambda r: r.input_length)]
    for req in picks:
        assert len(encode(pb.text(req))) == req.input_length


def test_deterministic_for_a_seed() -> None:
    spec = load_workload("ci-small")
    a, b = generate_trace(spec, seed=3), generate_trace(spec, seed=3)
    assert [request_to_json(r) for r in a.requests] == [request_to_json(r) for r in b.requests]
    c = generate_trace(spec, seed=4)
    assert [r.input_length for r in a.requests] != [r.input_length for r in c.requests]
    assert abs(inspect_trace(c)["hit_ratio_tokens"] - 0.90) <= 0.01


def test_ci_small_shape() -> None:
    spec = load_workload("ci-small")
    s = inspect_trace(generate_trace(spec))
    assert spec.server["engine"] == "cpu" and spec.server["model"] == "tiny"
    assert spec.slo and spec.sweep
    assert 1000 <= s["input_tokens_min"] and s["input_tokens_max"] <= 6 * K
    assert s["requests"] <= 150 and s["output_tokens_max"] <= 32
    assert abs(s["hit_ratio_tokens"] - 0.90) <= 0.01


@pytest.mark.parametrize("target", [0.35, 0.6, 0.8, 0.92])
def test_other_targets(target: float) -> None:
    spec = dataclasses.replace(load_workload("ci-small"), target_hit_ratio=target, sessions=12)
    assert abs(inspect_trace(generate_trace(spec))["hit_ratio_tokens"] - target) <= 0.01


def test_unreachable_target_names_field() -> None:
    spec = dataclasses.replace(load_workload("ci-small"), target_hit_ratio=0.99)
    with pytest.raises(InputError, match="reachable range") as err:
        generate_trace(spec)
    assert err.value.field == "target_hit_ratio"


def test_arrival_processes() -> None:
    base = dataclasses.replace(load_workload("ci-small"), sessions=20)
    rate = generate_trace(dataclasses.replace(base, arrivals=Arrivals(process="rate", request_rate=4.0)))
    assert inspect_trace(rate)["rate_rps"] == pytest.approx(4.0, rel=0.02)
    for arr in (Arrivals(process="poisson", session_rate=2.0), Arrivals(process="gamma", session_rate=2.0,
                                                                           burstiness=0.3)):
        tr = generate_trace(dataclasses.replace(base, arrivals=arr))
        t = np.array([r.arrival_ms for r in tr.requests])
        assert (np.diff(t) >= 0).all() and t[0] == 0
        starts = np.array([r.arrival_ms for r in tr.requests if r.turn == 0 or r.session_id is None]) / 1000
        assert 0.5 < (len(starts) - 1) / (starts.max() - starts.min()) < 8  # ~2 starts/s, loosely
    think = [r.extra["think_ms"] for r in tr.requests if r.turn]
    assert think and all(x >= 0 for x in think)


def test_cli_gen_writes_a_replayable_trace(tmp_path: Path) -> None:
    out = tmp_path / "ci.jsonl"
    res = CliRunner().invoke(main, ["trace", "gen", "ci-small", "-o", str(out), "--seed", "1", "--json"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)
    tr = read_trace(out, block_size=64)
    assert len(tr) == stats["requests"]
    assert inspect_trace(tr)["hit_ratio_tokens"] == pytest.approx(stats["hit_ratio_tokens"])


SPEC = """\
name: t
start_tokens: {dist: uniform, min: 1000, max: 2000}
cap_tokens: 4000
turns: 4
tool_output_tokens: 100
output_tokens: 10
"""


@pytest.mark.parametrize("extra,field,line", [
    ("bogus: 1\n", "bogus", 7),
    ("arrivals: {process: poisson, session_rate: 0}\n", "arrivals.session_rate", 7),
    ("arrivals: {process: rate}\n", "arrivals.request_rate", 7),
    ("arrivals: {process: zipf, session_rate: 1}\n", "arrivals.process", 7),
    ("think_time_s: {dist: weibull}\n", "think_time_s.dist", 7),
    ("output_tokens2: 5\n", "output_tokens2", 7),
    ("slo: p50(ttft) < 1s\n", "slo", 7),
])
def test_spec_errors_name_file_line_field(tmp_path: Path, extra: str, field: str, line: int) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(SPEC + extra)
    with pytest.raises(InputError) as err:
        load_workload(str(path))
    assert (err.value.file, err.value.field) == (str(path), field)
    assert err.value.line == line


def test_spec_bad_values(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(SPEC.replace("turns: 4", "turns: {dist: uniform, min: 0, max: 3}"))
    with pytest.raises(InputError, match="below 1"):
        load_workload(path)
    path.write_text(SPEC.replace("cap_tokens: 4000", "cap_tokens: 1500"))
    with pytest.raises(InputError) as err:
        load_workload(path)
    assert err.value.field == "start_tokens"
    path.write_text(SPEC.replace("name: t\n", ""))
    with pytest.raises(InputError) as err:
        load_workload(path)
    assert err.value.field == "name"
    path.write_text("name: [unclosed\n")
    with pytest.raises(InputError, match="malformed YAML"):
        load_workload(path)


def test_cli_unknown_workload_exits_2(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["trace", "gen", "no-such-workload", "-o", str(tmp_path / "x.jsonl")])
    assert res.exit_code == EXIT_CONFIG and "unknown workload" in res.output


def test_spec_without_target_uses_sizes_as_given(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(SPEC)
    tr = generate_trace(load_workload(path))
    lengths = [r.input_length for r in tr.requests if r.session_id == "s00000"]
    assert np.diff(lengths).tolist() == [110, 110, 110]  # tool output 100 + previous answer 10


@pytest.mark.parametrize("name", ["white-paper-agent", "ci-small"])
def test_shipped_slo_and_sweep_sections_are_accepted_downstream(name: str) -> None:
    from paasbench.metrics.slo import parse_gates
    from paasbench.sweep.settings import resolve_settings

    spec = load_workload(name)
    assert len(parse_gates(spec.slo)) == len(spec.slo) >= 1
    assert resolve_settings({}, spec.sweep, name)["axis"] == "rate"


def test_request_rate_with_a_single_session_gives_finite_times() -> None:
    # one session, no cold requests: every start is 0, so no time scale can slow the trace to the rate;
    # the generator used to double the scale to infinity and die on NaN timestamps
    spec = dataclasses.replace(load_workload("ci-small"), sessions=1, cold_fraction=0.0, target_hit_ratio=None,
                               arrivals=Arrivals(process="rate", request_rate=0.001))
    t = np.array([r.arrival_ms for r in generate_trace(spec).requests])
    assert len(t) > 1 and np.isfinite(t).all() and t[0] == 0 and (np.diff(t) >= 0).all()


def test_negative_seed_is_an_input_error() -> None:
    with pytest.raises(InputError) as err:
        generate_trace(load_workload("ci-small"), seed=-1)
    assert err.value.field == "seed"
    res = CliRunner().invoke(main, ["trace", "gen", "ci-small", "-o", "unused.jsonl", "--seed", "-1"])
    assert res.exit_code == EXIT_CONFIG and "seed" in res.output


def test_non_utf8_spec_file_is_an_input_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: x\n\xff\xfe\n")
    res = CliRunner().invoke(main, ["trace", "gen", str(bad), "-o", str(tmp_path / "t.jsonl")])
    assert res.exit_code == EXIT_CONFIG and str(bad) in res.output and "UTF-8" in res.output, res.output


def test_cli_gen_names_the_block_size_the_trace_needs(tmp_path: Path) -> None:
    """ci-small's hash ids are 64-token blocks: `trace inspect` / `run --trace` on the file need --block-size 64
    (their default, 512, stops with an error), so `trace gen` says so, in the command to paste."""
    out = tmp_path / "ci.jsonl"
    res = CliRunner().invoke(main, ["trace", "gen", "ci-small", "-o", str(out), "--seed", "1"])
    assert res.exit_code == 0, res.output
    assert f"paasbench trace inspect {out} --block-size 64" in " ".join(res.output.split())
    again = CliRunner().invoke(main, ["trace", "inspect", str(out), "--block-size", "64", "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout)["block_size"] == 64
