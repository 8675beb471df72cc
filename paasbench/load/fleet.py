"""Load workers and the driver that gathers their records: one protocol for one worker or many.

Why one protocol: ``run --workers 1`` (this process), ``--workers N`` (processes here, ``paasbench.load.workers``)
and ``--ray`` (actors on a cluster, ``paasbench.load.ray_workers``) must write the same records file and the same
summary, stop the same way on Ctrl-C and on an SLO abort, and feed the same live view. So each worker is a
:class:`ShardWorker` sending its shard of the schedule (:mod:`paasbench.load.shard`) and emitting messages, and
the driver's :class:`Fleet` takes every message, whichever transport carried it:

==========  ===========================  ==================================================================
kind        payload                      meaning
==========  ===========================  ==================================================================
``Y``       ``{"planned": n}``           prepared (tokenizer, prompts, its plan) and waiting for ``t0``
``R``       a ``RequestRecord``          a request finished (cancelled ones included): written at once
``P``       ``{"sent": n}``              requests sent so far (4 Hz, for the live view)
``F``       ``{"send_s", "at_s"}``       a stream's first token (its intended send, its time): only where the
                                         run's ``stop_when`` has ``first_token`` (a certified step)
``D``       ``{"sent": n}``              the shard is done (or stopped, its in-flight requests recorded)
``E``       ``{"error": text}``          the worker failed; its unsent requests are reported as lost
==========  ===========================  ==================================================================

The driver sends ``go(t0, t0_epoch_ns)`` once every worker is ready and ``stop(why)`` to end early. A
worker that vanishes (its process killed, its node lost) is *lost*: the requests it planned and never
recorded are counted in ``meta.workers.lost`` of the summary, never silently dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

from paas_common.lifetime import ctrl_c_interrupts
from paasbench.load.live import Progress
from paasbench.load.shard import ShardWorker, WorkerSpec
from paasbench.metrics.records import RecordWriter, RequestRecord


class Fleet:
    """The driver side: every worker's messages in, one records file and one progress out."""

    def __init__(self, count: int, writer: RecordWriter, progress: Progress,
                 stop_when: Callable[[RequestRecord], str | None] | None, on_abort: Callable[[], Any]) -> None:
        self.writer, self.progress, self.stop_when, self.on_abort = writer, progress, stop_when, on_abort
        self.abort_reason: str | None = None
        self.planned: list[int | None] = [None] * count
        self.recorded = [0] * count
        self.sent = [0] * count
        self.finished = [False] * count
        self.ready = [False] * count
        self.lost_why: dict[int, str] = {}
        self._changed = asyncio.Event()

    def deliver(self, w: int, kind: str, payload: Any) -> None:
        if kind == "R":
            self.recorded[w] += 1
            self.take(payload)
        elif kind == "Y":
            self.planned[w] = payload["planned"]
            self.ready[w] = True
            if all(p is not None for p in self.planned):
                self.progress.planned = sum(p for p in self.planned if p is not None)
        elif kind in ("P", "D"):
            self.sent[w] = payload["sent"]
            self.progress.sent = sum(self.sent)
            if kind == "D":
                self.finished[w] = True
        elif kind == "F":   # a first token, where the stop_when asked for them (runner: first_tokens)
            self.stop_when.first_token(payload["send_s"], payload["at_s"])  # type: ignore[union-attr]
        elif kind == "E":
            self.lose(w, payload["error"])
        self._changed.set()

    def lose(self, w: int, why: str) -> None:
        """Worker ``w`` is gone without finishing: what it planned and never recorded is reported."""
        if not self.finished[w]:
            self.finished[w] = self.ready[w] = True
            self.lost_why[w] = why
            self._changed.set()

    def take(self, rec: RequestRecord) -> None:
        self.writer.write(rec)
        p = self.progress
        p.done += 1
        if rec.ok:
            p.input_tokens += rec.prompt_tokens if rec.prompt_tokens is not None else rec.input_tokens_sent
            p.output_tokens += rec.completion_tokens or 0
            if rec.first_token_s is not None:
                p.recent_ttft_ms.append((rec.first_token_s - rec.intended_send_s) * 1e3)
        else:
            p.errors += 1
        if self.stop_when is not None and self.abort_reason is None:
            reason = self.stop_when(rec)
            if reason is not None:
                self.abort_reason = reason
                self.on_abort()

    async def _until(self, flags: list[bool]) -> None:
        while not all(flags):
            self._changed.clear()
            await self._changed.wait()

    async def all_ready(self) -> None:
        await self._until(self.ready)

    async def wait(self) -> None:
        """Until every worker has finished or is lost."""
        await self._until(self.finished)

    def lost(self) -> list[dict[str, Any]]:
        return [{"worker": w, "why": why, "planned": self.planned[w], "recorded": self.recorded[w],
                 "unsent_or_unrecorded": None if self.planned[w] is None else self.planned[w] - self.recorded[w]}
                for w, why in sorted(self.lost_why.items())]


class Pool(Protocol):
    """How a set of workers is started and talked to; the run (``runner.run_load``) drives it."""

    lead_s: float   # how far ahead of "now" t0 is set, so every worker hears ``go`` before it

    async def start(self) -> None: ...      # start and prepare every worker (returns once all are ready)
    def describe(self) -> str: ...          # where the workers run, for the user
    async def go(self, t0: float, t0_epoch_ns: int) -> None: ...
    async def stop(self, why: str) -> None: ...
    async def close(self) -> None: ...      # after the run: release the workers
    def meta(self) -> dict[str, Any]: ...   # for summary.meta.workers


class InlinePool:
    """One worker on this process's event loop: ``--workers 1``, the default."""

    lead_s = 0.0

    def __init__(self, spec: WorkerSpec, fleet: Fleet) -> None:
        self.fleet = fleet
        self.worker = ShardWorker(spec, lambda kind, payload: fleet.deliver(0, kind, payload))
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        with ctrl_c_interrupts():   # the tokenizer, the prompt tape, the plan: seconds on the loop's thread
            planned = self.worker.prepare()
        self.fleet.deliver(0, "Y", {"planned": planned})

    def describe(self) -> str:
        return "1 load worker in this process"

    async def go(self, t0: float, t0_epoch_ns: int) -> None:
        self.task = asyncio.create_task(self.worker.serve(t0, t0_epoch_ns))
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is not None:
            self.fleet.lose(0, "the load worker failed")  # close() re-raises its exception

    async def stop(self, why: str) -> None:
        self.worker.stop(why)
        if self.task is None:         # stopped before it went: nothing was sent
            self.fleet.deliver(0, "D", {"sent": 0})

    async def close(self) -> None:
        if self.task is not None and not self.task.cancelled():
            await self.task

    def meta(self) -> dict[str, Any]:
        return {"count": 1, "backend": "inline"}
