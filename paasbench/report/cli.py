"""``paasbench report`` and ``paasbench compare``."""

from __future__ import annotations

from pathlib import Path

import click

from paasbench import slo
from paasbench.cost import load_cost_inputs

_slo_option = click.option("--slo", "slo_specs", multiple=True,
                           help="Gate(s) to judge by, overriding the recorded ones: 'p50(ttft) <= 6000ms', "
                                "'preset:white-paper' or a YAML file. Repeatable.")
_cost_option = click.option("--cost-inputs", type=click.Path(dir_okay=False, path_type=Path),
                            help="YAML file of cost inputs (prices, hardware); see docs/cost.md.")


@click.command("report")
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for report.html and report.md.")
@click.option("--title", help="Report title.")
@_slo_option
@_cost_option
def report(results: tuple[Path, ...], out_dir: Path, title: str | None, slo_specs: tuple[str, ...],
           cost_inputs: Path | None) -> None:
    """Render a self-contained HTML report and a Markdown report from run and/or sweep directories."""
    from paasbench.report.render import render

    html, md = render(list(results), out_dir, title=title, cost_inputs=load_cost_inputs(cost_inputs),
                      gates=slo.parse_gates(list(slo_specs)) or None)
    click.echo(f"wrote {html}\nwrote {md}")


@click.command("compare")
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for compare.html and compare.md.")
@click.option("--title", help="Report title.")
@_slo_option
@_cost_option
def compare(results: tuple[Path, ...], out_dir: Path, title: str | None, slo_specs: tuple[str, ...],
            cost_inputs: Path | None) -> None:
    """Put runs or sweeps side by side (the first is the baseline), with deltas, as HTML and Markdown."""
    from paasbench.report.render import render_compare

    html, md = render_compare(list(results), out_dir, title=title, cost_inputs=load_cost_inputs(cost_inputs),
                              gates=slo.parse_gates(list(slo_specs)) or None)
    click.echo(f"wrote {html}\nwrote {md}")
