"""Roofline step time of one engine step: ``max(FLOPs / (peak * MFU), bytes / (BW * MBU)) + comm + overhead``
(a device whose compute and memory traffic do not overlap -- ``overlap < 1``, a CPU -- adds part of the smaller).

Each term is spelled out in docs/engines.md. The step is a list of ``(n_new, start_pos)`` items, the
same shape the engines see, so prefill chunks, decode tokens and mixed batches cost what they do:
weights are streamed once per step and shared by every token in it (why batching decode pays), KV is
read once per sequence, and attention FLOPs grow with the context each new token attends to (the
quadratic prefill term).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from paas_common.errors import InputError
from reference_server.sim.profiles import DeviceProfile, ModelProfile, dtype_bytes


@dataclass(frozen=True)
class StepCost:
    tokens: int
    seqs: int
    linear_flops: float   # block matmuls + the LM head at each sequence's last position
    attn_flops: float     # q.k and p.v over the attended context
    indexer_flops: float  # sparse attention's key scorer: every key, every query, in FP8
    weight_bytes: float   # weights streamed from memory (MoE: only the experts the step's tokens hit)
    kv_bytes: float       # KV read (context) and written (new tokens)
    compute_s: float
    memory_s: float
    comm_s: float         # tensor-parallel all-reduces over the card-to-card link
    overhead_s: float

    overlap: float = 1.0

    @property
    def seconds(self) -> float:
        c, m = self.compute_s, self.memory_s
        return max(c, m) + (1.0 - self.overlap) * min(c, m) + self.comm_s + self.overhead_s


def attended_pairs(n: int, start: int, topk: int = 0) -> int:
    """Sum over the new tokens at positions ``start .. start+n-1`` of the keys each attends (itself
    and everything before it, capped at ``topk`` for sparse attention): ``n*start + n(n+1)/2`` dense."""
    lo, hi = start + 1, start + n          # context length seen by the first and last new token
    if not topk or hi <= topk:
        return (lo + hi) * n // 2
    if lo > topk:
        return n * topk
    return (lo + topk) * (topk - lo + 1) // 2 + (hi - topk) * topk


def touched_params(model: ModelProfile, tokens: int) -> float:
    """Block weights a step of ``tokens`` tokens must read. MoE: the shared part always, plus each
    expert hit by at least one token -- E * (1 - (1 - k/E)^tokens) experts in expectation."""
    E, k = model.num_experts, model.experts_per_token
    if not E or not k or tokens == 0:
        return model.total_params if tokens else 0.0
    expert = (model.total_params - model.active_params) / (E - k)
    shared = model.active_params - k * expert
    return shared + expert * E * (1.0 - (1.0 - k / E) ** tokens)


def indexer_bytes_per_token(model: ModelProfile) -> int:
    return model.layers * model.indexer_head_dim   # FP8 indexer keys


def weight_params(model: ModelProfile) -> float:
    """Parameters held in memory: the model's own plus the untied LM head."""
    return model.total_params + model.hidden * model.vocab


def weight_bytes_total(model: ModelProfile) -> float:
    return weight_params(model) * dtype_bytes(model.weight_dtype)


KV_FLOOR = 0.2   # share of an instance's memory kept for KV cache and activations when sizing it


def instance_sizes(device: DeviceProfile, limit: int = 64) -> list[int]:
    """Card counts an instance can have: a divisor of the machine's cards (tensor/expert parallel inside
    one machine, several instances per machine) or whole machines (pipeline stages across them)."""
    n = device.cards
    return [c for c in range(1, n + 1) if n % c == 0] + [n * k for k in range(2, limit + 1)]


def needed_gb_per_card(weight_bytes: float, cards: int, kv_floor: float = KV_FLOOR) -> float:
    """Card memory (GB) at which ``weight_bytes`` fit ``cards`` cards with ``kv_floor`` of it left for KV."""
    return weight_bytes / (1 - kv_floor) / cards / 1e9


def fits(model: ModelProfile, device: DeviceProfile, cards: int, kv_floor: float = KV_FLOOR) -> bool:
    """The weights fit ``cards`` cards with at least ``kv_floor`` of their memory left for KV."""
    return needed_gb_per_card(weight_bytes_total(model), cards, kv_floor) <= device.hbm_gb


def instance_cards(model: ModelProfile, device: DeviceProfile, cards: int | None = None,
                   kv_floor: float = KV_FLOOR) -> int:
    """Cards of one serving instance (one worker): ``cards`` when given (checked), else the fewest of
    :func:`instance_sizes` that hold the weights plus the KV floor -- a 742B FP8 model takes two 8 x 80 GB
    machines (16 cards) but one 8 x 141 GB machine; a 7B FP16 model one card. Raises ``InputError`` naming
    the cards asked for and the cards needed when the weights do not fit."""
    sizes = instance_sizes(device)
    need = next((c for c in sizes if fits(model, device, c, kv_floor)), None)
    weights_gb = weight_bytes_total(model) / 1e9
    if need is None:
        raise InputError(f"{model.name} ({weights_gb:,.0f} GB of weights) does not fit {sizes[-1]} cards of "
                         f"{device.name} ({device.hbm_gb:g} GB each)", field="--cards-per-worker")
    if cards is None:
        return need
    if cards not in sizes:
        raise InputError(f"{cards} cards: an instance is a divisor of the {device.name} machine's {device.cards} "
                         f"cards or whole machines ({', '.join(str(c) for c in sizes if c <= 4 * device.cards)}, ...)",
                         field="--cards-per-worker")
    if cards < need:
        raise InputError(f"{cards} cards of {device.name} hold {cards * device.hbm_gb:,.0f} GB; {model.name} needs "
                         f"{need} cards: {weights_gb:,.0f} GB of weights + a KV floor of {kv_floor:.0%} of memory "
                         f"(>= {weights_gb / (1 - kv_floor):,.0f} GB)", field="--cards-per-worker")
    return cards


def compute_bound_chunk(model: ModelProfile, device: DeviceProfile, cards: int, block_size: int,
                        limit: int = 65536) -> int:
    """The smallest prefill chunk (``block_size`` x a power of two) whose step is compute-bound -- compute
    time >= memory time for a chunk at position 0, the least compute any chunk of a prompt has. Smaller
    chunks stream the weights (MoE: nearly every expert from ~100 tokens on) for too few FLOPs."""
    n = max(1, block_size)
    while n < limit:
        c = step_cost(model, device, [(n, 0)], cards)
        if c.compute_s >= c.memory_s:
            return n
        n *= 2
    return limit


def step_cost(model: ModelProfile, device: DeviceProfile, items: Sequence[tuple[int, int]],
              tp: int | None = None) -> StepCost:
    """Cost of one step over ``items`` = ``[(n_new_tokens, start_pos), ...]`` tensor-parallel over
    ``tp`` cards (default :func:`instance_cards`): tensor parallel inside a machine, pipeline stages
    across machines (chunks in flight keep every stage busy, so throughput counts all cards)."""
    tp = tp or instance_cards(model, device)
    n_tok, n_seq = sum(n for n, _ in items), len(items)
    w_b = dtype_bytes(model.weight_dtype)
    qk, v = model.qk_head_dim or model.head_dim, model.v_head_dim or model.head_dim
    per_pair = 2 * model.heads * (qk + v) * model.layers
    idx_pair = 2 * model.indexer_heads * model.indexer_head_dim * model.layers
    lm_head = model.hidden * model.vocab

    linear = 2.0 * model.active_params * n_tok + 2.0 * lm_head * n_seq
    attn = float(sum(attended_pairs(n, p, model.sparse_topk) for n, p in items)) * per_pair
    indexer = float(sum(attended_pairs(n, p) for n, p in items)) * idx_pair if idx_pair else 0.0
    idx_bpt = indexer_bytes_per_token(model)
    main_bpt = model.kv_bytes_per_token() - idx_bpt
    kv = 0.0
    for n, p in items:
        ctx = p + n
        read = min(ctx, model.sparse_topk * n) if model.sparse_topk else ctx
        kv += read * main_bpt + ctx * idx_bpt + n * main_bpt  # context read + new tokens written
    # a one-row matmul streams its weights once (GEMV); a CPU BLAS GEMM first packs (copies) them, which
    # costs gemm_weight_passes reads -- the block weights run over n_tok rows, the LM head over n_seq
    passes = device.gemm_weight_passes
    weights = (touched_params(model, n_tok) * (1.0 if n_tok == 1 else passes)
               + (lm_head * (1.0 if n_seq == 1 else passes) if n_seq else 0.0)) * w_b

    attn_mfu = device.attn_mfu or device.mfu
    compute = (linear / (device.peak_flops(model.weight_dtype) * device.mfu * tp)
               + attn / (device.peak_flops(model.compute_dtype) * attn_mfu * tp)
               + indexer / (device.peak_flops("fp8") * attn_mfu * tp))
    bw = device.hbm_tbps * 1e12 * tp
    memory = weights / (bw * device.mbu) + kv / (bw * (device.kv_mbu or device.mbu))
    comm = 0.0
    act = n_tok * model.hidden * dtype_bytes(model.compute_dtype)
    tp_in = min(tp, device.cards)
    if tp_in > 1:  # tensor parallel inside a machine: two all-reduces per layer, a ring moves 2(tp-1)/tp per card
        if not device.interconnect_gbps:
            raise ValueError(f"device {device.name!r} has no interconnect_gbps for tensor parallel {tp_in}")
        comm += model.layers * 2 * (2 * (tp_in - 1) / tp_in) * act / (device.interconnect_gbps * 1e9)
    machines = -(-tp // device.cards)
    if machines > 1:  # pipeline stages across machines: activations cross each machine boundary once
        if not device.network_gbps:
            raise ValueError(f"device {device.name!r} has no network_gbps for {machines} pipeline stages")
        comm += (machines - 1) * act / (device.network_gbps * 1e9)
    overhead = (device.step_overhead_s + device.seq_overhead_s * n_seq) if n_seq else 0.0
    return StepCost(n_tok, n_seq, linear, attn, indexer, weights, kv, compute, memory, comm, overhead, device.overlap)


def step_seconds(model: ModelProfile, device: DeviceProfile, items: Sequence[tuple[int, int]],
                 tp: int | None = None) -> float:
    return step_cost(model, device, items, tp).seconds


def prefill_seconds(model: ModelProfile, device: DeviceProfile, prompt_tokens: int, chunk_tokens: int,
                    tp: int | None = None) -> float:
    """Modeled TTFT compute of one prompt prefilled alone in chunks of ``chunk_tokens``."""
    return sum(step_seconds(model, device, [(min(chunk_tokens, prompt_tokens - s), s)], tp)
               for s in range(0, prompt_tokens, chunk_tokens))


def kv_transfer_seconds(nbytes: float, device: DeviceProfile, link: str = "network") -> float:
    """Wire time of ``nbytes`` of KV between two machines (``network``) or two cards (``interconnect``)."""
    gbps = device.network_gbps if link == "network" else device.interconnect_gbps
    if not gbps:
        raise ValueError(f"device {device.name!r} has no {link}_gbps")
    return device.link_latency_s + nbytes / (gbps * 1e9)


def kv_capacity_tokens(model: ModelProfile, device: DeviceProfile, tp: int | None = None,
                       kv_dtype: str | None = None) -> int:
    """Tokens of KV that fit in the HBM left after the weights, over ``tp`` cards (0 if the weights don't fit)."""
    tp = tp or instance_cards(model, device)
    free = device.hbm_gb * 1e9 * tp - weight_bytes_total(model)
    return max(0, int(free // model.kv_bytes_per_token(kv_dtype)))


def kv_footprint(model: ModelProfile, dtype: str, context: int, device: DeviceProfile | None = None,
                 cards: int | None = None) -> dict:
    """KV bytes per token and per ``context``-token request (``paasbench kv-size``); with a ``device``, the
    instance's cards and how many such requests fit in the memory left after the weights."""
    per_token = model.kv_bytes_per_token(dtype)
    out: dict = {"model_profile": model.name, "attention": model.attention_kind, "kv_dtype": dtype,
                 "dtype_bytes": dtype_bytes(dtype), "context_tokens": context, "kv_bytes_per_token": per_token,
                 "kv_bytes_per_request": per_token * context}
    if device is not None:
        cards = instance_cards(model, device, cards)
        cap = kv_capacity_tokens(model, device, cards, dtype)
        out.update({"device_profile": device.name, "instance_cards": cards, "kv_capacity_tokens": cap,
                    "requests_fitting": cap // context})
    return out
