"""``python -m reference_server`` (and ``paasbench serve``, the same command): start the reference server.

The command is defined here, in the server's own package, so the server starts without importing the harness:
it needs only :mod:`paas_common`. ``paasbench serve`` is this command (:mod:`paasbench.cli` lists it). The
flags are :func:`reference_server.options.serve_options`; the server's run is :mod:`reference_server.server`.
"""

from __future__ import annotations

import asyncio
import sys

import click

from reference_server.options import serve_options


@click.command("serve")
@serve_options
def serve(**kw: object) -> None:
    """Start the reference split prefill/decode server (router + worker processes)."""
    from paas_common.lifetime import die_with_parent
    from reference_server.auth import exposure_warning, load_auth
    from reference_server.options import server_config
    from reference_server.server import serve as serve_until_stopped, validate

    die_with_parent()          # a no-op unless a paasbench process started us with a tether
    auth = load_auth(kw["api_key"], kw["api_key_file"], kw["api_keys_file"],  # type: ignore[arg-type]
                     bool(kw["trust_tenant_header"]))
    cfg = server_config(kw)
    validate(cfg)
    if warning := exposure_warning(cfg.host, auth):
        print(f"reference_server: warning: {warning}", file=sys.stderr, flush=True)
    if cfg.engine == "sim":
        from reference_server.hardware import server_hardware

        hw = server_hardware(cfg)
        print(f"reference_server: {' + '.join(f'{n} {r}' for r, n in hw.workers.items())} workers x "
              f"{hw.cards_per_worker} cards = {hw.cards} cards of {hw.device['name']} on {hw.machines} machine(s); "
              f"prefill-worker chunk {hw.prefill_worker_chunk_tokens} tokens", file=sys.stderr, flush=True)
    sys.exit(asyncio.run(serve_until_stopped(cfg, auth)))
