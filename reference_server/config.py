"""Server configuration: one typed record built from the CLI flags and handed to every process.

The mode budget lives here because it is the fairness rule of the mode comparison (article §6.2):
every mode gets the same number of worker processes, so a sweep compares scheduling, not hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["colocated", "chunked", "disaggregated"]
Role = Literal["mixed", "prefill", "decode"]
MODES: tuple[str, ...] = ("colocated", "chunked", "disaggregated")
# Workers run on the router's host and listen on loopback only, whatever --host the public API binds:
# their ports are internal (token-protected as well). With --join-port, workers on other hosts must reach
# them: then they listen on --host (reference_server.join).
INTERNAL_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    mode: Mode = "disaggregated"
    engine: str = "cpu"                  # "cpu" (real numpy/torch model), "sim" (roofline twin), "vllm" (instances)
    backend: str = "numpy"
    device: str = "cpu"                  # cpu | cuda[:N] | musa[:N] (torch backend); per-worker map: devices.py
    prefill_devices: tuple[int, ...] | None = None   # device index per prefill worker; None: one each, in order
    decode_devices: tuple[int, ...] | None = None
    dtype: str = "auto"                  # weights/activations: auto = bfloat16 on an accelerator, float32 on a CPU
    kv_dtype: str = "auto"               # KV pool: auto (= dtype), float32, bfloat16, fp8_e4m3 (per-block scales)
    gpu_memory_utilization: float = 0.9  # accelerator: KV pool = this share of device memory minus the weights
    model: str = "tiny"                  # cpu engine: built-in size (tiny, small) or a Hugging Face checkpoint dir
    model_profile: str | None = None     # sim
    device_profile: str | None = None    # sim
    model_set: str | None = None         # sim: profile fields overridden, "key=value,..." (what-if)
    device_set: str | None = None        # sim: e.g. "hbm_gb=141,mfu=0.5"
    cards_per_worker: int | None = None  # sim: cards of one instance (TP/EP); None: the fewest that hold it
    prefill_device_profile: str | None = None  # sim: the prefill pool's card when it differs (heterogeneous pools)
    prefill_cards_per_worker: int | None = None  # sim: cards of one prefill instance on that card; None: the fewest
    sim_time_scale: float = 1.0          # sim: sleep time multiplier (tests shrink modeled times)
    workers: int = 2                     # process budget shared by all modes
    prefill_workers: int | None = None   # disaggregated split; default: half the budget (at least 1)
    decode_workers: int | None = None
    block_size: int = 512
    kv_budget_mb: float | None = None    # KV pool per worker; None: 256 MB (CPU), --gpu-memory-utilization
                                         # of the device after the weights (GPU), modeled HBM left (sim)
    remote_prefill_threshold: int = 1000  # Dynamo's max_local_prefill_length default
    prefill_queue_bound: int = 2          # per prefill worker (Dynamo: prefill queue < 2)
    prefill_chunk_tokens: int = 512       # chunked-prefill token budget per step (mixed and decode workers)
    prefill_worker_chunk_tokens: int | None = None  # prefill-only workers; None: compute-bound (sim), else the above
    max_num_seqs: int = 64                # running sequences per worker (decode batch cap)
    max_waiting: int = 256                # requests admitted but not running, server-wide; beyond → 429
    tokens_per_chunk: int = 1             # output tokens per SSE chunk (after the first token)
    kv_transport: str = "shm"             # "shm" (same host) or "tcp"
    kv_fp8: bool = False                  # FP8 (e4m3, per-block scale) on the wire
    model_name: str | None = None         # name served in /v1/models; default derived from engine/model
    seed: int = 0
    fault_spec: str | None = None         # fault injection plan (reference_server.faults): JSON or a file; None: off
    debug_corrupt_kv_every: int = 0       # test hook: prefill worker flips a KV byte every N transfers
    debug_step_slowdown: float = 0.0      # test hook: each engine step burns this fraction more CPU (perf gate)
    debug_reuse_shortfall: int = 0        # test hook: each allocation reuses this many cached blocks fewer (perf gate)
    util_window_s: float = 10.0           # /metrics pool utilization window
    block_hash: str = "sha256"            # prefix-cache block hash: "sha256" or "xxh3" (faster, for trusted traffic)
    max_body_mb: float = 64.0             # request bodies over this are refused (413) before they are read
    heartbeat_interval_s: float = 0.5     # supervisor: ping every worker this often
    heartbeat_timeout_s: float = 3.0      # ... and declare it down (kill, restart) if it has not answered
    request_timeout_s: float = 600.0      # deadline on every internal wait of one request (504 after)
    kv_store_gb: float | None = None      # host KV store; None: 1 GB of shm (cpu), 1024 GB modeled DRAM (sim); 0: off
    kv_store: str = "builtin"             # which store: builtin, mooncake, mooncake://HOST:PORT (kv/backend.py)
    kv_store_timeout_s: float = 1.0       # a worker's wait for one store call; past it a miss (kv/guard.py)
    routing: str = "cost"                 # "cost" (estimated local vs remote time) or "threshold" (the article's rule)
    vllm_python: str | None = None        # vllm: python of vLLM's environment; None: $PAASBENCH_VLLM_PYTHON or ours
    vllm_args: str | None = None          # vllm: extra `vllm serve` flags for every launched instance
    vllm_prefill_urls: tuple[str, ...] = ()   # vllm: running prefill instances to use instead of launching
    vllm_decode_urls: tuple[str, ...] = ()    # vllm: running decode (or colocated) instances
    kv_connector: str = "auto"            # vllm: "nixl", "example" (shared storage) or "auto" (nixl if importable)
    kv_shared_dir: str | None = None      # vllm: the ExampleConnector's directory (made and removed by the server)
    join_port: int | None = None          # accept workers joining from other hosts on --host:this (None: off)

    @property
    def worker_host(self) -> str:
        """Where this host's workers listen: loopback, or --host when workers on other hosts must reach them."""
        return INTERNAL_HOST if self.join_port is None else self.host

    def store_bytes(self) -> int:
        """Capacity of the host's shared KV store (0: no store)."""
        if self.engine == "vllm":
            return 0                      # vLLM's KV lives in its instances; the connector moves it
        gb = self.kv_store_gb if self.kv_store_gb is not None else (1024.0 if self.engine == "sim" else 1.0)
        return int(gb * 1e9)

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.engine == "sim":
            return f"sim-{self.model_profile or 'default'}"
        from reference_server.engine.config import CONFIGS

        if self.model not in CONFIGS:
            return self.model             # a checkpoint: its --model path as given (vLLM's default name)
        return f"paasbench-{self.model}"

    def pools(self) -> dict[Role, int]:
        """Worker processes per role. Colocated and chunked: N mixed workers; disaggregated: P + D = N."""
        if self.engine == "vllm" and (self.vllm_prefill_urls or self.vllm_decode_urls):
            if self.mode != "disaggregated":   # attached: one worker per instance given
                return {"mixed": len(self.vllm_decode_urls)}
            return {"prefill": len(self.vllm_prefill_urls), "decode": len(self.vllm_decode_urls)}
        if self.mode != "disaggregated":
            return {"mixed": self.workers}
        p, d = self.prefill_workers, self.decode_workers
        if p is None and d is None:
            p = max(1, self.workers // 2)
            d = max(1, self.workers - p)
        elif p is None:
            p = max(1, self.workers - d)  # type: ignore[operator]
        elif d is None:
            d = max(1, self.workers - p)
        return {"prefill": p, "decode": d}  # type: ignore[dict-item]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What one worker process needs: its role and index, the server config, the internal token, and the
    address its control and KV ports listen on (a joined worker's own host)."""

    role: Role
    index: int
    config: ServerConfig
    internal_token: str = field(repr=False)
    host: str = INTERNAL_HOST
    device_slot: int | None = None       # its place in this host's device map (None: index; joined: 0, alone)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def slot(self) -> int:
        return self.index if self.device_slot is None else self.device_slot
