"""``paasbench ab``: installs A and B measured interleaved on this machine (:mod:`paasbench.gate.ab`), their runs
written for ``paasbench gate --paired``; exit 1 when a side's server or run fails."""

from __future__ import annotations

import time
from pathlib import Path

import click

from paas_common.lifetime import sigterm_unwinds
from paasbench.gate.ab import PROBES, WORKLOAD


@click.command("ab")
@click.option("--a", "a_env", required=True, help="Side A (the base): a virtualenv directory or its python.")
@click.option("--b", "b_env", required=True, help="Side B (the candidate): a virtualenv directory or its python.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Output directory.")
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(min=1), help="A B rounds per probe.")
@click.option("--probe", "probes", multiple=True, type=click.Choice(list(PROBES)),
              help="What to measure (default: every probe). Repeatable.")
@click.option("--requests", default=40, show_default=True, type=click.IntRange(min=2),
              help="Requests per run (closed loop, concurrency 1).")
@click.option("--workload", default=WORKLOAD, show_default=True, help="Workload spec the runs replay.")
@click.option("--a-server-arg", multiple=True, metavar="NAME=VALUE", help="Extra reference-server flag for side A.")
@click.option("--b-server-arg", multiple=True, metavar="NAME=VALUE",
              help="Extra reference-server flag for side B, e.g. debug-reuse-shortfall=1 (a KV-reuse regression the twin gate must catch).")
@click.option("--b-client-env", multiple=True, metavar="NAME=VALUE",
              help="Environment variable for side B's paasbench runs, e.g. PAASBENCH_DEBUG_CLIENT_SLOWDOWN=0.2 (the test "
                   "hooks of docs/performance.md) to check the gate catches a slower client.")
@click.option("--probe-rounds", multiple=True, metavar="PROBE=N",
              help="Rounds for one probe instead of --rounds, e.g. client=3.")
def ab(a_env: str, b_env: str, out: Path, rounds: int, probes: tuple[str, ...], requests: int, workload: str,
       a_server_arg: tuple[str, ...], b_server_arg: tuple[str, ...], b_client_env: tuple[str, ...],
       probe_rounds: tuple[str, ...]) -> None:
    """Run installs A and B interleaved on this machine (A B A B …) and write their runs for `paasbench gate`."""
    from paasbench.gate.ab import Side, client_env, probe_round_counts, resolve_python, run_ab, server_flags

    a = Side("A", resolve_python(a_env, "--a"), server_flags(a_server_arg))
    b = Side("B", resolve_python(b_env, "--b"), server_flags(b_server_arg), client_env(b_client_env, "--b-client-env"))
    t0 = time.monotonic()
    with sigterm_unwinds():   # the running round's server is stopped
        run_ab(a, b, out, rounds=rounds, probes=list(probes) or list(PROBES), requests=requests, workload=workload,
               rounds_by_probe=probe_round_counts(probe_rounds), log=lambda line: click.echo(line, err=True))
    click.echo(f"A/B: {rounds} round(s) in {time.monotonic() - t0:.0f} s -> {out}", err=True)

