"""``paasbench report`` and ``paasbench compare``: the same options, two renderers."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import click

from paasbench import slo
from paasbench.cost import load_cost_inputs


def _command(name: str, stem: str, doc: str, renderer: Callable[[], Callable]) -> click.Command:
    @click.command(name, help=doc)
    @click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
    @click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
                  help=f"Directory for {stem}.html and {stem}.md.")
    @click.option("--title", help="Report title.")
    @click.option("--slo", "slo_specs", multiple=True,
                  help="Gate(s) to judge by, overriding the recorded ones: 'p50(ttft) <= 6000ms', "
                       "'preset:white-paper' or a YAML file. Repeatable.")
    @click.option("--cost-inputs", type=click.Path(dir_okay=False, path_type=Path),
                  help="YAML file of cost inputs (prices, hardware); see docs/cost.md.")
    def cmd(results: tuple[Path, ...], out_dir: Path, title: str | None, slo_specs: tuple[str, ...],
            cost_inputs: Path | None) -> None:
        html, md = renderer()(list(results), out_dir, title=title, cost_inputs=load_cost_inputs(cost_inputs),
                              gates=slo.parse_gates(list(slo_specs)) or None)
        click.echo(f"wrote {html}\nwrote {md}")

    return cmd


def _render() -> Callable:
    from paasbench.report.render import render  # imported on use: `paasbench --help` stays fast

    return render


def _render_compare() -> Callable:
    from paasbench.report.render import render_compare

    return render_compare


report = _command("report", "report", "Render a self-contained HTML report and a Markdown report from run and/or "
                  "sweep directories.", _render)
compare = _command("compare", "compare", "Put runs or sweeps side by side (the first is the baseline), with deltas, "
                   "as HTML and Markdown.", _render_compare)
