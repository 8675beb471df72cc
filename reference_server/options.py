"""The reference server's flags: one definition, for ``paasbench serve``, ``python -m reference_server`` (the same
command, :mod:`reference_server.cli`) and the sweep's embedded server flags (:func:`parse_flags`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import click

from reference_server.config import MODES, ServerConfig

F = Callable[..., Any]


def _kv_store(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from reference_server.kv.backend import parse_kv_store

    try:
        parse_kv_store(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def _devices(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    from reference_server.devices import parse_devices

    try:
        return parse_devices(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback unless told otherwise).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 = any free port.")
@click.option("--mode", type=click.Choice(MODES), default="disaggregated", show_default=True)
@click.option("--engine", type=click.Choice(["cpu", "sim", "vllm"]), default="cpu", show_default=True,
              help="cpu: the built-in transformer; sim: the roofline twin; vllm: real vLLM instances behind the "
                   "router (--model: a checkpoint directory; docs/reference_server.md, \"vLLM instances\").")
@click.option("--backend", type=click.Choice(["numpy", "torch"]), default="numpy", show_default=True)
@click.option("--device", default="cpu", show_default=True,
              help="torch device for --backend torch: cpu, cuda, musa (cuda:N / musa:N pins every worker to N).")
@click.option("--prefill-devices", default=None, callback=_devices, metavar="I,J,...",
              help="Device index of each prefill worker [default: one device per worker, prefill first, then decode].")
@click.option("--decode-devices", default=None, callback=_devices, metavar="I,J,...",
              help="Device index of each decode worker.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="Weights and activations (auto: bfloat16 on an accelerator, float32 on a CPU).")
@click.option("--kv-dtype", type=click.Choice(["auto", "float32", "bfloat16", "fp8_e4m3"]), default="auto",
              show_default=True, help="KV pool dtype (auto: --dtype's; fp8_e4m3: per-block scales; torch only).")
@click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=click.FloatRange(0.05, 1.0),
              help="Accelerator: the KV pool takes this share of device memory minus what the weights use.")
@click.option("--model", default="tiny", show_default=True,
              help="cpu engine: a built-in random model (tiny, small) or a Hugging Face checkpoint directory "
                   "(Llama/Qwen2/Qwen3: config.json, *.safetensors, tokenizer.json).")
@click.option("--model-profile", default=None, help="sim engine model profile (e.g. glm-5.2-fp8).")
@click.option("--device-profile", default=None, help="sim engine device profile (e.g. mtt-s5000).")
@click.option("--model-set", default=None, metavar="KEY=VALUE,...",
              help="sim: override model profile fields, e.g. total_params=371e9 (what-if).")
@click.option("--device-set", default=None, metavar="KEY=VALUE,...",
              help="sim: override device profile fields, e.g. hbm_gb=141,mfu=0.5,tflops.fp8=900 (what-if).")
@click.option("--cards-per-worker", default=None, type=click.IntRange(min=1),
              help="sim: cards of one worker's model instance (tensor/expert parallel) [default: the fewest that "
                   "hold the weights with 20% of memory left for KV].")
@click.option("--prefill-device-profile", default=None,
              help="sim, disaggregated: the prefill pool's device profile when it is another card than "
                   "--device-profile's (e.g. mtt-s5000 prefill machines beside an h200 decode pool).")
@click.option("--prefill-cards-per-worker", default=None, type=click.IntRange(min=1),
              help="sim: cards of one prefill worker's instance on --prefill-device-profile [default: the fewest "
                   "that hold the weights with 20% of memory left for KV].")
@click.option("--sim-time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0.0),
              help="sim engine: multiply modeled step times (e.g. 0.01 to run a 400K request in a test).")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=1), help="Worker process budget, all modes.")
@click.option("--prefill-workers", default=None, type=click.IntRange(min=0),
              help="disaggregated: P (default N//2); 0 with --join-port: every prefill worker joins from another host.")
@click.option("--decode-workers", default=None, type=click.IntRange(min=0),
              help="disaggregated: D (default N-P); 0 with --join-port: every decode worker joins from another host.")
@click.option("--block-size", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--kv-budget-mb", default=None, type=click.FloatRange(min=0.001),
              help="KV pool per worker [default: 256 (cpu); the device's HBM left after the weights (sim)].")
@click.option("--remote-prefill-threshold", default=1000, show_default=True, type=click.IntRange(min=0),
              help="--routing threshold: remote prefill iff prompt − prefix hit > this (and the prefill queue "
                   "has room). --routing cost: the floor below which a prefill always stays local.")
@click.option("--prefill-queue-bound", default=2, show_default=True, type=click.IntRange(min=0),
              help="--routing threshold: outstanding remote prefills per prefill worker before prefills stay "
                   "local (0 disables remote prefill in both rules).")
@click.option("--routing", type=click.Choice(["cost", "threshold"]), default="cost", show_default=True,
              help="Where a prefill runs: the cheaper of local and remote by estimated time (cost), or the "
                   "article's rule: remote iff uncached tokens > --remote-prefill-threshold (threshold).")
@click.option("--kv-store-gb", default=None, type=click.FloatRange(min=0.0),
              help="Host KV store shared by every worker [default: 1 (cpu: real shared memory); 1024 (sim: "
                   "modeled host DRAM)]; 0 disables it.")
@click.option("--kv-store", default="builtin", show_default=True, callback=_kv_store, metavar="BACKEND",
              help="The shared KV store: builtin (one shared-memory segment on this host), mooncake (Mooncake "
                   "Store; the server starts mooncake_master and the memory owner, needs paasbench[mooncake]) "
                   "or mooncake://HOST:PORT (an existing master). --kv-store-gb is the memory this server adds.")
@click.option("--kv-store-timeout", "kv_store_timeout_s", default=1.0, show_default=True,
              type=click.FloatRange(min=0.001),
              help="Seconds a worker waits for one store call; past it (and while that call has not returned) "
                   "every store call is a miss, recomputed: a store that stops answering never holds up a worker.")
@click.option("--prefill-chunk-tokens", default=512, show_default=True, type=click.IntRange(min=1),
              help="Prefill tokens per engine step on mixed and decode workers (chunked-prefill budget).")
@click.option("--prefill-worker-chunk-tokens", default=None, type=click.IntRange(min=1),
              help="Prefill tokens per step on prefill-only workers [default: sim: the smallest compute-bound "
                   "chunk on the roofline; cpu: --prefill-chunk-tokens].")
@click.option("--max-num-seqs", default=64, show_default=True, type=click.IntRange(min=1), help="Running sequences per worker.")
@click.option("--max-waiting", default=256, show_default=True, type=click.IntRange(min=0),
              help="Requests queued beyond running capacity before 429.")
@click.option("--tokens-per-chunk", default=1, show_default=True, type=click.IntRange(min=1), help="Output tokens per SSE chunk.")
@click.option("--kv-transport", type=click.Choice(["shm", "tcp"]), default="shm", show_default=True)
@click.option("--kv-fp8", is_flag=True, help="FP8 (e4m3, per-block scale) KV on the wire.")
@click.option("--join-port", default=None, type=click.IntRange(0, 65535),
              help="Router: accept prefill/decode workers joining from other hosts on --host:PORT (0 = any free "
                   "port); needs --kv-transport tcp and --internal-token-file. Off by default.")
@click.option("--join", "join", default=None, metavar="HOST:PORT",
              help="Start no router: run one worker that joins the router whose --host:--join-port this is; it "
                   "listens on --host and takes its configuration from the router.")
@click.option("--role", type=click.Choice(["prefill", "decode"]), default=None, help="With --join: the worker's pool.")
@click.option("--internal-token-file", default=None, type=click.Path(dir_okay=False),
              help="The internal token the router and every joined worker share (with --join-port / --join); "
                   "without joining, a fresh random one per launch.")
@click.option("--vllm-python", default=None, metavar="PYTHON",
              help="--engine vllm: the python of vLLM's environment [default: $PAASBENCH_VLLM_PYTHON, else this one].")
@click.option("--vllm-args", default=None, metavar="'FLAGS'",
              help="--engine vllm: extra `vllm serve` flags for every instance launched, e.g. '--max-model-len 4096'.")
@click.option("--vllm-prefill-url", "vllm_prefill_urls", multiple=True, metavar="URL",
              help="--engine vllm: use this running prefill instance (kv_producer) instead of launching one; repeat.")
@click.option("--vllm-decode-url", "vllm_decode_urls", multiple=True, metavar="URL",
              help="--engine vllm: use this running decode instance (kv_consumer; colocated modes: a plain one).")
@click.option("--kv-connector", type=click.Choice(["auto", "nixl", "example"]), default="auto", show_default=True,
              help="--engine vllm: vLLM's KV connector between prefill and decode instances: nixl (UCX), example "
                   "(shared storage under a directory the server makes and removes; needs nothing extra), or "
                   "auto: nixl when vLLM's environment can import it, else example.")
@click.option("--api-key", default=None, envvar="PAASBENCH_API_KEY",
              help="Require 'Authorization: Bearer KEY' (env PAASBENCH_API_KEY; on the command line, ps shows it).")
@click.option("--api-key-file", default=None, type=click.Path(dir_okay=False),
              help="Read the API key from this file instead of the command line.")
@click.option("--api-keys-file", default=None, type=click.Path(dir_okay=False),
              help="Several tenants: one 'KEY TENANT' per line. A key's tenant is its prefix-cache namespace.")
@click.option("--trust-tenant-header", is_flag=True,
              help="Take the tenant from the x-tenant header (only behind a gateway that sets it itself).")
@click.option("--model-name", default=None, help="Model name served in /v1/models.")
@click.option("--seed", default=0, show_default=True, type=int, help="Model weights seed (cpu engine).")
@click.option("--block-hash", type=click.Choice(["sha256", "xxh3"]), default="sha256", show_default=True,
              help="Prefix-cache block hash. xxh3 is faster; use it only when callers cannot craft collisions.")
@click.option("--max-body-mb", default=64.0, show_default=True, type=click.FloatRange(min=0.001),
              help="Largest request body accepted (413 beyond), checked before it is read or parsed.")
@click.option("--heartbeat-interval", "heartbeat_interval_s", default=0.5, show_default=True,
              type=click.FloatRange(min=0.01), help="Seconds between worker heartbeats.")
@click.option("--heartbeat-timeout", "heartbeat_timeout_s", default=3.0, show_default=True,
              type=click.FloatRange(min=0.01), help="A worker that has not answered a heartbeat in this many seconds "
              "is declared down: its requests fail over or fail, and it is restarted.")
@click.option("--request-timeout", "request_timeout_s", default=600.0, show_default=True,
              type=click.FloatRange(min=0.01), help="Deadline for one request inside the server (504 after).")
@click.option("--fault-spec", default=None, metavar="JSON|FILE",
              help="Fault injection (testing only): a plan of HTTP, stream, KV and worker faults by probability or "
                   "every N-th request (docs/faults.md); also enables POST /admin/faults. Off by default.")
@click.option("--debug-corrupt-kv-every", default=0, type=click.IntRange(min=0), hidden=True,
              help="Test hook: the prefill worker flips one KV byte in every N-th transfer.")
@click.option("--debug-step-slowdown", default=0.0, type=click.FloatRange(min=0.0), hidden=True,
              help="Test hook: every engine step burns this fraction more process CPU (0.1: a 10% slower step).")
@click.option("--debug-reuse-shortfall", default=0, type=click.IntRange(min=0), hidden=True,
              help="Test hook: every request reuses N cached prefix blocks fewer than it matched, and the engine "
                   "computes them again (a regression in the KV path the perf gate must catch).")
def _serve_flags(**kw: object) -> None:
    """The decorators above are the one definition of the server's flags; :func:`serve_options` hands them out."""


def serve_options(f: F) -> F:
    """Every flag of the server, in ``--help`` order: what ``paasbench serve`` and ``python -m reference_server``
    take, and what a sweep's ``--server-arg`` flags are parsed by (:func:`parse_flags`)."""
    f.__click_params__ = [*getattr(f, "__click_params__", []), *_serve_flags.__click_params__]  # type: ignore[attr-defined]
    return f


AUTH_PARAMS = ("api_key", "api_key_file", "api_keys_file", "trust_tenant_header")   # router-only: keys stay out
                                                                                   # of the config workers get
JOIN_PARAMS = ("join", "role", "internal_token_file")   # how this process joins (reference_server.join)


def server_config(params: Mapping[str, Any]) -> ServerConfig:
    """The :class:`ServerConfig` of this command's parsed parameters (the key options are not part of it)."""
    return ServerConfig(**{k: v for k, v in params.items() if k not in AUTH_PARAMS + JOIN_PARAMS})


def parse_flags(args: list[str]) -> dict[str, Any]:
    """The parameters ``python -m reference_server ARGS`` would run with (raises ``click.UsageError``)."""
    return _PARSER.make_context("serve", list(args)).params


_PARSER = click.command("serve")(serve_options(lambda **kw: None))
