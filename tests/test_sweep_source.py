"""Workload retargeting per context bucket, trace sizing, and embedded-server flags."""

from __future__ import annotations

import pytest

from paas_common.errors import InputError
from paasbench.sweep.embedded import server_args, server_section
from paasbench.sweep.source import Source, parse_buckets


def test_parse_buckets():
    assert parse_buckets("64K,128k, 256K,400K") == [65536, 131072, 262144, 409600]
    assert parse_buckets("8192") == [8192]
    with pytest.raises(InputError, match="x64"):
        parse_buckets("x64")


def test_bucket_retarget_keeps_contexts_in_bucket_and_hit_target():
    src = Source.from_workload("white-paper-agent", 0)
    for bucket in (65536, 262144):
        trace = src.trace_for(bucket, requests=100)
        lengths = [r.input_length for r in trace.requests if r.session_id is not None]
        assert max(lengths) <= bucket
        assert sorted(lengths)[len(lengths) // 2] >= 0.75 * bucket      # most of them near the bucket
        assert abs(trace.meta["hit_ratio_tokens"] - 0.90) <= 0.01


def test_trace_is_sized_for_the_step_and_cached():
    src = Source.from_workload("ci-small", 0)
    small = src.trace_for(None, requests=10)
    big = src.trace_for(None, requests=2000)
    assert len(big) >= 2000 > len(small)
    assert src.trace_for(None, requests=1999) is big                    # cached, not regenerated
    assert src.trace_for(None, requests=len(small)) is small


def test_server_section_picks_engine_by_context():
    assert server_section({}, 409600)["engine"] == "sim"
    assert server_section({}, 409600)["device_profile"] == "mtt-s5000"
    assert server_section({}, 6144) == {"engine": "cpu", "model": "tiny"}
    assert server_section({"engine": "cpu", "model": "small"}, 409600)["engine"] == "cpu"   # spec wins


def test_server_args():
    args = server_args({"engine": "sim", "model_profile": "glm-5.2-fp8", "port": 1, "kv_fp8": True,
                        "api_key": None}, {"remote_prefill_threshold": "4096"})
    assert args == ["--engine", "sim", "--model-profile", "glm-5.2-fp8", "--kv-fp8",
                    "--remote-prefill-threshold", "4096"]


def test_fresh_prefixes_keep_structure_but_share_nothing_across_steps():
    from paasbench.sweep.source import fresh_prefixes

    trace = Source.from_workload("ci-small", 0).trace_for(None, requests=50)
    assert fresh_prefixes(trace, 0) is trace
    a, b = fresh_prefixes(trace, 1), fresh_prefixes(trace, 2)
    ids = lambda t: {h for r in t.requests for h in r.hash_ids}  # noqa: E731
    assert not (ids(trace) & ids(a)) and not (ids(a) & ids(b))
    for r0, r1 in zip(trace.requests[:30], a.requests[:30]):
        assert r1.input_length == r0.input_length and len(r1.hash_ids) == len(r0.hash_ids)
    # which requests share a prefix is unchanged: the same pairs agree on their first block
    firsts0 = [r.hash_ids[0] for r in trace.requests]
    firsts1 = [r.hash_ids[0] for r in a.requests]
    assert [x == firsts0[0] for x in firsts0] == [x == firsts1[0] for x in firsts1]
