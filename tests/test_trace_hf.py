"""Prompt files through HF datasets (local only): ShareGPT conversations, a custom column, parquet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from paas_common.errors import InputError
from paas_common.tokenizer import encode
from paasbench.cli import main
from paasbench.load.prompts import PromptBuilder
from paasbench.trace import load_trace

FIX = Path(__file__).parent / "fixtures" / "trace"


def test_sharegpt_turns_become_growing_sessions() -> None:
    tr = load_trace(FIX / "sharegpt.json", block_size=8)
    assert tr.meta["format"] == "prompts" and len(tr) == 3
    t0, t1, other = tr.requests
    assert (t0.session_id, t0.turn, t1.session_id, t1.turn) == ("chat-1", 0, "chat-1", 1)
    assert other.session_id is None
    assert t1.prompt.startswith(t0.prompt)
    for req in tr.requests:
        assert req.input_length == len(encode(req.prompt))
        assert len(req.hash_ids) == -(-req.input_length // 8)
        assert PromptBuilder(block_size=8).text(req) == req.prompt
    assert t0.output_length == len(encode("def reverse(s):\n    return s[::-1]"))
    assert other.output_length == len(encode("Paris."))
    full = len(encode(t0.prompt)) // 8
    assert t1.hash_ids[:full] == t0.hash_ids[:full]            # shared prefix → shared ids
    assert not set(other.hash_ids) & set(t0.hash_ids)


def test_custom_prompt_column_and_inspect() -> None:
    tr = load_trace(FIX / "prompts.jsonl", prompt_column="question")
    assert [r.output_length for r in tr.requests] == [40, 12]
    assert tr.requests[1].prompt == "List three prime numbers."
    res = CliRunner().invoke(main, ["trace", "inspect", str(FIX / "prompts.jsonl"), "--prompt-column",
                                    "question", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["requests"] == 2


def test_parquet(tmp_path: Path) -> None:
    import pandas as pd

    path = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": ["alpha beta gamma", "alpha beta delta"], "max_tokens": [5, 6]}).to_parquet(path)
    tr = load_trace(path, block_size=2)
    assert [r.output_length for r in tr.requests] == [5, 6]
    assert tr.requests[0].hash_ids[0] == tr.requests[1].hash_ids[0]


def test_no_prompt_column_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"foo": 1}\n')
    with pytest.raises(InputError, match="no prompt column") as err:
        load_trace(path)
    assert err.value.file == str(path)


@pytest.mark.parametrize("extra,field", [('"timestamp": "soon"', "timestamp"),
                                         ('"output_length": "many"', "output_length"),
                                         ('"max_tokens": -5', "max_tokens")])
def test_bad_numeric_column_is_a_located_input_error(tmp_path: Path, extra: str, field: str) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "hello there"}\n{"prompt": "hello again", %s}\n' % extra)
    with pytest.raises(InputError) as err:
        load_trace(path)
    assert (err.value.file, err.value.line, err.value.field) == (str(path), 2, field)
    res = CliRunner().invoke(main, ["trace", "inspect", str(path)])
    assert res.exit_code == 2 and f"{path}:2" in res.output
