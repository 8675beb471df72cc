"""What a target says about its KV blocks, so synthetic load can size its shared prefix in them.

A server shares a cached prefix in whole KV blocks of its own size; a prefix sized in other blocks is partly
recomputed and the server's hit falls short of the one the trace announces (docs/traces.md, "Synthetic
load"). Two servers say their block size: the bundled reference server in ``GET /v1/models``
(``data[0].block_size``) and vLLM in ``GET /metrics`` (the ``vllm:cache_config_info`` gauge's
``block_size`` label). For any other, ``--block-size`` says it. Asked once, before the trace is made, by
``run`` and ``sweep`` alike (:func:`in_target_blocks`), with or without a shared prefix; a target that does not
answer is not an error here (the run reports it when it sends). The embedded server's is its own setting
(``paasbench.sweep.settings``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paasbench.client.config import ClientConfig
from paasbench.client.models import first_model
from paasbench.metrics.prometheus import scrape


def target_block_size(client: ClientConfig) -> tuple[int, str] | None:
    """The target's KV block size in tokens and where it said so, or None if it does not say. ``/v1/models`` is
    the answer the run reads its model name from too (:mod:`paasbench.client.models`: asked once)."""
    size = (first_model(client) or {}).get("block_size")
    if isinstance(size, int) and size > 0:
        return size, "its /v1/models"
    said = [s.label("block_size") or "" for s in
            scrape(client.server_url, headers=client.target_headers).values("vllm:cache_config_info")]
    size = int(said[0]) if said and said[0].isdigit() else 0
    return (size, "its /metrics vllm:cache_config_info") if size > 0 else None


def in_target_blocks(synth: Any, client: ClientConfig) -> Any:
    """``synth`` (a :class:`~paasbench.workload.synthetic.Synthetic`, or None) in the blocks of the target ``client``
    sends to, when ``--block-size`` did not set them and the target says: its shared prefix is sized in them, and
    a trace without one is described in them too (its hash ids, its offered hit), so a synthetic trace has one
    block size, the target's, whatever its ``--isl``."""
    if synth is None or synth.block_size is not None:
        return synth
    told = target_block_size(client)
    return dataclasses.replace(synth, block_size=told[0], block_size_source=told[1]) if told else synth
