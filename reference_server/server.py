"""Run the reference server in this process: check its configuration, start the router (which starts the
worker processes) and the HTTP API, serve until SIGTERM or SIGINT, stop the workers.

On SIGTERM or SIGINT every request in flight ends at once (503, or an error event and ``[DONE]`` on a
stream that has started; its workers abort it), then the workers are stopped; each unlinks the
shared memory it created on its way out.

Prints ``PROCS {json}`` (every process of its tree: name -> pid and ports), ``JOIN HOST:PORT`` with
``--join-port`` (the address ``serve --join`` takes), and then ``READY http://HOST:PORT`` on stdout once ``/health`` would answer (``--port 0`` picks a free port and
the line names it). The command is ``paasbench serve`` / ``python -m reference_server``
(:mod:`reference_server.cli`); started by a paasbench process (the sweep's embedded server), it dies with
that process (:mod:`paas_common.lifetime`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import TYPE_CHECKING

from reference_server.auth import Auth
from reference_server.config import ServerConfig

if TYPE_CHECKING:
    from reference_server.router import Router


SHUTDOWN_GRACE_S = 2.0    # on stop, how long a handler may take to answer after its request was ended


def validate(cfg: ServerConfig) -> None:
    """Name errors exit 2 here with one clear line, instead of as a worker's start-up traceback."""
    from paas_common.errors import InputError, input_errors

    if cfg.engine == "vllm":
        from reference_server.engine.checkpoint import load_checkpoint
        from reference_server.vllm_instance import vllm_python

        with input_errors("--model"):
            load_checkpoint(cfg.model)        # the shape the cost rule prices KV in; vLLM loads it itself
        if not (cfg.vllm_prefill_urls or cfg.vllm_decode_urls):
            py = vllm_python(cfg.vllm_python)
            if not os.access(py, os.X_OK):
                raise InputError(f"{py}: not an executable python (vLLM's environment)", field="--vllm-python")
        elif cfg.mode == "disaggregated" and not (cfg.vllm_prefill_urls and cfg.vllm_decode_urls):
            raise InputError("attached P/D needs at least one --vllm-prefill-url and one --vllm-decode-url",
                             field="--vllm-decode-url")
    elif cfg.engine == "cpu":
        from reference_server.devices import DeviceMapError, check_devices
        from reference_server.engine.checkpoint import is_checkpoint, load_checkpoint
        from reference_server.engine.config import get_config

        with input_errors("--model"):
            if is_checkpoint(cfg.model):
                from reference_server.engine.vocab import get_vocab

                load_checkpoint(cfg.model)
                get_vocab(cfg.model)      # its tokenizer.json: the server encodes and decodes with it
            else:
                get_config(cfg.model)
        if cfg.backend == "numpy" and (cfg.dtype == "bfloat16" or cfg.kv_dtype not in ("auto", "float32")):
            flag = "--dtype" if cfg.dtype == "bfloat16" else "--kv-dtype"
            raise InputError(f"{flag} {cfg.dtype if flag == '--dtype' else cfg.kv_dtype} needs --backend torch "
                             "(numpy has no bfloat16 or FP8)", field=flag)
        with input_errors(lambda exc: exc.field, catch=DeviceMapError):  # type: ignore[attr-defined]
            check_devices(cfg)
    else:
        from reference_server.hardware import server_hardware

        server_hardware(cfg)   # profiles load, overrides parse, the instance fits its cards
    if (cfg.prefill_device_profile or cfg.prefill_cards_per_worker) and (cfg.engine != "sim"
                                                                         or cfg.mode != "disaggregated"):
        flag = "--prefill-device-profile" if cfg.prefill_device_profile else "--prefill-cards-per-worker"
        raise InputError("the prefill pool's own card is a sim twin's disaggregated pool: it needs --engine sim "
                         "and --mode disaggregated", field=flag)
    if cfg.kv_store != "builtin" and cfg.store_bytes() > 0:
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:
            raise InputError(f"--kv-store {cfg.kv_store} needs Mooncake Store: pip install 'paasbench[mooncake]' "
                             f"and apt-get install libibverbs1 librdmacm1 libnuma1 ({exc})", field="--kv-store") from None
        from reference_server.kv.mooncake_service import memory_shortfall, segment_bytes

        short = memory_shortfall(segment_bytes(cfg))     # the memory owner would abort at start
        if short:
            raise InputError(short, field="--kv-store-gb")
    if cfg.join_port is not None:
        from reference_server.join import check_bind_host

        if cfg.mode != "disaggregated":
            raise InputError("workers join a prefill or a decode pool: --join-port needs --mode disaggregated",
                             field="--join-port")
        if cfg.engine == "vllm":
            raise InputError("--join-port takes the reference engine's workers (--engine cpu or sim), not vLLM "
                             "instances (give running ones with --vllm-prefill-url / --vllm-decode-url)",
                             field="--join-port")
        if cfg.kv_transport != "tcp":
            raise InputError("KV reaches workers on other hosts over TCP: --join-port needs --kv-transport tcp",
                             field="--join-port")
        check_bind_host(cfg.host)
    else:
        for flag, n in (("--prefill-workers", cfg.prefill_workers), ("--decode-workers", cfg.decode_workers)):
            if n == 0:
                raise InputError(f"{flag} 0 leaves that pool empty unless workers join: give --join-port", field=flag)
    if cfg.fault_spec is not None:
        from reference_server.faults import FaultPlan, FaultSpecError

        with input_errors("--fault-spec", catch=FaultSpecError):
            FaultPlan.parse(cfg.fault_spec)


def _procs(router: "Router", port: int) -> dict[str, dict[str, object]]:
    """Every process of this server's tree with the ports it listens on (workers listen on loopback)."""
    from multiprocessing import resource_tracker

    out: dict[str, dict[str, object]] = {"router": {"pid": os.getpid(), "ports": [port]}, **router.sup.procs()}
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)   # spawn starts it; it cleans shm
    if tracker:
        out["resource-tracker"] = {"pid": tracker, "ports": []}
    return out


def vllm_shared_dir(cfg: ServerConfig) -> tuple[ServerConfig, str | None]:
    """``--engine vllm`` launching instances: a private directory for their logs and the shared-storage
    connector's KV files (``kv/``), removed when the server stops (the connector never deletes them)."""
    if cfg.engine != "vllm" or cfg.vllm_prefill_urls or cfg.vllm_decode_urls:
        return cfg, None
    import dataclasses
    import tempfile

    root = tempfile.mkdtemp(prefix="paasbench-vllm-")
    os.mkdir(os.path.join(root, "kv"))
    return dataclasses.replace(cfg, kv_shared_dir=os.path.join(root, "kv"), kv_connector=connector(cfg)), root


def connector(cfg: ServerConfig) -> str:
    """``--kv-connector auto`` for launched instances: NIXL where vLLM's environment can import it, else the
    example connector (needs nothing extra). Asked once here, so every worker configures the same one."""
    if cfg.kv_connector != "auto" or cfg.mode == "colocated":
        return cfg.kv_connector
    from reference_server.vllm_instance import nixl_importable, vllm_env, vllm_python

    return "nixl" if nixl_importable(vllm_python(cfg.vllm_python), vllm_env(cpu=cfg.device == "cpu")) else "example"


async def serve(cfg: ServerConfig, auth: Auth, token: str | None = None) -> int:
    import shutil

    from aiohttp import web

    from reference_server.api import build_app
    from reference_server.router import Router

    cfg, scratch = vllm_shared_dir(cfg)
    router = Router(cfg, token)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    try:
        await router.start(timeout_s=1200.0 if cfg.engine == "vllm" else 300.0)   # vLLM: minutes to start
        # handler_cancellation: a client that disconnects cancels its handler at once, wherever it waits,
        # and the request is aborted on its workers (docs/faults.md, "Clients that leave").
        runner = web.AppRunner(build_app(router, auth), access_log=None, handler_cancellation=True,
                               shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        print("PROCS " + json.dumps(_procs(router, port)), flush=True)
        if cfg.join_port is not None:
            join_port = await router.sup.accept_joins(cfg.host, cfg.join_port)
            print(f"JOIN {host}:{join_port}", flush=True)
        print(f"READY http://{host}:{port}", flush=True)
        await stop.wait()
        return 0
    except Exception as exc:  # noqa: BLE001 - startup failure: say why, exit non-zero
        print(f"reference_server: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        router.end_requests("server shutting down")   # every handler answers at once: nothing to wait for
        if runner is not None:
            await runner.cleanup()
        router.stop()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
