"""A real sim worker (engine, scheduler, engine loop) that runs one request with a host cost injected into each
step: what tests/test_sim_host_time.py and tests/test_step_clock.py time against the worker's own modeled clock."""

from __future__ import annotations

import time

import pytest

from reference_server.config import ServerConfig, WorkerSpec
from reference_server.scheduler import Seq
from reference_server.worker import Worker

STEP_S = 0.02            # every modeled step: a fixed 20 ms (the device's per-step overhead, nothing else)


class Done(Exception):
    pass


def sim_worker(chunk: int = 512) -> Worker:
    cfg = ServerConfig(mode="chunked", engine="sim", model_profile="tiny", device_profile="cpu-local",
                       device_set=f"step_overhead_s={STEP_S},seq_overhead_s=0", prefill_chunk_tokens=chunk,
                       kv_budget_mb=16)
    return Worker(WorkerSpec("mixed", 0, cfg, "t"))


def run_one(w: Worker, host_s: float, prompt: int, out: int) -> tuple[Seq, list[float]]:
    """Run one request through the engine loop, each step paying ``host_s`` of host time; returns the
    sequence and the wall time of every emit."""
    seq = Seq(rid="r", tenant="t", prompt=list(range(1, prompt + 1)), max_tokens=out, ignore_eos=True)
    emits: list[float] = []
    emit, step = w.emit, w.sched.step

    def slow_step():
        time.sleep(host_s)                      # the injected host cost of the step's bookkeeping
        return step()

    def timed_emit(s: Seq, tokens: list[int], final: bool) -> None:
        emits.append(time.perf_counter())
        emit(s, tokens, final)

    def finish(s: Seq, extra: object = None) -> None:
        raise Done

    w.emit, w.finish, w.sched.step = timed_emit, finish, slow_step      # type: ignore[method-assign]
    w.inbox.put(lambda: w.sched.add(seq))
    with pytest.raises(Done):
        w.loop()
    return seq, emits
