"""Prompt materialization speed and memory on a 1,000-request white-paper trace (64K-400K contexts).

What is measured, all in this one run:

* lazy text path: ``PromptBuilder.text(req)`` for every request in trace order, each prompt dropped after
  use (what the runner does at send time): tokens/s and peak traced memory (tracemalloc, a second pass);
* token-id path: ``PromptBuilder.token_ids(req)`` likewise (``--prompt-format token-ids``);
* baseline 1, speed: the tokenizer's ``encode`` of the same prompt texts (a sample of requests) - the cost of the
  usual "generate text, tokenize to check/trim the length" approach, per token;
* baseline 2, memory: the bytes that eager materialization (all prompts held, as some tools do) would
  need: the sum of ``sys.getsizeof`` of every prompt string, measured during the lazy pass.

The word tape shared by all blocks (built once per process, constant size) is reported separately; the
traced peak covers everything materialization allocates after it exists.

The same figures for another tokenizer with ``--tokenizer`` (a tiktoken name, or a local tokenizer.json /
model directory). ``--train-bytelevel DIR`` first trains a 32K byte-level BPE (the Llama 3 / Qwen / DeepSeek
family) on this Python installation's own library sources into DIR/tokenizer.json, offline, and uses it.

Run: ``python benchmarks/bench_materialize.py [--requests 1000] [--tokenizer NAME | --train-bytelevel DIR]``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import tracemalloc

from paas_common.tokenizer import DEFAULT_TOKENIZER, encode
from paasbench.load.prompts import PromptBuilder, tape
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


def train_bytelevel(out_dir: str, vocab_size: int = 32_000) -> str:
    """A byte-level BPE trained on the standard library's .py files (text and code, all local)."""
    import sysconfig
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    if (out / "tokenizer.json").is_file():
        return str(out)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--encode-sample", type=int, default=8, help="requests re-tokenized for the baseline")
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="tiktoken name or local tokenizer.json/dir")
    ap.add_argument("--train-bytelevel", metavar="DIR", help="train a byte-level BPE into DIR and use it")
    args = ap.parse_args()
    tok = train_bytelevel(args.train_bytelevel) if args.train_bytelevel else args.tokenizer
    print(f"tokenizer: {tok}")

    tr = white_paper_trace(args.requests)
    total = sum(r.input_length for r in tr.requests)
    print(f"trace: {len(tr)} requests, {total / 1e6:.1f}M input tokens, "
          f"max {max(r.input_length for r in tr.requests):,}")

    t0 = time.perf_counter()
    tp = tape(tok)  # what the first PromptBuilder of a process pays
    tape_s = time.perf_counter() - t0
    pb = PromptBuilder(block_size=tr.block_size, tokenizer=tok)
    tape_bytes = sys.getsizeof(tp.text) + tp.chars.itemsize * len(tp.chars) + tp.ids.itemsize * len(tp.ids)
    t0 = time.perf_counter()
    eager_bytes = 0
    for req in tr.requests:
        eager_bytes += sys.getsizeof(pb.text(req))
    text_s = time.perf_counter() - t0

    pb = PromptBuilder(block_size=tr.block_size, tokenizer=tok)
    t0 = time.perf_counter()
    for req in tr.requests:
        pb.token_ids(req)
    ids_s = time.perf_counter() - t0

    pb = PromptBuilder(block_size=tr.block_size, tokenizer=tok)
    tracemalloc.start()
    for req in tr.requests:
        pb.text(req)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    step = max(1, len(tr) // args.encode_sample)
    sample = tr.requests[::step][:args.encode_sample]
    texts = [pb.text(r) for r in sample]
    t0 = time.perf_counter()
    n_enc = sum(len(encode(t, tok)) for t in texts)
    enc_s = time.perf_counter() - t0
    assert n_enc == sum(r.input_length for r in sample), "materialized prompts must tokenize exactly"
    del texts

    text_tps, ids_tps, enc_tps = total / text_s, total / ids_s, n_enc / enc_s
    print(f"lazy text materialization : {text_tps / 1e6:8.1f}M tokens/s  ({text_s:.2f} s)")
    print(f"lazy token-id prompts     : {ids_tps / 1e6:8.1f}M tokens/s  ({ids_s:.2f} s)")
    print(f"baseline encode (tokenizer): {enc_tps / 1e6:8.2f}M tokens/s  ({len(sample)} requests, "
          f"{n_enc / 1e6:.1f}M tokens)")
    print(f"speed ratio text/encode   : {text_tps / enc_tps:8.1f}x")
    print(f"word tape (once, constant): {tape_bytes / 2**20:8.1f} MiB, built in {tape_s:.2f} s")
    print(f"peak traced memory (lazy) : {peak / 2**20:8.1f} MiB beyond the tape")
    print(f"eager: all prompts held   : {eager_bytes / 2**20:8.1f} MiB")
    print(f"memory ratio eager/lazy   : {eager_bytes / (peak + tape_bytes):8.1f}x (lazy incl. tape)")


if __name__ == "__main__":
    main()
