"""HTML + Markdown reports (``paasbench report``) and side-by-side comparisons (``paasbench compare``)."""

from paasbench.report.render import render, render_compare

__all__ = ["render", "render_compare"]
