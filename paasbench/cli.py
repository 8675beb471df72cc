"""The ``paasbench`` command line.

Every subcommand lives in :mod:`paasbench.commands`, one module per command — except ``serve``, the reference
server's own command (:mod:`reference_server.cli`, so the server needs nothing of the harness) — imported only when the
command is looked up (its module imports little; numpy, pandas and aiohttp wait inside the command), so
``paasbench --help`` stays fast and one broken optional dependency cannot take down every command.
Each entry maps a command name to ``"module:attribute"`` of a click command or group.
"""

from __future__ import annotations

import atexit
import importlib
import signal
from typing import Any

import click

from paas_common.errors import EXIT_INTERRUPTED
from paasbench import __version__

COMMANDS: dict[str, str] = {
    "run": "paasbench.commands.run:run",
    "trace": "paasbench.commands.trace:trace",
    "sweep": "paasbench.commands.sweep:sweep",
    "report": "paasbench.commands.report:report",
    "compare": "paasbench.commands.report:compare",
    "gate": "paasbench.commands.gate:gate",
    "ab": "paasbench.commands.ab:ab",
    "serve": "reference_server.cli:serve",   # the server's own command (it imports no paasbench)
    "kv-size": "paasbench.commands.sim:kv_size",
    "calibrate": "paasbench.commands.sim:calibrate",
    "plan": "paasbench.commands.plan:plan",
    "plan-curves": "paasbench.commands.plan:plan_curves",
}


def _ignore_ctrl_c_in_teardown() -> None:
    """Ctrl-C once the command is over (its outputs written, its exit status chosen) leaves that status alone.

    CPython puts SIGINT back to the default action (die by the signal) when it tears the interpreter down,
    after the exit handlers and before it destroys the modules, which takes tens of milliseconds with numpy
    and pandas loaded. A Ctrl-C in that window killed a finished run by the signal (status -2, with no
    message), where a moment earlier it would have exited 130 with one and a moment later with the run's own
    status. Registered at import, so it runs after every other exit handler (they run in reverse order).
    """
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:   # not the main thread (an embedding program's exit): nothing of ours to protect
        pass


atexit.register(_ignore_ctrl_c_in_teardown)


class LazyGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # Ctrl-C while a command loads or before it handles it: 130, not click's 1
            click.echo("interrupted (exit 130)", err=True)
            ctx.exit(EXIT_INTERRUPTED)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except ImportError as exc:  # a missing optional dependency must not break the other commands
            return _unavailable(name, exc)


def _unavailable(name: str, exc: ImportError) -> click.Command:
    def fail() -> None:
        raise click.ClickException(f"'{name}' is unavailable: {exc}")

    return click.Command(name, callback=fail, help=f"(unavailable: {exc})")


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="paasbench")
def main() -> None:
    """Benchmark Prefill-as-a-Service LLM serving: replay agent traces, gate on SLOs, price the result."""
