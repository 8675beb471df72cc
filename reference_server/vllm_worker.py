"""A worker whose engine is a real vLLM instance (``--engine vllm``): the same worker behind the same router.

The router (:mod:`reference_server.router`) and the supervisor talk to every worker over one control protocol
(``match``, ``generate``, ``prefill``, ``kv``, ``kv_failed``, ``abort``, ``stats``, ``ping``:
:mod:`reference_server.worker`). This worker answers it by driving a vLLM OpenAI server it starts (its own
process group, tethered to this worker: :mod:`reference_server.vllm_instance`) or, with ``--vllm-prefill-url`` /
``--vllm-decode-url``, one already running. So routing, streaming, usage, faults, supervision and ``/metrics``
are the router's, unchanged, and vLLM does the model math and the KV transfer:

* **local** (``generate``): the decode (or mixed) instance gets the request and prefills it itself;
* **remote**: the prefill instance gets ``max_tokens=1`` with ``kv_transfer_params={"do_remote_decode": true}``
  (``prefill``); its connector (the ``kv_producer``) saves or exposes the KV, and the ``kv_transfer_params`` of
  its response go, in a ``kv`` message straight to the decode worker's control port, into the decode request
  (``generate(remote)``), whose connector (the ``kv_consumer``) loads the KV instead of computing it. That is
  the protocol of vLLM's own disaggregated proxies; a prefill that fails turns into a local prefill
  (``kv_failed``), as with the built-in engines.

What the routing rules are fed (:mod:`reference_server.routing`), from the instance where it says it:

* ``running``: the instance's own ``vllm:num_requests_running`` (``/metrics``, at most 0.5 s old);
* ``prefill_s``: seconds per prefilled token, an average over this instance's own prefills (time to its first
  token over the prompt tokens it computed, ``usage`` minus its ``cached_tokens``);
* ``hit``: vLLM has no per-prompt prefix-cache query, so the worker keeps the chained block hashes of the
  prompts it sent (:class:`PrefixRecord`, at most the instance's own KV block count, least recently used
  out), and checks every prediction against the instance's answer (``usage.prompt_tokens_details
  .cached_tokens``): ``stats`` counts both, and ``paasbench_timings`` carries the engine's figure.

The stage timings take the connector's own time where the instance exposes it (:class:`ConnectorClock`):
``kv_transfer_ms`` from the decode instance's transfer histogram (NIXL's ``vllm:nixl_xfer_time_seconds``, the
example connector's load time), ``transfer_bytes`` from its bytes per transfer (NIXL's
``vllm:nixl_bytes_transferred``, the example connector's files read), ``kv_write_ms`` from the prefill instance's
save histogram, each from a read of
the instance's ``/metrics`` begun after the request ended. That read and the periodic one that keeps ``running``
fresh are one path (:meth:`VllmWorker._fresh`): the periodic read happens only when no request read in the
last 0.5 s, so the page is not fetched twice over.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import tempfile
import threading
import time
import urllib.request
from collections import OrderedDict
from pathlib import Path
from typing import Any

from paas_common.lifetime import Tether
from paas_common.prometheus import ParseError, format_line, parse, parse_line, totals
from reference_server.config import INTERNAL_HOST, WorkerSpec
from reference_server.ipc import Conn, Peers, blob_tokens, serve_blocking
from reference_server.kv.block_manager import chain_hashes
from reference_server.routing import PrefillEstimator
from reference_server.worker import exit_now, worker_process
from reference_server.vllm_instance import CONNECTOR_TIMES

SCRAPE_EVERY_S = 0.5
WIRE_BYTES_PER_S = 1.4e9      # the cost rule's KV bandwidth: same-host copies (docs/kv.md); a GPU fabric differs
STARTUP_S = 900.0             # vLLM's start on a busy CPU box takes minutes (docs/engines-real.md)


# ---------------------------------------------------------------------------------------------- figures

def figures_of(text: str) -> dict[str, float]:
    """Prometheus text -> metric name -> sum over its series (``_total`` kept as vLLM names it); ParseError
    (:mod:`paas_common.prometheus`) when a sample line is malformed."""
    return totals(parse(text))


def label_value(text: str, metric: str, label: str) -> str | None:
    """The value of ``label`` on the first series of ``metric`` (vLLM's ``cache_config_info`` carries its
    configuration as labels); None when there is none, or the exposition does not parse."""
    try:
        return next((s.label(label) for s in parse(text) if s.name == metric), None)
    except ParseError:
        return None


def relabel(name: str, text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """An instance's exposition with ``worker="name"`` added to every series: (HELP/TYPE lines, (metric name,
    sample line)). A line that does not parse is left out: the rest of the instance's figures still pass."""
    meta, samples = [], []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#"):
            meta.append(line)
            continue
        if not line:
            continue
        try:
            s = parse_line(line)
        except (ValueError, IndexError):
            continue
        samples.append((s.name, format_line(s.name, [("worker", name), *s.labels], s.value_text)))
    return meta, samples


def merge_expositions(parts: list[tuple[str, str]]) -> str:
    """Several instances' ``/metrics`` as one exposition: each metric's HELP/TYPE once, every series labelled
    with its worker (what the router's ``/metrics`` passes through)."""
    seen: set[str] = set()
    order: list[str] = []
    families: dict[str, list[str]] = {}
    for name, text in parts:
        meta, samples = relabel(name, text)
        for line in meta:
            key = " ".join(line.split()[:3])
            if key not in seen:
                seen.add(key)
                fam = line.split()[2] if len(line.split()) > 2 else ""
                families.setdefault(fam, []).append(line)
                if fam not in order:
                    order.append(fam)
        for base, s in samples:
            fam = next((f for f in (base, re.sub(r"_(total|sum|count|bucket|created)$", "", base)) if f in families),
                       base)
            families.setdefault(fam, []).append(s)
            if fam not in order:
                order.append(fam)
    return "".join(line + "\n" for fam in order for line in families[fam])


def connector_metric(connector: str, role: str, figures: dict[str, float]) -> tuple[str | None, str | None]:
    """The histograms of the connector's own figures this worker reads (:data:`CONNECTOR_TIMES`): a prefill
    instance's save time; a decode instance's transfer time and bytes per transfer. ``auto`` (attached
    instances, whose connector was set by whoever started them): the connector whose histogram the instance
    exposes."""
    names = [connector] if connector in CONNECTOR_TIMES else list(CONNECTOR_TIMES)
    for name in names:
        save, load, load_bytes = CONNECTOR_TIMES[name]
        metric = save if role == "prefill" else load
        if metric is not None and (connector == name or metric + "_count" in figures):
            return metric, (None if role == "prefill" else load_bytes)
    return None, None


class ConnectorClock:
    """One of the connector's own time histograms on an instance's ``/metrics``
    (:data:`reference_server.vllm_instance.CONNECTOR_TIMES`), read per request from a snapshot fetched after
    the request ended: the mean of the observations added since the previous read, and how many. Requests one
    at a time get exactly their own; overlapping ones share the mean of the transfers that finished in between
    (vLLM's connector stats carry no request id), and a request after which none finished gets None."""

    def __init__(self, metric: str | None) -> None:
        self.metric = metric
        self.last = (0.0, 0.0)                      # (sum, count) at the previous read

    def baseline(self, figures: dict[str, float]) -> None:
        """Start from the instance's figures now (what it observed before this worker: not ours)."""
        if self.metric is not None:
            self.last = (figures.get(self.metric + "_sum", 0.0), figures.get(self.metric + "_count", 0.0))

    def take(self, figures: dict[str, float]) -> tuple[float, int] | None:
        if self.metric is None:
            return None
        now = (figures.get(self.metric + "_sum", 0.0), figures.get(self.metric + "_count", 0.0))
        before, self.last = self.last, now
        n = int(now[1] - before[1])
        return ((now[0] - before[0]) / n, n) if n > 0 else None


class PrefixRecord:
    """The prompts this worker sent its instance, as chained hashes of whole blocks, least recently used out
    past the instance's block count: the prefix hit vLLM would find, predicted (vLLM answers no query)."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.bs, self.cap = block_size, max(1, capacity_blocks)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def _chain(self, prompt: list[int]) -> list[bytes]:
        """The chained hashes of the prompt's whole blocks: the block manager's own chain (one root: one
        instance, one model)."""
        return chain_hashes(b"", prompt, self.bs, len(prompt) // self.bs)

    def match(self, prompt: list[int]) -> int:
        n = 0
        with self._lock:
            for h in self._chain(prompt):
                if h not in self._blocks:
                    break
                n += 1
        return n * self.bs

    def add(self, prompt: list[int]) -> None:
        with self._lock:
            for h in self._chain(prompt):
                self._blocks[h] = None
                self._blocks.move_to_end(h)
            while len(self._blocks) > self.cap:
                self._blocks.popitem(last=False)


# ---------------------------------------------------------------------------------------------- worker

class VllmWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        from reference_server.engine.checkpoint import load_checkpoint

        self.spec, self.cfg = spec, spec.config
        self.ckpt = load_checkpoint(self.cfg.model)
        self.instance: Any = None
        self.url = self._attach_url()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.session: Any = None
        self.owner: dict[str, Conn] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.kv_wait: dict[str, asyncio.Future] = {}      # decode: rid -> the prefill's kv_transfer_params
        self.kv_early: dict[str, dict[str, Any]] = {}     # a kv message that came before its generate
        self.estimator = PrefillEstimator(None, self.cfg.prefill_chunk_tokens)
        self.figures: dict[str, float] = {}               # the instance's /metrics, summed per name
        self.metrics_text = ""
        self.metrics_at = -math.inf                       # monotonic time the figures' read began
        self._scrape_lock = asyncio.Lock()                # one read of /metrics at a time (event loop)
        self.record: PrefixRecord | None = None
        self.counters: dict[str, float] = {"kv_transfers": 0, "kv_recomputes": 0, "kv_checksum_failures": 0,
                                           "kv_discarded": 0, "hit_predicted_tokens": 0, "hit_engine_tokens": 0}
        self.aborted: dict[str, int] = {}
        self.t_start = time.monotonic()
        self.peers = Peers(spec.internal_token)      # the decode workers the kv notes go to
        self.max_model_len: int | None = None             # the instance's own limit (set at start)
        self.clock = ConnectorClock(None)                 # the connector's own times (set at start)
        self.bytes_clock = ConnectorClock(None)           # ... and bytes per transfer (decode side)

    def _attach_url(self) -> str | None:
        urls = (self.cfg.vllm_prefill_urls if self.spec.role == "prefill" else self.cfg.vllm_decode_urls) or ()
        return urls[self.spec.index].rstrip("/") if self.spec.index < len(urls) else None

    # ---- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the instance (unless attached to one) and wait until it answers."""
        from reference_server.ports import free_port
        from reference_server.vllm_instance import (VllmInstance, kv_transfer_config, serve_command, vllm_env,
                                                    vllm_python)

        if self.url is None:
            port = free_port()
            kv = kv_transfer_config(self.cfg.kv_connector, self.spec.role, self.cfg.kv_shared_dir,
                                    cpu=self.cfg.device == "cpu")
            cmd = serve_command(vllm_python(self.cfg.vllm_python), self.cfg.model, port,
                                served_name=self.cfg.served_model_name, block_size=self.cfg.block_size,
                                max_num_seqs=self.cfg.max_num_seqs, kv_transfer=kv,
                                extra=self.cfg.vllm_args.split() if self.cfg.vllm_args else ())
            env = vllm_env(cpu=self.cfg.device == "cpu")
            devices = self.cfg.prefill_devices if self.spec.role == "prefill" else self.cfg.decode_devices
            if devices and self.spec.index < len(devices):   # one instance per device set
                env["CUDA_VISIBLE_DEVICES"] = str(devices[self.spec.index])
            if self.cfg.kv_connector == "nixl":    # NIXL's side channel: one port per instance
                env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": INTERNAL_HOST,
                            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
            log_dir = Path(self.cfg.kv_shared_dir or tempfile.gettempdir()).parent
            self.instance = VllmInstance.launch(cmd, log_dir / f"vllm-{self.spec.name}.log", env, port)
            self.url = self.instance.url
            self.instance.wait_ready(STARTUP_S)
        else:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                if r.status != 200:
                    raise RuntimeError(f"{self.url}/health answered {r.status}")
        self._scrape_blocking()
        times, nbytes = connector_metric(self.cfg.kv_connector, self.spec.role, self.figures)
        self.clock, self.bytes_clock = ConnectorClock(times), ConnectorClock(nbytes)
        self.clock.baseline(self.figures)
        self.bytes_clock.baseline(self.figures)
        self.max_model_len = self._max_model_len()
        blocks = label_value(self.metrics_text, "vllm:cache_config_info", "num_gpu_blocks")
        self.num_blocks = int(blocks) if blocks and blocks.isdigit() else 1024
        self.record = PrefixRecord(self.cfg.block_size, self.num_blocks)

    def _max_model_len(self) -> int | None:
        """The longest prompt + output the instance takes (its ``/v1/models``' ``max_model_len``): the router
        reports and enforces the smallest; None when the instance does not say."""
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:   # type: ignore[operator]
                models = json.loads(r.read()).get("data") or []
        except (OSError, ValueError):
            return None
        limits = [int(m["max_model_len"]) for m in models if isinstance(m, dict) and m.get("max_model_len")]
        return min(limits) if limits else None

    def info(self, port: int) -> dict[str, Any]:
        c = self.ckpt.config
        dtype = str(json.loads((Path(self.cfg.model) / "config.json").read_text()).get("torch_dtype") or "float32")
        shape = {"name": c.name, "version": self.ckpt.version, "layers": c.layers, "kv_heads": c.kv_heads,
                 "head_dim": c.head_dim, "vocab_size": int(c.vocab or 0),
                 "kv_dtype": dtype if dtype in ("float32", "float16", "bfloat16") else "float32"}
        return {"port": port, "num_blocks": self.num_blocks, "block_size": self.cfg.block_size, "shape": shape,
                "virtual_kv": False, "wire_bytes_per_s": WIRE_BYTES_PER_S, "max_model_len": self.max_model_len,
                "engine_url": self.url,
                "engine_pid": self.instance.proc.pid if self.instance is not None else None,
                "engine_log": str(self.instance.log) if self.instance is not None else None}

    def _load(self, text: str, at: float) -> None:
        """A read of the instance's ``/metrics`` begun at ``at`` (monotonic); one that does not parse leaves the
        last figures standing until the next read."""
        try:
            figures = figures_of(text)
        except ParseError:
            return
        self.metrics_text, self.figures, self.metrics_at = text, figures, at

    def _scrape_blocking(self) -> None:
        """The first read, at start (before the event loop runs)."""
        at = time.monotonic()
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:   # type: ignore[operator]
                self._load(r.read().decode(), at)
        except OSError:
            pass

    async def _fresh(self, since: float) -> None:
        """Make the figures a read begun at or after ``since`` (monotonic): the latest one when it is that
        recent, else one read now. The one path to the instance's ``/metrics`` while serving: the periodic
        refresh (:meth:`_poll`) and each request's connector time (:class:`ConnectorClock`) share it."""
        async with self._scrape_lock:
            if self.metrics_at >= since:
                return
            at = time.monotonic()
            try:
                async with self.session.get(self.url + "/metrics") as r:
                    text = await r.text()
            except Exception:  # noqa: BLE001 - no figures this time; the next read covers it
                return
            self._load(text, at)

    async def _poll(self) -> None:
        """Keep the figures routing reads (``running``) at most :data:`SCRAPE_EVERY_S` old: a read the
        requests made meanwhile counts."""
        while True:
            await asyncio.sleep(SCRAPE_EVERY_S)
            await self._fresh(time.monotonic() - SCRAPE_EVERY_S)

    async def _connector_time(self, ended: float) -> tuple[tuple[float, int] | None, tuple[float, int] | None]:
        """The connector's own time, and bytes per transfer (decode side), for a request that ended at ``ended``
        (monotonic): from figures read after it."""
        if self.clock.metric is None:
            return None, None
        await self._fresh(ended)
        if self.metrics_at < ended:
            return None, None
        return self.clock.take(self.figures), self.bytes_clock.take(self.figures)

    # ---- control plane (reader threads) -------------------------------------------------------------

    def on_message(self, conn: Conn, msg: dict[str, Any], blob: bytes) -> None:
        op = msg.get("op")
        if op == "ping":
            conn.send({"op": "reply", "id": msg["id"]})
        elif op == "match":
            conn.send({"op": "reply", "id": msg["id"], **self.offer(blob_tokens(blob))})
        elif op == "stats":
            conn.send({"op": "reply", "id": msg["id"], "stats": self.stats()})
        elif op == "store":                # no host KV store behind vLLM (its connector is the transfer path)
            conn.send({"op": "reply", "id": msg["id"]})
        elif op in ("generate", "prefill"):
            self.owner[msg["rid"]] = conn
            prompt = blob_tokens(blob)
            self._call(lambda: self._spawn(msg["rid"], self._prefill(msg, prompt) if op == "prefill"
                                           else self._generate(msg, prompt)))
        elif op in ("kv", "kv_failed"):
            rid, params = msg["rid"], msg.get("kv_transfer_params") if op == "kv" else None
            self._call(lambda: self._kv_arrived(rid, op == "kv", params))
        elif op == "abort":
            rid = msg["rid"]
            self._call(lambda: self._abort(rid))

    def _call(self, fn: Any) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)

    def offer(self, prompt: list[int]) -> dict[str, Any]:
        hit = self.record.match(prompt) if self.record is not None else 0
        hit = min(hit, max(0, len(prompt) - 1))
        return {"hit": hit, "store_hit": 0, "onboard_s": 0.0,
                "running": int(self.figures.get("vllm:num_requests_running", 0)),
                "prefill_s": self.estimator.prefill_s(len(prompt) - hit, hit)}

    def stats(self) -> dict[str, Any]:
        f = self.figures
        up = time.monotonic() - self.t_start
        busy = f.get("vllm:request_prefill_time_seconds_sum", 0.0) + f.get("vllm:request_decode_time_seconds_sum", 0.0)
        return {"role": self.spec.role, "index": self.spec.index, "utilization": min(1.0, busy / max(up, 1e-9)),
                "busy_s": busy, "uptime_s": up, "kv_usage": f.get("vllm:kv_cache_usage_perc", 0.0),
                "num_blocks": self.num_blocks,
                "cache": {"queries": 0, "hits": 0, "misses": 0,
                          "query_tokens": f.get("vllm:prefix_cache_queries_total", 0.0),
                          "hit_tokens": f.get("vllm:prefix_cache_hits_total", 0.0), "evictions": 0},
                "running": int(f.get("vllm:num_requests_running", 0)),
                "waiting": int(f.get("vllm:num_requests_waiting", 0)) + len(self.kv_wait),
                "aborted": dict(self.aborted), **self.counters,
                "external_hit_tokens": f.get("vllm:external_prefix_cache_hits_total", 0.0),
                "engine_metrics": self.metrics_text}

    # ---- requests (event loop) ----------------------------------------------------------------------

    def _spawn(self, rid: str, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks[rid] = task
        task.add_done_callback(lambda _t: self.tasks.pop(rid, None))

    def send(self, rid: str, msg: dict[str, Any]) -> None:
        conn = self.owner.get(rid)
        if conn is not None:
            conn.send(msg)

    def _body(self, msg: dict[str, Any], prompt: list[int], **extra: Any) -> dict[str, Any]:
        return {"model": self.cfg.served_model_name, "prompt": prompt, "max_tokens": int(msg.get("max_tokens", 16)),
                "temperature": 0.0, "ignore_eos": bool(msg.get("ignore_eos", False)), "return_token_ids": True,
                **extra}

    async def _prefill(self, msg: dict[str, Any], prompt: list[int]) -> None:
        """Prefill instance: ``max_tokens=1`` with ``do_remote_decode``; hand its ``kv_transfer_params`` to the
        decode worker, report timings to the router."""
        rid = msg["rid"]
        predicted = self.record.match(prompt) if self.record is not None else 0
        body = self._body(msg, prompt, max_tokens=1, stream=False,
                          kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                              "remote_engine_id": None, "remote_block_ids": None,
                                              "remote_host": None, "remote_port": None})
        t0 = time.perf_counter()
        try:
            async with self.session.post(self.url + "/v1/completions", json=body) as resp:
                out = await resp.json(content_type=None)
                if resp.status != 200:
                    raise RuntimeError(f"vLLM {self.spec.name} answered {resp.status}: {str(out)[:300]}")
            prefill_s = time.perf_counter() - t0
            cached = int(((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            self._learn(prompt, predicted, cached, prefill_s)
            dest = msg["dest"]
            note = {"op": "kv", "rid": rid, "kv_transfer_params": out.get("kv_transfer_params")}
            await asyncio.get_running_loop().run_in_executor(None, self._peer_send, dest, note)
            # no transfer_bytes here: the decode instance's connector counts what it loaded
            timings = {"queue_ms": 0.0, "prefill_ms": 1e3 * prefill_s, "cached_tokens": cached,
                       "prefill_tokens_computed": len(prompt) - cached, "engine_prefill_cached_tokens": cached}
            saved, _ = await self._connector_time(time.monotonic())
            if saved is not None:      # the connector's write of this prompt's KV (inside prefill_ms)
                timings["kv_write_ms"] = 1e3 * saved[0]
            self.send(rid, {"op": "prefilled", "rid": rid, "timings": timings})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the router fails over to a local prefill
            self.send(rid, {"op": "error", "rid": rid, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            self.owner.pop(rid, None)

    def _peer_send(self, dest: dict[str, Any], note: dict[str, Any]) -> None:
        self.peers.get(dest["host"], int(dest["port"])).send(note)

    def _kv_arrived(self, rid: str, ok: bool, params: Any) -> None:
        fut = self.kv_wait.get(rid)
        if fut is None:
            self.kv_early[rid] = {"ok": ok, "params": params}
        elif not fut.done():
            fut.set_result({"ok": ok, "params": params})

    async def _generate(self, msg: dict[str, Any], prompt: list[int]) -> None:
        """Decode (or colocated) instance: stream the whole output; after a remote prefill, with the prefill's
        ``kv_transfer_params`` (its connector loads the KV instead of computing it)."""
        rid = msg["rid"]
        extra: dict[str, Any] = {}
        kv_wait_ms, remote = 0.0, bool(msg.get("remote"))   # remote: KV comes from the prefill instance
        recomputed = False
        try:
            if remote:
                t_wait = time.perf_counter()
                got = self.kv_early.pop(rid, None)
                if got is None:
                    fut = self.kv_wait[rid] = asyncio.get_running_loop().create_future()
                    try:
                        got = await fut
                    finally:
                        self.kv_wait.pop(rid, None)
                kv_wait_ms = 1e3 * (time.perf_counter() - t_wait)
                remote = bool(got["ok"])              # the prefill failed: this instance prefills it all
                recomputed = not remote
                self.counters["kv_transfers" if remote else "kv_recomputes"] += 1
                if remote and got["params"]:
                    extra["kv_transfer_params"] = got["params"]
            await self._stream(msg, prompt, extra, remote, kv_wait_ms, recomputed)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the request fails with the instance's answer
            self.send(rid, {"op": "error", "rid": rid, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            self.owner.pop(rid, None)

    async def _stream(self, msg: dict[str, Any], prompt: list[int], extra: dict[str, Any], remote: bool,
                      kv_wait_ms: float, recomputed: bool = False) -> None:
        rid = msg["rid"]
        predicted = self.record.match(prompt) if self.record is not None else 0
        body = self._body(msg, prompt, stream=True, stream_options={"include_usage": True}, **extra)
        t0 = time.perf_counter()
        t_first: float | None = None
        n_out, usage, finish = 0, {}, None
        async with self.session.post(self.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"vLLM {self.spec.name} answered {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices") or []:
                    ids = list(ch.get("token_ids") or [])
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
                    if ids:
                        if t_first is None:
                            t_first = time.perf_counter()
                        n_out += len(ids)
                        self.send(rid, {"op": "tokens", "rid": rid, "ids": ids})
        ttft_s = (t_first or time.perf_counter()) - t0
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if not remote:
            self._learn(prompt, predicted, cached, ttft_s)
        elif self.record is not None:
            self.record.add(prompt)
        timings = {"queue_ms": 0.0, "prefill_ms": 0.0 if remote else 1e3 * ttft_s,
                   "decode_first_token_ms": 1e3 * ttft_s, "kv_wait_ms": kv_wait_ms,
                   "engine_cached_tokens": cached, "route_hit_predicted_tokens": predicted}
        if remote:
            # the connector's own time for this request's KV (decode side: NIXL's read, the example
            # connector's file load); without one, the time to the first token (load plus one decode step)
            loaded, moved = await self._connector_time(time.monotonic())
            timings["kv_transfer_ms"] = 1e3 * (loaded[0] if loaded else ttft_s)
            timings["kv_transfer_source"] = "connector" if loaded else "decode_first_token"
            if loaded:
                timings["kv_connector_transfers"] = loaded[1]
            if moved:        # the connector's own count of the bytes it moved (files read, NIXL's transfer)
                timings["transfer_bytes"] = int(round(moved[0]))
        if recomputed:
            timings["kv_recomputed"] = True            # the router then reports the prefill as local
        self.send(rid, {"op": "done", "rid": rid, "finish_reason": finish or "length",
                        "prompt_tokens": int(usage.get("prompt_tokens", len(prompt))), "cached_tokens": cached,
                        "completion_tokens": int(usage.get("completion_tokens", n_out)), "timings": timings})

    def _learn(self, prompt: list[int], predicted: int, cached: int, prefill_s: float) -> None:
        """After a prefill on this instance: its seconds per computed token, and the predicted hit vs its own."""
        self.estimator.observe(prefill_s, len(prompt) - cached)
        self.counters["hit_predicted_tokens"] += predicted
        self.counters["hit_engine_tokens"] += cached
        if self.record is not None:
            self.record.add(prompt)

    def _abort(self, rid: str) -> None:
        task = self.tasks.get(rid)
        fut = self.kv_wait.get(rid)
        # the stages /metrics counts (metrics.WORKER_ABORT_STAGES): waiting for the prefill's KV, else in vLLM
        stage = "awaiting_kv" if fut is not None else (
            None if task is None else "prefill" if self.spec.role == "prefill" else "decode")
        if task is not None:
            task.cancel()                    # closes the HTTP stream: vLLM aborts the request
        self.kv_early.pop(rid, None)
        self.owner.pop(rid, None)
        if stage is not None:
            self.aborted[stage] = self.aborted.get(stage, 0) + 1

    # ---- main ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        poll = asyncio.ensure_future(self._poll())
        try:
            await asyncio.Event().wait()
        finally:
            poll.cancel()
            await self.session.close()

    def stop(self) -> None:
        if self.instance is not None:
            self.instance.stop()


def start_vllm_worker(spec: WorkerSpec) -> tuple[VllmWorker, dict[str, Any]]:
    """The worker with its instance up and its control port open, and its ready report; an instance it
    launched is stopped again when the start fails (or SIGTERM comes meanwhile)."""
    w = VllmWorker(spec)
    try:
        w.start()
        _, port = serve_blocking(INTERNAL_HOST, spec.internal_token, w.on_message)
        info = w.info(port)
        w.loop = asyncio.new_event_loop()    # before ready: the first message may come at once
    except BaseException:
        w.stop()
        raise
    return w, info


def run_vllm_worker(w: VllmWorker) -> None:
    """Serve requests until SIGTERM, then stop the instance and exit at once."""
    try:
        assert w.loop is not None
        w.loop.run_until_complete(w.run())
    except SystemExit:
        pass
    finally:
        w.stop()
        exit_now()


def vllm_worker_main(spec: WorkerSpec, ready: Any, router: Tether) -> None:
    """Process entry point (the supervisor's spawn): :func:`reference_server.worker.worker_process`'s shape."""
    worker_process(ready, router, lambda: start_vllm_worker(spec), run_vllm_worker)
