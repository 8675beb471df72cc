"""Model and device profiles: YAML package data (``model-NAME.yaml``, ``device-NAME.yaml``).

A profile is data, not code, so a new accelerator or model is one reviewed YAML file whose comments
carry its sources and assumptions. Loaders accept a bundled name or a path to a YAML file (what
``paasbench calibrate --out`` writes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from paas_common.errors import InputError

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
# ModelShape.kv_dtype spelling of each profile dtype, and back
SHAPE_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "fp8_e4m3"}
PROFILE_DTYPE = {shape: name for name, shape in SHAPE_DTYPE.items()}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise InputError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}", field="dtype") from None


@dataclass(frozen=True)
class ModelProfile:
    """What a roofline needs to know about a model. Parameter counts exclude the input embedding
    table (a lookup, not a matmul) and the LM head (run only at sampled positions; costed apart)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    total_params: float           # all block weights (what must sit in HBM, what a dense step streams)
    active_params: float          # block weights one token multiplies by (MoE: shared + top-k experts)
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    compute_dtype: str = "bf16"   # attention and activations
    attention: str = "gqa"        # "gqa" (MHA is kv_heads == heads) or "mla"
    qk_head_dim: int = 0          # per-head q.k width in prefill; 0 = head_dim
    v_head_dim: int = 0           # per-head value width; 0 = head_dim
    kv_lora_rank: int = 0         # MLA latent width cached per token per layer ...
    qk_rope_head_dim: int = 0     # ... plus the decoupled RoPE key
    num_experts: int = 0          # routed experts per MoE layer (0 = dense)
    experts_per_token: int = 0
    sparse_topk: int = 0          # sparse attention (DSA): keys each query attends; 0 = dense
    indexer_heads: int = 0        # DSA lightning indexer, scans every key in FP8
    indexer_head_dim: int = 0
    description: str = ""

    @property
    def attention_kind(self) -> str:
        """``mha`` (a ``gqa`` profile with as many KV heads as query heads), ``gqa`` or ``mla``: what
        ``kv-size`` says, in its text and its JSON alike."""
        return "mha" if self.attention == "gqa" and self.kv_heads == self.heads else self.attention

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """Bytes of KV cache one token adds, over all layers (MLA: one latent, not K and V)."""
        b = dtype_bytes(dtype or self.kv_dtype)
        if self.attention == "mla":
            per_layer = (self.kv_lora_rank + self.qk_rope_head_dim) * b + self.indexer_head_dim  # indexer keys: FP8
        else:
            per_layer = 2 * self.kv_heads * self.head_dim * b
        return self.layers * per_layer


@dataclass(frozen=True)
class DeviceProfile:
    """One machine of ``cards`` accelerators (per-card figures); the sim runs a model tensor-parallel
    over all of them unless told otherwise."""

    name: str
    tflops: dict[str, float]      # dense peak per card, by dtype
    hbm_tbps: float               # memory bandwidth per card, TB/s
    hbm_gb: float                 # memory per card, GB
    cards: int = 1
    interconnect_gbps: float = 0  # card-to-card, GB/s per direction (tensor-parallel all-reduce)
    network_gbps: float = 0       # the machine's KV-transfer link to a peer machine, GB/s
    link_latency_s: float = 0.0
    mfu: float = 0.5              # achievable fraction of peak FLOP/s on the linear layers
    attn_mfu: float = 0.0         # ... on attention (0 = mfu)
    mbu: float = 0.8              # achievable fraction of memory bandwidth (weights: long contiguous reads)
    kv_mbu: float = 0.0           # ... on paged KV reads/writes (0 = mbu)
    overlap: float = 1.0          # 1: compute and memory traffic overlap (roofline max); 0: they add up (a CPU)
    gemm_weight_passes: float = 1.0  # weight reads of a multi-row matmul vs a one-row one (CPU BLAS packs: ~3)
    step_overhead_s: float = 0.0  # per step: launch, scheduling, sampling
    seq_overhead_s: float = 0.0   # per sequence in the step (per-sequence attention set-up)
    description: str = ""
    sources: list[str] = field(default_factory=list)

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s per card for ``dtype``; a dtype the card lacks runs at the next wider one it has."""
        for d in {"fp8": ("fp8", "bf16", "fp16", "fp32"), "bf16": ("bf16", "fp16", "fp32"),
                  "fp16": ("fp16", "bf16", "fp32"), "fp32": ("fp32",)}[dtype]:
            if self.tflops.get(d):
                return self.tflops[d] * 1e12
        raise InputError(f"device profile {self.name!r} has no TFLOPS for {dtype} or wider", field="tflops")


def _names(kind: str) -> list[str]:
    root = resources.files(__name__)
    return sorted(p.name[len(kind) + 1:-5] for p in root.iterdir() if p.name.startswith(kind + "-") and p.name.endswith(".yaml"))


def model_profile_names() -> list[str]:
    return _names("model")


def device_profile_names() -> list[str]:
    return _names("device")


def _load(kind: str, name: str, cls: type) -> Any:
    path = Path(name)
    if name.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise InputError(f"{kind} profile file not found", file=name)
        text, where = path.read_text(), str(path)
    else:
        res = resources.files(__name__) / f"{kind}-{name}.yaml"
        if not res.is_file():
            raise InputError(f"unknown {kind} profile {name!r}; valid: {', '.join(_names(kind))} (or a path to a YAML file)",
                             field=f"{kind}_profile")
        text, where = res.read_text(), f"{kind}-{name}.yaml"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(f"not valid YAML: {exc}", file=where) from exc
    if not isinstance(data, dict):
        raise InputError("a profile must be a YAML mapping", file=where)
    return _build(cls, data, where)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InputError(f"unknown keys {unknown}; valid: {sorted(known)}", file=where, field=unknown[0])
    for f in dataclasses.fields(cls):  # YAML 1.1 reads "742.0e9" (no exponent sign) as a string
        if f.name in data and f.type in ("float", "int"):
            try:
                data[f.name] = float(data[f.name]) if f.type == "float" else int(data[f.name])
            except (TypeError, ValueError):
                raise InputError(f"expected a number, got {data[f.name]!r}", file=where, field=f.name) from None
    try:
        return cls(**data)
    except TypeError as exc:
        raise InputError(str(exc), file=where) from exc


def with_overrides(profile: Any, overrides: str | None, where: str = "--device-set") -> Any:
    """``profile`` with ``"key=value,key=value"`` applied (``tflops.fp8=900`` sets one dtype's rate), checked
    like a YAML file's fields: the what-if knob for one assumption (card memory, MFU, model size) without
    copying the whole profile."""
    if not overrides:
        return profile
    data = dataclasses.asdict(profile)
    for item in overrides.split(","):
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or not key:
            raise InputError(f"{item.strip()!r} is not KEY=VALUE (e.g. hbm_gb=141)", field=where)
        head, dot, sub = key.partition(".")
        if head not in data:
            raise InputError(f"unknown key {head!r}; valid: {sorted(data)}", field=where)
        parsed = yaml.safe_load(value)
        if dot:
            if not isinstance(data[head], dict):
                raise InputError(f"{head!r} is not a mapping; set it as {head}=VALUE", field=where)
            try:
                data[head] = {**data[head], sub: float(parsed)}
            except (TypeError, ValueError):
                raise InputError(f"{key}: expected a number, got {value!r}", field=where) from None
        else:
            data[head] = parsed
    return _build(type(profile), data, where)


def load_model_profile(name: str, overrides: str | None = None) -> ModelProfile:
    p = with_overrides(_load("model", name, ModelProfile), overrides, "--model-set")
    for d in (p.weight_dtype, p.kv_dtype, p.compute_dtype):
        dtype_bytes(d)
    if p.attention not in ("gqa", "mla"):
        raise InputError(f"attention must be gqa or mla, not {p.attention!r}", file=name, field="attention")
    return p


def model_profile_of(cfg: Any, weight_dtype: str, kv_dtype: str) -> ModelProfile:
    """The roofline's view of a real engine's model (:class:`reference_server.engine.config.ModelConfig`:
    a built-in size or a checkpoint's), in the engine's dtypes (``ModelShape`` spelling: ``bfloat16``...)."""
    if cfg.vocab is None:
        from reference_server.engine.vocab import vocab_size

        vocab = vocab_size()
    else:
        vocab = int(cfg.vocab)
    block = float(cfg.block_params())
    w = PROFILE_DTYPE[weight_dtype]
    return ModelProfile(cfg.name, cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, vocab, block, block,
                        weight_dtype=w, kv_dtype=PROFILE_DTYPE[kv_dtype], compute_dtype=w,
                        description=f"the real engine's {cfg.name} ({weight_dtype} weights, {kv_dtype} KV)")


def load_device_profile(name: str, overrides: str | None = None) -> DeviceProfile:
    return with_overrides(_load("device", name, DeviceProfile), overrides, "--device-set")
