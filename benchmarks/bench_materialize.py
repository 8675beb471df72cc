"""Prompt materialization speed and memory on a 1,000-request white-paper trace (64K-400K contexts).

What is measured, all in this one run:

* lazy text path: ``PromptBuilder.text(req)`` for every request in trace order, each prompt dropped after
  use (what the runner does at send time): tokens/s and peak traced memory (tracemalloc, a second pass);
* token-id path: ``PromptBuilder.token_ids(req)`` likewise (``--prompt-format token-ids``);
* baseline 1, speed: tiktoken ``encode`` of the same prompt texts (a sample of requests) - the cost of the
  usual "generate text, tokenize to check/trim the length" approach, per token;
* baseline 2, memory: the bytes that eager materialization (all prompts held, as some tools do) would
  need: the sum of ``sys.getsizeof`` of every prompt string, measured during the lazy pass.

The word tape shared by all blocks (built once per process, constant size) is reported separately; the
traced peak covers everything materialization allocates after it exists.

Run: ``python benchmarks/bench_materialize.py [--requests 1000]``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import tracemalloc

from paasbench.prompts import PromptBuilder, tape
from paasbench.tokenizer import encode
from paasbench.trace.model import Trace
from paasbench.workload import generate_trace, load_workload


def white_paper_trace(n: int) -> Trace:
    spec = load_workload("white-paper-agent")
    sessions = spec.sessions
    while True:
        tr = generate_trace(dataclasses.replace(spec, sessions=sessions))
        if len(tr) >= n:
            return Trace(tr.requests[:n], block_size=tr.block_size, meta=tr.meta)
        sessions = int(sessions * n / len(tr)) + 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--encode-sample", type=int, default=8, help="requests re-tokenized for the baseline")
    args = ap.parse_args()

    tr = white_paper_trace(args.requests)
    total = sum(r.input_length for r in tr.requests)
    print(f"trace: {len(tr)} requests, {total / 1e6:.1f}M input tokens, "
          f"max {max(r.input_length for r in tr.requests):,}")

    t0 = time.perf_counter()
    tp = tape()  # what the first PromptBuilder of a process pays
    tape_s = time.perf_counter() - t0
    pb = PromptBuilder(block_size=tr.block_size)
    tape_bytes = sys.getsizeof(tp.text) + tp.chars.itemsize * len(tp.chars) + tp.ids.itemsize * len(tp.ids)
    t0 = time.perf_counter()
    eager_bytes = 0
    for req in tr.requests:
        eager_bytes += sys.getsizeof(pb.text(req))
    text_s = time.perf_counter() - t0

    pb = PromptBuilder(block_size=tr.block_size)
    t0 = time.perf_counter()
    for req in tr.requests:
        pb.token_ids(req)
    ids_s = time.perf_counter() - t0

    pb = PromptBuilder(block_size=tr.block_size)
    tracemalloc.start()
    for req in tr.requests:
        pb.text(req)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    step = max(1, len(tr) // args.encode_sample)
    sample = tr.requests[::step][:args.encode_sample]
    texts = [pb.text(r) for r in sample]
    t0 = time.perf_counter()
    n_enc = sum(len(encode(t)) for t in texts)
    enc_s = time.perf_counter() - t0
    assert n_enc == sum(r.input_length for r in sample), "materialized prompts must tokenize exactly"
    del texts

    text_tps, ids_tps, enc_tps = total / text_s, total / ids_s, n_enc / enc_s
    print(f"lazy text materialization : {text_tps / 1e6:8.1f}M tokens/s  ({text_s:.2f} s)")
    print(f"lazy token-id prompts     : {ids_tps / 1e6:8.1f}M tokens/s  ({ids_s:.2f} s)")
    print(f"baseline tiktoken encode  : {enc_tps / 1e6:8.2f}M tokens/s  ({len(sample)} requests, "
          f"{n_enc / 1e6:.1f}M tokens)")
    print(f"speed ratio text/encode   : {text_tps / enc_tps:8.1f}x")
    print(f"word tape (once, constant): {tape_bytes / 2**20:8.1f} MiB, built in {tape_s:.2f} s")
    print(f"peak traced memory (lazy) : {peak / 2**20:8.1f} MiB beyond the tape")
    print(f"eager: all prompts held   : {eager_bytes / 2**20:8.1f} MiB")
    print(f"memory ratio eager/lazy   : {eager_bytes / (peak + tape_bytes):8.1f}x (lazy incl. tape)")


if __name__ == "__main__":
    main()
