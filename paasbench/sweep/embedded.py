"""The embedded reference server: which engine a workload needs, and its flags.

With no ``--target`` a sweep brings its own server. The workload's ``server:`` section says how (keys
are the server's flags with underscores: ``{engine: sim, model_profile: glm-5.2-fp8}`` becomes
``--engine sim --model-profile glm-5.2-fp8``). When it does not name an engine, the context lengths
decide: a real CPU model cannot prefill 64K+ tokens in a useful time, so long contexts go to the
``sim`` hardware twin (the white paper's mtt-s5000 x GLM-5.2-FP8 by default) and short ones to the real
``cpu`` engine.

The server is stopped on every way out -- normal end, error, Ctrl-C, SIGTERM (turned into
KeyboardInterrupt by the CLI) -- because :class:`EmbeddedServer` is a context manager; and when the
sweep is killed outright (SIGKILL, OOM) it dies with it, being tethered (:mod:`paas_common.lifetime`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import click

from paas_common.errors import EXIT_RUN_FAILED, InputError

if TYPE_CHECKING:
    from reference_server.launcher import EmbeddedServer

LONG_CONTEXT_TOKENS = 64 * 1024
SIM_DEFAULT: dict[str, Any] = {"engine": "sim", "model_profile": "glm-5.2-fp8", "device_profile": "mtt-s5000"}
CPU_DEFAULT: dict[str, Any] = {"engine": "cpu", "model": "tiny"}


def server_section(workload_server: Mapping[str, Any] | None, max_context_tokens: int) -> dict[str, Any]:
    """The workload's server section, with the engine filled in from the context lengths if missing."""
    section = dict(workload_server or {})
    if "engine" not in section:
        base = SIM_DEFAULT if max_context_tokens >= LONG_CONTEXT_TOKENS else CPU_DEFAULT
        section = {**base, **section}
    elif section["engine"] == "sim":
        section = {**SIM_DEFAULT, **section}
    return section


def embedded_block_size(server: Mapping[str, Any] | None, max_context_tokens: int) -> int:
    """The KV block size the embedded server will cache in: its section's ``block_size``, else the server's
    default (what its ``/v1/models`` reports once it runs)."""
    import dataclasses

    from reference_server.config import ServerConfig

    default = next(f.default for f in dataclasses.fields(ServerConfig) if f.name == "block_size")
    return int(server_section(server, max_context_tokens).get("block_size") or default)


def prime_concurrency(section: Mapping[str, Any]) -> int:
    """Closed loops a step primes its sessions with on this server (:func:`paasbench.sweep.step.prime`): two per
    prefill instance, enough to keep each busy without queueing the primers behind one another."""
    return 2 * int(section.get("prefill_workers") or section.get("workers") or 2)


def server_args(section: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> list[str]:
    """Flags for ``python -m reference_server``. ``overrides`` (e.g. a swept server parameter) win.
    ``True`` is a bare flag, ``False``/``None`` drop the flag."""
    merged = {**section, **(overrides or {})}
    args: list[str] = []
    for key, value in merged.items():
        if key in ("host", "port"):      # the launcher picks a free loopback port
            continue
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False or value is None:
            continue
        else:
            args += [flag, str(value)]
    return args


def parse_server_args(items: tuple[str, ...]) -> dict[str, Any]:
    """``--server-arg NAME=VALUE`` items -> a server-section overlay (``remote-prefill-threshold=0`` ->
    ``{"remote_prefill_threshold": "0"}``)."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise InputError(f"'{item}' is not NAME=VALUE (e.g. mode=chunked)", field="--server-arg")
        out[name.strip().lstrip("-").replace("-", "_")] = value.strip()
    return out


def section_hardware(section: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Cards and machines the embedded server occupies, with the assumptions behind them (``meta.hardware``):
    computed by the server's own code from the flags it will be started with. A worker that cannot fit its
    cards is an ``InputError`` here, before anything starts."""
    from reference_server.hardware import hardware_for_flags

    return hardware_for_flags(server_args(section, overrides)).to_dict()


class ServerFailed(click.ClickException):
    """The embedded server would not start: the run failed (exit 1), with the server's last log lines."""

    exit_code = EXIT_RUN_FAILED


@contextlib.contextmanager
def embedded_server(section: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> Iterator["EmbeddedServer"]:
    """Start the reference server, yield it (``.url``, ``.procs``), stop it however the block is left. What it
    says of itself (``/v1/models``) is asked afresh inside the block: a swept server parameter restarts the server
    with other flags (``block-size``), perhaps on a port its predecessor used."""
    from paasbench.client.models import asked_once
    from reference_server.launcher import EmbeddedServer, ServerStartError  # `--target` runs need no server code

    args = server_args(section, overrides)
    server = EmbeddedServer(args)
    try:
        server.start()
    except ServerStartError as exc:
        raise ServerFailed(f"embedded reference server ({' '.join(args)}) failed to start: {exc}") from None
    except BaseException:       # Ctrl-C / SIGTERM while it boots: the process tree exists, stop it
        server.stop()
        raise
    try:
        with asked_once():
            yield server
    finally:
        server.stop()
