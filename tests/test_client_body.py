"""The request body of a materialized prompt: built from the tape's bytes, once per request, and on the wire exactly
the JSON of the request the user asked for (issue #23, 128K-token prompts).

A 128K-token prompt is ~0.5 MB. The client used to build it as a string (256 blocks joined in Python) and serialize
it into the body; now the prompt builder cuts it from the tape's bytes as a JSON string's contents
(``PromptBuilder.json_text``) and ``build_body`` joins it in. These tests hold the new path to the old bytes.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
from pathlib import Path

import orjson
import pytest

from paas_common.tokenizer import count_words
from paasbench.client import ClientConfig, JsonText, build_body
from paasbench.load.prompts import PromptBuilder
from paasbench.load.runner import LoadConfig, run_load
from paasbench.metrics.records import read_records
from paasbench.trace.model import Trace, TraceRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_server import SSEServer  # noqa: E402

BS = 64


def _reference(cfg: ClientConfig, model: str | None, prompt: str | list[int], max_tokens: int) -> bytes:
    """The request as docs/metrics.md and the OpenAI API define it, serialized whole."""
    body: dict = {} if model is None else {"model": model}
    if cfg.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True, **({"continuous_usage_stats": True}
                                                          if cfg.continuous_usage else {})})
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return orjson.dumps(body)


CONFIGS = [
    ClientConfig("http://h"),
    ClientConfig("http://h", api="chat"),
    ClientConfig("http://h", continuous_usage=True, ignore_eos=False),
    ClientConfig("http://h", extra_body={"temperature": 0.5, "stop": ["\n"], "max_tokens": 3}),
    ClientConfig("http://h", extra_body={"prompt": "replaced by --extra-body"}),
    ClientConfig("http://h", api="chat", extra_body={"note": "\x00paasbench-prompt\x00"}),  # the marker itself
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("model", ["m", None])
def test_a_json_text_prompt_gives_the_bytes_of_the_whole_request_serialized(cfg: ClientConfig, model) -> None:
    for prompt in ["", " plain words", 'quotes " and \\ backslashes\nnew lines\ttabs', "non-ASCII é 中 🙂 \x7f"]:
        want = _reference(cfg, model, prompt, 16)
        assert build_body(cfg, model, JsonText(orjson.dumps(prompt)[1:-1]), 16) == want
        assert build_body(cfg, model, prompt, 16) == want
    assert build_body(cfg, model, [1, 2, 3], 4) == _reference(cfg, model, [1, 2, 3], 4)


def test_json_text_is_what_orjson_writes_for_the_prompt_text() -> None:
    pb = PromptBuilder(BS, salt=11)
    rnd = random.Random(5)
    for n in (1, BS - 1, BS, BS + 1, 37 * BS + 5):
        ids = [rnd.getrandbits(70) - (1 << 69) for _ in range(math.ceil(n / BS))]  # negative and > 64-bit ids too
        req = TraceRequest(0.0, n, 1, ids)
        got = pb.json_text(req)
        assert isinstance(got, JsonText)
        assert got == orjson.dumps(pb.text(req))[1:-1] == pb.text_bytes(req)
    carried = TraceRequest(0.0, 3, 1, [0], prompt='say "hi"\n')  # a trace's own prompt is escaped
    assert pb.json_text(carried) == orjson.dumps('say "hi"\n')[1:-1]


def test_the_body_on_the_wire_is_the_request_json_and_no_prompt_string_is_built(tmp_path, monkeypatch) -> None:
    """A run sends each prompt from the tape's bytes: the prompt is never built as a string on the send path
    (``PromptBuilder.text`` fails here; the old client built every prompt with it), and the bytes the server
    received are, byte for byte, ``orjson.dumps`` of the request with the prompt text in it."""
    n = 5 * BS + 3
    trace = Trace([TraceRequest(0.0, n, 4, [100 * i + k for k in range(math.ceil(n / BS))]) for i in range(4)],
                  block_size=BS)
    cfg = ClientConfig("http://unused", prompt_salt=7)
    expected_prompts = [PromptBuilder(BS, salt=7).text(r) for r in trace.requests]

    def no_string(self, req):  # noqa: ANN001
        raise AssertionError("the prompt was built as a string on the send path")

    monkeypatch.setattr(PromptBuilder, "text", no_string)
    wire = tmp_path / "bodies.jsonl"
    with SSEServer(record=wire) as srv:
        res = asyncio.run(run_load(trace, LoadConfig(mode="concurrency", concurrency=2),
                                   ClientConfig(srv.url, prompt_salt=7), tmp_path / "out"))
    recs = list(read_records(res.records_path))
    assert [r.error_message for r in recs if not r.ok] == []
    assert sorted(r.prompt_tokens for r in recs) == [n] * 4   # the server counted every token
    got = sorted(wire.read_bytes().splitlines())
    want = sorted(_reference(cfg, "sse-test", p, 4) for p in expected_prompts)
    assert got == want


def test_count_words_is_len_of_split() -> None:
    rnd = random.Random(1)
    alphabet = " \t\n\x0b\x0c\r\x1c\x1d\x1e\x1fab\u3000é"
    for _ in range(2000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 12)))
        assert count_words(text) == len(text.split()), repr(text)
    assert count_words(" word" * 1000) == 1000


def test_a_chat_endpoint_url_gets_chat_bodies_or_a_refusal_before_any_load(tmp_path) -> None:
    # before: `--target http://HOST/v1/chat/completions` (the help allows a full URL) was POSTed completions
    # bodies, {"prompt": ...}: 3 x HTTP 400 "body.messages Field required" from vLLM
    from click.testing import CliRunner

    from paasbench.cli import main

    args = ["--isl", "32", "--osl", "2", "--rate", "50", "--max-requests", "3", "--no-live"]
    with SSEServer(record=tmp_path / "bodies.jsonl") as srv:
        url = srv.url + "/v1/chat/completions"
        res = CliRunner().invoke(main, ["run", "--target", url, "--out", str(tmp_path / "a"), *args])
        assert res.exit_code == 0, res.output
        bodies = srv.take_bodies()
        assert len(bodies) == 3 and all("messages" in b and "prompt" not in b for b in bodies)
        res = CliRunner().invoke(main, ["run", "--target", url, "--api", "completions", "--out", str(tmp_path / "b"),
                                        *args])
        assert res.exit_code == 2 and "is the chat endpoint, but --api is completions" in res.output, res.output
        assert srv.take_bodies() == []                                    # refused before any load
    assert ClientConfig(target="http://h:1/v1/completions").api == "completions"
    assert ClientConfig(target="http://h:1").api == "completions" and ClientConfig("http://h:1/v1", "chat").api == "chat"
