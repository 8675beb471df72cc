"""Fuzzing the two parsers that read untrusted bytes: the Mooncake trace reader and the client's SSE scanner.

Properties (hypothesis, bounded to a few seconds):

* trace: any bytes in a trace file give a Trace or an ``InputError`` naming the file and line — never
  another exception; valid records survive write -> read unchanged;
* SSE: any bytes, cut anywhere, never raise out of ``StreamParser.feed``; a well-formed stream gives the
  same token count, ``[DONE]`` and error verdict however the network splits it.
"""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paas_common.errors import InputError
from paasbench.client.sse import StreamParser
from paasbench.trace.model import Trace, TraceRequest
from paasbench.trace.mooncake import read_trace, write_trace

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
KEYS = ["timestamp", "input_length", "output_length", "hash_ids", "session_id", "turn", "prompt"]
# objects that look like trace records (the interesting inputs), and arbitrary lines
record_like = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=7).map(json.dumps)
trace_line = record_like | st.text(max_size=40) | st.binary(max_size=40).map(lambda b: b.decode("latin-1"))


@FUZZ
@given(lines=st.lists(trace_line | st.binary(max_size=30), min_size=1, max_size=6))
def test_any_trace_file_is_a_trace_or_a_located_input_error(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass") for x in lines))
    try:
        trace = read_trace(path, block_size=4)
    except InputError as exc:
        assert exc.file == str(path) and exc.line is not None and exc.line >= 1, exc.located()
        return
    for r in trace.requests:
        assert r.input_length >= 1 and len(r.hash_ids) == math.ceil(r.input_length / 4)


valid_request = st.builds(
    lambda ts, n_in, n_out, sess, prompt: TraceRequest(
        arrival_ms=float(ts), input_length=n_in, output_length=n_out, hash_ids=list(range(-(-n_in // 4))),
        session_id=sess, turn=0 if sess is not None else None, prompt=prompt),
    st.integers(0, 10**9), st.integers(1, 200), st.integers(0, 50), st.none() | st.text(max_size=5),
    st.none() | st.text(max_size=20))


@FUZZ
@given(reqs=st.lists(valid_request, min_size=1, max_size=5))
def test_valid_records_round_trip(tmp_path, reqs):
    reqs.sort(key=lambda r: r.arrival_ms)
    path = tmp_path / "rt.jsonl"
    write_trace(Trace(requests=reqs, block_size=4), path)
    back = read_trace(path, block_size=4).requests
    assert [(r.arrival_ms, r.input_length, r.output_length, r.hash_ids, r.session_id, r.prompt) for r in back] == \
        [(r.arrival_ms, r.input_length, r.output_length, r.hash_ids, r.session_id, r.prompt) for r in reqs]


def feed_split(data: bytes, cuts: list[int]) -> StreamParser:
    p = StreamParser()
    at = 0
    for c in sorted(set(min(c, len(data)) for c in cuts)) + [len(data)]:
        if c > at:
            p.feed(data[at:c], float(c))
            at = c
    return p


@FUZZ
@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=8))
def test_any_bytes_cut_anywhere_never_raise(data, cuts):
    p = feed_split(b"data: " + data, cuts)
    assert len(p.times) == len(p.counts) and all(n >= 0 for n in p.counts)


texts = st.text(max_size=6)   # quotes, backslashes, unicode, "data:" and "[DONE]" inside text included


@st.composite
def sse_streams(draw) -> tuple[bytes, int]:
    chat = draw(st.booleans())
    sep = draw(st.sampled_from([":", ": "]))
    events, n = [], 0
    for t in draw(st.lists(texts, min_size=0, max_size=8)):
        if chat:
            ev = {"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}
        else:
            ev = {"choices": [{"index": 0, "text": t, "finish_reason": None}]}
        events.append(json.dumps(ev, separators=(",", sep)))
        n += bool(t)
    if draw(st.booleans()):
        events.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}))
    eol = draw(st.sampled_from(["\n\n", "\r\n\r\n"]))
    body = "".join(f"data: {e}{eol}" for e in events) + f"data: [DONE]{eol}"
    return body.encode(), n


@FUZZ
@given(stream=sse_streams(), cuts=st.lists(st.integers(0, 2000), max_size=10))
def test_well_formed_stream_counts_the_same_however_it_is_split(stream, cuts):
    data, n = stream
    whole, split = feed_split(data, []), feed_split(data, cuts)
    assert whole.error is None and split.error is None
    assert whole.done and split.done
    assert sum(whole.counts) == sum(split.counts) == n
