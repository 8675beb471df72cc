"""Mooncake JSONL reading/writing: validation errors located by file/line/field, --lenient, round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from paas_common.errors import EXIT_CONFIG, InputError
from paasbench.cli import main
from paasbench.trace import load_trace
from paasbench.trace.mooncake import read_trace, write_trace

FIX = Path(__file__).parent / "fixtures" / "trace"
GOOD = '{"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1, 2]}'

# (bad second line, field the error must name; None = no field, e.g. broken JSON)
BAD_LINES = [
    ('{"timestamp": 5, "input_length": 8, "output_length": 2, "hash_ids": [1, 2]', None),  # malformed JSON
    ('[1, 2, 3]', None),                                                                      # not an object
    ('{"timestamp": 5, "output_length": 2, "hash_ids": [1, 2]}', "input_length"),            # missing
    ('{"timestamp": 5, "input_length": 8, "output_length": 2}', "hash_ids"),                 # missing
    ('{"input_length": 8, "output_length": 2, "hash_ids": [1, 2]}', "timestamp"),            # missing
    ('{"timestamp": 5, "input_length": -8, "output_length": 2, "hash_ids": []}', "input_length"),
    ('{"timestamp": 5, "input_length": 8, "output_length": -1, "hash_ids": [1, 2]}', "output_length"),
    ('{"timestamp": 5, "input_length": 8, "output_length": 2, "hash_ids": [1, 2, 3]}', "hash_ids"),
    ('{"timestamp": 5, "input_length": 9, "output_length": 2, "hash_ids": [1, 2]}', "hash_ids"),
    ('{"timestamp": 5, "input_length": 8, "output_length": 2, "hash_ids": [1, "b"]}', "hash_ids"),
    ('{"timestamp": "5", "input_length": 8, "output_length": 2, "hash_ids": [1, 2]}', "timestamp"),
    ('{"timestamp": 5, "input_length": 8.5, "output_length": 2, "hash_ids": [1, 2]}', "input_length"),
]


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("line,field", BAD_LINES)
def test_bad_line_names_file_line_field(tmp_path: Path, line: str, field: str | None) -> None:
    path = _write(tmp_path, GOOD, line)
    with pytest.raises(InputError) as err:
        read_trace(path, block_size=4)
    assert err.value.file == str(path)
    assert err.value.line == 2
    assert err.value.field == field
    assert f"{path}:2" in str(err.value.format_message())


def test_a_cut_line_is_located_at_its_real_column(tmp_path: Path) -> None:
    # before: a line truncated after 1,145 characters got "malformed JSON ... at column 1": the line was parsed
    # with its newline, so the parser's error fell on its second line, and only that line's column was printed
    ids = list(range(1, 300))
    whole = json.dumps({"timestamp": 5, "input_length": len(ids) * 4, "output_length": 2, "hash_ids": ids})
    cut = whole[:1145]
    with pytest.raises(InputError) as err:
        read_trace(_write(tmp_path, GOOD, cut), block_size=4)
    assert err.value.line == 2
    assert "at column 1,146, the end of the line (1,145 characters): is it cut short?" in err.value.reason
    bad = whole.replace('"output_length": 2', '"output_length" 2')   # broken inside the line
    with pytest.raises(InputError) as err:
        read_trace(_write(tmp_path, GOOD, bad), block_size=4)
    assert f"at column {bad.index(' 2,') + 2}" in err.value.reason   # the 2 where ':' was due and "cut short" not in err.value.reason


def test_timestamps_going_backwards(tmp_path: Path) -> None:
    late = GOOD.replace('"timestamp": 0', '"timestamp": 100')
    path = _write(tmp_path, late, GOOD)
    with pytest.raises(InputError) as err:
        read_trace(path, block_size=4)
    assert (err.value.line, err.value.field) == (2, "timestamp")
    assert "backwards" in err.value.reason


@pytest.mark.parametrize("line,field", BAD_LINES[:3] + BAD_LINES[7:8])
def test_cli_exits_2_with_location(tmp_path: Path, line: str, field: str | None) -> None:
    path = _write(tmp_path, GOOD, line)
    res = CliRunner().invoke(main, ["trace", "inspect", str(path), "--block-size", "4"])
    assert res.exit_code == EXIT_CONFIG
    assert f"{path}:2" in res.output
    if field:
        assert f"field '{field}'" in res.output


def test_block_size_must_match(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)  # 2 ids for 8 tokens: fine at 4, wrong at the default 512
    assert len(read_trace(path, block_size=4)) == 1
    with pytest.raises(InputError, match="block-size"):
        read_trace(path)


def test_lenient_skips_and_counts() -> None:
    tr = read_trace(FIX / "mixed_bad.jsonl", block_size=4, lenient=True)
    assert [r.arrival_ms for r in tr.requests] == [0.0, 4.0, 5.0]
    assert tr.meta["skipped_lines"] == 4
    lines = [int(r.split(":")[1].split(",")[0]) for r in tr.meta["skip_reasons"]]
    assert lines == [2, 3, 5, 7]
    with pytest.raises(InputError) as err:
        read_trace(FIX / "mixed_bad.jsonl", block_size=4)
    assert err.value.line == 2


def test_cli_lenient_reports_skipped() -> None:
    res = CliRunner().invoke(main, ["trace", "inspect", str(FIX / "mixed_bad.jsonl"), "--block-size", "4",
                                    "--lenient", "--json"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)
    assert stats["requests"] == 3 and stats["skipped_lines"] == 4


def test_round_trip_keeps_extra_fields(tmp_path: Path) -> None:
    tr = read_trace(FIX / "extras.jsonl")
    first, second, third = tr.requests
    assert first.extra == {"tenant": "acme", "meta": {"tags": ["x", "y"], "score": 0.5}}
    assert (second.session_id, second.turn, second.extra) == ("s1", 3, {"delay": 250})
    assert third.prompt == "literal text wins" and third.extra == {"note": None}
    out = tmp_path / "rt.jsonl"
    write_trace(tr, out)
    original = [json.loads(x) for x in (FIX / "extras.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert again == original
    assert out.read_text() == (FIX / "extras.jsonl").read_text()  # same key order, same bytes


def test_load_trace_dispatches_mooncake() -> None:
    tr = load_trace(FIX / "small.jsonl", block_size=4)
    assert tr.meta["format"] == "mooncake" and len(tr) == 5


@pytest.mark.parametrize("line, field", [('{"timestamp": 0, "input_length": 10, "output_length": 5}', "hash_ids"),
                                         ('{"timestamp": 0, "output_length": 5, "hash_ids": [0]}', "input_length")])
def test_a_mooncake_line_missing_a_field_is_named_as_such(tmp_path: Path, line: str, field: str) -> None:
    """Not "no prompt column ... pass --prompt-column", as if it were a prompt file."""
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InputError, match="missing required field") as err:
        load_trace(path)
    assert (err.value.file, err.value.line, err.value.field) == (str(path), 1, field)


def test_missing_file_is_input_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["trace", "inspect", str(tmp_path / "nope.jsonl")])
    assert res.exit_code == EXIT_CONFIG


def test_non_utf8_line_is_located_and_lenient_skips_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    later = GOOD.replace("0,", "2,", 1)
    path.write_bytes(f"{GOOD}\n".encode() + b'{"timestamp": 1, \xff\xfe}\n' + f"{later}\n".encode())
    res = CliRunner().invoke(main, ["trace", "inspect", str(path), "--block-size", "4"])
    assert res.exit_code == EXIT_CONFIG and f"{path}:2" in res.output and "UTF-8" in res.output
    tr = read_trace(path, block_size=4, lenient=True)
    assert len(tr) == 2 and tr.meta["skipped_lines"] == 1


def test_gen_to_an_unwritable_path_is_an_input_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = CliRunner().invoke(main, ["trace", "gen", "ci-small", "-o", str(blocker / "t.jsonl")])
    assert res.exit_code == EXIT_CONFIG and "cannot write trace" in res.output, res.output
