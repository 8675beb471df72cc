"""``paasbench report`` and ``paasbench compare``: the same options, two renderers (:mod:`paasbench.report.render`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import click

F = Callable[..., Any]


def _report_options(stem: str) -> Callable[[F], F]:
    """RESULTS..., ``--out``, ``--title``, ``--slo``, ``--cost-inputs``: what both commands take."""
    def decorate(f: F) -> F:
        for opt in reversed([
            click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path)),
            click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
                         help=f"Directory for {stem}.html and {stem}.md."),
            click.option("--title", help="Report title."),
            click.option("--slo", "slo_specs", multiple=True,
                         help="Gate(s) to judge by, overriding the recorded ones: 'p50(ttft) <= 6000ms', "
                              "'preset:white-paper' or a YAML file. Repeatable."),
            click.option("--cost-inputs", type=click.Path(dir_okay=False, path_type=Path),
                         help="YAML file of cost inputs (prices, hardware); see docs/cost.md."),
        ]):
            f = opt(f)
        return f
    return decorate


def _render(renderer: Callable[..., tuple[Path, Path]], results: tuple[Path, ...], out_dir: Path,
            title: str | None, slo_specs: tuple[str, ...], cost_inputs: Path | None) -> None:
    from paasbench.cost.table import load_cost_inputs
    from paasbench.metrics import slo

    html, md = renderer(list(results), out_dir, title=title, cost_inputs=load_cost_inputs(cost_inputs),
                        gates=slo.parse_gates(list(slo_specs)) or None)
    click.echo(f"wrote {html}\nwrote {md}")


@click.command("report")
@_report_options("report")
def report(**o: Any) -> None:
    """Render a self-contained HTML report and a Markdown report from run and/or sweep directories."""
    from paasbench.report.render import render  # imported on use: `paasbench --help` stays fast

    _render(render, **o)


@click.command("compare")
@_report_options("compare")
def compare(**o: Any) -> None:
    """Put runs or sweeps side by side (the first is the baseline), with deltas, as HTML and Markdown."""
    from paasbench.report.render import render_compare

    _render(render_compare, **o)
