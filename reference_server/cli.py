"""``paasbench serve`` / ``python -m reference_server``: start the router and its worker processes.

Prints ``READY http://HOST:PORT`` on stdout once ``/health`` would answer (``--port 0`` picks a free
port and the line names it). SIGTERM or SIGINT stops the workers and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import click

from reference_server.config import MODES, ServerConfig


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback unless told otherwise).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 = any free port.")
@click.option("--mode", type=click.Choice(MODES), default="disaggregated", show_default=True)
@click.option("--engine", type=click.Choice(["cpu", "sim"]), default="cpu", show_default=True)
@click.option("--backend", type=click.Choice(["numpy", "torch"]), default="numpy", show_default=True)
@click.option("--device", default="cpu", show_default=True, help="torch device for --backend torch: cpu, cuda, musa.")
@click.option("--model", default="tiny", show_default=True, help="cpu engine model size.")
@click.option("--model-profile", default=None, help="sim engine model profile (e.g. glm-5.2-fp8).")
@click.option("--device-profile", default=None, help="sim engine device profile (e.g. mtt-s5000).")
@click.option("--sim-time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0.0),
              help="sim engine: multiply modeled step times (e.g. 0.01 to run a 400K request in a test).")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=1), help="Worker process budget, all modes.")
@click.option("--prefill-workers", default=None, type=click.IntRange(min=1), help="disaggregated: P (default N//2).")
@click.option("--decode-workers", default=None, type=click.IntRange(min=1), help="disaggregated: D (default N-P).")
@click.option("--block-size", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--kv-budget-mb", default=None, type=click.FloatRange(min=0.001),
              help="KV pool per worker [default: 256 (cpu); the device's HBM left after the weights (sim)].")
@click.option("--remote-prefill-threshold", default=1000, show_default=True, type=click.IntRange(min=0),
              help="Remote prefill iff prompt − prefix hit > this (and the prefill queue has room).")
@click.option("--prefill-queue-bound", default=2, show_default=True, type=click.IntRange(min=0),
              help="Outstanding remote prefills per prefill worker before prefills stay local.")
@click.option("--prefill-chunk-tokens", default=512, show_default=True, type=click.IntRange(min=1),
              help="Prefill tokens per engine step (chunked-prefill budget).")
@click.option("--max-num-seqs", default=64, show_default=True, type=click.IntRange(min=1), help="Running sequences per worker.")
@click.option("--max-waiting", default=256, show_default=True, type=click.IntRange(min=0),
              help="Requests queued beyond running capacity before 429.")
@click.option("--tokens-per-chunk", default=1, show_default=True, type=click.IntRange(min=1), help="Output tokens per SSE chunk.")
@click.option("--kv-transport", type=click.Choice(["shm", "tcp"]), default="shm", show_default=True)
@click.option("--kv-fp8", is_flag=True, help="FP8 (e4m3, per-block scale) KV on the wire.")
@click.option("--api-key", default=None, envvar="PAASBENCH_API_KEY", help="Require 'Authorization: Bearer KEY'.")
@click.option("--model-name", default=None, help="Model name served in /v1/models.")
@click.option("--seed", default=0, show_default=True, type=int, help="Model weights seed (cpu engine).")
@click.option("--debug-corrupt-kv-every", default=0, type=click.IntRange(min=0), hidden=True,
              help="Test hook: the prefill worker flips one KV byte in every N-th transfer.")
@click.option("--debug-step-slowdown", default=0.0, type=click.FloatRange(min=0.0), hidden=True,
              help="Test hook: every engine step burns this fraction more process CPU (0.1: a 10% slower step).")
def serve(**kw: object) -> None:
    """Start the reference split prefill/decode server (router + worker processes)."""
    cfg = ServerConfig(**kw)  # type: ignore[arg-type]
    _validate(cfg)
    sys.exit(asyncio.run(_main(cfg)))


def _validate(cfg: ServerConfig) -> None:
    """Name errors exit 2 here with one clear line, instead of as a worker's start-up traceback."""
    from paasbench.errors import InputError

    if cfg.engine == "cpu":
        from reference_server.engine.config import get_config

        try:
            get_config(cfg.model)
        except ValueError as exc:
            raise InputError(str(exc), field="--model") from None
    else:
        from reference_server.sim.profiles import load_device_profile, load_model_profile

        load_model_profile(cfg.model_profile or cfg.model)
        load_device_profile(cfg.device_profile or "cpu-local")


async def _main(cfg: ServerConfig) -> int:
    from aiohttp import web

    from reference_server.api import build_app
    from reference_server.router import Router

    router = Router(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    try:
        await router.start()
        runner = web.AppRunner(build_app(router), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        print(f"READY http://{host}:{port}", flush=True)
        await stop.wait()
        return 0
    except Exception as exc:  # noqa: BLE001 - startup failure: say why, exit non-zero
        print(f"reference_server: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if runner is not None:
            await runner.cleanup()
        router.stop()
