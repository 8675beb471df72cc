"""Small, dependency-free SVG charts, so a report is one HTML file that renders offline (GuideLLM's CDN-hosted
report broke offline, #303). Line charts (curves, CDFs, with reference lines and marked points) and horizontal
bar charts (stage breakdowns, side-by-side comparisons) are all a benchmark report needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from typing import Sequence

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]


@dataclass(slots=True)
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str | None = None
    dashed: bool = False
    markers: bool = True
    step: bool = False          # draw as a step function (CDFs)
    width: float = 2.0          # stroke width: a wide, pale series under a narrow one keeps both visible
    opacity: float = 1.0
    line: bool = True           # False: markers only (a scatter of points that are not a curve)


@dataclass(slots=True)
class Mark:
    """A labelled point (the knee, the best passing step)."""

    x: float
    y: float
    label: str
    color: str = "#000"


@dataclass(slots=True)
class RefLine:
    value: float
    label: str
    axis: str = "y"             # "y": horizontal line at y=value; "x": vertical at x=value
    color: str = "#d62728"


@dataclass(slots=True)
class Chart:
    title: str
    x_label: str
    y_label: str
    series: list[Series] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    lines: list[RefLine] = field(default_factory=list)
    x_log: bool = False
    y_log: bool = False         # latency spanning decades (a saturated step next to healthy ones)
    legend: str = "tl"          # "tl" top-left, "br" bottom-right (CDFs rise on the left)
    y_min: float | None = None
    y_max: float | None = None
    width: int = 600
    height: int = 330


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 × 10^k) covering [lo, hi]."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while not ticks or ticks[-1] < hi - step * 1e-9:  # the last tick covers hi: bars end inside the frame
        ticks.append(round(t, 12))
        t += step
    return ticks


def fmt_tick(v: float) -> str:
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:g}G"
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}K"
    if a >= 100 or v == 0:
        return f"{v:.0f}"
    return f"{v:.3g}"


def line_chart(c: Chart) -> str:
    """Render a :class:`Chart` as an inline ``<svg>`` element."""
    pts = [(x, y) for s in c.series for x, y in zip(s.xs, s.ys) if _finite(x, y)]
    if not pts:
        return _empty(c, "no data")
    left, right, top, bottom = 64, 16, 34, 48
    pw, ph = c.width - left - right, c.height - top - bottom
    xs = [x for x, _ in pts] + [r.value for r in c.lines if r.axis == "x"]
    ys = [y for _, y in pts] + [r.value for r in c.lines if r.axis == "y"] + [m.y for m in c.marks]
    x_lo, x_hi, xt, tx = _axis(xs, c.x_log, None, None, pad=1.0)
    y_lo, y_hi, yt, ty = _axis(ys, c.y_log, c.y_min, c.y_max, pad=1.05)

    def px(v: float) -> float:
        return left + (tx(v) - x_lo) / (x_hi - x_lo) * pw

    def py(v: float) -> float:
        return top + ph - (ty(v) - y_lo) / (y_hi - y_lo) * ph

    out = [_open(c), f'<text x="{c.width / 2}" y="18" text-anchor="middle" class="t">{escape(c.title)}</text>']
    for t in yt:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="g"/>'
                   f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{fmt_tick(t)}</text>')
    for v in xt:
        if x_lo - 1e-9 <= tx(v) <= x_hi + 1e-9:
            out.append(f'<line x1="{px(v):.1f}" x2="{px(v):.1f}" y1="{top}" y2="{top + ph}" class="g"/>'
                       f'<text x="{px(v):.1f}" y="{top + ph + 16}" text-anchor="middle">{fmt_tick(v)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>')
    out.append(f'<text x="{left + pw / 2}" y="{c.height - 8}" text-anchor="middle">{escape(c.x_label)}</text>')
    out.append(f'<text transform="translate(14,{top + ph / 2}) rotate(-90)" text-anchor="middle">'
               f'{escape(c.y_label)}</text>')
    for r in c.lines:
        if (r.axis == "y" and c.y_log or r.axis == "x" and c.x_log) and r.value <= 0:
            continue
        if r.axis == "y":
            y = py(r.value)
            out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{r.color}" '
                       f'stroke-dasharray="6 4" stroke-width="1.5"/><text x="{left + pw - 4}" y="{y - 4:.1f}" '
                       f'text-anchor="end" fill="{r.color}">{escape(r.label)}</text>')
        else:
            x = px(r.value)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" stroke="{r.color}" '
                       f'stroke-dasharray="6 4" stroke-width="1.5"/><text x="{x + 4:.1f}" y="{top + 12}" '
                       f'fill="{r.color}">{escape(r.label)}</text>')
    for i, s in enumerate(c.series):
        color = s.color or PALETTE[i % len(PALETTE)]
        sp = [(px(x), py(y)) for x, y in zip(s.xs, s.ys)
              if _finite(x, y) and (not c.x_log or x > 0) and (not c.y_log or y > 0)]
        if not sp:
            continue
        if s.step:
            path = [sp[0]]
            for (x0, y0), (x1, y1) in zip(sp, sp[1:]):
                path += [(x1, y0), (x1, y1)]
            sp_line = path
        else:
            sp_line = sp
        d = " ".join(f"{x:.1f},{y:.1f}" for x, y in sp_line)
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        fade = f' stroke-opacity="{s.opacity:g}"' if s.opacity < 1 else ""
        if s.line:
            out.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="{s.width:g}"{dash}'
                       f'{fade}><title>{escape(s.name)}</title></polyline>')
        if (s.markers or not s.line) and not s.step:
            out.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in sp)
    for k, m in enumerate(c.marks):  # alternate label sides so two marks on one point stay readable
        if _finite(m.x, m.y):
            if (c.x_log and m.x <= 0) or (c.y_log and m.y <= 0):
                continue
            x, y = px(m.x), py(m.y)
            lx, ly, anchor = (x + 10, y + 16, "start") if k % 2 == 0 else (x - 10, y - 10, "end")
            if anchor == "start" and lx + 7 * len(m.label) > left + pw:   # keep the label inside the frame
                lx, anchor = x - 10, "end"
            elif anchor == "end" and lx - 7 * len(m.label) < left:
                lx, anchor = x + 10, "start"
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{7 + 3 * k}" fill="none" stroke="{m.color}" '
                       f'stroke-width="2"/><text x="{lx:.1f}" y="{ly:.1f}" text-anchor="{anchor}" class="mk" '
                       f'fill="{m.color}">{escape(m.label)}</text>')
    items = [(s.name, s.color or PALETTE[i % len(PALETTE)], s.dashed, s.width, s.opacity)
             for i, s in enumerate(c.series)]
    if c.legend == "br":
        lx, ly = left + pw - 8 - 7 * max((len(it[0]) for it in items), default=0) - 24, top + ph - 8 - 15 * len(items)
    else:
        lx, ly = left + 8, top + 8
    out.append(_legend(items, lx, ly))
    out.append("</svg>")
    return "".join(out)


def bar_chart(title: str, categories: Sequence[str], groups: dict[str, Sequence[float]], *,
              unit: str = "", stacked: bool = False, width: int = 600) -> str:
    """Horizontal bars: one row per category, one bar (or stacked segment) per group."""
    cats = list(categories)
    if not cats or not groups:
        return _empty(Chart(title, "", "", width=width, height=90), "no data")
    names = list(groups)
    row_h = 22 if stacked else 14 * len(names) + 8
    label_w, top = 150, 34
    height = top + row_h * len(cats) + 40 + (16 if len(names) > 1 else 0)
    pw = width - label_w - 70
    totals = [sum(max(groups[n][i] or 0.0, 0.0) for n in names) if stacked
              else max((groups[n][i] or 0.0) for n in names) for i in range(len(cats))]
    vmax = max(totals) or 1.0
    ticks = nice_ticks(0.0, vmax)
    vmax = ticks[-1]
    chart = Chart(title, "", "", width=width, height=height)
    out = [_open(chart), f'<text x="{width / 2}" y="18" text-anchor="middle" class="t">{escape(title)}</text>']
    base_y = top + row_h * len(cats)
    for t in ticks:
        x = label_w + t / vmax * pw
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{base_y}" class="g"/>'
                   f'<text x="{x:.1f}" y="{base_y + 14}" text-anchor="middle">{fmt_tick(t)}</text>')
    if unit:
        out.append(f'<text x="{label_w + pw / 2}" y="{base_y + 30}" text-anchor="middle">{escape(unit)}</text>')
    for i, cat in enumerate(cats):
        y0 = top + i * row_h
        out.append(f'<text x="{label_w - 6}" y="{y0 + row_h / 2 + 4:.1f}" text-anchor="end">{escape(cat)}</text>')
        acc = 0.0
        for j, n in enumerate(names):
            v = max(groups[n][i] or 0.0, 0.0)
            color = PALETTE[j % len(PALETTE)]
            if stacked:
                x, y, h = label_w + acc / vmax * pw, y0 + 3, row_h - 6
                acc += v
            else:
                x, y, h = label_w, y0 + 4 + j * 14, 12
            w = v / vmax * pw
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{h}" fill="{color}">'
                       f'<title>{escape(n)} {escape(cat)}: {v:.4g}</title></rect>')
            if not stacked:
                out.append(f'<text x="{x + w + 4:.1f}" y="{y + 10:.1f}" class="v">{v:.4g}</text>')
    if len(names) > 1:
        out.append(_legend([(n, PALETTE[j % len(PALETTE)], False, 3.0, 1.0) for j, n in enumerate(names)],
                           label_w, height - 14, horizontal=True))
    out.append("</svg>")
    return "".join(out)


def wide(values: Sequence[float | None], ratio: float = 30.0) -> bool:
    """True when positive values span more than ``ratio``: plot them on a log axis."""
    pos = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    return bool(pos) and max(pos) / min(pos) > ratio


def cdf_points(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Empirical CDF as step-chart points: x sorted, y = fraction of values <= x."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def _finite(x: float | None, y: float | None) -> bool:
    return x is not None and y is not None and math.isfinite(x) and math.isfinite(y)


def _axis(values: list[float], log: bool, lo: float | None, hi: float | None, pad: float):
    """(lo, hi, tick values, transform) of one axis; lo/hi are in transformed units."""
    if log:
        pos = [v for v in values if v > 0] or [1.0]
        a, b = math.floor(math.log10(min(pos))), math.ceil(math.log10(max(pos)))
        b = b if b > a else a + 1
        decades = b - a
        mults = (1, 2, 5) if decades <= 3 else (1,)
        ticks = [m * 10.0 ** k for k in range(a, b + 1) for m in mults if m * 10.0 ** k <= 10.0 ** b]
        return float(a), float(b), ticks, (lambda v: math.log10(v) if v > 0 else float("-inf"))
    v_lo = lo if lo is not None else min(0.0, min(values))
    v_hi = hi if hi is not None else (max(values) * pad or 1.0)
    ticks = nice_ticks(v_lo, v_hi)
    v_lo, v_hi = min(v_lo, ticks[0]), max(v_hi, ticks[-1])
    if v_hi == v_lo:
        v_lo, v_hi = v_lo - 1, v_hi + 1
    return v_lo, v_hi, ticks, (lambda v: v)


def _open(c: Chart) -> str:
    return (f'<svg class="chart" width="{c.width}" height="{c.height}" '
            f'viewBox="0 0 {c.width} {c.height}" role="img" aria-label="{escape(c.title)}">')


def _empty(c: Chart, why: str) -> str:
    return (_open(c) + f'<text x="{c.width / 2}" y="18" text-anchor="middle" class="t">{escape(c.title)}</text>'
            f'<text x="{c.width / 2}" y="{c.height / 2}" text-anchor="middle">{escape(why)}</text></svg>')


def _legend(items: list[tuple[str, str, bool, float, float]], x: float, y: float, horizontal: bool = False) -> str:
    """One entry per series: (name, colour, dashed, stroke width, opacity), drawn as the series is."""
    out = []
    if items and not horizontal:  # a backdrop, so a legend over a curve stays legible
        w = 28 + 6.5 * max(len(it[0]) for it in items)
        out.append(f'<rect x="{x - 4}" y="{y - 8}" width="{w:.0f}" height="{15 * len(items) + 2}" '
                   f'fill="#fff" fill-opacity="0.85"/>')
    for i, (name, color, dashed, width, opacity) in enumerate(items):
        ix, iy = (x + i * 120, y) if horizontal else (x, y + i * 15)
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        fade = f' stroke-opacity="{opacity:g}"' if opacity < 1 else ""
        out.append(f'<line x1="{ix}" x2="{ix + 16}" y1="{iy}" y2="{iy}" stroke="{color}" '
                   f'stroke-width="{max(width, 3.0):g}"{dash}{fade}/>'
                   f'<text x="{ix + 20}" y="{iy + 4}" class="lg">{escape(name)}</text>')
    return "".join(out)
