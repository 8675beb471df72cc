"""The HTML report renders offline in headless Chromium, with its plots drawn (skipped without chromium).

Networking is cut (proxy to a closed port, resolver mapped to nothing), so a report that depended on a CDN would
render without its plots. The PNG is decoded here (zlib + PNG row filters) to check that chart pixels exist.
"""

from __future__ import annotations

import importlib.util
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from paasbench.report import render
from paasbench.report import svg

ROOT = Path(__file__).resolve().parent.parent
FIX = Path(__file__).parent / "fixtures" / "report"
_spec = importlib.util.spec_from_file_location("screenshot_report", ROOT / "scripts" / "screenshot_report.py")
shot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shot)

pytestmark = pytest.mark.skipif(shot.find_chromium() is None, reason="no chromium on PATH (apt-get install chromium)")


def decode_png(path: Path) -> np.ndarray:
    """RGB(A) 8-bit PNG -> H x W x C array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        f, row = raw[y * (stride + 1)], np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        if f == 1 or f == 3 or f == 4:  # filters that depend on the left neighbour: sequential
            cur = row.copy()
            for x in range(stride):
                a = cur[x - channels] if x >= channels else 0
                c = prev[x - channels] if x >= channels else 0
                b = prev[x]
                if f == 1:
                    pred = a
                elif f == 3:
                    pred = (a + b) // 2
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[x] = (cur[x] + pred) & 0xFF
        elif f == 2:
            cur = (row + prev) & 0xFF
        else:
            cur = row
        out[y] = cur
        prev = cur
    return out.reshape(height, width, channels)


def test_chart_pixels_render_offline(tmp_path: Path):
    chart = svg.line_chart(svg.Chart("t", "x", "y", [svg.Series("s", [0, 1, 2, 3], [0, 2, 1, 3])]))
    page = tmp_path / "chart.html"
    page.write_text(f"<!DOCTYPE html><html><body style='margin:0'>{chart}</body></html>")
    png = shot.screenshot(page, tmp_path / "chart.png", width=640, height=360)
    img = decode_png(png)[..., :3].astype(int)
    blue = np.array([0x1F, 0x77, 0xB4])  # PALETTE[0]: the series colour
    near = (np.abs(img - blue).sum(axis=-1) < 40).sum()
    assert near > 200, f"only {near} series-coloured pixels: the SVG did not draw"


def test_full_report_screenshot(tmp_path: Path):
    html, _ = render([FIX / "run", FIX / "sweep"], tmp_path)
    png = shot.screenshot(html, tmp_path / "report.png", width=1400, height=2400)
    width, height = struct.unpack(">II", png.read_bytes()[16:24])
    assert (width, height) == (1400, 2400)
    assert png.stat().st_size > 100_000  # tables and charts, not a blank page
