"""Host CPU a long prompt costs the reference server before its first engine step, per request, by stage.

The sim twin models the device, not the host: what the router and workers do with a prompt before the first
modeled step (JSON parsing and tokenizing the body, packing it for each worker it asks, each worker unpacking
and hashing it for its prefix match, then admission hashing it again) is paid on this machine's CPU and shows
in the wall-clock TTFT but not in the modeled one. This script times those stages on the server's own code (no
HTTP, no processes: CPU time of this process), for a text prompt and for the same prompt sent as token ids
(``paasbench run --prompt-format token-ids``).

    python benchmarks/bench_prompt_path.py                       # 64K and 256K tokens
    python benchmarks/bench_prompt_path.py --tokens 65536 --repeats 5

Prints one line per prompt length and stage: CPU ms per request (the median of ``--repeats``) and the load
average it ran at. ``match+admit`` counts the match query of each of ``--workers`` workers (one unpack and one
hashing pass each: disaggregated cost routing asks every decode and prefill worker) and the admitting worker's
own unpack and hashing pass.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_server.engine.vocab import get_vocab  # noqa: E402
from reference_server.ipc import blob_tokens, tokens_blob  # noqa: E402
from reference_server.kv.block_manager import BlockManager  # noqa: E402
from reference_server.parse import parse  # noqa: E402


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        fn()
        times.append(1e3 * (time.process_time() - c0))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, action="append", help="prompt length (repeatable; default 65536, 262144)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="workers asked for a prefix match (default 2)")
    ap.add_argument("--block-size", type=int, default=512, help="the server's --block-size (default 512)")
    a = ap.parse_args()
    vocab = get_vocab("tiny")                              # the sim's token space (cl100k)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "tensor", "route", "cache", "token", "block"]
    print(f"load average {os.getloadavg()[0]:.2f}; CPU ms per request, median of {a.repeats}")
    for n in a.tokens or [65536, 262144]:
        text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(n // 3))
        ids = vocab.encode(text)
        while len(ids) < n:                               # top up to exactly n tokens
            ids += ids[:n - len(ids)]
        ids = ids[:n]
        text_body = json.dumps({"prompt": text, "max_tokens": 8, "stream": True}).encode()
        ids_body = json.dumps({"prompt": ids, "max_tokens": 8, "stream": True}).encode()
        blocks = BlockManager(n // a.block_size + 8, a.block_size, "bench", "sha256")

        def match_admit() -> None:
            blob = tokens_blob(ids)
            for _ in range(a.workers):                     # each worker asked: unpack + hash for its offer
                blocks.match_prefix("t", blob_tokens(blob))
            blocks.lookup("t", blob_tokens(blob))         # the admitting worker: unpack + hash again

        stages = {"parse text (json + tokenize)": lambda: parse(text_body, False, vocab),
                  "parse token ids (json + check)": lambda: parse(ids_body, False, vocab),
                  f"match+admit ({a.workers} workers + admit)": match_admit}
        for name, fn in stages.items():
            print(f"{n:>7} tokens  {name:<34} {cpu_ms(fn, a.repeats):8.1f} ms")


if __name__ == "__main__":
    main()
