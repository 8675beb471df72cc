"""Drive a trace through the streaming client under a load config; write records and the summary.

``run_load`` is the one entry point for ``paasbench run`` and ``paasbench sweep``, with one load worker or
many (``--workers``, ``--ray``): the same shard runner (:mod:`paasbench.load.shard`) sends each worker's part of
the schedule, and every record comes back here. Each request's record is written and flushed the moment it finishes;
the summary is computed afterwards from the records file, so the run never holds every record (and its
per-chunk timeline) in memory, and an interrupted run is summarized from exactly what reached the disk.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import os
import platform
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import aiohttp
import orjson

from paas_common.errors import InputError
from paas_common.lifetime import ctrl_c_interrupts
from paasbench import __version__
from paasbench.client import ClientConfig, clock, debug
from paasbench.client.models import model_id
from paasbench.client.rxstamp import arrival_clock
from paasbench.gate import host_load
from paasbench.load.fleet import Fleet, InlinePool, Pool
from paasbench.load.live import LiveView, Progress
from paasbench.load.prompt_units import release as release_prompt_memory
from paasbench.load.schedule import LoadConfig, Shard
from paasbench.load.shard import WorkerSpec
from paasbench.metrics.records import RecordWriter, RequestRecord, read_records
from paasbench.trace.model import Trace

if TYPE_CHECKING:
    from paasbench.metrics.prometheus import Watch

__all__ = ["ClientConfig", "LoadConfig", "RunResult", "run_load", "run_load_sync"]


@dataclass(slots=True)
class RunResult:
    summary: dict[str, Any]
    records_path: Path
    summary_path: Path
    out_dir: Path
    interrupted: bool = False
    aborted: str | None = None        # why ``stop_when`` ended the run early, if it did
    server_metrics: dict[str, Any] | None = None  # the target's /metrics around the run (``watch``)


StopWhen = Callable[[RequestRecord], "str | None"]  # a finished record -> a reason to stop the run, or None
def _meta(trace: Trace, load: LoadConfig, cfg: ClientConfig, model: str | None, run_id: str,
          extra: dict[str, Any] | None) -> dict[str, Any]:
    from paasbench.metrics.verify import tokenizer_identity
    from paasbench.gate.fingerprint import describe as describe_machine

    client = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    client["headers"] = sorted(cfg.headers)  # names only: values may be secrets
    meta = {"run_id": run_id, "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "target": cfg.target, "endpoint": cfg.endpoint, "model": model, "api": cfg.api,
            "trace": trace.source, "trace_requests": len(trace), "block_size": trace.block_size,
            "workload": trace.meta.get("workload") or trace.meta.get("name"), "seed": load.seed,
            "prompt_salt": f"{client.pop('prompt_salt') or 0:016x}",   # hex: --prompt-salt takes it back
            "load": asdict(load), "client": client, "tokenizer": tokenizer_identity(cfg.tokenizer),
            "arrival_clock": arrival_clock(cfg.target),   # what stamps a chunk's arrival (docs/metrics.md)
            "versions": {"paasbench": __version__, "python": platform.python_version(),
                         "aiohttp": aiohttp.__version__}}
    if "machine" not in (extra or {}):     # a sweep's steps carry the sweep's own (timed) record
        meta["machine"] = describe_machine(timed=False).to_json()
    meta.update(extra or {})
    return meta


def _make_pool(specs: list[WorkerSpec], fleet: Fleet, ray: str | None) -> Pool:
    if ray is not None:
        from paasbench.load.ray_workers import RayPool

        return RayPool(specs, fleet, ray)
    if len(specs) > 1:
        from paasbench.load.workers import ProcessPool

        return ProcessPool(specs, fleet)
    return InlinePool(specs[0], fleet)


async def run_load(trace: Trace, load: LoadConfig, client: ClientConfig, out_dir: str | os.PathLike[str], *,
                   live: bool = False, plain_progress: bool = False, meta: dict[str, Any] | None = None,
                   goodput_limits: dict[str, float] | None = None,
                   stop_when: StopWhen | None = None, workers: int = 1, ray: str | None = None,
                   announce: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None,
                   watch: Watch | None = None, release_prompts: bool = False) -> RunResult:
    """Replay ``trace`` under ``load`` against ``client.target``; write ``out_dir``/records.jsonl and summary.json.

    ``workers`` load workers each send their shard of the one schedule (:class:`paasbench.load.schedule.Shard`):
    one runs on this event loop, more run as processes here (``paasbench.load.workers``) or, with ``ray`` (a Ray
    address, or ``"local"``), as Ray actors (``paasbench.load.ray_workers``). Their records arrive here as they
    finish and are written to the one records file; ``announce`` is told where the workers run.

    On cancellation (Ctrl-C) the requests in flight are stopped and recorded as failed with error kind
    ``cancelled`` and the time they had waited, the summary is written (``meta.interrupted = true``) and
    ``CancelledError`` propagates. Requests whose intended time had not come are not part of the run.

    ``warn`` is told when ``load.duration_s`` has passed with requests still in flight: the duration ends the
    sending, not them, and a run of a few long requests would otherwise seem to hang.

    ``stop_when`` sees every finished record; when it returns a reason the run stops the same way, but
    returns normally with ``RunResult.aborted`` (and ``meta.aborted``) set to that reason — k6's abortOnFail.
    One with a ``first_token(send_s, at_s)`` method is also told each stream's first token as it arrives (its
    intended send time and the token's time, on the run clock), from every worker.

    ``live`` shows the run's progress on stderr: counters over a bar on a terminal, plain lines every 10 s off
    one or with ``plain_progress`` (``--no-live``); see :mod:`paasbench.load.live`.

    ``watch`` scrapes the target's ``/metrics`` around the run (:class:`paasbench.metrics.prometheus.Watch`); its
    figures, with client vs engine over the same requests (:mod:`paasbench.metrics.versus`), go into
    ``summary.json`` as ``server_metrics``.

    ``release_prompts``: once the load is over, forget the tapes and tokenizers this process loaded
    (:func:`paasbench.load.prompt_units.release`) before the summary's libraries come in, so the run's peak RSS
    is not the two stacked; for a process that runs once (``paasbench run``), not for one that runs again (a
    sweep's steps would each load them anew).
    """

    load.validate()
    client.validate()
    if client.prompt_salt is None:  # fresh prompt content per run: no previous run's blocks in the server's cache
        client = dataclasses.replace(client, prompt_salt=secrets.randbits(64))
    if workers < 1:
        raise InputError(f"must be >= 1, got {workers}", field="workers")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)  # a previous run's summary must never pass for this one's
    if debug.LAUNCH_S:
        with ctrl_c_interrupts():   # synchronous: a Ctrl-C must not wait for it to end
            debug.launch_cost()
    progress = Progress(duration_s=load.duration_s, warmup_s=load.warmup_s)
    run_id = secrets.token_hex(4)
    records_path = out / "records.jsonl"
    # the model requests name when --model is not given: the target's first, asked once per command
    model = client.model or await in_daemon_thread(model_id, client)
    if watch is not None:
        await watch.begin()
    main_task = asyncio.current_task()
    assert main_task is not None
    stopping = aborted = False

    def abort() -> None:  # ``stop_when`` said stop: cancel the run, unless it is already stopping
        nonlocal aborted
        if not stopping:
            aborted = True
            main_task.cancel()

    # a stop_when that judges requests still streaming (sequential.Sequential) is told each first token as it comes
    first_tokens = callable(getattr(stop_when, "first_token", None))
    specs = [WorkerSpec(trace, load, client, model, run_id, Shard(w, workers), first_tokens) for w in range(workers)]
    fleet = Fleet(workers, RecordWriter(records_path), progress, stop_when, on_abort=abort)
    pool = _make_pool(specs, fleet, ray)
    view = LiveView(progress, live=not plain_progress) if live else None
    t0, t0_epoch_ns = 0.0, 0
    host_before = host_load.sample()   # the machine's other work over the run (paasbench/gate/host_load.py)
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
            if watch is not None:
                watch.follow(t0)
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
    if watch is not None and main_task.cancelling() == 0:
        # a Ctrl-C meanwhile stops its wait for an idle engine, is counted below, and the summary is still written
        await _to_the_end(watch.finish(stop=lambda: main_task.cancelling() > 0))
    # Ctrl-C at any moment counts, even while the workers were being stopped or joined (their cancel was
    # held off until the records were complete)
    interrupted = main_task.cancelling() > 0
    other_work = host_load.between(host_before, host_load.sample())
    window = (load.warmup_s, float("inf")) if load.warmup_s else None
    # t0 on time.monotonic (system-wide on Linux): lets record times be matched with server-side logs
    extra = {**(meta or {}), "interrupted": interrupted, "aborted": fleet.abort_reason, "sent": progress.sent,
             "t0_monotonic": t0, "t0_epoch_ns": t0_epoch_ns, "workers": {**pool.meta(), "lost": fleet.lost()},
             "host_load": other_work.to_json() if other_work is not None else None}
    run_meta = _meta(trace, load, client, model, run_id, extra)   # the tokenizer's identity, while it is loaded
    if release_prompts:   # nothing more is sent: the prompts' tape and tokenizer leave before pandas comes in
        del specs, pool
        release_prompt_memory()
    from paasbench.metrics.summary import summarize  # after the load: pandas is no part of launch → first request
    from paasbench.metrics.verify import sent_traffic_hit

    # the hit the sent traffic offered, beside the server's (metrics/verify.py): the window's requests. Each
    # reads the records file as a stream: a run's records are never all in memory (docs/performance.md)
    offered = sent_traffic_hit(trace, read_records(records_path), window or (-float("inf"), float("inf")))
    summary = summarize(read_records(records_path), window=window, goodput_limits=goodput_limits,
                        offered_hit=offered, meta=run_meta)
    server_metrics = watch.figures() if watch is not None else None
    if server_metrics is not None:
        from paasbench.metrics.versus import compare

        server_metrics["versus"] = compare(read_records(records_path), server_metrics, window=window)
        summary["server_metrics"] = server_metrics
    tmp = summary_path.with_suffix(".json.tmp")
    tmp.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    os.replace(tmp, summary_path)
    result = RunResult(summary, records_path, summary_path, out, interrupted, fleet.abort_reason, server_metrics)
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


async def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread, awaited. Unlike ``asyncio.to_thread``, a Ctrl-C meanwhile is not held
    up by it: ``asyncio.run`` joins its default executor's threads before it returns, so a Ctrl-C during the
    target's model lookup waited out the lookup's 10 s timeout; a daemon thread is left to end on its own."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    ctx = contextvars.copy_context()    # as asyncio.to_thread does: the command's answers (client.models)

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        try:
            ok, value = True, ctx.run(fn, *args)
        except BaseException as exc:   # noqa: BLE001 - handed to the awaiting task
            ok, value = False, exc
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:           # the loop is closed: nobody waits for it any more
            pass

    threading.Thread(target=work, name="paasbench-lookup", daemon=True).start()
    return await fut


def run_load_sync(trace: Trace, load: LoadConfig, client: ClientConfig, out_dir: str | os.PathLike[str],
                  **kwargs: Any) -> RunResult:
    return asyncio.run(run_load(trace, load, client, out_dir, **kwargs))
