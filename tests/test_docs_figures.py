"""scripts/docs_figures.py: every figure the docs state has a row in docs/figures.yaml (its command, or a setting),
and the check fails, naming doc, line and figure, on one that has none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "docs_figures.py"
sys.path.insert(0, str(ROOT / "scripts"))

import docs_figures  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_every_figure_in_the_docs_is_registered():
    res = _run()
    assert res.returncode == 0, res.stderr
    assert "0 problem(s)" in res.stdout


def _tree(tmp_path: Path, doc: str, registry: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "README.md").write_text("# x\n")
    (tmp_path / "docs" / "a.md").write_text(doc)
    (tmp_path / "docs" / "figures.yaml").write_text(registry)
    return tmp_path


def test_an_unregistered_figure_fails_with_doc_line_and_figure(tmp_path):
    root = _tree(tmp_path, "# A\n\nThe client streams 7.2–7.4 µs per token.\nIt held 900 streams for 12.5 s.\n",
                 'docs/a.md:\n  - {figure: "7.2–7.4 µs", source: "python benchmarks/client_capacity.py"}\n')
    res = _run("--root", str(root))
    assert res.returncode == 1
    assert "docs/a.md:4: figure '12.5 s' is not in docs/figures.yaml" in res.stderr
    assert "7.2–7.4" not in res.stderr and "900" not in res.stderr     # registered; a count without a unit
    stub = _run("--root", str(root), "--stub").stdout
    assert stub == 'docs/a.md:\n  - {figure: "12.5 s", source: "TODO: command"}\n'


def test_a_row_whose_figure_left_its_doc_fails(tmp_path):
    root = _tree(tmp_path, "Nothing measured here.\n",
                 'docs/a.md:\n  - {figure: "18%", source: "unverified: no record"}\n')
    res = _run("--root", str(root))
    assert res.returncode == 1 and "docs/a.md: figure '18%' is no longer stated in docs/a.md" in res.stderr


def test_strict_fails_on_figures_still_waiting_for_a_command(tmp_path):
    root = _tree(tmp_path, "Up to 18% within a round.\n",
                 'docs/a.md:\n  - {figure: "18%", source: "unverified: no record"}\n')
    assert _run("--root", str(root)).returncode == 0
    res = _run("--root", str(root), "--strict")
    assert res.returncode == 1 and "figure '18%' has no command yet" in res.stderr


def test_what_counts_as_a_figure(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("1.81M input TPM at 9 req/s; 657.8K; p50 6,000 ms; 2 × 16 cards; 64K bucket; 1.40×\n"
                   "`--step-duration 45s` and v0.1.0, section 3, 2026, 10% (±31%)\n"
                   "```\npaasbench sweep --time-budget 900s\n```\n")
    got = [f.text for f in docs_figures.figures(doc, tmp_path)]
    assert got == ["1.81M input TPM", "9 req/s", "657.8K", "6,000 ms", "2 ×", "1.40×", "10%", "±31%"]


def test_a_doc_listed_twice_in_the_registry_is_named(tmp_path):
    root = _tree(tmp_path, "It took 12.5 s.\n", 'docs/a.md:\n  - {figure: "12.5 s", source: "x"}\n'
                                                  'docs/a.md:\n  - {figure: "1 s", source: "y"}\n')
    res = _run("--root", str(root))
    assert res.returncode == 1 and "figures.yaml:3: 'docs/a.md' is already a key at line 1" in res.stderr


def test_a_figure_is_checked_against_the_committed_file_that_keeps_it(tmp_path):
    root = _tree(tmp_path, "It served 1.81M input TPM at 88.8% hit, TTFT 5,277 ms, weights 743 GB.\n",
                 'docs/a.md:\n'
                 '  - {figure: "1.81M input TPM", source: "x", json: "reports/s.json#best.tpm"}\n'
                 '  - {figure: "88.8%", source: "x", json: "reports/s.json#steps.1.hit", scale: 100}\n'
                 '  - {figure: "5,277 ms", source: "x", json: "reports/s.json#steps.0.ttft"}\n'
                 '  - {figure: "743 GB", source: "x", json: "reports/s.json#gb"}\n')
    (root / "reports" / "s.json").write_text('{"best": {"tpm": 1812572.0}, "gb": 742.95, '
                                             '"steps": [{"ttft": 5276.6}, {"hit": 0.8883}]}')
    assert _run("--root", str(root)).returncode == 0
    (root / "reports" / "s.json").write_text('{"best": {"tpm": 1816000.0}, "gb": 742.95, '
                                             '"steps": [{"ttft": 5277.6}, {"hit": 0.8873}]}')
    res = _run("--root", str(root))
    assert res.returncode == 1
    assert "'1.81M input TPM': reports/s.json#best.tpm holds 1.816e+06, which does not round" in res.stderr
    assert "'88.8%': reports/s.json#steps.1.hit holds 88.73" in res.stderr
    assert "'5,277 ms': reports/s.json#steps.0.ttft holds 5277.6" in res.stderr
    assert "743 GB" not in res.stderr          # GB is a unit, not a G suffix
    (root / "reports" / "s.json").write_text('{"searches": {"64": {"from": "the bound 3.41 req/s at 64K"}}}')
    (root / "docs" / "a.md").write_text("It started below the bound of 3.14 req/s.\n")
    (root / "docs" / "figures.yaml").write_text(
        'docs/a.md:\n  - {figure: "3.14 req/s", source: "x", json: "reports/s.json#searches.64.from"}\n')
    assert "says 'the bound 3.41 req/s at 64K', which does not state 3.14 req/s" in _run("--root", str(root)).stderr
    (root / "reports" / "s.json").unlink()
    assert ("cannot read reports/s.json#searches.64.from: No such file or directory"
            in _run("--root", str(root)).stderr)
