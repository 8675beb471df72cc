"""The hand-rolled SVG charts: ticks cover the data, points land where their values say, log axes work."""

from __future__ import annotations

import re

from paasbench.report import svg


def test_nice_ticks_cover_the_range():
    for lo, hi in [(0, 688), (0, 1), (0.5, 4), (56e3, 536e3), (0, 0), (3, 3)]:
        t = svg.nice_ticks(lo, hi)
        assert t[0] <= lo and t[-1] >= hi and len(t) >= 2
        steps = {round(b - a, 9) for a, b in zip(t, t[1:])}
        assert len(steps) == 1


def test_points_are_placed_by_value():
    chart = svg.Chart("t", "x", "y", [svg.Series("s", [0, 10], [0, 100])], width=200, height=200)
    out = svg.line_chart(chart)
    pts = re.search(r'<polyline points="([^"]+)"', out).group(1).split()
    (x0, y0), (x1, y1) = [tuple(map(float, p.split(","))) for p in pts]
    assert x1 > x0 and y1 < y0              # up and to the right
    # frame: left 64, right 16, top 34, bottom 48 -> plot box 120 x 118; y axis 0..125 (100 · 1.05 headroom,
    # rounded up to a 25-step tick), so y=100 sits at 4/5 of the height
    assert (x0, x1) == (64.0, 184.0) and y0 == 152.0 and abs(y1 - (152 - 118 * 100 / 125)) < 0.1
    assert ">125<" in out


def test_log_axis_and_reference_line():
    chart = svg.Chart("t", "x", "y", [svg.Series("s", [1, 2, 3], [10, 100, 10000])], y_log=True,
                      lines=[svg.RefLine(1000, "SLO")], marks=[svg.Mark(2, 100, "knee")])
    out = svg.line_chart(chart)
    assert ">10K<" in out and ">100<" in out and "SLO" in out and "knee" in out
    ys = [float(p.split(",")[1]) for p in re.search(r'<polyline points="([^"]+)"', out).group(1).split()]
    assert abs((ys[0] - ys[1]) - (ys[1] - ys[2]) / 2) < 0.2   # 10x then 100x: equal decades on a log axis


def test_empty_and_bars():
    assert "no data" in svg.line_chart(svg.Chart("t", "x", "y", [svg.Series("s", [], [])]))
    bars = svg.bar_chart("b", ["p50", "p90"], {"a": [1.0, 688.0], "b": [2.0, None]})
    widths = [float(w) for w in re.findall(r'width="([\d.]+)" height="12"', bars)]
    assert max(widths) <= 600 - 150 - 70 + 0.01  # the longest bar stays inside the plot
    assert svg.wide([1, 100]) and not svg.wide([10, 20]) and not svg.wide([None, 0])
