"""The embedded twin as a plan sees it: one card's model and device profiles, and the server flags that deploy a
pool of them (for the probes) or a whole planned deployment (for its verification).

Every twin deployment a plan starts routes every prefill to the prefill pool (``--routing threshold
--remote-prefill-threshold 0`` and a prefill queue without bound): the plan sizes a prefill pool that does the
prefills and a decode pool that decodes, so the server must not move prefills onto the decode workers when the
prefill pool is busy, as its default cost rule does (docs/reference_server.md, *Routing*). The colocated and
chunked alternatives are the server's own modes on the same number of mixed workers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ALL_REMOTE = {"routing": "threshold", "remote_prefill_threshold": 0, "prefill_queue_bound": 1_000_000}


@dataclass(frozen=True, slots=True)
class Card:
    """One card's twin: the model on ``device_profile`` with the server settings that shape its steps."""

    model_profile: str
    device_profile: str
    cards_per_worker: int | None = None       # None: the fewest that hold the model
    block_size: int = 512
    max_num_seqs: int = 64
    prefill_chunk_tokens: int = 512           # mixed and decode workers
    sim_time_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)   # other server settings of the workload's section

    @classmethod
    def from_section(cls, section: dict[str, Any], device_profile: str | None = None,
                     scale: float | None = None) -> "Card":
        known = {"model_profile", "device_profile", "cards_per_worker", "block_size", "max_num_seqs",
                 "prefill_chunk_tokens", "sim_time_scale"}
        skip = known | {"engine", "mode", "workers", "prefill_workers", "decode_workers", *ALL_REMOTE}
        return cls(model_profile=str(section.get("model_profile") or "glm-5.2-fp8"),
                   device_profile=str(device_profile or section.get("device_profile") or "mtt-s5000"),
                   cards_per_worker=int(section["cards_per_worker"]) if section.get("cards_per_worker") else None,
                   block_size=int(section.get("block_size") or 512),
                   max_num_seqs=int(section.get("max_num_seqs") or 64),
                   prefill_chunk_tokens=int(section.get("prefill_chunk_tokens") or 512),
                   sim_time_scale=float(scale if scale is not None else section.get("sim_time_scale") or 1.0),
                   extra={k: v for k, v in section.items() if k not in skip})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def profiles(self) -> tuple[Any, Any, int]:
        """(model, device, cards per instance)."""
        from reference_server.sim.profiles import load_device_profile, load_model_profile
        from reference_server.sim.roofline import instance_cards

        model, device = load_model_profile(self.model_profile), load_device_profile(self.device_profile)
        return model, device, instance_cards(model, device, self.cards_per_worker)

    def instance(self) -> Any:
        from paasbench.plan.curves import Instance
        from reference_server.sim.roofline import kv_capacity_tokens

        model, device, cards = self.profiles()
        return Instance(machine_type=device.name, cards_per_instance=cards, cards_per_machine=device.cards,
                        model=model.name, kv_tokens=kv_capacity_tokens(model, device, cards),
                        chunk_tokens=self.prefill_chunk_tokens)

    def base_section(self) -> dict[str, Any]:
        return {"engine": "sim", "model_profile": self.model_profile, "device_profile": self.device_profile,
                "block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                "prefill_chunk_tokens": self.prefill_chunk_tokens, "sim_time_scale": self.sim_time_scale,
                **({"cards_per_worker": self.cards_per_worker} if self.cards_per_worker else {}), **self.extra}


def disaggregated_section(prefill: Card, decode: Card, prefill_workers: int, decode_workers: int) -> dict[str, Any]:
    """The server section of ``prefill_workers`` prefill instances of ``prefill``'s card and ``decode_workers`` of
    ``decode``'s, every prefill on the prefill pool."""
    section = {**decode.base_section(), "mode": "disaggregated", "prefill_workers": prefill_workers,
               "decode_workers": decode_workers, "workers": prefill_workers + decode_workers, **ALL_REMOTE}
    if prefill.device_profile != decode.device_profile or prefill.cards_per_worker != decode.cards_per_worker:
        section["prefill_device_profile"] = prefill.device_profile
        if prefill.cards_per_worker:
            section["prefill_cards_per_worker"] = prefill.cards_per_worker
    return section


def mixed_section(card: Card, mode: str, workers: int) -> dict[str, Any]:
    """``workers`` mixed workers of ``card`` in ``mode`` (colocated or chunked)."""
    return {**card.base_section(), "mode": mode, "workers": workers}


def scaled_limits(scale: float, *, verify: bool = False) -> Any:
    """The saturation test's limits on a twin ``scale`` times slower: its absolute growth amounts (250 ms of TTFT,
    0.5 s in system) are meant in the device's time, so they are ``scale`` times as long on the twin's wall clock.
    Unscaled, a twin at scale 5 was called saturated for 63 -> 114 ms (device) of TTFT growth across a 2-second
    window that met its p90 <= 300 ms; the client's own schedule lag is wall time and keeps its limit. A probe is a
    search step and counts any growth; a ``verify`` run judges it against the SLO's bound, as a sweep's
    verification does (``sweep.saturation.step_limits``)."""
    import dataclasses

    from paasbench.sweep.saturation import step_limits

    base = step_limits("verify" if verify else "probe")
    return dataclasses.replace(base, ttft_growth_min_ms=base.ttft_growth_min_ms * scale,
                               tis_growth_min_s=base.tis_growth_min_s * scale)
