"""Malformed request bodies get HTTP 400 with an OpenAI-style error naming the field (never a 500 or a
silent reinterpretation); an oversized body gets 413 before it is parsed; tokenizing a huge prompt runs
off the event loop, so the server keeps answering meanwhile."""

from __future__ import annotations

import threading
import time

import pytest

from reference_server.launcher import EmbeddedServer
from server_client import get, post

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with EmbeddedServer(["--mode", "chunked", "--workers", "1", "--max-body-mb", "12"], startup_timeout_s=90) as s:
        yield s


@pytest.mark.parametrize("path,body,names", [
    ("/v1/completions", {"prompt": "hi", "stream_options": "x"}, "'stream_options' must be an object"),
    ("/v1/completions", {"prompt": "hi", "stream": "false"}, "'stream' must be a boolean"),     # before: streamed
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "'stream_options.include_usage' must be a boolean"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": 1}, "'ignore_eos' must be a boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content must be a string or a list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0] must be"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0] must be an object with a string 'role'"),
    ("/v1/completions", {"prompt": "hi", "model": 3}, "'model' must be a string"),
], ids=["stream_options-str", "stream-str", "include_usage-str", "ignore_eos-int", "part-text-int", "content-int",
        "part-str", "no-role", "model-int"])
def test_malformed_field_is_a_400_naming_it(server, path, body, names):
    status, out, headers = post(server.url, path, body)
    assert status == 400, out                                # before: 500 with a traceback, or a stream
    assert headers["Content-Type"].startswith("application/json")
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["code"] == 400
    assert names in out["error"]["message"]


def test_well_formed_variants_still_work(server):
    status, out, _ = post(server.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url",
                                                                                   "image_url": {"url": "x"}}]}],
        "max_tokens": 2, "stream": False, "stream_options": None, "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 2


def test_oversized_body_is_a_413_json_error(server):
    status, out, _ = post(server.url, "/v1/completions", {"prompt": "x" * (13 << 20)})
    assert status == 413 and "--max-body-mb" in out["error"]["message"]


def test_tokenizing_a_huge_prompt_does_not_stall_the_server(server):
    # ~5 MB of CJK (11 MB as JSON escapes): about a second or more of tokenization, then refused for
    # exceeding the context. /health, asked meanwhile, must be answered before that request ends.
    huge = {"prompt": "漢字テスト中文字符" * (5_000_000 // 27), "max_tokens": 1}
    done: dict[str, float] = {}

    def send() -> None:
        done["status"] = post(server.url, "/v1/completions", huge)[0]
        done["end"] = time.monotonic()

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.2)                                           # the body is in; tokenization is under way
    t0 = time.monotonic()
    assert get(server.url, "/health")[0] == 200
    health_end = time.monotonic()
    t.join(120)
    assert done["status"] == 400                              # too long for the context, as before
    assert health_end < done["end"] and health_end - t0 < 1.0, (health_end - t0, done["end"] - t0)
    # before: /health waited for the tokenization (3.7 s) and was answered after it
