"""KV connectors that vLLM loads from this module (``kv_connector_module_path``), inside the vLLM process.

Why they exist: the per-stage timings want the connector's *own* transfer time (issue #22), and vLLM's stock
connectors differ in what they report.

* ``NixlConnector`` already measures every transfer (``vllm:nixl_xfer_time_seconds``, the decode side's
  read); :class:`PaasbenchNixlConnector` only adds one setting vLLM 0.32 has no option for: NIXL's
  progress thread (``nixl_agent_config(enable_prog_thread=...)``). vLLM builds the agent's config itself
  (``num_threads`` and telemetry only); on a 2-core CPU host the progress thread busy-polls a core per
  instance and stalled requests ~30 s (#22), so ``kv_connector_extra_config.enable_prog_thread: false``
  turns it off, through NIXL's own config class.
* ``ExampleConnector`` (shared storage) reports nothing. :class:`TimedExampleConnector` is it, unchanged,
  with its two bulk operations timed where they run (the model runner's thread): ``save_kv_layer`` (every
  layer's write of a request's KV to its file, summed over the layers of one forward step) and
  ``start_load_kv`` (one request's files read and injected into the paged cache). They travel as vLLM's
  ``KVConnectorStats`` (worker -> scheduler -> stat logger) into two histograms on the instance's
  ``/metrics``: ``vllm:example_connector_save_time_seconds`` (one observation per forward step that wrote
  files: one prompt's prefill when requests come one at a time) and
  ``vllm:example_connector_load_time_seconds`` (one per request loaded), with
  ``vllm:example_connector_load_bytes`` the bytes of the files that load read (the KV moved, as a wire would
  count it; NIXL has ``vllm:nixl_bytes_transferred``).
  ``reference_server.vllm_instance.CONNECTOR_TIMES`` names, per connector, the histograms the paasbench
  worker reads.

This module imports vLLM; only vLLM's process imports it (the worker puts the repository on its
``PYTHONPATH``). Nothing in ``reference_server`` imports it.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# 1 ms to 10 s: a file or a transfer of one prompt's KV
BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
BYTES_BUCKETS = [float(2 ** (10 + 2 * i)) for i in range(12)]     # 1 KiB to 4 GiB, x4 a step


@dataclass
class ConnectorTimes(KVConnectorStats):
    """Seconds per forward step that saved files and per request loaded, since the last collection (lists)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"save_s": [], "load_s": [], "load_bytes": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in ("save_s", "load_s", "load_bytes"):
            self.data[k].extend(other.data.get(k, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k in ("save_s", "load_s"):
            xs = self.data[k]
            out[f"num_{k[:-2]}s"] = len(xs)
            out[f"mean_{k}"] = round(sum(xs) / len(xs), 6) if xs else 0.0
        out["load_bytes"] = sum(self.data["load_bytes"])
        return out

    def is_empty(self) -> bool:
        return not (self.data["save_s"] or self.data["load_s"])

    def clone_and_reset(self) -> "ConnectorTimes":
        out = copy.deepcopy(self)
        self.reset()
        return out


class ConnectorTimeMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.hist = {}
        for key, what in (("save_s", "save"), ("load_s", "load")):
            h = self._histogram_cls(name=f"vllm:example_connector_{what}_time_seconds",
                                    documentation=f"ExampleConnector: seconds to {what} one request's KV "
                                                  f"({'all layers written to files' if what == 'save' else 'files read and injected'}).",
                                    buckets=BUCKETS_S, labelnames=labelnames)
            self.hist[key] = create_metric_per_engine(h, self.per_engine_labelvalues)
        h = self._histogram_cls(name="vllm:example_connector_load_bytes",
                                documentation="ExampleConnector: bytes of one request's KV files read.",
                                buckets=BYTES_BUCKETS, labelnames=labelnames)
        self.hist["load_bytes"] = create_metric_per_engine(h, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.hist.items():
            for s in transfer_stats_data.get(key, []):
                per_engine[engine_idx].observe(s)


class TimedExampleConnector(ExampleConnector):
    """vLLM's ExampleConnector with its file writes and reads timed (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._times = ConnectorTimes()
        self._saving_s: float | None = None        # this forward step's writes so far (None: none yet)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        loads = [r for r in meta.requests if not r.is_store]
        if not loads or forward_context.attn_metadata is None:
            return super().start_load_kv(forward_context, **kwargs)
        # one request at a time, so each load is timed on its own (the parent loads every request it is given)
        requests = meta.requests
        try:
            for r in loads:
                meta.requests = [r]
                t0 = time.perf_counter()
                super().start_load_kv(forward_context, **kwargs)
                self._times.data["load_s"].append(time.perf_counter() - t0)
                self._times.data["load_bytes"].append(self._files_bytes(forward_context, r))
        finally:
            meta.requests = requests

    def _files_bytes(self, forward_context: Any, r: Any) -> int:
        """Bytes of the files the parent's load of ``r`` read: one per layer with a KV cache (its own loop)."""
        total = 0
        for name, layer in forward_context.no_compile_layers.items():
            if getattr(layer, "kv_cache", None) is not None:
                try:
                    total += os.path.getsize(self._generate_filename_debug(name, r.token_ids, r.mm_hashes))
                except OSError:
                    pass
        return total

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        if any(r.is_store for r in self._get_connector_metadata().requests):
            self._saving_s = (self._saving_s or 0.0) + time.perf_counter() - t0

    def wait_for_save(self) -> None:
        super().wait_for_save()
        if self._saving_s is not None:             # the step's layers are all written: one observation
            self._times.data["save_s"].append(self._saving_s)
            self._saving_s = None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None if self._times.is_empty() else self._times.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return ConnectorTimes(data=data) if data is not None else ConnectorTimes()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return ConnectorTimeMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _nixl_connector() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    return NixlConnector


def __getattr__(name: str) -> Any:
    # NixlConnector's module needs NIXL only when an agent is made; built lazily so the example connector
    # loads where vLLM's NIXL module would not import.
    if name == "PaasbenchNixlConnector":
        return _paasbench_nixl()
    raise AttributeError(name)


@functools.lru_cache(maxsize=1)
def _paasbench_nixl() -> type:
    base = _nixl_connector()

    class PaasbenchNixlConnector(base):  # type: ignore[misc, valid-type]
        """vLLM's NixlConnector; ``kv_connector_extra_config.enable_prog_thread`` sets NIXL's progress thread
        (vLLM 0.32 always leaves it on)."""

        def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            prog = vllm_config.kv_transfer_config.get_from_extra_config("enable_prog_thread", True)
            if not prog:
                from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

                cfg = base_worker.nixl_agent_config
                if cfg is not None and not isinstance(cfg, functools.partial):
                    base_worker.nixl_agent_config = functools.partial(cfg, enable_prog_thread=False)
            super().__init__(vllm_config, *args, **kwargs)

    PaasbenchNixlConnector.__module__ = __name__
    return PaasbenchNixlConnector

