"""The ``sim`` engine: the hardware twin. Same interface and batching as ``cpu``, but a step costs
what the roofline says a model profile costs on a device profile; KV is accounted, never allocated
(:class:`VirtualKV`), so a 400K-token context on a 744B model runs on a laptop.

**Host time is overlapped, as on an engine with async scheduling.** Between two busy steps the worker
does its own bookkeeping on the host (emitting tokens, IPC, admitting requests, planning the next
batch); a real engine runs that on the CPU while the accelerator computes the previous step. So a step
sleeps only what is left of its modeled length after the host time the worker spent since the
previous busy step ended (:meth:`SimEngine.step`; a step that slept ended when its sleep was due, so a
late wake-up on a busy host is host time of the next one). Where the host took longer than the modeled step,
the excess is *host-bound* time: the twin ran slower than the device it models, and says so
(``host_bound_seconds_total``; the worker's ``/metrics`` and each request's ``host_bound_ms``). After
an idle wait (:meth:`SimEngine.idle`) nothing overlaps: the first step's host work is paid in full,
as on real hardware whose accelerator sat idle."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from typing import Any, Sequence

from paas_common.hashing import mix64
from reference_server.engine.base import Engine, ModelShape, SeqStep, VirtualKV
from reference_server.engine.batch import check_block_ids, validate_batch
from reference_server.engine.vocab import emittable_ids, vocab_size
from reference_server.sim.profiles import (SHAPE_DTYPE, DeviceProfile, ModelProfile, dtype_bytes, load_device_profile,
                                           load_model_profile)
from reference_server.sim.roofline import StepCost, instance_cards, step_cost

class SimEngine(Engine):
    def __init__(self, *, block_size: int, num_blocks: int, model_profile: str | ModelProfile,
                 device_profile: str | DeviceProfile = "cpu-local", seed: int = 0, time_scale: float = 1.0,
                 tp: int | None = None, step_slowdown: float = 0.0) -> None:
        """``time_scale`` multiplies every sleep (0: account modeled time without sleeping, for tests
        and what-if sweeps); ``tp``: cards of the instance the model is split over (tensor/expert parallel;
        default: the fewest that hold the weights plus the KV floor, :func:`instance_cards`);
        ``step_slowdown``: test hook, every step's modeled time is that fraction longer (perf gate check)."""
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError("block_size and num_blocks must be positive")
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.model = model_profile if isinstance(model_profile, ModelProfile) else load_model_profile(model_profile)
        self.device = device_profile if isinstance(device_profile, DeviceProfile) else load_device_profile(device_profile)
        self.tp = instance_cards(self.model, self.device, tp)
        self.block_size, self.num_blocks, self.time_scale, self.seed = block_size, num_blocks, time_scale, seed
        self.step_slowdown = step_slowdown
        self._emit = emittable_ids()
        m = self.model
        # ModelShape describes KV as K and V of kv_heads x head_dim; an MLA latent (one vector, not a
        # pair) is expressed as one head of half its byte width so kv_bytes_per_token() stays exact.
        per_layer = m.kv_bytes_per_token() // m.layers
        kv_heads, head_dim = (m.kv_heads, m.head_dim) if m.attention == "gqa" else (1, per_layer // (2 * dtype_bytes(m.kv_dtype)))
        version = hashlib.sha256(json.dumps({"sim": asdict(m), "seed": seed}, sort_keys=True).encode()).hexdigest()[:16]
        self.shape = ModelShape(name=m.name, version=version, layers=m.layers, kv_heads=kv_heads, head_dim=head_dim,
                                vocab_size=vocab_size(), kv_dtype=SHAPE_DTYPE[m.kv_dtype])
        if self.shape.kv_bytes_per_token() != m.kv_bytes_per_token():
            raise ValueError(f"model profile {m.name!r}: per-layer KV bytes {per_layer} cannot be shaped as K/V heads")
        self.block_nbytes = block_size * m.kv_bytes_per_token()
        self.last_cost: StepCost | None = None
        self.modeled_seconds_total = 0.0
        # host time: perf_counter when the previous busy step ended (None: idle since); the excess of host
        # time over modeled steps, in real seconds, and how many steps had any
        self._host_from: float | None = None
        self.last_host_bound_s = 0.0
        self.host_bound_seconds_total = 0.0
        self.host_bound_steps = 0
        self.steps = 0

    def cost(self, batch: Sequence[SeqStep]) -> StepCost:
        """The roofline cost of a step, without running it."""
        return step_cost(self.model, self.device, [(len(s.token_ids), s.start_pos) for s in batch], self.tp)

    def _token(self, s: SeqStep) -> int:
        # a function of (seed, last token, its position) only: the same prompt gives the same output in
        # every serving mode and across prefill/decode hand-offs, like greedy decoding of a real model
        pos = s.start_pos + len(s.token_ids) - 1
        h = mix64(mix64(self.seed) ^ mix64(int(s.token_ids[-1]) * 1_000_003 + pos))
        return int(self._emit[h % len(self._emit)])

    def idle(self) -> None:
        """The worker has no step to run next (it waits for work): the host time until the next step is
        not overlapped with a previous one."""
        self._host_from = None

    def step(self, batch: Sequence[SeqStep]) -> list[int]:
        t0 = time.perf_counter()
        if not batch:
            return []
        host_s = 0.0 if self._host_from is None else t0 - self._host_from   # since the previous busy step
        validate_batch(batch, block_size=self.block_size, num_blocks=self.num_blocks, vocab=self.shape.vocab_size)
        self.last_cost = cost = self.cost(batch)
        seconds = cost.seconds * (1.0 + self.step_slowdown)
        self.modeled_seconds_total += seconds      # the modeled clock: scheduler and gate read time from it
        tokens = [self._token(s) for s in batch]
        remaining = seconds * self.time_scale - host_s - (time.perf_counter() - t0)
        self.steps += 1
        self.last_host_bound_s = 0.0
        if remaining > 0:
            end = time.perf_counter() + remaining
            time.sleep(remaining)
            # the modeled step ended at ``end``: a late wake-up (a busy host's scheduler) is host time too,
            # overlapped by the next step like the rest
            self._host_from = end
            return tokens
        if self.time_scale > 0:                    # at scale 0 nothing sleeps: no step is "host-bound"
            self.last_host_bound_s = -remaining
            self.host_bound_seconds_total -= remaining
            self.host_bound_steps += 1
        self._host_from = time.perf_counter()
        return tokens

    @property
    def last_busy_s(self) -> float:
        """Real seconds the last step kept this worker busy: its modeled length (scaled) plus any host-bound
        excess; the overlapped host time is inside it, not before it."""
        return self.last_cost.seconds * (1.0 + self.step_slowdown) * self.time_scale + self.last_host_bound_s \
            if self.last_cost is not None else 0.0

    def read_blocks(self, block_ids: Sequence[int]) -> VirtualKV:
        check_block_ids(block_ids, self.num_blocks)
        return VirtualKV(n_blocks=len(block_ids), nbytes=len(block_ids) * self.block_nbytes)

    def write_blocks(self, block_ids: Sequence[int], kv: Any) -> None:
        check_block_ids(block_ids, self.num_blocks)
        if not isinstance(kv, VirtualKV):
            raise ValueError(f"the sim engine installs VirtualKV, not {type(kv).__name__}")
        if kv.n_blocks != len(block_ids) or kv.nbytes != len(block_ids) * self.block_nbytes:
            raise ValueError(f"VirtualKV of {kv.n_blocks} blocks / {kv.nbytes} B does not match {len(block_ids)} "
                             f"blocks of {self.block_nbytes} B")
