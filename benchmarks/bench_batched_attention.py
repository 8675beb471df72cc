"""Batched decode attention (one SDPA call for the whole batch) against the per-sequence loop, same run.

Both sides are the torch backend of the same engine on the same KV pool; only ``model.batched`` differs:

* ``loop``     per sequence: gather its blocks, trim, tiled softmax attention (the numpy reference's code);
* ``batched``  every decode item in one ``scaled_dot_product_attention`` call over padded block tables
  with a key-validity mask (what a GPU runs).

A decode step of ``B`` sequences at context ``C`` is timed (fastest of ``--repeat``, thread CPU time
with one torch thread, so neighbours on a shared machine cannot inflate it); the ratio is loop /
batched. On a CPU the win is the removed per-sequence Python and small-kernel overhead; on a GPU the
same change also turns B small kernels into one large one.

Run: ``python benchmarks/bench_batched_attention.py [--model small] [--batches 1,8,32] [--context 1024]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from reference_server.engine import SeqStep, create_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    bs, ctx = 128, args.context
    batches = [int(b) for b in args.batches.split(",")]
    per = -(-(ctx + 1) // bs)
    eng = create_engine("cpu", block_size=bs, num_blocks=per * max(batches), model=args.model, backend="torch")
    rng = np.random.default_rng(0)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(max(batches))]
    for i, t in enumerate(tables):
        eng.step([SeqStep(f"s{i}", rng.integers(0, 100_000, ctx).tolist(), 0, t)])
    print(f"decode step, {args.model}, context {ctx}, torch on cpu (1 thread), fastest of {args.repeat}")
    print(f"{'batch':>6} {'loop ms':>9} {'batched ms':>11} {'loop/batched':>13}")
    for b in batches:
        batch = [SeqStep(f"s{i}", [5], ctx, tables[i]) for i in range(b)]
        best = {}
        for mode in (False, True):
            eng.model.batched = mode
            eng.step(batch)
            times = []
            for _ in range(args.repeat):
                t0 = time.thread_time()
                eng.step(batch)
                times.append(time.thread_time() - t0)
            best[mode] = min(times)
        print(f"{b:>6} {best[False] * 1e3:>9.2f} {best[True] * 1e3:>11.2f} {best[False] / best[True]:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
