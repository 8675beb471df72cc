"""Engines behind one interface (:mod:`reference_server.engine.base`); build one with :func:`create_engine`."""

from __future__ import annotations

from typing import Any

from reference_server.engine.base import Engine, ModelShape, SeqStep, VirtualKV

__all__ = ["Engine", "ModelShape", "SeqStep", "VirtualKV", "create_engine", "ENGINE_KINDS"]

ENGINE_KINDS = ("cpu", "sim")


def create_engine(kind: str, *, block_size: int, num_blocks: int | None, model: str = "tiny",
                  backend: str = "numpy", device: str = "cpu", model_profile: Any = None,
                  device_profile: Any = None, seed: int = 0, time_scale: float = 1.0, cards: int | None = None,
                  step_slowdown: float = 0.0, **real: Any) -> Engine:
    """``cpu``: the real transformer ``model`` (a built-in size or a checkpoint directory) on
    ``backend``/``device``; ``real`` passes ``dtype``, ``kv_dtype``, ``kv_budget_bytes`` and
    ``gpu_memory_utilization`` on (``num_blocks=None``: sized from the budget or the device's free
    memory). ``sim``: the roofline twin of ``model_profile`` (default: the profile named like
    ``model``) on ``device_profile`` (default ``cpu-local``; a name, a YAML path or a loaded profile)
    over ``cards`` cards per instance (default: the fewest that hold it); ``time_scale`` scales its
    sleeps (0 = account time without sleeping).
    ``step_slowdown`` is a test hook (``--debug-step-slowdown``): every step costs that fraction more, in the
    engine's own currency (cpu: process CPU burnt, sim: modeled time), for checking the performance gate."""
    if kind == "cpu":
        from reference_server.engine.cpu import CpuEngine

        return CpuEngine(block_size=block_size, num_blocks=num_blocks, model=model, backend=backend,
                         device=device, seed=seed, step_slowdown=step_slowdown, **real)
    if kind == "sim":
        from reference_server.engine.sim import SimEngine

        return SimEngine(block_size=block_size, num_blocks=num_blocks, model_profile=model_profile or model,
                         device_profile=device_profile or "cpu-local", seed=seed, time_scale=time_scale,
                         tp=cards, step_slowdown=step_slowdown)
    raise ValueError(f"unknown engine {kind!r}; valid: {', '.join(ENGINE_KINDS)}")
