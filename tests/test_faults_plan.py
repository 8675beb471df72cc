"""The fault plan (reference_server/faults.py): which request gets which fault, deterministically."""

from __future__ import annotations

import json
import re

import pytest

from reference_server.faults import FaultInjector, FaultPlan, FaultSpecError


def kinds(plan: FaultPlan, n: int) -> list[str | None]:
    inj = FaultInjector(plan)
    return [(r.kind if (r := inj.draw()) else None) for _ in range(n)]


def test_every_nth_request():
    plan = FaultPlan.parse('{"rules": [{"kind": "http_503", "every": 3}]}')
    assert kinds(plan, 7) == [None, None, "http_503", None, None, "http_503", None]


def test_probabilities_are_seeded_and_capped():
    spec = {"seed": 7, "rules": [{"kind": "reset", "prob": 0.2}, {"kind": "stall", "prob": 0.1, "times": 3}]}
    a = kinds(FaultPlan.from_obj(spec), 2000)
    assert a == kinds(FaultPlan.from_obj(spec), 2000)                  # same seed, same faults
    assert a != kinds(FaultPlan.from_obj({**spec, "seed": 8}), 2000)
    assert a.count("stall") == 3                                        # capped
    assert 0.17 < a.count("reset") / 2000 < 0.23                        # ~20%
    inj = FaultInjector(FaultPlan.from_obj(spec))
    for _ in range(10):
        inj.draw()
    assert inj.state()["requests_seen"] == 10


def test_spec_from_a_file(tmp_path):
    p = tmp_path / "faults.json"
    p.write_text(json.dumps({"rules": [{"kind": "kill_decode", "every": 1, "after_tokens": 3}]}))
    assert FaultPlan.parse(str(p)).rules[0].after_tokens == 3


@pytest.mark.parametrize("spec, message", [
    ("{nope", "not JSON"),
    ('[1]', "must be an object"),
    ('{"rules": [{"kind": "explode", "every": 1}]}', "rules[0]: field 'kind': unknown fault 'explode'"),
    ('{"rules": [{"kind": "reset"}]}', "rules[0]: a rule needs 'every' or 'prob'"),
    ('{"rules": [{"kind": "reset", "prob": 1.5}]}', "rules[0]: field 'prob': must be in [0, 1]"),
    ('{"rules": [{"kind": "reset", "every": 1, "colour": 3}]}', "rules[0]: unknown field(s) colour"),
    ('{"rules": [{"kind": "reset", "prob": 0.6}, {"kind": "stall", "prob": 0.6}]}', "sum to more than 1"),
    ('{"seed": "x"}', "field 'seed'"),
])
def test_bad_specs_are_named(spec, message):
    with pytest.raises(FaultSpecError, match=re.escape(message)):
        FaultPlan.parse(spec)
