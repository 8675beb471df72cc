"""Which accelerator each worker process runs on: ``--device cuda|musa|cpu`` plus a device map.

Prefill and decode workers each get their own device index: ``--prefill-devices 0,1 --decode-devices
2,3`` (one index per worker of that pool; repeating an index shares a device on purpose), or by
default one device per worker in order — prefill workers first, then decode (or the mixed workers of
colocated/chunked mode) — an even split of the first P + D devices. ``--device cuda:N`` pins every
worker to device N. A map that names a device the host does not have, or a default map with more
workers than devices, is refused before any worker starts (exit 2, naming the numbers).

The router checks the map (:func:`check_devices`); each worker process resolves its own entry
(:func:`worker_device`) and makes it the process's current device when it builds its engine.
"""

from __future__ import annotations

from typing import Callable

from reference_server.config import ServerConfig


class DeviceMapError(ValueError):
    """The device map cannot be honoured on this host; ``field`` names the flag to change."""

    def __init__(self, message: str, field: str) -> None:
        self.field = field
        super().__init__(message)


def parse_devices(text: str | None) -> tuple[int, ...] | None:
    """``"0,1"`` -> (0, 1). Raises ``ValueError`` on anything but comma-separated non-negative integers."""
    if text is None or text == "":
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"{text!r}: expected comma-separated device indices like 0,1")
        out.append(int(part))
    return tuple(out)


def device_map(cfg: ServerConfig, count: int) -> dict[str, tuple[str, ...]]:
    """Role -> the device of each of its workers (``"cuda:2"``, or ``"cpu"``), checked against ``count``
    devices of ``cfg.device``'s kind."""
    pools = cfg.pools()
    explicit = {"prefill": cfg.prefill_devices, "decode": cfg.decode_devices}
    kind, _, pinned = cfg.device.partition(":")
    if kind == "cpu":
        named = [f"--{r}-devices" for r, v in explicit.items() if v is not None]
        if named:
            raise DeviceMapError(f"{' and '.join(named)} need an accelerator (--device cuda or musa)", named[0])
        return {role: ("cpu",) * n for role, n in pools.items()}
    if pinned:
        idx = int(pinned)
        if idx >= count:
            raise DeviceMapError(f"--device {cfg.device}: this host has {count} {kind} device(s) (0-{count - 1})"
                                 if count else f"--device {cfg.device}: this host has no {kind} device", "--device")
        return {role: (f"{kind}:{idx}",) * n for role, n in pools.items()}
    out: dict[str, tuple[str, ...]] = {}
    if "mixed" in pools:
        named = [f"--{r}-devices" for r, v in explicit.items() if v is not None]
        if named:
            raise DeviceMapError(f"{named[0]} applies to --mode disaggregated; mode {cfg.mode} runs mixed workers "
                                 f"on devices 0-{pools['mixed'] - 1}", named[0])
    else:
        for role in ("prefill", "decode"):
            ids = explicit[role]
            if ids is None:
                continue
            flag = f"--{role}-devices"
            if len(ids) != pools[role]:
                raise DeviceMapError(f"{flag} {','.join(map(str, ids))} names {len(ids)} device(s) for "
                                     f"{pools[role]} {role} worker(s): give one index per worker", flag)
            missing = sorted({i for i in ids if i >= count})
            if missing:
                raise DeviceMapError(f"{flag} {','.join(map(str, ids))}: device(s) {','.join(map(str, missing))} do "
                                     f"not exist; this host has {count} {kind} device(s)"
                                     + (f" (0-{count - 1})" if count else ""), flag)
            out[role] = tuple(f"{kind}:{i}" for i in ids)
    need = sum(n for r, n in pools.items() if r not in out)
    taken = {d for devs in out.values() for d in devs}
    free = [i for i in range(count) if f"{kind}:{i}" not in taken]
    if need > len(free):
        workers = " + ".join(f"{n} {r}" for r, n in pools.items() if r not in out)
        raise DeviceMapError(f"{workers} worker(s) need {need} {kind} device(s), one each, but this host has "
                             f"{count} ({len(free)} not already mapped); give --prefill-devices/--decode-devices "
                             f"to share devices, or fewer workers", "--device")
    for role in ("prefill", "decode", "mixed"):
        if role in pools and role not in out:
            out[role], free = tuple(f"{kind}:{i}" for i in free[:pools[role]]), free[pools[role]:]
    return out


def check_devices(cfg: ServerConfig, count_fn: Callable[[str], int] | None = None) -> dict[str, tuple[str, ...]]:
    """The map for this host (``count_fn(kind)`` counts devices; injected in tests)."""
    kind = cfg.device.partition(":")[0]
    if kind != "cpu" and cfg.backend != "torch":
        raise DeviceMapError(f"--device {cfg.device} needs --backend torch (numpy runs on the CPU)", "--backend")
    if count_fn is None:
        from reference_server.engine.backend import device_count as count_fn
    try:
        count = count_fn(kind)
    except ImportError as exc:
        raise DeviceMapError(f"--device {cfg.device} needs torch: pip install 'paasbench[torch]' ({exc})", "--device") from None
    except ValueError as exc:
        raise DeviceMapError(str(exc), "--device") from None
    return device_map(cfg, count)


def worker_device(cfg: ServerConfig, role: str, index: int) -> str:
    """This worker's device (called in the worker process, which then makes it current)."""
    return check_devices(cfg)[role][index]
