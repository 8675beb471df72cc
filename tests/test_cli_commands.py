"""Every registered subcommand imports and answers --help: a missing module or dependency shows up here,
not as a silent '(unavailable)' entry in `paasbench --help`."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from paasbench.cli import COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_imports_and_has_help(name: str) -> None:
    module_name, attr = COMMANDS[name].split(":")
    command = getattr(importlib.import_module(module_name), attr)
    assert isinstance(command, click.Command)
    result = CliRunner().invoke(main, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["no-such-command"])
    assert result.exit_code == 2


def test_help_imports_no_heavy_library() -> None:
    """`paasbench --help` looks up every command for its one-line help: that must not load numpy, pandas, aiohttp
    or jinja2 (each command imports them inside its body). Before paasbench/commands/ it loaded numpy, pandas and
    jinja2 (~1.4 s vs ~0.4 s on the shared 2-core box)."""
    code = ("import sys; from click.testing import CliRunner; from paasbench.cli import main; "
            "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('numpy', 'pandas', 'aiohttp', 'jinja2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
