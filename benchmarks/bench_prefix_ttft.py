"""TTFT at a 90% prefix hit over TTFT at 0% hit, through the real reference server (cpu engine).

For each repeat: a fresh random prompt of ``--context`` tokens is sent cold (0% hit, measured), then a
prompt sharing its first 90% (block-rounded by the server) with a new 10% tail is sent (measured).
TTFT is client-side: request send → first SSE chunk with a token, over loopback HTTP.

    python benchmarks/bench_prefix_ttft.py --context 16384 --repeats 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_client import stream  # noqa: E402

from reference_server.launcher import EmbeddedServer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mode", default="disaggregated")
    ap.add_argument("--chunk", type=int, default=2048, help="--prefill-chunk-tokens")
    ap.add_argument("--model", default="tiny")
    a = ap.parse_args()
    n, shared = a.context, int(a.context * 0.9)
    rng = random.Random(0)
    args = ["--mode", a.mode, "--workers", "2", "--model", a.model, "--prefill-chunk-tokens", str(a.chunk),
            "--kv-budget-mb", "1024"]
    cold, warm, hits, t_cold, t_warm = [], [], [], [], []
    with EmbeddedServer(args, startup_timeout_s=120) as s:
        stream(s.url, {"prompt": [rng.randrange(1000, 90000) for _ in range(600)], "max_tokens": 2})  # warm-up
        for _ in range(a.repeats):
            base = [rng.randrange(1000, 90000) for _ in range(n)]
            r0 = stream(s.url, {"prompt": base, "max_tokens": 1})
            r9 = stream(s.url, {"prompt": base[:shared] + [rng.randrange(1000, 90000) for _ in range(n - shared)],
                                "max_tokens": 1})
            assert r0.status == 200 and r9.status == 200, (r0.body, r9.body)
            cold.append(r0.ttft)
            warm.append(r9.ttft)
            hits.append(r9.usage["prompt_tokens_details"]["cached_tokens"])
            t_cold.append(r0.timings)
            t_warm.append(r9.timings)
            print(f"  cold TTFT {r0.ttft:7.3f} s (prefill {r0.timings['prefill_ms']:8.1f} ms, "
                  f"{r0.timings['prefill_location']})   90%-hit TTFT {r9.ttft:7.3f} s "
                  f"(prefill {r9.timings['prefill_ms']:8.1f} ms, {r9.timings['prefill_location']}, "
                  f"cached {hits[-1]})", flush=True)
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"context {n} tokens, mode {a.mode}, model {a.model}, repeats {a.repeats}")
    print(f"TTFT 0% hit  (median): {c * 1e3:9.1f} ms")
    print(f"TTFT 90% hit (median): {w * 1e3:9.1f} ms   cached tokens {statistics.median(hits):.0f} "
          f"({statistics.median(hits) / n:.1%})")
    print(f"ratio TTFT(90%) / TTFT(0%): {w / c:.3f}   speed-up {c / w:.1f}x")


if __name__ == "__main__":
    main()
