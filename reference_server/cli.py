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
    from reference_server.join import load_internal_token
    from reference_server.options import server_config
    from reference_server.server import serve as serve_until_stopped, validate

    die_with_parent()          # a no-op unless a paasbench process started us with a tether
    if kw["join"] is not None:
        sys.exit(_join_router(kw))
    if kw["role"] is not None:
        raise click.UsageError("--role goes with --join (the pool of a worker joining a router)")
    auth = load_auth(kw["api_key"], kw["api_key_file"], kw["api_keys_file"],  # type: ignore[arg-type]
                     bool(kw["trust_tenant_header"]))
    cfg = server_config(kw)
    validate(cfg)
    if warning := exposure_warning(cfg.host, auth):
        print(f"reference_server: warning: {warning}", file=sys.stderr, flush=True)
    if cfg.engine == "sim":
        from reference_server.hardware import server_hardware

        hw = server_hardware(cfg)
        pool = hw.prefill_pool
        shape = (f"{hw.workers.get('prefill', 0)} prefill x {pool['cards_per_worker']} cards of {pool['device']['name']} + "
                 + " + ".join(f"{n} {r}" for r, n in hw.workers.items() if r != "prefill")
                 + f" x {hw.cards_per_worker} cards of {hw.device['name']} = {hw.cards} cards"
                 if pool else
                 f"{' + '.join(f'{n} {r}' for r, n in hw.workers.items())} workers x {hw.cards_per_worker} cards = "
                 f"{hw.cards} cards of {hw.device['name']}")
        print(f"reference_server: {shape} on {hw.machines} machine(s); "
              f"prefill-worker chunk {hw.prefill_worker_chunk_tokens} tokens", file=sys.stderr, flush=True)
    token = None if cfg.join_port is None else load_internal_token(kw["internal_token_file"], "--join-port")  # type: ignore[arg-type]
    sys.exit(asyncio.run(serve_until_stopped(cfg, auth, token)))


def _join_router(kw: dict[str, object]) -> int:
    """``serve --join ROUTER --role ROLE``: one worker of this host joins a router on another
    (:mod:`reference_server.join`); the router's configuration, not this command's, sizes it."""
    from reference_server.auth import is_loopback
    from reference_server.join import check_bind_host, join, load_internal_token

    if kw["role"] is None:
        raise click.UsageError("--join needs --role prefill or --role decode")
    token = load_internal_token(kw["internal_token_file"], "--join")  # type: ignore[arg-type]
    host = str(kw["host"])
    check_bind_host(host)
    if not is_loopback(host):
        print(f"reference_server: warning: this worker listens on {host}: its control and KV ports take anyone "
              "who can reach this address and proves the internal token; keep them inside the cluster's network",
              file=sys.stderr, flush=True)
    return join(str(kw["join"]), str(kw["role"]), host, token)
