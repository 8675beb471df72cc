"""Shapes of the real engine's transformer: the built-in random ``tiny``/``small``, or a checkpoint's.

``tiny`` is sized so a 2-core laptop prefills a 4K prompt in well under a second and decodes a
batch of 8 at >= 50 steps/s: the real work is dominated by the 100K-row tied embedding / LM head,
which is why the hidden size stays small. A Hugging Face checkpoint (:mod:`.checkpoint`) yields the
same record with its own sizes, vocabulary and the Llama/Qwen2/Qwen3 variations (q/k/v biases,
per-head q/k RMSNorm, an untied LM head).
"""

from __future__ import annotations

import os

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int              # SwiGLU inner width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    vocab: int | None = None      # embedding rows; None: the harness tokenizer's (built-in models)
    tied_head: bool = True        # LM head = embedding (False: a separate lm_head matrix)
    qkv_bias: bool = False        # Qwen2: biases on q/k/v projections
    o_bias: bool = False          # Llama with attention_bias: a bias on o_proj too
    qk_norm: bool = False         # Qwen3: RMSNorm over head_dim on q and k before RoPE

    def as_dict(self) -> dict:
        return asdict(self)

    def block_params(self) -> int:
        """Weights touched per token, excluding the embedding table (a lookup) and the LM head."""
        d, hd = self.hidden, self.head_dim
        attn = d * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * d
        mlp = 3 * d * self.ffn
        return self.layers * (attn + mlp + 2 * d) + d


CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("tiny", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=384),
        ModelConfig("small", layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=768),
    )
}


def get_config(name: str) -> ModelConfig:
    """A built-in model; ``--model`` that is neither one nor a checkpoint directory says which it looked
    like (a path that is not there, or an unknown name), whatever the backend and device."""
    try:
        return CONFIGS[name]
    except KeyError:
        if os.sep in name or name.startswith((".", "~")) or (os.altsep and os.altsep in name):
            raise ValueError(f"no checkpoint directory at {name!r} (a Hugging Face checkpoint: a directory "
                             f"with config.json and *.safetensors)") from None
        raise ValueError(f"unknown model {name!r}; built in: {', '.join(CONFIGS)}; "
                         f"or a Hugging Face checkpoint directory") from None
