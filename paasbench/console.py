"""Tables printed whole: off a terminal, a table is as wide as its contents, not 80 columns.

rich sizes its console from the terminal, and off one (a CI log, a pipe, ``| tee``) it assumes 80 columns and
cuts every table to fit: the latency table's "19,731.…" and "schedule…". A log is read whole, so what is not a
terminal gets the table's own width; on a terminal, the terminal's width stands (the user can widen it).
"""

from __future__ import annotations

from rich.console import Console, RenderableType

WIDEST = 1000   # columns a table may measure at most (a guard, not a layout)


def print_whole(console: Console, renderable: RenderableType) -> None:
    """Print ``renderable`` on ``console``; off a terminal at its natural width, so no cell is cut."""
    if console.is_terminal:
        console.print(renderable)
        return
    natural = Console(width=WIDEST, file=console.file, color_system=None).measure(renderable).maximum
    wide = Console(width=max(console.width, natural), file=console.file, no_color=console.no_color,
                   color_system=console.color_system, highlight=False, force_terminal=False)
    wide.print(renderable)
