"""``run --ray ADDRESS``: the load workers as Ray actors spread over a cluster's nodes.

Why Ray: when one machine's cores cannot offer the load, an existing cluster scheduler places the workers
(``SPREAD`` over nodes) and carries their messages, so paasbench needs no agent of its own on each node.
Each actor runs a ``paasbench.load.fleet.ShardWorker`` on its own thread and event loop and buffers its
messages; the driver drains every actor every ``DRAIN_EVERY_S`` and writes the records as they come.

Clocks: the schedule is on the driver's ``time.monotonic()``. Before ``t0`` and after the run the driver
measures each actor's clock offset NTP-style: ``PROBES`` round trips, each ``offset = remote - (sent +
received) / 2``, keeping the round trip with the smallest time, whose half is the offset's uncertainty.
An actor sends on ``t0 + offset`` of its own clock, so its records' ``*_s`` times are on the driver's
clock (to within the uncertainty); ``meta.workers.clocks`` keeps both measurements, whose difference is
the drift over the run.

A lost actor (node down, process killed) is reported with the requests it planned and never recorded
(``meta.workers.lost``), as for local worker processes. Ray is optional: ``pip install 'paasbench[ray]'``.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import threading
import time
from typing import Any

from paas_common.errors import InputError
from paasbench.load.fleet import Fleet
from paasbench.load.shard import ShardWorker, WorkerSpec, decode, encode

DRAIN_EVERY_S = 0.1
PROBES = 16


def require_ray() -> Any:
    """The ``ray`` module, or an input error naming ``--ray`` and the extra to install."""
    try:
        import ray
    except ImportError:
        raise InputError("Ray is not installed: pip install 'paasbench[ray]'", field="--ray") from None
    return ray


def connect(address: str, cpus: int) -> bool:
    """Join the Ray cluster at ``address`` (``local``: start a private instance with ``cpus`` CPUs) unless
    this process already has; whether this call started Ray. No cluster there is an input error naming
    ``--ray`` (exit 2, before anything is written), not Ray's traceback."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    try:
        if address == "local":   # loopback only, no dashboard: a private instance for this run
            ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except ConnectionError as exc:
        where = ("--ray auto joins a cluster already running on this machine (`ray start --head`) or the one "
                 "RAY_ADDRESS names, and found none" if address == "auto"
                 else f"no Ray cluster answered at {address} ({str(exc).splitlines()[0]})")
        auth = ("" if os.environ.get("RAY_AUTH_MODE") == "token" else
                " (a cluster whose head has a token, ~/.ray/auth_token, refuses a driver without it: set "
                "RAY_AUTH_MODE=token and the cluster's token, in RAY_AUTH_TOKEN or ~/.ray/auth_token; docs/scale-out.md)")
        raise InputError(f"{where}{auth}; start one, give its head's address (--ray HOST:6379), or use --ray local "
                         "to start a Ray instance for this run on this machine", field="--ray") from None
    return True


class LoadActor:
    """The actor body (wrapped by ``ray.remote`` in :meth:`RayPool.start`)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.out: collections.deque[bytes] = collections.deque()
        self.worker = ShardWorker(spec, lambda kind, payload: self.out.append(encode(kind, payload)))
        self.loop: asyncio.AbstractEventLoop | None = None

    def where(self) -> dict[str, Any]:
        """Where this actor runs: its Ray node's id, the hostname, and its process (the driver adds the node's
        address: two nodes may share a hostname, as two VMs built from one image do)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(), "pid": os.getpid()}

    def prepare(self) -> int:
        return self.worker.prepare()

    def clock(self) -> float:
        return time.monotonic()

    def go(self, t0: float, t0_epoch_ns: int) -> None:
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            ready.set()
            self.loop.run_until_complete(self.worker.serve(t0, t0_epoch_ns))
            self.loop.close()

        threading.Thread(target=run, name="paasbench-load", daemon=True).start()
        ready.wait()

    def stop(self, why: str) -> None:
        if self.loop is None:
            self.worker.stop(why)
            self.out.append(encode("D", {"sent": 0}))
        else:
            try:
                self.loop.call_soon_threadsafe(self.worker.stop, why)
            except RuntimeError:  # the loop has finished: nothing left to stop
                pass

    def drain(self) -> list[bytes]:
        out = []
        while self.out:
            out.append(self.out.popleft())
        return out


async def measure_offset(actor: Any) -> dict[str, float]:
    """The actor's clock minus the driver's (s) and its uncertainty: the best of ``PROBES`` round trips."""
    best: tuple[float, float] | None = None
    for _ in range(PROBES):
        sent = time.monotonic()
        remote = await actor.clock.remote()
        received = time.monotonic()
        rtt = received - sent
        if best is None or rtt < best[0]:
            best = (rtt, remote - (sent + received) / 2)
    assert best is not None
    return {"offset_s": best[1], "uncertainty_s": best[0] / 2}


class RayPool:
    """``len(specs)`` Ray actors on the cluster at ``address`` (``local``: a Ray instance started here)."""

    lead_s = 0.5   # the "go" calls reach every actor before t0

    def __init__(self, specs: list[WorkerSpec], fleet: Fleet, address: str) -> None:
        self.specs, self.fleet, self.address = specs, fleet, address
        self.actors: list[Any] = []
        self.where: list[dict[str, Any]] = []
        self.clocks: list[dict[str, Any]] = []
        self.started_ray = False
        self._drainer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ray = require_ray()
        self.started_ray = connect(self.address, len(self.specs))
        actor_class = ray.remote(num_cpus=1, max_restarts=0)(LoadActor)
        self.actors = [actor_class.options(scheduling_strategy="SPREAD").remote(spec) for spec in self.specs]
        self.where = list(await asyncio.gather(*(a.where.remote() for a in self.actors)))
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}   # the address the node joined with
        for w in self.where:
            w["node_address"] = address.get(w["node_id"], "?")
        planned = await asyncio.gather(*(a.prepare.remote() for a in self.actors))
        for w, n in enumerate(planned):
            self.fleet.deliver(w, "Y", {"planned": n})
        self.clocks = [{"start": await measure_offset(a)} for a in self.actors]

    def describe(self) -> str:
        nodes = collections.Counter(_node(w) for w in self.where)
        return (f"{len(self.actors)} Ray actors on " + ", ".join(f"{h} ({n})" for h, n in nodes.items())
                + ", pids: " + " ".join(str(w["pid"]) for w in self.where))

    async def go(self, t0: float, t0_epoch_ns: int) -> None:
        await asyncio.gather(*(a.go.remote(t0 + c["start"]["offset_s"], t0_epoch_ns)
                               for a, c in zip(self.actors, self.clocks)))
        self._drainer = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        ray = require_ray()
        while not all(self.fleet.finished):
            for w, actor in enumerate(self.actors):
                if self.fleet.finished[w]:
                    continue
                try:
                    msgs = await actor.drain.remote()
                except ray.exceptions.RayError as exc:
                    self.fleet.lose(w, f"Ray actor on {_node(self.where[w])} lost: {type(exc).__name__}")
                    continue
                for msg in msgs:
                    self.fleet.deliver(w, *decode(msg))
            await asyncio.sleep(DRAIN_EVERY_S)

    async def stop(self, why: str) -> None:
        await asyncio.gather(*(a.stop.remote(why) for w, a in enumerate(self.actors) if not self.fleet.finished[w]),
                             return_exceptions=True)
        if self._drainer is None:   # stopped before "go": collect the actors' "D"
            self._drainer = asyncio.create_task(self._drain())

    async def close(self) -> None:
        if not self.actors and not self.started_ray:
            return   # never started (Ray missing, or stopped before start)
        ray = require_ray()
        if self._drainer is not None:
            self._drainer.cancel()
            await asyncio.gather(self._drainer, return_exceptions=True)
        for w, actor in enumerate(self.actors):
            if w not in self.fleet.lost_why:
                try:
                    self.clocks[w]["end"] = await measure_offset(actor)
                except ray.exceptions.RayError:
                    pass
            ray.kill(actor)
        if self.started_ray:
            ray.shutdown()

    def meta(self) -> dict[str, Any]:
        return {"count": len(self.specs), "backend": "ray", "address": self.address,
                "actors": [{**where, "clock": clock} for where, clock in zip(self.where, self.clocks)]}


def _node(where: dict[str, Any]) -> str:
    """An actor's node as the log names it: ``host address (node id prefix)``."""
    return f"{where['host']} {where['node_address']} (node {where['node_id'][:8]})"
