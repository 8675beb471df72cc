"""Render reports: one jinja2 environment, templates and CSS shipped as package data (importlib.resources), so
a non-editable install renders the same self-contained HTML as a checkout."""

from __future__ import annotations

import datetime as _dt
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Sequence

import jinja2

from paas_common.errors import InputError
from paasbench import __version__
from paasbench.metrics import slo
from paasbench.cost.table import CostInputs
from paasbench.report.compare import compare_context
from paasbench.report.load import Result, load_result
from paasbench.report.sections import section

PathLike = str | os.PathLike[str]


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    templates = resources.files("paasbench.report") / "templates"
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: (templates / name).read_text(encoding="utf-8")),
        autoescape=jinja2.select_autoescape(["html", "html.jinja"], default_for_string=False),
        undefined=jinja2.StrictUndefined, trim_blocks=False, lstrip_blocks=False, keep_trailing_newline=True,
    )
    env.filters["mdcell"] = lambda v: str(v).replace("|", "\\|").replace("\n", " ")
    return env


def _css() -> str:
    return (resources.files("paasbench.report") / "templates" / "style.css").read_text(encoding="utf-8")


def _write(out_dir: PathLike, stem: str, html: str, md: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    html_path, md_path = out / f"{stem}.html", out / f"{stem}.md"
    html_path.write_text(html, encoding="utf-8")
    md_path.write_text(md, encoding="utf-8")
    return html_path, md_path


def _common(title: str) -> dict:
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"title": title, "generated": now, "version": __version__, "css": _css()}


def _load_all(results: Sequence[PathLike | Result]) -> list[Result]:
    if not results:
        raise InputError("no results given")
    return [r if not isinstance(r, (str, os.PathLike)) else load_result(r) for r in results]


def render(results: Sequence[PathLike | Result], out_dir: PathLike, *, title: str | None = None,
           cost_inputs: CostInputs | None = None, gates: Sequence[slo.Gate] | None = None,
           stem: str = "report") -> tuple[Path, Path]:
    """Render ``OUT/report.html`` and ``OUT/report.md`` for run and/or sweep directories.

    ``gates`` overrides the SLO each result recorded (a sweep's ``slo``); ``cost_inputs`` the default prices.
    """
    loaded = _load_all(results)
    ctx = _common(title or "paasbench report: " + ", ".join(r.name for r in loaded))
    ctx["sections"] = [section(r, list(gates or []), cost_inputs) for r in loaded]
    env = _env()
    return _write(out_dir, stem, env.get_template("report.html.jinja").render(ctx),
                  env.get_template("report.md.jinja").render(ctx))


def render_compare(results: Sequence[PathLike | Result], out_dir: PathLike, *, title: str | None = None,
                   cost_inputs: CostInputs | None = None, gates: Sequence[slo.Gate] | None = None,
                   stem: str = "compare") -> tuple[Path, Path]:
    """Render ``OUT/compare.html`` and ``OUT/compare.md``: the first result is the baseline."""
    loaded = _load_all(results)
    if len(loaded) < 2:
        raise InputError("compare needs at least two results")
    names = [r.name for r in loaded]
    for i, r in enumerate(loaded):  # two runs called "run" would make an ambiguous table
        if names.count(r.name) > 1:
            r.name = f"{r.name}#{i + 1}"
    ctx = _common(title or "paasbench compare: " + " vs ".join(r.name for r in loaded))
    ctx["c"] = compare_context(loaded, list(gates or []), cost_inputs)
    env = _env()
    return _write(out_dir, stem, env.get_template("compare.html.jinja").render(ctx),
                  env.get_template("compare.md.jinja").render(ctx))


def render_pages(template: str, title: str, ctx: dict, out_dir: PathLike, stem: str) -> tuple[Path, Path]:
    """``OUT/STEM.html`` and ``OUT/STEM.md`` from ``TEMPLATE.html.jinja`` / ``TEMPLATE.md.jinja`` with ``ctx`` (and
    the title, time, version and CSS every page has): how another part (the plan report) renders its own page."""
    env = _env()
    full = {**_common(title), **ctx}
    return _write(out_dir, stem, env.get_template(f"{template}.html.jinja").render(full),
                  env.get_template(f"{template}.md.jinja").render(full))
