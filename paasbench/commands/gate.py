"""``paasbench gate``: judge CURRENT results against BASELINE results metric by metric (:mod:`paasbench.gate.compare`),
print the Markdown verdict, write it as Markdown/HTML, annotate a GitHub Actions job; exit 99 on a regression
or an SLO breach, 3 when a change beyond the tolerance is undecided."""

from __future__ import annotations

import os
from pathlib import Path

import click

from paas_common.errors import InputError, SLOBreach, Undecided


@click.command("gate")
@click.option("--baseline", required=True, multiple=True, metavar="PATH|GLOB",
              help="Baseline results: run or sweep directories, summary.json / sweep.json files or a committed "
                   "baseline JSON; globs (quoted) and repeats give several results. Repeatable.")
@click.option("--current", required=True, multiple=True, metavar="PATH|GLOB",
              help="Results to judge (same forms as --baseline). Repeatable.")
@click.option("--tolerance", default="5%", show_default=True,
              help="Allowed change of the median in the worse direction, relative: '5%' or 0.05.")
@click.option("--metric-tolerance", multiple=True, metavar="METRIC=TOL",
              help="Per-metric tolerance, e.g. 'ttft_ms.p99=20%' or 'modeled_*=5%' (glob). Repeatable; later wins.")
@click.option("--metric", "metrics", multiple=True, metavar="METRIC",
              help="Compare only these metrics or globs (default: every gated headline metric). Repeatable.")
@click.option("--confidence", default="95%", show_default=True, help="Level of the Student-t interval on each change (Holm-corrected across metrics).")
@click.option("--paired", is_flag=True,
              help="The i-th baseline and i-th current results ran back to back (`paasbench ab` rounds): compare "
                   "round by round, so load shared by both runs of a round drops out.")
@click.option("--slo", "slo_specs", multiple=True, help="Also judge the current results against these SLO gates.")
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the Markdown verdict here too.")
@click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the verdict as a self-contained HTML page here.")
@click.option("--compare-at", type=click.Choice(["reference", "best"]), default="reference", show_default=True,
              help="Sweeps: compare per-run figures at a reference load below capacity (<= 60% of the baseline's "
                   "best load) or at the baseline's best load.")
@click.option("--report-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Also render the first baseline vs the first current result side by side: DIR/compare.html, .md.")
def gate(baseline: tuple[str, ...], current: tuple[str, ...], tolerance: str, metric_tolerance: tuple[str, ...],
         metrics: tuple[str, ...], confidence: str, paired: bool, slo_specs: tuple[str, ...], md_out: Path | None,
         html_out: Path | None, compare_at: str, report_dir: Path | None) -> None:
    """Compare CURRENT to BASELINE metric by metric; exit 99 on a regression beyond the tolerance or an SLO breach,
    3 when a change beyond the tolerance could not be decided either way by the results given (more would).

    With GITHUB_ACTIONS=true, prints ::error annotations and appends the Markdown to $GITHUB_STEP_SUMMARY.
    """
    from paasbench.gate.compare import annotations, compare, html_page, load_side, markdown, metric_tolerances, parse_tolerance
    from paasbench.metrics import slo

    tol = parse_tolerance(tolerance)
    level = parse_tolerance(confidence, what="--confidence")
    if not 0 < level < 1:
        raise InputError(f"--confidence '{confidence}' must lie between 0% and 100%")
    gates = slo.parse_gates(list(slo_specs))
    bases, curs = load_side(baseline, "baseline"), load_side(current, "current")
    result = compare(bases, curs, tol, per_metric=metric_tolerances(metric_tolerance), metrics=list(metrics) or None,
                     gates=gates or None, at=compare_at, confidence=level, paired=paired)
    if report_dir is not None:
        from paasbench.report.render import render_compare

        render_compare([bases[0], curs[0]], report_dir, title="paasbench gate: baseline vs current",
                       gates=gates or None)
    b_label, c_label = " ".join(baseline), " ".join(current)
    text = markdown(result, b_label, c_label)
    click.echo(text)
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    for path, body in ((md_out, text), (html_out, html_page(result, b_label, c_label) if html_out else "")):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body, encoding="utf-8")
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for line in annotations(result):
            click.echo(line)
        _append_env_file("GITHUB_STEP_SUMMARY", text)
        _append_env_file("GITHUB_OUTPUT", f"passed={str(result.passed).lower()}\n"
                                          f"regressions={len(result.regressions)}\n"
                                          f"undecided={len(result.undecided)}\n")
    if result.failed:
        parts = [f"{len(result.regressions)} regression(s)"] if result.regressions else []
        parts += result.problems
        if result.verdict is not None and not result.verdict.passed:
            parts.append(f"{len(result.verdict.failures)} SLO gate(s) failed")
        raise SLOBreach("performance gate failed: " + ", ".join(parts))
    if result.undecided:
        names = ", ".join(c.metric.label for c in result.undecided)
        raise Undecided(f"performance gate undecided (exit 3): {len(result.undecided)} change(s) beyond the tolerance "
                        f"that {result.n_base} vs {result.n_cur} results could not decide: {names}; give more "
                        "results a side (the verdict says about how many)")


def _append_env_file(var: str, text: str) -> None:
    path = os.environ.get(var)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text if text.endswith("\n") else text + "\n")
