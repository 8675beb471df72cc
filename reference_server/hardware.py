"""What a server configuration occupies: cards per worker, cards, machines -- and the prefill-only
workers' chunk size.

One worker is one model instance. On the ``sim`` engine an instance spans ``cards`` cards of the device
profile (tensor/expert parallel; :func:`reference_server.sim.roofline.instance_cards` sizes and checks it),
and a machine has the device profile's ``cards``; the server occupies every worker's cards, packed onto
whole machines. The cost model charges those machines, so the sweep records this next to its figures
(``meta.hardware``, and ``cards`` / ``machines`` on each cost row). The ``cpu`` engine runs its workers
as processes on this one host: one machine, no cards.

A disaggregated sim server may give its prefill pool another card (``--prefill-device-profile``): its
prefill instances then span that card's cards (``--prefill-cards-per-worker``) on that card's machines, and the
two pools are counted on machines of their own type (a machine holds one kind of card).

Workers that joined from other hosts (``serve --join``) count where they run: each joined host is a
machine of its own (its workers' cards packed onto whole machines there), next to the router's host when it
runs workers of its own (a router whose workers all joined occupies no machine of the count). A
running server reports this in ``/health`` (``hardware``), which is what a sweep against ``--target``
records; from flags alone (an embedded server) nobody has joined yet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from reference_server.config import ServerConfig


@dataclass(frozen=True)
class Hardware:
    engine: str
    workers: dict[str, int]              # worker processes per role
    cards_per_worker: int | None         # None: the cpu engine (processes on this host)
    cards_per_machine: int | None
    prefill_worker_chunk_tokens: int | None = None
    kv_floor: float | None = None
    kv_tokens_per_worker: int | None = None
    device: dict[str, Any] = field(default_factory=dict)   # the profile's figures (assumptions), as used
    model: dict[str, Any] = field(default_factory=dict)
    joined: dict[str, dict[str, int]] = field(default_factory=dict)   # host -> role -> workers joined from it
    # the prefill pool's card when it is another one (--prefill-device-profile): {"device": {...},
    # "cards_per_worker", "cards_per_machine", "prefill_worker_chunk_tokens"}; None: the same card as the rest
    prefill_pool: dict[str, Any] | None = None

    def _cards_of(self, role: str) -> tuple[int | None, int | None]:
        """(cards per worker, cards per machine) of ``role``'s workers."""
        if role == "prefill" and self.prefill_pool is not None:
            return self.prefill_pool["cards_per_worker"], self.prefill_pool["cards_per_machine"]
        return self.cards_per_worker, self.cards_per_machine

    @property
    def cards(self) -> int | None:
        if self.cards_per_worker is None:
            return None
        return sum(n * (self._cards_of(role)[0] or 0) for role, n in self.workers.items())

    @property
    def machines(self) -> int:
        """The hosts that carry workers, each as the whole machines its workers' cards fill (each kind of card
        on machines of its own): the router's host (none when every worker joined from elsewhere: a router
        alone occupies no card) and each host workers joined from."""
        local = dict(self.workers)
        for roles in self.joined.values():
            for role, n in roles.items():
                local[role] = local.get(role, 0) - n
        return self._machines(local) + sum(self._machines(r) for r in self.joined.values())

    def _machines(self, workers: dict[str, int]) -> int:
        """Machines of one host's ``workers`` (role -> count): none without workers, else at least one."""
        if sum(n for n in workers.values() if n > 0) <= 0:
            return 0
        if self.cards_per_worker is None or not self.cards_per_machine:
            return 1
        kinds: dict[tuple[int | None, int | None], int] = {}
        for role, n in workers.items():
            if n > 0:
                kinds[self._cards_of(role)] = kinds.get(self._cards_of(role), 0) + n
        return max(1, sum(-(-n * (cpw or 0) // (cpm or 1)) for (cpw, cpm), n in kinds.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"cards": self.cards, "machines": self.machines, **dataclasses.asdict(self)}


def sim_profiles(cfg: ServerConfig) -> tuple[Any, Any]:
    """The sim engine's model and device profiles, with ``--model-set`` / ``--device-set`` applied."""
    from reference_server.sim.profiles import load_device_profile, load_model_profile

    return (load_model_profile(cfg.model_profile or cfg.model, cfg.model_set),
            load_device_profile(cfg.device_profile or "cpu-local", cfg.device_set))


def role_profiles(cfg: ServerConfig, role: str) -> tuple[Any, Any, int | None]:
    """(model, device, cards per worker as asked) of one role's sim workers: the prefill pool's own card when
    ``--prefill-device-profile`` gives one (``--device-set`` is the other card's and does not apply to it)."""
    model, device = sim_profiles(cfg)
    if role == "prefill" and cfg.prefill_device_profile:
        from reference_server.sim.profiles import load_device_profile

        return model, load_device_profile(cfg.prefill_device_profile), cfg.prefill_cards_per_worker
    return model, device, cfg.cards_per_worker


def server_hardware(cfg: ServerConfig, joined: dict[str, dict[str, int]] | None = None) -> Hardware:
    """The hardware of ``cfg``'s workers plus the ``joined`` ones (host -> role -> count). Raises ``InputError``
    (exit 2) when ``--cards-per-worker`` cannot hold the model."""
    joined = joined or {}
    workers = dict(cfg.pools())
    for roles in joined.values():
        for role, n in roles.items():
            workers[role] = workers.get(role, 0) + n   # type: ignore[index]
    if cfg.engine != "sim":
        return Hardware(cfg.engine, workers, None, None, prefill_chunk(cfg), joined=joined)
    from reference_server.sim.roofline import (KV_FLOOR, instance_cards, kv_capacity_tokens, weight_bytes_total,
                                               weight_params)

    model, device = sim_profiles(cfg)
    cards = instance_cards(model, device, cfg.cards_per_worker)
    mod = {k: getattr(model, k) for k in ("name", "total_params", "active_params", "weight_dtype", "kv_dtype")}
    mod.update(weight_params=weight_params(model), weight_bytes=weight_bytes_total(model),
               kv_bytes_per_token=model.kv_bytes_per_token())
    pool = None
    chunk_device, chunk_cards = device, cards
    if cfg.prefill_device_profile and cfg.mode == "disaggregated":
        _, p_device, p_asked = role_profiles(cfg, "prefill")
        p_cards = instance_cards(model, p_device, p_asked)
        chunk_device, chunk_cards = p_device, p_cards
        pool = {"device": _device_figures(p_device), "cards_per_worker": p_cards, "cards_per_machine": p_device.cards,
                "kv_tokens_per_worker": kv_capacity_tokens(model, p_device, p_cards)}
    return Hardware("sim", workers, cards, device.cards, prefill_chunk(cfg, model, chunk_device, chunk_cards),
                    KV_FLOOR, kv_capacity_tokens(model, device, cards), _device_figures(device), mod, joined, pool)


def _device_figures(device: Any) -> dict[str, Any]:
    return {k: getattr(device, k) for k in ("name", "hbm_gb", "hbm_tbps", "tflops", "mfu", "attn_mfu", "mbu", "kv_mbu",
                                            "interconnect_gbps", "network_gbps", "cards")}


def prefill_chunk(cfg: ServerConfig, model: Any = None, device: Any = None, cards: int | None = None) -> int:
    """Tokens per step on a prefill-only worker: ``--prefill-worker-chunk-tokens``, else on the sim the
    smallest compute-bound chunk (:func:`compute_bound_chunk`), else ``--prefill-chunk-tokens``. Mixed and
    decode workers keep ``--prefill-chunk-tokens``: there a long chunk stalls every running decode."""
    if cfg.prefill_worker_chunk_tokens:
        return cfg.prefill_worker_chunk_tokens
    if model is None or device is None:
        return cfg.prefill_chunk_tokens
    from reference_server.sim.roofline import compute_bound_chunk

    return compute_bound_chunk(model, device, cards or 1, cfg.block_size)


def hardware_for_flags(args: list[str]) -> Hardware:
    """:func:`server_hardware` of the server ``python -m reference_server ARGS`` would start (the embedded
    server of a sweep): parsed by the server's own command, so the flags mean exactly what they mean there."""
    import click

    from paas_common.errors import InputError
    from reference_server.options import parse_flags, server_config

    try:
        params = parse_flags(args)
    except click.UsageError as exc:
        raise InputError(f"embedded server flags: {exc.format_message()}", field="server") from None
    return server_hardware(server_config(params))
