"""Command-line value types and options shared by the commands.

Why: click's ``float`` accepts ``nan`` and ``inf``, and a NaN rate or duration then fails deep inside
trace generation with a bare ``ValueError`` (exit 1, a traceback) instead of a usage error naming the
flag (exit 2). A prompt salt is hex as summary.json records it, checked here for the same reason. What every
request to a target carries besides the load (``--header``, ``--extra-body``) is one set of options, so `run`
and `sweep` reach the same gateways with the same bodies.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import click


class FiniteFloat(click.ParamType):
    """A finite float (no ``nan``, ``inf``)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(v):
            self.fail(f"must be a finite number, got {value!r}", param, ctx)
        return v


FINITE = FiniteFloat()


class Salt(click.ParamType):
    """A prompt salt: up to 16 hex digits (what summary.json's ``meta.prompt_salt`` records)."""

    name = "hex"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower().removeprefix("0x")
        if not text or len(text) > 16 or any(c not in "0123456789abcdef" for c in text):
            self.fail(f"must be 1-16 hex digits (as summary.json's meta.prompt_salt), got {value!r}", param, ctx)
        return int(text, 16)


SALT = Salt()
SALT_HELP = ("Prompt content salt, 16 hex digits (default: a fresh random one per run, so no run finds a previous "
             "run's prompts in the server's prefix cache). Give a run's meta.prompt_salt to send its exact prompts "
             "again (warm-cache studies).")


def request_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--header`` and ``--extra-body``: what every request to the target carries (read by
    :func:`paasbench.client.config.headers_from` and :func:`~paasbench.client.config.extra_body_from`)."""
    f = click.option("--extra-body", help="JSON object merged into every request body.")(f)
    return click.option("--header", multiple=True,
                        help="Extra header NAME:VALUE on every request to the target (repeatable).")(f)

