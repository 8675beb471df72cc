"""Hugging Face checkpoints of the Llama / Qwen2 / Qwen3 dense GQA family, loaded onto the one model.

A model directory holds ``config.json``, the weights as ``*.safetensors`` (one file, or shards listed
in ``model.safetensors.index.json``) and ``tokenizer.json``. Nothing is fetched: ``--model PATH``
names a local directory. The three families differ only in details the model already knows how to
run — Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on q and k, Llama 3 a rescaled RoPE, small
ones tie the LM head to the embedding — so loading is a renaming (the tokenizer is read by the
one loader the harness also uses, :func:`paas_common.tokenizer.load_tokenizer`, through :mod:`.vocab`):

    model.embed_tokens.weight                    -> embed            [vocab, hidden]
    lm_head.weight (absent when tied)            -> lm_head          [vocab, hidden]
    model.norm.weight                            -> final_norm
    layers.i.input_layernorm / post_attention_layernorm -> i.attn_norm / i.mlp_norm
    layers.i.self_attn.{q,k,v}_proj.weight (.bias)      -> i.wqkv [hidden, (H + 2 KVH) hd] (i.bqkv)
    layers.i.self_attn.o_proj.weight (.bias)            -> i.wo [H hd, hidden] (i.bo)
    layers.i.self_attn.{q,k}_norm.weight                -> i.q_norm, i.k_norm  [hd]
    layers.i.mlp.{gate,up}_proj.weight / down_proj      -> i.w_gate_up [hidden, 2 ffn] / i.w_down

(HF linear weights are ``[out, in]``; the model multiplies ``x @ W`` so they are transposed once here.)
Tensors are read with the ``safetensors`` library: straight onto the torch device in its dtype for the
torch backend, or as float32 numpy for the numpy backend (numpy has no bfloat16, so BF16 is widened
from its bits).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reference_server.engine.config import ModelConfig

FAMILIES = ("llama", "qwen2", "qwen3")
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A model directory this loader cannot serve; the message names the file and field."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: ModelConfig
    files: tuple[Path, ...]
    version: str                 # prefix-cache key: config + every shard's safetensors header
    eos_ids: tuple[int, ...]
    rope_scaling: dict[str, Any] | None


def is_checkpoint(model: str) -> bool:
    """``--model`` names a directory (a checkpoint) rather than a built-in size."""
    from reference_server.engine.config import CONFIGS

    return bool(model) and model not in CONFIGS and Path(model).is_dir()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def _field(cfg: dict[str, Any], path: Path, name: str, default: Any = ...) -> Any:
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if default is ...:
        raise CheckpointError(f"{path}: field '{name}' missing")
    return default


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        return f.read(n)


def _rope_params(cfg: dict[str, Any], cpath: Path) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 nests them under rope_parameters; older configs have rope_theta / rope_scaling
    nested = cfg.get("rope_parameters") or {}
    theta = float(nested.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or ({k: v for k, v in nested.items() if k != "rope_theta"} or None)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{cpath}: rope_scaling type {kind!r} is not supported (default, llama3)")
    return theta, dict(scaling)  # type: ignore[arg-type]


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a model directory's config and index (not the weights): shape, files, cache version."""
    root = Path(path)
    cpath = root / "config.json"
    raw = _read_json(cpath)
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{cpath}: model_type {family!r} is not supported (dense GQA: {', '.join(FAMILIES)})")
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{cpath}: use_sliding_window is not supported")
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{cpath}: mlp_bias is not supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{cpath}: hidden_act {act!r} is not supported (silu)")
    index = root / INDEX
    if index.exists():
        weight_map = _field(_read_json(index), index, "weight_map")
        files = tuple(root / f for f in sorted(set(weight_map.values())))
    else:
        files = tuple(sorted(root.glob("*.safetensors")))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors weights (and no {INDEX})")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{index}: lists {f.name}, which is missing")
    hidden = int(_field(raw, cpath, "hidden_size"))
    heads = int(_field(raw, cpath, "num_attention_heads"))
    theta, scaling = _rope_params(raw, cpath)
    headers = [_safetensors_header(f) for f in files]
    names = set().union(*(json.loads(h).keys() for h in headers))
    cfg = ModelConfig(
        name=root.resolve().name, layers=int(_field(raw, cpath, "num_hidden_layers")), hidden=hidden, heads=heads,
        kv_heads=int(_field(raw, cpath, "num_key_value_heads", heads)),
        head_dim=int(_field(raw, cpath, "head_dim", hidden // heads)),
        ffn=int(_field(raw, cpath, "intermediate_size")), rope_theta=theta,
        norm_eps=float(_field(raw, cpath, "rms_norm_eps", 1e-6)), vocab=int(_field(raw, cpath, "vocab_size")),
        tied_head=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in names,
        o_bias="model.layers.0.self_attn.o_proj.bias" in names,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in names)
    if cfg.heads % cfg.kv_heads:
        raise CheckpointError(f"{cpath}: num_attention_heads {heads} is not a multiple of num_key_value_heads {cfg.kv_heads}")
    if not cfg.tied_head and "lm_head.weight" not in names:
        raise CheckpointError(f"{cpath}: tie_word_embeddings is false but no lm_head.weight is stored")
    h = hashlib.sha256(cpath.read_bytes())
    for f, head in zip(files, headers):
        h.update(f.name.encode() + struct.pack("<Q", f.stat().st_size) + head)
    gen = root / "generation_config.json"
    eos = _read_json(gen).get("eos_token_id") if gen.exists() else None
    eos = eos if eos is not None else raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
    return Checkpoint(root, cfg, files, h.hexdigest()[:16], eos_ids, scaling)


# ---- weights -------------------------------------------------------------------------------------

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _numpy_tensors(files: tuple[Path, ...]) -> dict[str, np.ndarray]:
    from safetensors import deserialize

    out: dict[str, np.ndarray] = {}
    for f in files:
        for name, t in deserialize(f.read_bytes()):
            if t["dtype"] == "BF16":   # the top half of a float32: widen the bits
                bits = np.frombuffer(t["data"], np.uint16).astype(np.uint32) << 16
                arr = bits.view(np.float32)
            elif t["dtype"] in _NP_DTYPES:
                arr = np.frombuffer(t["data"], _NP_DTYPES[t["dtype"]]).astype(np.float32)
            else:
                raise CheckpointError(f"{f}: tensor {name} has dtype {t['dtype']} (supported: BF16, F16, F32, F64)")
            out[name] = arr.reshape(t["shape"])
    return out


def _torch_tensors(files: tuple[Path, ...], device: str, dtype: Any) -> dict[str, Any]:
    from safetensors import safe_open

    # safetensors maps straight onto CUDA devices; anything else (MUSA) is read on the host, then moved
    direct = device if device.startswith(("cpu", "cuda")) else "cpu"
    out: dict[str, Any] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=direct) as sf:
            for name in sf.keys():
                out[name] = sf.get_tensor(name).to(device, dtype)
    return out


def load_weights(ckpt: Checkpoint, backend: Any) -> dict[str, Any]:
    """The checkpoint's tensors under the model's names, as arrays of ``backend`` (its float dtype)."""
    if backend.name == "numpy":
        raw = _numpy_tensors(ckpt.files)
    else:
        raw = _torch_tensors(ckpt.files, backend.device, backend.float_dtype)
    xp, cfg = backend.xp, ckpt.config

    def get(name: str) -> Any:
        try:
            t = raw.pop(name)
        except KeyError:
            raise CheckpointError(f"{ckpt.path}: tensor {name} missing from the safetensors files") from None
        return t if backend.name != "numpy" else np.ascontiguousarray(t)

    def linear(*names: str) -> Any:   # HF [out, in] (stacked along out) -> [in, out], contiguous
        w = xp.concat([get(n) for n in names], axis=0) if len(names) > 1 else get(names[0])
        return _contiguous(xp.permute_dims(w, (1, 0)), backend)

    def cat(*names: str) -> Any:
        return xp.concat([get(n) for n in names], axis=0)

    w: dict[str, Any] = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight")}
    if not cfg.tied_head:
        w["lm_head"] = get("lm_head.weight")
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[f"{i}.attn_norm"] = get(p + "input_layernorm.weight")
        w[f"{i}.wqkv"] = linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        if cfg.qkv_bias:
            w[f"{i}.bqkv"] = cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        if cfg.qk_norm:
            w[f"{i}.q_norm"], w[f"{i}.k_norm"] = get(a + "q_norm.weight"), get(a + "k_norm.weight")
        w[f"{i}.wo"] = linear(a + "o_proj.weight")
        if cfg.o_bias:
            w[f"{i}.bo"] = get(a + "o_proj.bias")
        w[f"{i}.mlp_norm"] = get(p + "post_attention_layernorm.weight")
        w[f"{i}.w_gate_up"] = linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        w[f"{i}.w_down"] = linear(p + "mlp.down_proj.weight")
    if cfg.tied_head:
        raw.pop("lm_head.weight", None)
    raw = {k: v for k, v in raw.items() if not k.endswith("rotary_emb.inv_freq")}
    if raw:
        raise CheckpointError(f"{ckpt.path}: tensors this loader does not know: {sorted(raw)[:5]}")
    want = {"embed": (cfg.vocab, cfg.hidden), "0.wqkv": (cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim),
            "0.w_gate_up": (cfg.hidden, 2 * cfg.ffn)}
    for k, shape in want.items():
        if tuple(w[k].shape) != shape:
            raise CheckpointError(f"{ckpt.path}: {k} has shape {tuple(w[k].shape)}, config.json implies {shape}")
    return w


def _contiguous(a: Any, backend: Any) -> Any:
    return np.ascontiguousarray(a) if backend.name == "numpy" else a.contiguous()


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """RoPE inverse frequencies (float64), with Llama 3's long-context rescaling when configured."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if not scaling:
        return inv
    factor = float(scaling["factor"])
    lo, hi = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
