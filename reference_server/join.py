"""A worker on another host: ``serve --join ROUTER --role prefill|decode`` registers with a running router.

The router is started with ``--join-port`` and both hosts hold the same internal token
(``--internal-token-file``). The join is the challenge-response every internal connection uses
(:mod:`reference_server.challenge`), in both directions: the router's challenge proves this worker holds
the token (no token, no join), and this worker's challenge in its ``hello`` proves the router does, before
it takes the router's configuration. Then:

1. the router answers ``welcome`` with the server configuration and this worker's name (``decode-1``): the
   worker builds exactly the engine the router's own workers run, from the router's flags, not its own;
2. it opens its control port and (decode) its TCP KV port on ``--host`` and sends its ready report on the
   join connection; the router connects to the control port as it does to a child's and heartbeats it;
3. the join connection stays open with nothing on it: it is this worker's tether. When it closes (the
   router stopped, or dropped this worker after a missed heartbeat) the worker leaves. The router never
   restarts a joined worker: start it again to rejoin.

KV between hosts goes over the TCP transport (:mod:`reference_server.kv.transport.tcp`, authenticated on the
same token). The shared KV store: the built-in one is the router host's shared memory, so a joined worker
runs without it; with ``--kv-store mooncake`` the ``welcome`` names the router's Mooncake master, and this
worker starts its host's memory owner (``mooncake_client``, ``--kv-store-gb`` of this host's memory, on
``--host``, tethered) mounted on that master before it reports ready: its puts and onboarding reads go
through the same store as every other worker's. That memory owner is supervised here as the router
supervises its own (:mod:`reference_server.kv.mooncake_service`): restarted on the same address when it dies,
and this worker's store handle opened anew on it. A host that cannot (no package, master unreachable)
reports the failed start and the join ends, both sides saying why. A worker that joins again from the same
host for the same role, after the router dropped it, takes the name it had.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
from typing import Any

from paas_common.errors import InputError
from reference_server import challenge
from reference_server.config import ServerConfig, WorkerSpec
from reference_server.ipc import drain, pack, recv_frame

MIN_TOKEN_CHARS = 16


class JoinRefused(Exception):
    """The router refused this worker, or could not prove it holds the internal token."""


def load_internal_token(path: str | None, flag: str) -> str:
    """The internal token in ``path`` (``--internal-token-file``), needed by ``flag``; InputError (exit 2)
    when it is not given, unreadable or too short to be a secret."""
    if not path:
        raise InputError(f"{flag} needs --internal-token-file: the secret every host of this server shares "
                         "(e.g. `openssl rand -hex 32 > internal.token`, copied to each host)", field=flag)
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise InputError(f"cannot read the internal token: {exc.strerror}", file=path,
                         field="--internal-token-file") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise InputError(f"the internal token has {len(token)} characters; give at least {MIN_TOKEN_CHARS} "
                         "random ones", file=path, field="--internal-token-file")
    return token


def split_address(value: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) -> (host, port); InputError naming ``flag`` otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"'{value}' is not HOST:PORT (the router's --host and --join-port)", field=flag)
    return host.strip("[]"), int(port)


def check_bind_host(host: str, flag: str = "--host") -> None:
    """Other hosts connect to the address a worker or the join port listens on, so it must be one
    address, not a wildcard."""
    if host in ("0.0.0.0", "::", ""):
        raise InputError(f"{flag} {host or '(empty)'} is a wildcard: give this host's address that the other "
                         "hosts reach (workers on other hosts connect to it)", field=flag)


def handshake(sock: socket.socket, token: str, role: str, host: str) -> dict[str, Any]:
    """Answer the router's challenge, challenge it back; returns its ``welcome`` (config, name, index)."""
    msg, _ = recv_frame(sock)
    mine = challenge.nonce()
    hello = challenge.answer(token, msg, role=role, host=host, nonce=mine.hex())
    if hello is None:
        raise JoinRefused(f"the router sent no challenge ({msg.get('op')!r})")
    sock.sendall(pack(hello))
    welcome, _ = recv_frame(sock)
    if welcome.get("op") != "welcome":
        raise JoinRefused(f"the router refused this worker: {welcome.get('error')}")
    if not challenge.proven(token, mine, welcome, "welcome"):
        raise JoinRefused("the router did not prove it holds the internal token")
    return welcome


def router_config(fields: dict[str, Any]) -> ServerConfig:
    """The router's :class:`ServerConfig` from its JSON form (tuples travel as lists)."""
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items() if k in known})


def join(router: str, role: str, host: str, token: str) -> int:
    """Run a worker that joins the router at ``router`` (HOST:PORT) until the router lets it go."""
    from reference_server.worker import _stop, run_worker, start_worker

    rhost, rport = split_address(router, "--join")
    try:
        sock = socket.create_connection((rhost, rport), timeout=30.0, source_address=(host, 0))
    except OSError as exc:
        print(f"reference_server: cannot reach the router's join port {router}: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        welcome = handshake(sock, token, role, host)
    except (JoinRefused, ConnectionError, OSError) as exc:
        print(f"reference_server: join refused: {exc}", file=sys.stderr, flush=True)
        return 1
    # The router's configuration, as this host sees it: one worker, of this role, on this host's devices.
    cfg = dataclasses.replace(router_config(welcome["config"]), prefill_workers=int(role == "prefill"),
                              decode_workers=int(role == "decode"), prefill_devices=None, decode_devices=None)
    spec = WorkerSpec(role=role, index=int(welcome["index"]), config=cfg, internal_token=token,  # type: ignore[arg-type]
                      host=host, device_slot=0)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    sock.settimeout(None)
    store = None
    try:
        store = _store_part(welcome.get("store"), host)
        w, info = start_worker(spec)
    except Exception as exc:  # noqa: BLE001 - tell the router, then exit non-zero
        error = f"{type(exc).__name__}: {exc}"
        sock.sendall(pack({"op": "ready", "ok": False, "error": error}))
        print(f"reference_server: worker {spec.name} failed to start: {error}", file=sys.stderr, flush=True)
        if store is not None:
            store.stop()
        return 1
    if store is not None:
        info["store_client"] = store.client_addr
        # this host's memory owner is supervised here, as the router supervises its own: restarted on the same
        # address when it dies, and this worker's store handle opened anew on it
        store.watch(log=lambda line: print(f"reference_server: {line}", file=sys.stderr, flush=True),
                    on_restart=lambda: _reattach(w))
    sock.sendall(pack({"op": "ready", "ok": True, **info}))
    print(f"reference_server: joined {router} as {spec.name}; control port {host}:{info['port']}"
          + (f", KV port {host}:{info['kv_port']}" if info.get("kv_port") else ""), file=sys.stderr, flush=True)
    threading.Thread(target=_leave_when_closed, args=(sock,), daemon=True, name="join-tether").start()
    try:
        run_worker(w)
    finally:
        if store is not None:
            store.stop()
    return 0


def _store_part(store: dict[str, Any] | None, host: str) -> Any:
    """This host's part of the router's shared KV store, started on this (the main) thread so it is tethered
    here: a Mooncake memory owner on ``host`` mounted on the router's master; None for no store or the
    built-in one. Raises, naming the master, when this host cannot take part."""
    if not store or store.get("backend") != "mooncake":
        return None
    from reference_server.kv.mooncake_service import MooncakeService, log_dir

    try:
        return MooncakeService(store["master"], int(store["segment"]), log_dir(), host)
    except ImportError as exc:
        raise RuntimeError(f"the router's KV store is Mooncake Store (master {store['master']}) and this host "
                           f"cannot load it ({exc}): pip install 'paasbench[mooncake]' and apt-get install "
                           "libibverbs1 librdmacm1 libnuma1") from None
    except Exception as exc:  # noqa: BLE001 - named for the router's log and this host's
        raise RuntimeError(f"cannot join the router's Mooncake store (master {store['master']}) from {host}: "
                           f"{exc}") from None


def _reattach(w: Any) -> None:
    """The memory owner of this host was restarted: open this worker's store handle on it again."""
    try:
        w.reattach_store()
    except Exception as exc:  # noqa: BLE001 - it serves without the store until the next restart
        print(f"reference_server: could not re-attach the KV store after its memory owner restarted: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _leave_when_closed(sock: socket.socket) -> None:
    """The join connection is the tether: when the router closes it (or vanishes), stop the engine loop."""
    drain(sock)
    print("reference_server: the router closed the join connection; leaving", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
