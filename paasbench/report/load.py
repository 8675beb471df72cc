"""Recorded results, as the report, compare and gate read them: a run directory or a sweep directory.

* run: ``DIR/summary.json`` (+ ``DIR/records.jsonl`` for CDFs), or a ``summary.json`` file itself;
* sweep: ``DIR/sweep.json`` (+ ``DIR/step-NNN/``), or a ``sweep.json`` file itself.

Any JSON file whose ``schema`` says ``paasbench.summary/…`` or ``paasbench.sweep/…`` (a committed baseline, say)
loads the same way; a file that is neither is an :class:`InputError`, never an empty report.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paas_common.errors import InputError


def shown_path(path: Path | str) -> str:
    """A result's path as a report names it: relative to where the command runs, never this machine's
    absolute path (a report is shared; ``/home/ci/work/...`` means nothing to its reader)."""
    p = str(path)
    if not os.path.isabs(p):
        return p
    try:
        return os.path.relpath(p)
    except ValueError:          # another drive (Windows): nothing relative exists
        return Path(p).name


@dataclass(slots=True)
class RunResult:
    name: str
    path: Path                       # the directory (or file) it came from
    summary: dict[str, Any]
    records_path: Path | None = None  # records.jsonl, when present next to the summary
    verdict: dict[str, Any] | None = None  # as recorded by a sweep step

    @property
    def meta(self) -> dict[str, Any]:
        return self.summary.get("meta") or {}


@dataclass(slots=True)
class SweepResult:
    name: str
    path: Path
    data: dict[str, Any]
    steps: list[RunResult] = field(default_factory=list)
    step_loads: list[dict[str, Any]] = field(default_factory=list)   # {kind, value} per step
    step_passed: list[bool | None] = field(default_factory=list)

    @property
    def meta(self) -> dict[str, Any]:
        return self.data.get("meta") or {}

    @property
    def slo(self) -> list[str]:
        return list(self.data.get("slo") or [])

    @property
    def best(self) -> RunResult | None:
        """The step the sweep named best (highest passing load), or None when no step passed."""
        best = self.data.get("best") or {}
        index = best.get("index")
        for step, load in zip(self.steps, self.step_loads):
            if load.get("index") == index:
                return step
        return None

    @property
    def capacity_is_floor(self) -> bool:
        """The sweep's capacity is a lower bound: every load it tried passed before it stopped (its time
        budget or step limit), so the true max input TPM lies above the figure."""
        return bool((self.data.get("best") or {}).get("lower_bound"))

    @property
    def max_input_tpm(self) -> float | None:
        best = self.data.get("best") or {}
        value = best.get("input_tpm")
        if value is None and self.best is not None:
            value = self.best.summary.get("input_tpm")
        return value


Result = RunResult | SweepResult


def load_result(path: str | Path, name: str | None = None) -> Result:
    path = Path(path)
    if path.is_dir():
        if (path / "sweep.json").is_file():
            return _sweep(path / "sweep.json", name)
        if (path / "summary.json").is_file():
            return _run(path / "summary.json", name)
        raise InputError("not a result: no summary.json or sweep.json in it", file=str(path))
    if not path.is_file():
        raise InputError("no such result file or directory", file=str(path))
    data = _read_json(path)
    schema = str(data.get("schema", ""))
    if schema.startswith("paasbench.sweep") or "steps" in data:
        return _sweep(path, name, data)
    if schema.startswith("paasbench.summary") or "ttft_ms" in data:
        return _run(path, name, data)
    raise InputError("not a paasbench summary or sweep (no 'schema', 'ttft_ms' or 'steps')", file=str(path))


def headline(result: Result) -> RunResult | None:
    """The one run that stands for a result: a run itself, or a sweep's best step."""
    return result if isinstance(result, RunResult) else result.best


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", file=str(path)) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON: {exc.msg}", file=str(path), line=exc.lineno) from None
    if not isinstance(data, dict):
        raise InputError("expected a JSON object", file=str(path))
    return data


def _default_name(path: Path) -> str:
    folder = path.parent if path.name in ("summary.json", "sweep.json") else path
    return folder.name if path.name in ("summary.json", "sweep.json") else path.stem


def _run(summary_path: Path, name: str | None, data: dict[str, Any] | None = None) -> RunResult:
    summary = data if data is not None else _read_json(summary_path)
    records = summary_path.parent / "records.jsonl"
    return RunResult(name or _default_name(summary_path), summary_path.parent, summary,
                     records if records.is_file() else None)


def _sweep(sweep_path: Path, name: str | None, data: dict[str, Any] | None = None) -> SweepResult:
    data = data if data is not None else _read_json(sweep_path)
    steps = data.get("steps")
    if not isinstance(steps, list):
        raise InputError("a sweep needs a 'steps' list", file=str(sweep_path), field="steps")
    sweep = SweepResult(name or _default_name(sweep_path), sweep_path.parent, data)
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise InputError("each step is an object", file=str(sweep_path), field=f"steps[{i}]")
        step_dir = sweep_path.parent / str(step.get("dir", f"step-{i:03d}"))
        summary = step.get("summary")
        if summary is None and (step_dir / "summary.json").is_file():
            summary = _read_json(step_dir / "summary.json")
        if not isinstance(summary, dict):
            raise InputError("step has no summary", file=str(sweep_path), field=f"steps[{i}].summary")
        records = step_dir / "records.jsonl"
        sweep.steps.append(RunResult(f"step-{step.get('index', i):03d}", step_dir, summary,
                                     records if records.is_file() else None, step.get("verdict")))
        load = dict(step.get("load") or {})
        load["index"] = step.get("index", i)
        sweep.step_loads.append(load)
        sweep.step_passed.append(step.get("passed"))
    return sweep
