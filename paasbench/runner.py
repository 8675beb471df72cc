"""Drive a trace through the streaming client under a load config; write records and the summary.

``run_load`` is the one entry point for ``paasbench run`` and ``paasbench sweep``, with one load worker or
many (``--workers``, ``--ray``): the same shard runner (``_Run``) sends each worker's part of the schedule,
and every record comes back here. Each request's record is written and flushed the moment it finishes;
the summary is computed afterwards from the records file, so the run never holds every record (and its
per-chunk timeline) in memory, and an interrupted run is summarized from exactly what reached the disk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import platform
import secrets
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine

import aiohttp
import numpy as np
import orjson

from paasbench import __version__
from paasbench.client import Client, ClientConfig, clock, make_session
from paasbench.live import LiveView, Progress
from paasbench.errors import InputError
from paasbench.records import RecordWriter, RequestRecord, read_records
from paasbench.schedule import (OPEN_LOOP, LoadConfig, SessionPlan, Shard, open_loop_times, session_plans,
                                sleep_until)
from paasbench.trace.model import Trace, TraceRequest

__all__ = ["ClientConfig", "LoadConfig", "RunResult", "run_load", "run_load_sync"]


@dataclass(slots=True)
class RunResult:
    summary: dict[str, Any]
    records_path: Path
    summary_path: Path
    out_dir: Path
    interrupted: bool = False
    aborted: str | None = None        # why ``stop_when`` ended the run early, if it did


StopWhen = Callable[[RequestRecord], "str | None"]  # a finished record -> a reason to stop the run, or None
Sink = Callable[[RequestRecord], None]               # where a shard's finished records go (paasbench.fleet)


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

    # -- prompts and plan, before t0 ------------------------------------------------------------
    def prepare(self) -> None:
        """Load the tokenizer and prompt block table before t0, not inside the first request's latency."""
        from paasbench.prompts import PromptBuilder
        from paasbench.tokenizer import get_tokenizer

        get_tokenizer(self.cfg.tokenizer)  # also needed mid-run when a stream comes without usage
        if self.cfg.prompt_format == "token-ids" or any(r.prompt is None for r in self.trace.requests):
            self._builder = PromptBuilder(self.trace.block_size, self.cfg.tokenizer)

    def plan(self) -> int:
        """Fix this shard's part of the schedule; the number of requests it plans to send."""
        mode = self.load.mode
        if mode in OPEN_LOOP:
            # the duration cut is applied here, not in open_loop_times: its mask would shift the indices of an
            # out-of-order (hand-built) trace, sending request i at another request's time
            times = open_loop_times(self.trace.requests, dataclasses.replace(self.load, duration_s=None))
            order = [i for i in np.argsort(times, kind="stable").tolist() if self._in_time(float(times[i]))]
            self._plan = [(i, float(times[i])) for i in self.shard.take(order)]
            planned = len(self._plan)
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

    def _prompt(self, req: TraceRequest) -> str | list[int]:
        if self._builder is None:
            assert req.prompt is not None
            return req.prompt
        if self.cfg.prompt_format == "token-ids":
            return self._builder.token_ids(req)
        return self._builder.text(req)

    # -- one request ----------------------------------------------------------------------------
    async def one(self, i: int, intended: float) -> RequestRecord:
        req = self.trace.requests[i]
        rec = RequestRecord(index=i, request_id=f"{self.run_id}-{i}", session_id=req.session_id, turn=req.turn,
                            intended_send_s=intended, actual_send_s=None, first_token_s=None, end_s=None,
                            input_tokens_sent=req.input_length, max_tokens=max(1, req.output_length))
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

    def _cancelled(self, rec: RequestRecord) -> None:
        if rec.error_kind != "cancelled":  # not yet sent (a slot, the prompt); send() stamps its own
            rec.end_s = clock() - self.t0
        assert rec.end_s is not None
        why = self.stop_why or "interrupted"
        rec.error_kind = "cancelled"
        rec.error_message = (f"run {why} after the request had waited {rec.end_s - rec.intended_send_s:.3f} s"
                             + ("" if rec.actual_send_s is not None else " for a concurrency slot"))
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
        for i, t in self._plan:
            await sleep_until(self.t0 + t, self.spin)
            self._spawn(self.one(i, t))

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


async def _discover_model(session: aiohttp.ClientSession, cfg: ClientConfig) -> str | None:
    """The server's first model id, so users need not type it; None (field omitted) if it does not say."""
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        async with session.get(cfg.models_url, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=min(10.0, cfg.first_byte_timeout_s))) as r:
            if r.status == 200:
                data = orjson.loads(await r.read()).get("data") or []
                return str(data[0]["id"]) if data else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _meta(trace: Trace, load: LoadConfig, cfg: ClientConfig, model: str | None, run_id: str,
          extra: dict[str, Any] | None) -> dict[str, Any]:
    client = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    client["headers"] = sorted(cfg.headers)  # names only: values may be secrets
    meta = {"run_id": run_id, "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "target": cfg.target, "endpoint": cfg.endpoint, "model": model, "api": cfg.api,
            "trace": trace.source, "trace_requests": len(trace), "block_size": trace.block_size,
            "workload": trace.meta.get("workload") or trace.meta.get("name"), "seed": load.seed,
            "load": asdict(load), "client": client,
            "versions": {"paasbench": __version__, "python": platform.python_version(),
                         "aiohttp": aiohttp.__version__}}
    meta.update(extra or {})
    return meta


async def run_load(trace: Trace, load: LoadConfig, client: ClientConfig, out_dir: str | os.PathLike[str], *,
                   live: bool = False, meta: dict[str, Any] | None = None,
                   goodput_limits: dict[str, float] | None = None,
                   stop_when: StopWhen | None = None, workers: int = 1, ray: str | None = None,
                   announce: Callable[[str], None] | None = None,
                   warn: Callable[[str], None] | None = None) -> RunResult:
    """Replay ``trace`` under ``load`` against ``client.target``; write ``out_dir``/records.jsonl and summary.json.

    ``workers`` load workers each send their shard of the one schedule (:class:`paasbench.schedule.Shard`):
    one runs on this event loop, more run as processes here (``paasbench.workers``) or, with ``ray`` (a Ray
    address, or ``"local"``), as Ray actors (``paasbench.ray_workers``). Their records arrive here as they
    finish and are written to the one records file; ``announce`` is told where the workers run.

    On cancellation (Ctrl-C) the requests in flight are stopped and recorded as failed with error kind
    ``cancelled`` and the time they had waited, the summary is written (``meta.interrupted = true``) and
    ``CancelledError`` propagates. Requests whose intended time had not come are not part of the run.

    ``warn`` is told when ``load.duration_s`` has passed with requests still in flight: the duration ends the
    sending, not them, and a run of a few long requests would otherwise seem to hang.

    ``stop_when`` sees every finished record; when it returns a reason the run stops the same way, but
    returns normally with ``RunResult.aborted`` (and ``meta.aborted``) set to that reason — k6's abortOnFail.
    """
    from paasbench.fleet import Fleet, WorkerSpec, make_pool
    from paasbench.metrics import summarize  # here, not at the top: load workers import this module, not pandas

    load.validate()
    client.validate()
    if workers < 1:
        raise InputError(f"must be >= 1, got {workers}", field="workers")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)  # a previous run's summary must never pass for this one's
    progress = Progress()
    run_id = secrets.token_hex(4)
    records_path = out / "records.jsonl"
    async with make_session(client) as session:
        model = client.model or await _discover_model(session, client)
    main_task = asyncio.current_task()
    assert main_task is not None
    stopping = aborted = False

    def abort() -> None:  # ``stop_when`` said stop: cancel the run, unless it is already stopping
        nonlocal aborted
        if not stopping:
            aborted = True
            main_task.cancel()

    specs = [WorkerSpec(trace, load, client, model, run_id, Shard(w, workers)) for w in range(workers)]
    fleet = Fleet(workers, RecordWriter(records_path), progress, stop_when, on_abort=abort)
    pool = make_pool(specs, fleet, ray)
    view = LiveView(progress) if live else None
    t0, t0_epoch_ns = 0.0, 0
    overtime: asyncio.TimerHandle | None = None
    try:
        try:
            await pool.start()
            if announce:
                announce(pool.describe())
            if view:
                view.__enter__()
            epoch_ns, now = time.time_ns(), clock()  # the wall-clock anchor of the run clock
            t0, t0_epoch_ns = now + pool.lead_s, epoch_ns + round(pool.lead_s * 1e9)
            progress.started = t0
            if warn is not None and load.duration_s is not None:
                overtime = asyncio.get_running_loop().call_at(t0 + load.duration_s, _overtime, load, client,
                                                              progress, warn)
            await pool.go(t0, t0_epoch_ns)
            await fleet.wait()
        except asyncio.CancelledError:
            stopping = True
            if aborted:
                main_task.uncancel()  # our own stop, not Ctrl-C
            await _to_the_end(pool.stop("aborted" if aborted else "interrupted"))
            await _to_the_end(fleet.wait())
        finally:
            stopping = True
            if overtime is not None:
                overtime.cancel()
            await _to_the_end(pool.close())
    finally:
        if view:
            view.__exit__(None, None, None)
        fleet.writer.close()
    # Ctrl-C at any moment counts, even while the workers were being stopped or joined (their cancel was
    # held off until the records were complete)
    interrupted = main_task.cancelling() > 0
    window = (load.warmup_s, float("inf")) if load.warmup_s else None
    # t0 on time.monotonic (system-wide on Linux): lets record times be matched with server-side logs
    extra = {**(meta or {}), "interrupted": interrupted, "aborted": fleet.abort_reason, "sent": progress.sent,
             "t0_monotonic": t0, "t0_epoch_ns": t0_epoch_ns, "workers": {**pool.meta(), "lost": fleet.lost()}}
    summary = summarize(read_records(records_path), window=window, goodput_limits=goodput_limits,
                        meta=_meta(trace, load, client, model, run_id, extra))
    tmp = summary_path.with_suffix(".json.tmp")
    tmp.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    os.replace(tmp, summary_path)
    result = RunResult(summary, records_path, summary_path, out, interrupted, fleet.abort_reason)
    if interrupted:
        raise asyncio.CancelledError()
    return result


def _overtime(load: LoadConfig, client: ClientConfig, progress: Progress, warn: Callable[[str], None]) -> None:
    if progress.in_flight > 0:
        warn(f"--duration {load.duration_s:g} s is over: nothing more is sent, and the {progress.in_flight} "
             f"request(s) in flight run to their end (each up to --total-timeout {client.total_timeout_s:g} s); "
             "Ctrl-C stops them and keeps the summary")


async def _to_the_end(aw: Awaitable[Any]) -> None:
    """Await ``aw`` to its end even when this task is cancelled meanwhile (Ctrl-C while the run is already
    stopping or joining its workers): the cancel stays counted on the task (``Task.cancelling()``) and takes
    effect once the summary is written, so no moment of a Ctrl-C can leave a run without its summary."""
    inner = asyncio.ensure_future(aw)
    while not inner.done():
        try:
            await asyncio.wait({inner})
        except asyncio.CancelledError:
            pass
    inner.result()  # its own exception, if it raised one


def run_load_sync(trace: Trace, load: LoadConfig, client: ClientConfig, out_dir: str | os.PathLike[str],
                  **kwargs: Any) -> RunResult:
    return asyncio.run(run_load(trace, load, client, out_dir, **kwargs))
