"""Every registered subcommand imports and answers --help: a missing module or dependency shows up here,
not as a silent '(unavailable)' entry in `paasbench --help`."""

from __future__ import annotations

import importlib

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
