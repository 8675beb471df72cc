"""Command-line value types shared by the commands.

Why: click's ``float`` accepts ``nan`` and ``inf``, and a NaN rate or duration then fails deep inside
trace generation with a bare ``ValueError`` (exit 1, a traceback) instead of a usage error naming the
flag (exit 2).
"""

from __future__ import annotations

import math
from typing import Any

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
