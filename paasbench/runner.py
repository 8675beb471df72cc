"""Drive a trace through the streaming client under a load config; write records and the summary.

``run_load`` is the one entry point for ``paasbench run`` and ``paasbench sweep``. Each request's record is
written and flushed the moment it finishes; the summary is computed afterwards from the records file, so
the run never holds every record (and its per-chunk timeline) in memory, and an interrupted run is
summarized from exactly what reached the disk.
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
from typing import Any, Callable, Coroutine

import aiohttp
import numpy as np
import orjson

from paasbench import __version__
from paasbench.client import Client, ClientConfig, clock, make_session
from paasbench.live import LiveView, Progress
from paasbench.metrics import summarize
from paasbench.records import RecordWriter, RequestRecord, read_records
from paasbench.schedule import OPEN_LOOP, LoadConfig, SessionPlan, open_loop_times, session_plans, sleep_until
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


class _Run:
    def __init__(self, trace: Trace, load: LoadConfig, cfg: ClientConfig, out: Path,
                 progress: Progress, stop_when: StopWhen | None = None) -> None:
        self.trace, self.load, self.cfg, self.out, self.progress = trace, load, cfg, out, progress
        self.stop_when = stop_when
        self.abort_reason: str | None = None
        self.main_task: asyncio.Task[Any] | None = None
        self.run_id = secrets.token_hex(4)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        self.budget = load.max_requests if load.max_requests is not None else len(trace)
        self.spin = load.spin_ms / 1e3
        self.t0 = 0.0
        self.t0_epoch_ns = 0
        self.client: Client
        self.writer: RecordWriter
        self._builder: Any = None

    # -- prompts --------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Load the tokenizer and prompt block table before t0, not inside the first request's latency."""
        from paasbench.prompts import PromptBuilder
        from paasbench.tokenizer import get_tokenizer

        get_tokenizer(self.cfg.tokenizer)  # also needed mid-run when a stream comes without usage
        if self.cfg.prompt_format == "token-ids" or any(r.prompt is None for r in self.trace.requests):
            self._builder = PromptBuilder(self.trace.block_size, self.cfg.tokenizer)

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
        self._finish(rec)
        return rec

    def _cancelled(self, rec: RequestRecord) -> None:
        if rec.error_kind != "cancelled":  # not yet sent (a slot, the prompt); send() stamps its own
            rec.end_s = clock() - self.t0
        assert rec.end_s is not None
        why = "aborted" if self.abort_reason is not None else "interrupted"
        rec.error_kind = "cancelled"
        rec.error_message = (f"run {why} after the request had waited {rec.end_s - rec.intended_send_s:.3f} s"
                             + ("" if rec.actual_send_s is not None else " for a concurrency slot"))
        self._write(rec)
        self.progress.done += 1
        self.progress.errors += 1

    def _write(self, rec: RequestRecord) -> None:
        rec.stamp_wall_clock(self.t0_epoch_ns)
        self.writer.write(rec)

    def _finish(self, rec: RequestRecord) -> None:
        self._write(rec)
        if self.stop_when is not None and self.abort_reason is None:
            reason = self.stop_when(rec)
            if reason is not None and self.main_task is not None:
                self.abort_reason = reason
                self.main_task.cancel()  # run_load tells this cancel from Ctrl-C by abort_reason
        p = self.progress
        p.done += 1
        if rec.ok:
            p.input_tokens += rec.prompt_tokens if rec.prompt_tokens is not None else rec.input_tokens_sent
            p.output_tokens += rec.completion_tokens or 0
            if rec.first_token_s is not None:
                p.recent_ttft_ms.append((rec.first_token_s - rec.intended_send_s) * 1e3)
        else:
            p.errors += 1

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
        # the duration cut is applied here, not in open_loop_times: its mask would shift the indices of an
        # out-of-order (hand-built) trace, sending request i at another request's time
        times = open_loop_times(self.trace.requests, dataclasses.replace(self.load, duration_s=None))
        order = [i for i in np.argsort(times, kind="stable").tolist() if self._in_time(float(times[i]))]
        self.progress.planned = len(order)
        for i in order:
            t = float(times[i])
            await sleep_until(self.t0 + t, self.spin)
            self._spawn(self.one(i, t))

    async def closed_loop(self) -> None:
        n = min(len(self.trace), self.budget)
        self.progress.planned = n
        indices = iter(range(n))

        async def slot() -> None:
            intended = 0.0
            for i in indices:  # shared iterator: each slot takes the next request when it frees
                if not self._in_time(intended):
                    return
                rec = await self.one(i, intended)
                intended = rec.end_s if rec.end_s is not None else clock() - self.t0

        assert self.load.concurrency is not None
        await asyncio.gather(*(slot() for _ in range(self.load.concurrency)))

    async def sessions(self) -> None:
        for plan in session_plans(self.trace.requests, self.load):
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

    async def execute(self) -> None:
        mode = self.load.mode
        run = self.open_loop if mode in OPEN_LOOP else self.closed_loop if mode == "concurrency" else self.sessions
        self.t0_epoch_ns, self.t0 = time.time_ns(), clock()  # the wall-clock anchor of the run clock
        self.progress.started = self.t0
        await run()
        while self.tasks:
            await asyncio.gather(*list(self.tasks))


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
                   stop_when: StopWhen | None = None) -> RunResult:
    """Replay ``trace`` under ``load`` against ``client.target``; write ``out_dir``/records.jsonl and summary.json.

    On cancellation (Ctrl-C) the requests in flight are stopped and recorded as failed with error kind
    ``cancelled`` and the time they had waited, the summary is written (``meta.interrupted = true``) and
    ``CancelledError`` propagates. Requests whose intended time had not come are not part of the run.

    ``stop_when`` sees every finished record; when it returns a reason the run stops the same way, but
    returns normally with ``RunResult.aborted`` (and ``meta.aborted``) set to that reason — k6's abortOnFail.
    """
    load.validate()
    client.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    run = _Run(trace, load, client, out, progress, stop_when)
    run.main_task = asyncio.current_task()
    run.prepare()
    records_path = out / "records.jsonl"
    interrupted = False
    async with make_session(client) as session:
        model = client.model or await _discover_model(session, client)
        run.client = Client(client, session, model)
        run.writer = RecordWriter(records_path)
        view = LiveView(progress) if live else None
        try:
            if view:
                view.__enter__()
            await run.execute()
        except asyncio.CancelledError:
            if run.abort_reason is not None:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # our own stop, not Ctrl-C
            else:
                interrupted = True
            for task in list(run.tasks):
                task.cancel()
            await asyncio.gather(*run.tasks, return_exceptions=True)
        finally:
            if view:
                view.__exit__(None, None, None)
            await run.client.aclose()
            run.writer.close()
    window = (load.warmup_s, float("inf")) if load.warmup_s else None
    # t0 on time.monotonic (system-wide on Linux): lets record times be matched with server-side logs
    extra = {**(meta or {}), "interrupted": interrupted, "aborted": run.abort_reason, "sent": progress.sent,
             "t0_monotonic": run.t0, "t0_epoch_ns": run.t0_epoch_ns}
    summary = summarize(read_records(records_path), window=window, goodput_limits=goodput_limits,
                        meta=_meta(trace, load, client, model, run.run_id, extra))
    summary_path = out / "summary.json"
    tmp = summary_path.with_suffix(".json.tmp")
    tmp.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    os.replace(tmp, summary_path)
    result = RunResult(summary, records_path, summary_path, out, interrupted, run.abort_reason)
    if interrupted:
        raise asyncio.CancelledError()
    return result


def run_load_sync(trace: Trace, load: LoadConfig, client: ClientConfig, out_dir: str | os.PathLike[str],
                  **kwargs: Any) -> RunResult:
    return asyncio.run(run_load(trace, load, client, out_dir, **kwargs))
