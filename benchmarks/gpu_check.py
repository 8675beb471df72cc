"""GPU acceptance check for the real engine: measured throughput next to the device's roofline.

Builds random-weight Hugging Face checkpoints (no download) — one of Qwen2.5-0.5B's shape and one of
Qwen2.5-7B's (a 7B-class GQA model) — writes them as sharded safetensors, loads them through
``--model PATH``'s loader, and prints, per model:

* prefill tokens/s of one sequence at 8K / 32K / 128K (8K-token chunks), against the compute bound
  ``(linear + attention FLOPs) / peak bf16 FLOP/s``;
* decode tokens/s at batch 1 / 32 / 128 (context 1K each), against the memory bound
  ``(weight + KV bytes) / HBM bandwidth``;
* TTFT of a 32K prompt with 0% and with 90% of it already in the prefix cache;
* KV transfer GB/s device-to-device (peer copy, when a second device exists) and host-staged (pinned
  memory: device -> host -> device), against the profile's card-to-card link;
* next to each prefill / decode / TTFT figure, the sim twin's modeled figure for the same steps (the
  profile's MFU/MBU and overheads) and its error, the number ``paasbench calibrate`` is meant to shrink.

Each bound comes from the sim's roofline terms (:func:`reference_server.sim.roofline.step_cost`) on
the device profile (``--profile``; default by device name), at 100% of peak: the fraction printed is
measured / bound. Every timed region ends in a device synchronize (token ids copied to the host).

    scripts/gpu_check.sh                              # a CUDA machine, < 5 minutes
    scripts/gpu_check.sh --quick --device cpu         # tiny shapes on a CPU: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from reference_server.engine import SeqStep, create_engine  # noqa: E402
from reference_server.engine.config import ModelConfig  # noqa: E402
from reference_server.sim.profiles import ModelProfile, load_device_profile, model_profile_of  # noqa: E402
from reference_server.sim.roofline import step_cost  # noqa: E402


SHAPES = {   # Qwen2 layout (q/k/v biases); the 7B-class one is Qwen2.5-7B's shape
    "qwen2.5-0.5b": ModelConfig("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, vocab=151936, tied_head=True, qkv_bias=True),
    "7b-class": ModelConfig("7b-class", 28, 3584, 28, 4, 128, 18944, vocab=152064, tied_head=False, qkv_bias=True),
    "quick": ModelConfig("quick", 2, 64, 4, 2, 16, 128, vocab=512, tied_head=True, qkv_bias=True),
}


def write_checkpoint(shape: ModelConfig, root: Path, device: str, dtype) -> None:
    """Random bf16 (fp32 on a CPU) Qwen2 checkpoint, 1/sqrt(fan_in) scaled, in shards of ~2 GB."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(0)
    d, hd = shape.hidden, shape.head_dim

    def rand(*s: int, scale: float | None = None) -> "torch.Tensor":
        x = torch.randn(*s, generator=gen, device=device, dtype=torch.float32)
        return (x * (scale if scale is not None else 1 / math.sqrt(s[-1]))).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": rand(shape.vocab, d, scale=0.02), "model.norm.weight": torch.ones(d, dtype=dtype)}
    if not shape.tied_head:
        tensors["lm_head.weight"] = rand(shape.vocab, d)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(d, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(d, dtype=dtype)
        for n, rows in (("q", shape.heads * hd), ("k", shape.kv_heads * hd), ("v", shape.kv_heads * hd)):
            tensors[p + f"self_attn.{n}_proj.weight"] = rand(rows, d)
            tensors[p + f"self_attn.{n}_proj.bias"] = rand(rows, scale=0.02)
        tensors[p + "self_attn.o_proj.weight"] = rand(d, shape.heads * hd)
        tensors[p + "mlp.gate_proj.weight"] = rand(shape.ffn, d)
        tensors[p + "mlp.up_proj.weight"] = rand(shape.ffn, d)
        tensors[p + "mlp.down_proj.weight"] = rand(d, shape.ffn)
    root.mkdir(parents=True, exist_ok=True)
    shards, cur, size, weight_map = [], {}, 0, {}
    for name, t in tensors.items():
        cur[name] = t
        size += t.numel() * t.element_size()
        if size > 2 << 30:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    for k, part in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(root / fname))
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=d, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=shape.tied_head,
        hidden_act="silu", eos_token_id=2)))


def _n(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)


class Check:
    def __init__(self, device: str, profile: str, quick: bool, kv_dtype: str = "auto") -> None:
        self.device, self.quick, self.kv_dtype = device, quick, kv_dtype
        self.dev = load_device_profile(profile)
        self.rows: list[dict] = []

    def bound(self, model: ModelProfile, steps: list[list[tuple[int, int]]], kind: str) -> float:
        """Seconds at 100% of peak: compute (FLOPs / peak) or memory (bytes / HBM)."""
        total = 0.0
        for items in steps:
            c = step_cost(model, self.dev, items, tp=1)
            if kind == "compute":
                total += (c.linear_flops + c.attn_flops) / self.dev.peak_flops(model.compute_dtype)
            else:
                total += (c.weight_bytes + c.kv_bytes) / (self.dev.hbm_tbps * 1e12)
        return total

    def modeled(self, model: ModelProfile, steps: list[list[tuple[int, int]]]) -> float:
        """Seconds the sim twin gives these steps on the profile (its MFU/MBU and overheads)."""
        return sum(step_cost(model, self.dev, items, tp=1).seconds for items in steps)

    def row(self, model: str, metric: str, value: float, unit: str, bound_value: float | None, kind: str,
            sim: float | None = None) -> None:
        frac = value / bound_value if bound_value else None
        if unit == "s" and bound_value:        # a time: the bound is a floor
            frac = bound_value / value
        err = sim / value - 1 if sim else None
        self.rows.append(dict(model=model, metric=metric, value=value, unit=unit, roofline=bound_value,
                              roofline_kind=kind, fraction=frac, sim=sim, sim_error=err))
        b = "" if bound_value is None else f"   roofline ({kind}) {bound_value:,.4g} {unit} = {frac:.0%}"
        t = "" if sim is None else f"   sim {sim:,.4g} ({err:+.0%})"
        print(f"{model:>13}  {metric:<28} {value:>12,.4g} {unit:<9}{b}{t}", flush=True)


def run_model(chk: Check, shape: ModelConfig, root: Path, *, prefill_lens: list[int], chunk: int, batches: list[int],
              ctx: int, ttft_len: int, decode_steps: int) -> None:
    import torch

    dtype = torch.float32 if chk.device == "cpu" else torch.bfloat16
    t0 = time.perf_counter()
    write_checkpoint(shape, root, chk.device if chk.device != "cpu" else "cpu", dtype)
    t_write = time.perf_counter() - t0
    bs = 256 if not chk.quick else 16
    need = max(max(prefill_lens), max(batches) * (ctx + decode_steps), 2 * ttft_len) // bs + 4 * max(batches) + 8
    t0 = time.perf_counter()
    eng = create_engine("cpu", block_size=bs, num_blocks=need, model=str(root), backend="torch",
                        device=chk.device if chk.device == "cpu" else f"{chk.device}:0", kv_dtype=chk.kv_dtype)
    t_load = time.perf_counter() - t0
    print(f"{shape.name:>13}  checkpoint written in {t_write:.1f} s, loaded in {t_load:.1f} s "
          f"({eng.shape.kv_dtype} KV, {need} blocks of {bs})", flush=True)
    model = model_profile_of(eng.cfg, eng.be.dtype_name, eng.shape.kv_dtype)
    rng = np.random.default_rng(0)
    V = min(1000, shape.vocab)

    def prefill(seq: str, tokens: list[int], table: list[int], start: int = 0) -> tuple[float, list]:
        """Seconds to prefill ``tokens[start:]`` in chunks (each step ends synchronized), and its steps."""
        steps, t0 = [], time.perf_counter()
        for s in range(start, len(tokens), chunk):
            part = tokens[s:s + chunk]
            eng.step([SeqStep(seq, part, s, table)])          # returns token ids: the device has finished
            steps.append([(len(part), s)])
        return time.perf_counter() - t0, steps

    prefill("warm", rng.integers(0, V, min(chunk, 512)).tolist(), list(range(need)))   # kernels, allocator
    for n in prefill_lens:
        secs, steps = prefill("p", rng.integers(0, V, n).tolist(), list(range(need)))
        bound = chk.bound(model, steps, "compute")
        chk.row(shape.name, f"prefill {_n(n)} tok/s", n / secs, "tok/s", n / bound, "compute",
                n / chk.modeled(model, steps))
    for b in batches:
        per = -(-(ctx + decode_steps) // bs)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
        for i in range(b):   # fill each sequence's context
            eng.step([SeqStep(f"d{i}", rng.integers(0, V, ctx).tolist(), 0, tables[i])])
        last = [1] * b
        eng.step([SeqStep(f"d{i}", [last[i]], ctx, tables[i]) for i in range(b)])     # warm this batch shape
        t0 = time.perf_counter()
        for k in range(1, decode_steps):
            last = eng.step([SeqStep(f"d{i}", [last[i]], ctx + k, tables[i]) for i in range(b)])
        secs = time.perf_counter() - t0
        steps = [[(1, ctx + k)] * b for k in range(1, decode_steps)]
        bound = chk.bound(model, steps, "memory")
        chk.row(shape.name, f"decode batch {b} tok/s", b * (decode_steps - 1) / secs, "tok/s",
                b * (decode_steps - 1) / bound, "memory", b * (decode_steps - 1) / chk.modeled(model, steps))
    prompt = rng.integers(0, V, ttft_len).tolist()
    hit = (ttft_len * 9 // 10) // bs * bs
    table = list(range(-(-ttft_len // bs)))
    cold, steps = prefill("t0", prompt, table)
    chk.row(shape.name, f"TTFT {_n(ttft_len)} 0% hit", cold, "s", chk.bound(model, steps, "compute"), "compute",
            chk.modeled(model, steps))
    # the same prompt's first 90% is in the cache (the blocks just written): only the rest runs
    warm, steps = prefill("t90", prompt, table, start=hit)
    chk.row(shape.name, f"TTFT {_n(ttft_len)} {100 * hit // ttft_len}% hit", warm, "s",
            chk.bound(model, steps, "compute"), "compute", chk.modeled(model, steps))
    transfer(chk, eng, shape, list(range(min(need, -(-ttft_len // bs)))))
    eng.pool = eng.model = None    # free the device before the next model
    if chk.device == "cuda":
        torch.cuda.empty_cache()


def transfer(chk: Check, eng, shape: ModelConfig, blocks: list[int]) -> None:
    import torch

    from reference_server.kv.staging import can_peer, peer_copy, to_device, to_host

    kv = eng.pool.data[:, :, torch.as_tensor(blocks, device=eng.pool.data.device)]
    nbytes = kv.numel() * kv.element_size()
    link = chk.dev.interconnect_gbps or None
    src = kv.device
    n_dev = torch.cuda.device_count() if src.type == "cuda" else 0
    if n_dev >= 2:
        dst = torch.device("cuda", (src.index or 0) + 1 if (src.index or 0) + 1 < n_dev else 0)
        peer_copy(kv, dst)
        t0 = time.perf_counter()
        for _ in range(3):
            peer_copy(kv, dst)
        secs = (time.perf_counter() - t0) / 3
        chk.row(shape.name, f"KV d2d GB/s (peer {can_peer(src, dst)})", nbytes / secs / 1e9, "GB/s", link, "link")
    else:
        print(f"{shape.name:>13}  KV d2d: skipped (one {src.type} device)", flush=True)
    to_device(to_host(kv), src)
    t0 = time.perf_counter()
    for _ in range(3):
        to_device(to_host(kv), src)
    secs = (time.perf_counter() - t0) / 3
    chk.row(shape.name, "KV host-staged GB/s", nbytes / secs / 1e9, "GB/s", link, "link")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "musa", "cpu"])
    ap.add_argument("--profile", default=None, help="sim device profile for the roofline [default: by device name]")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU can run it in seconds)")
    ap.add_argument("--models", default=None, help="comma-separated: qwen2.5-0.5b,7b-class [default: both]")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written [default: a temp dir, removed]")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16", "fp8_e4m3"],
                    help="KV pool dtype (auto: bfloat16 on a GPU, float32 on a CPU)")
    args = ap.parse_args(argv)
    try:
        import torch
        from safetensors.torch import save_file  # noqa: F401 - write_checkpoint's, checked before any work

        if args.device == "musa":
            import torch_musa  # noqa: F401
    except ModuleNotFoundError as exc:   # exit 2 naming what to install, not a traceback
        extra = ("torch_musa (Moore Threads' build of torch)" if exc.name == "torch_musa"
                 else "pip install 'paasbench[torch]' (torch with CUDA for --device cuda)")
        print(f"gpu_check: needs the module {exc.name!r}, which is not installed: {extra}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)      # a shared CI box: one thread is steadier than oversubscribed cores
    profile = args.profile
    if profile is None:
        if args.device == "cpu":
            profile = "cpu-local"
        elif args.device == "musa":
            profile = "mtt-s5000"
        else:
            name = torch.cuda.get_device_name(0).lower()
            profile = "h200" if "h200" in name else "h100"
    chk = Check(args.device, profile, args.quick, args.kv_dtype)
    print(f"gpu_check: device {args.device} ({profile} roofline: {chk.dev.tflops} TFLOPS, {chk.dev.hbm_tbps} TB/s)")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        if args.quick:
            run_model(chk, SHAPES["quick"], work / "quick", prefill_lens=[256, 512], chunk=128, batches=[1, 4],
                      ctx=64, ttft_len=320, decode_steps=4)
        else:
            names = (args.models or "qwen2.5-0.5b,7b-class").split(",")
            for name in names:
                run_model(chk, SHAPES[name], work / name, prefill_lens=[8192, 32768, 131072], chunk=8192,
                          batches=[1, 32, 128], ctx=1024, ttft_len=32768, decode_steps=16)
                shutil.rmtree(work / name, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "profile": profile, "rows": chk.rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
