"""Errors and exit codes shared by every command.

Exit codes are part of the public contract (CI pipelines branch on them):

* ``0``  success, every SLO gate passed
* ``1``  the run itself failed (target unreachable, every request failed, internal error)
* ``2``  usage or configuration error: bad flag, malformed trace/spec/SLO (click also uses 2)
* ``3``  undecided: ``paasbench gate`` saw a change beyond the tolerance that its results could not decide either
  way (more results would; Nagios's UNKNOWN is 3); a breach (99) outranks it
* ``99`` an SLO gate or regression gate was breached (k6's convention, so existing CI habits carry over)
* ``130`` interrupted (SIGINT/SIGTERM: the shell's convention); what finished is on disk
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import click

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_CONFIG = 2
EXIT_UNDECIDED = 3
EXIT_SLO_BREACH = 99
EXIT_INTERRUPTED = 130


class InputError(click.ClickException):
    """Bad user input, located as precisely as we can: file, line, field.

    Raised by every parser (traces, workload specs, SLO expressions, cost inputs) so the CLI
    prints one consistent message and exits with :data:`EXIT_CONFIG`.
    """

    exit_code = EXIT_CONFIG

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        self.file, self.line, self.field, self.reason = file, line, field, message
        super().__init__(self.located())

    def located(self) -> str:
        where = []
        if self.file is not None:
            where.append(str(self.file) + (f":{self.line}" if self.line is not None else ""))
        elif self.line is not None:
            where.append(f"line {self.line}")
        if self.field is not None:
            where.append(f"field '{self.field}'")
        return (": ".join([", ".join(where), self.reason])) if where else self.reason


class RunFailed(click.ClickException):
    """The run measured nothing a verdict could rest on (target unreachable, every request failed)."""

    exit_code = EXIT_RUN_FAILED


class Undecided(click.ClickException):
    """The gate could not decide a change beyond its tolerance; the verdict says what would decide it."""

    exit_code = EXIT_UNDECIDED


class SLOBreach(click.ClickException):
    """One or more gates failed; the verdict has already been printed and written."""

    exit_code = EXIT_SLO_BREACH


@contextmanager
def input_errors(field: str | Callable[[Exception], str | None] | None = None,
                 catch: type[Exception] | tuple[type[Exception], ...] = ValueError) -> Iterator[None]:
    """Re-raise a library's ``catch`` exception as an :class:`InputError` naming ``field`` (exit 2, one line).

    How every command maps a library's complaint about its input to the exit-code contract: the library raises
    its own exception (``ValueError`` unless told), the command names the flag it came from. ``field`` may be a
    function of the exception (several flags feed one library call).
    """
    try:
        yield
    except catch as exc:
        raise InputError(str(exc), field=field(exc) if callable(field) else field) from None
