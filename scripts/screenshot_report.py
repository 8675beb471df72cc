#!/usr/bin/env python3
"""Screenshot a report in headless Chromium with networking off, to prove it renders offline.

    python scripts/screenshot_report.py runs/x/report.html report.png [--width 1400 --height 6000]

Networking is cut three ways: every proxy request goes to a closed port (127.0.0.1:9, "discard"), background
networking / component updates / sync are disabled, and the host resolver maps every name to nothing. A report
that needed a CDN would render without its plots. Exits 3 when no Chromium is installed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def screenshot(html: Path, png: Path, *, width: int = 1400, height: int = 6000, timeout_s: float = 90.0) -> Path:
    browser = find_chromium()
    if browser is None:
        raise FileNotFoundError("no chromium binary on PATH (Debian: apt-get install chromium)")
    png = png.resolve()
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="paasbench-chromium-") as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-default-apps", "--disable-extensions", "--no-first-run", "--no-default-browser-check",
               "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
               "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}", "--hide-scrollbars",
               f"--window-size={width},{height}", f"--screenshot={png}", html.resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot (rc={proc.returncode}): {proc.stderr[-2000:]}")
    return png


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=6000)
    args = ap.parse_args()
    if find_chromium() is None:
        print("no chromium on PATH", file=sys.stderr)
        return 3
    print(screenshot(args.html, args.png, width=args.width, height=args.height))
    return 0


if __name__ == "__main__":
    sys.exit(main())
