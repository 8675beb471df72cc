"""One load worker's side of a run: its shard of the schedule sent through the client, its records emitted.

Why a module of its own: the driver (:mod:`paasbench.load.runner`), the pools that start workers
(:mod:`paasbench.load.fleet`'s inline pool, :mod:`paasbench.load.workers`, :mod:`paasbench.load.ray_workers`) and
the worker processes and actors all need the same three things — the picklable :class:`WorkerSpec`, the
message encoding (:func:`encode`, :func:`decode`; the message kinds are listed in :mod:`paasbench.load.fleet`)
and the :class:`ShardWorker` that runs a shard (``_Run``) — so they sit here, below all of them, and imports run
one way: driver → pools → this module → schedule, prompts, client.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

import numpy as np
import orjson

from paasbench.client import Client, ClientConfig, JsonText, clock, make_session
from paasbench.load.live import Progress
from paasbench.load.schedule import (OPEN_LOOP, LoadConfig, SessionPlan, Shard, Turns, open_loop_times, session_plans,
                                     sleep_until)
from paasbench.metrics.records import RequestRecord
from paasbench.trace.model import Trace, TraceRequest

Sink = Callable[[RequestRecord], None]               # where a shard's finished records go (paasbench.load.fleet)


class _Run:
    """One shard of the run's schedule (all of it with one worker), sent on the run's ``t0``.

    Every finished record, cancelled ones included, goes to ``sink``; ``progress.sent`` counts sends."""

    def __init__(self, trace: Trace, load: LoadConfig, cfg: ClientConfig, progress: Progress, sink: Sink, *,
                 run_id: str, shard: Shard = Shard()) -> None:
        self.trace, self.load, self.cfg, self.progress, self.sink = trace, load, cfg, progress, sink
        self.shard = shard
        self.stop_why: str | None = None  # "aborted" | "interrupted", set by whoever stops the run
        self.run_id = run_id
        self.tasks: set[asyncio.Task[Any]] = set()
        # the in-flight cap is the run's: each worker holds its share of it (at least one slot)
        self.sem = asyncio.Semaphore(max(1, shard.budget(load.max_concurrency))) if load.max_concurrency else None
        self.budget = load.max_requests if load.max_requests is not None else len(trace)
        self.spin = load.spin_ms / 1e3
        self.t0 = 0.0
        self.t0_epoch_ns = 0
        self.client: Client
        self._builder: Any = None
        self._plan: list[Any] = []
        self._slots: list[float] = []     # open loop: this shard's send times (schedule.py: Turns)

    # -- prompts and plan, before t0 ------------------------------------------------------------
    def prepare(self) -> None:
        """Load the tokenizer and prompt tape before t0, not inside the first request's latency."""
        from paas_common.tokenizer import get_tokenizer
        from paasbench.load.prompts import PromptBuilder

        get_tokenizer(self.cfg.tokenizer)  # also needed mid-run when a stream comes without usage
        if self.cfg.prompt_format == "token-ids" or any(r.prompt is None for r in self.trace.requests):
            self._builder = PromptBuilder(self.trace.block_size, self.cfg.tokenizer, salt=self.cfg.prompt_salt or 0,
                                          prompt_format=self.cfg.prompt_format)

    def plan(self) -> int:
        """Fix this shard's part of the schedule; the number of requests it plans to send."""
        mode = self.load.mode
        if mode in OPEN_LOOP:
            # the duration cut is applied here, not in open_loop_times: its mask would shift the indices of an
            # out-of-order (hand-built) trace, sending request i at another request's time. It cuts the send times,
            # not the plan: a request planned at or after the end is a spare, taken by a send time whose planned
            # turns all wait for their sessions (schedule.py: Turns), never sent at a time of its own
            times = open_loop_times(self.trace.requests, dataclasses.replace(self.load, duration_s=None))
            order = np.argsort(times, kind="stable").tolist()
            sessions = [self.trace.requests[i].session_id for i in order]
            mine = self.shard.by_session(order, sessions)
            self._plan = [(i, self.trace.requests[i].session_id) for i in mine]
            # a send time goes with the worker planned to use it
            self._slots = [float(times[i]) for i in mine if self._in_time(float(times[i]))]
            planned = len(self._slots)
        elif mode == "concurrency":
            assert self.load.concurrency is not None
            n = min(len(self.trace), self.budget)
            self._plan = self.shard.closed_loop_requests(n, self.load.concurrency)
            planned = len(self._plan)
        else:
            self._plan = self.shard.take(session_plans(self.trace.requests, self.load))
            self.budget = self.shard.budget(self.budget)
            planned = min(self.budget, sum(len(p.turns) for p in self._plan))
        self.progress.planned = planned
        return planned

    def _prompt(self, req: TraceRequest) -> str | list[int] | JsonText:
        if self._builder is None:
            assert req.prompt is not None
            return req.prompt
        if self.cfg.prompt_format == "token-ids":
            return self._builder.token_ids(req)
        return self._builder.json_text(req)

    # -- one request ----------------------------------------------------------------------------
    def _record(self, i: int, intended: float, turn_wait_s: float | None = None) -> RequestRecord:
        req = self.trace.requests[i]
        return RequestRecord(index=i, request_id=f"{self.run_id}-{i}", session_id=req.session_id, turn=req.turn,
                             intended_send_s=intended, actual_send_s=None, first_token_s=None, end_s=None,
                             input_tokens_sent=req.input_length, max_tokens=max(1, req.output_length),
                             turn_wait_s=turn_wait_s)

    async def one(self, i: int, intended: float, turn_wait_s: float | None = None) -> RequestRecord:
        req = self.trace.requests[i]
        rec = self._record(i, intended, turn_wait_s)
        acquired = False
        try:
            if self.sem is not None:
                await self.sem.acquire()  # intended time stays: the wait is schedule lag, inside every latency
                acquired = True
            self.progress.sent += 1
            try:
                body = self.client.body(self._prompt(req), rec.max_tokens)
            except Exception as exc:  # noqa: BLE001 - a request we cannot build is a failed request
                rec.actual_send_s = rec.end_s = clock() - self.t0
                rec.error_kind, rec.error_message = "client", f"cannot build request: {exc}"
            else:
                await self.client.send(rec, body, self.t0)
        except asyncio.CancelledError:
            # the run is stopping (Ctrl-C or --abort-on-fail) with this request in flight: it is a failed
            # request of the run, recorded with how long it had waited, not dropped from the summary
            self._cancelled(rec)
            raise
        finally:
            if acquired:
                self.sem.release()  # type: ignore[union-attr]
        self._write(rec)
        return rec

    def _cancelled(self, rec: RequestRecord, waiting_for: str = "a concurrency slot") -> None:
        if rec.error_kind != "cancelled":  # not yet sent (a slot, the prompt); send() stamps its own
            rec.end_s = clock() - self.t0
        assert rec.end_s is not None
        why = self.stop_why or "interrupted"
        rec.error_kind = "cancelled"
        rec.error_message = (f"run {why} after the request had waited {rec.end_s - rec.intended_send_s:.3f} s"
                             + ("" if rec.actual_send_s is not None else f" for {waiting_for}"))
        self._write(rec)

    def _write(self, rec: RequestRecord) -> None:
        rec.stamp_wall_clock(self.t0_epoch_ns)
        self.sink(rec)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _take(self) -> bool:
        if self.budget <= 0:
            return False
        self.budget -= 1
        return True

    def _in_time(self, t: float) -> bool:
        return self.load.duration_s is None or t < self.load.duration_s

    # -- arrival modes --------------------------------------------------------------------------
    async def open_loop(self) -> None:
        """Each send time takes the first planned request whose session has no turn in flight (schedule.py:
        :class:`Turns`)."""
        turns = Turns(self._plan)
        k, waiting = 0, False
        try:
            for k, t in enumerate(self._slots):
                await sleep_until(self.t0 + t, self.spin)
                i, waited = turns.take_now(), 0.0
                if i is None:
                    waiting = True
                    i = await turns.take()
                    waiting, waited = False, max(0.0, clock() - self.t0 - t)
                if i is None:
                    return
                self._spawn(self._turn(turns, i, t, waited))
        except asyncio.CancelledError:
            # the run is stopping while a send time waits for a turn to end: it, and those that came behind it, are
            # requests of the run (the next planned ones take them), failed, as ones waiting for a concurrency slot
            if waiting:
                now = clock() - self.t0
                for t, i in zip([t for t in self._slots[k:] if t <= now], turns.left()):
                    self._cancelled(self._record(i, t, now - t), "its session's previous turn")
            raise

    async def _turn(self, turns: Turns, i: int, intended: float, waited: float) -> None:
        try:
            await self.one(i, intended, waited)
        finally:
            turns.ended(i)

    async def closed_loop(self) -> None:
        indices = iter(self._plan)

        async def slot() -> None:
            intended = 0.0
            for i in indices:  # shared iterator: each slot takes the next request when it frees
                if not self._in_time(intended):
                    return
                rec = await self.one(i, intended)
                intended = rec.end_s if rec.end_s is not None else clock() - self.t0

        assert self.load.concurrency is not None
        await asyncio.gather(*(slot() for _ in range(self.shard.slots(self.load.concurrency))))

    async def sessions(self) -> None:
        for plan in self._plan:
            if not self._in_time(plan.start_s) or self.budget <= 0:
                break
            await sleep_until(self.t0 + plan.start_s, self.spin)
            self._spawn(self._session(plan))

    async def _session(self, plan: SessionPlan) -> None:
        t = end = plan.start_s
        for k, i in enumerate(plan.turns):
            if k:
                t = plan.intended(k, t, end)
            if not self._in_time(t) or not self._take():
                return
            await sleep_until(self.t0 + t, self.spin)
            rec = await self.one(i, t)
            end = rec.end_s if rec.end_s is not None else clock() - self.t0  # next turn: after this one ends

    async def execute(self, t0: float, t0_epoch_ns: int) -> None:
        """Send the planned shard on the run clock that starts at ``t0`` (``time.monotonic()``; with
        ``t0_epoch_ns`` its wall-clock reading); on cancellation the requests in flight are recorded as
        cancelled before ``CancelledError`` propagates."""
        mode = self.load.mode
        run = self.open_loop if mode in OPEN_LOOP else self.closed_loop if mode == "concurrency" else self.sessions
        self.t0, self.t0_epoch_ns = t0, t0_epoch_ns
        try:
            await sleep_until(t0, self.spin)
            await run()
            while self.tasks:
                await asyncio.gather(*list(self.tasks))
        except asyncio.CancelledError:
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            raise


Emit = Callable[[str, Any], None]
REPORT_EVERY_S = 0.25


@dataclass(slots=True)
class WorkerSpec:
    """Everything one worker needs, picklable (it travels to a process or an actor)."""

    trace: Trace
    load: LoadConfig
    client: ClientConfig
    model: str | None
    run_id: str
    shard: Shard
    first_tokens: bool = False   # emit each stream's first token as it comes ("F"), for a stop_when that asks


def encode(kind: str, payload: Any) -> bytes:
    body = payload.to_json().encode() if kind == "R" else orjson.dumps(payload)
    return kind.encode() + body


def decode(msg: bytes) -> tuple[str, Any]:
    kind, body = msg[:1].decode(), orjson.loads(msg[1:])
    return kind, RequestRecord.from_dict(body) if kind == "R" else body


class ShardWorker:
    """The worker side: prepare the shard before ``t0``, send it from ``t0``, emit every record."""

    def __init__(self, spec: WorkerSpec, emit: Emit) -> None:
        self.spec, self.emit = spec, emit
        self.progress = Progress()
        self.run = _Run(spec.trace, spec.load, spec.client, self.progress, lambda rec: emit("R", rec),
                        run_id=spec.run_id, shard=spec.shard)
        self._task: asyncio.Task[Any] | None = None

    def prepare(self) -> int:
        self.run.prepare()
        return self.run.plan()

    async def serve(self, t0: float, t0_epoch_ns: int) -> None:
        """Send the shard on the run clock starting at ``t0`` (this machine's ``time.monotonic()``)."""
        if self.run.stop_why is None:
            self._task = asyncio.current_task()
            async with make_session(self.spec.client) as session:
                self.run.client = Client(self.spec.client, session, self.spec.model)
                if self.spec.first_tokens:
                    self.run.client.on_first_token = self._first_token
                reporter = asyncio.create_task(self._report())
                try:
                    await self.run.execute(t0, t0_epoch_ns)
                except asyncio.CancelledError:
                    if self.run.stop_why is None:
                        raise
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]  # our stop: end normally
                finally:
                    reporter.cancel()
                    await self.run.client.aclose()
        self.emit("D", {"sent": self.progress.sent})

    def _first_token(self, rec: RequestRecord, at_s: float) -> None:
        self.emit("F", {"send_s": rec.intended_send_s, "at_s": at_s})

    def stop(self, why: str) -> None:
        """End the shard early (``why``: ``aborted`` | ``interrupted``); in-flight requests are recorded."""
        if self.run.stop_why is None:
            self.run.stop_why = why
            if self._task is not None:
                self._task.cancel()

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            self.emit("P", {"sent": self.progress.sent})
