"""Mooncake Store's processes on one host, and their supervision: the master and the memory owner are
restarted when they die, as the router restarts its workers.

Layout on one host (docs/kv.md has the figures):

* ``mooncake_master`` keeps the index (which key lives where) and evicts. ``--kv-store mooncake`` starts
  one (on a free port of the workers' address: 127.0.0.1, or ``--host`` with ``--join-port``); ``mooncake://
  HOST:PORT`` uses an existing one, which this server neither watches nor restarts. Metadata goes peer to
  peer (``P2PHANDSHAKE``): no etcd, no metadata server.
* ``mooncake_client`` owns the store's memory (``--kv-store-gb``; :func:`segment_bytes`, at least 16 MiB),
  mounted on the master.
  The router's host starts one; so does each host a worker joined from (its memory is in the store too).

**Supervision** (:meth:`MooncakeService.watch`): a thread of this process polls both children every
``interval_s``. A child that exited is reaped at once (no ``<defunct>`` left for the server's lifetime), the
cause logged (exit code or signal, and how long it had lived), and a new one started on the *same address*:
workers, the memory owner and hosts that joined keep what they were told. A restarted master: the memory
owner re-mounts its segment on it by itself, and every worker's handle on that memory owner works again
(measured: the first put after the restart failed with RPC_FAIL, the next one, 0.5 s later, stored and
read back its blocks). A restarted memory owner is a new memory pool: a handle on the old one answers
INVALID_PARAMS (-600) for good, so the restart bumps :attr:`generation` and the router re-attaches every
worker (:mod:`reference_server.store_link`; a joined host re-attaches its own worker). A restart that fails, or
a child that dies again within ``STABLE_S`` of its restart, backs off (0.5 s doubling to 8 s) and after
``RESTART_TRIES`` such failures in a row the part is given up, with the reason logged: the store stays down
(every store call a miss; ``/health`` degraded), the server serves on. One child per part at any time: the
dead one is reaped before its successor starts, and a successor that does not listen in time is killed.

The children are tethered to the thread that started them (``PR_SET_PDEATHSIG``, :mod:`paas_common.lifetime`):
the first ones to the main thread, their successors to the watch thread, which lives as long as the process.
A restarted master has lost every block (the store starts empty); the evictions it had counted are carried
over into the server's total.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from paas_common.lifetime import describe_exit, native_popen_kwargs
from reference_server.kv.mooncake import MooncakeUnavailable, port_open, sum_stats, value_bytes
from reference_server.kv.store import StoreStats
from reference_server.ports import free_port

SETUP_TIMEOUT_S = 15.0      # a child's first listen (~1.3 s measured)
SEGMENT_MIN = 16 << 20      # Mooncake's memory owner cannot allocate a smaller segment (any size above it works)
STABLE_S = 30.0             # a child that lived this long is healthy: its failure count starts over
RESTART_TRIES = 5           # failed restarts (or deaths within STABLE_S of one) in a row before giving up
BACKOFF_MAX_S = 8.0
WATCH_S = 0.5               # how often the children are polled
# A key looked up (every routing decision's match, every put's existence check) is leased: not evictable for
# this long. Mooncake's 10 s default kept a small store's every key leased under load, so it evicted nothing
# and refused the puts (NO_AVAILABLE_HANDLE); a read copies its blocks out at once and verifies their
# checksums, so a block evicted under a late read is a miss, never bad KV.
LEASE_MS = 500


def package_dir() -> Path:
    """Where the ``mooncake-transfer-engine-non-cuda`` wheel keeps its binaries (ImportError without it)."""
    import mooncake

    return Path(mooncake.__file__).parent


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    addr: str                   # HOST:PORT it serves on
    log: Path
    argv: list[str]
    started: float = 0.0        # time.monotonic() of its start
    restarts: int = 0
    failures: int = 0           # restarts in a row that failed or died young
    down: str = ""              # why it is down now ("" while it runs)
    retry_at: float = 0.0
    gave_up: str = ""           # why it is no longer restarted

    def tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-3:])
        except OSError:
            return ""


def _spawn(name: str, argv: list[str], addr: str, log_dir: Path) -> _Child:
    """Start a native Mooncake program tethered to the calling thread and wait until ``addr`` accepts; one that
    does not (exited, or not listening within ``SETUP_TIMEOUT_S``) is killed and reaped before this raises."""
    log = log_dir / f"{name}.log"
    with open(log, "ab") as out:        # a successor's lines follow its predecessor's (a post-mortem reads both)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                **native_popen_kwargs())
    child = _Child(name, proc, addr, log, argv, time.monotonic())
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while not port_open(addr, 0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise MooncakeUnavailable(f"{name} did not listen on {addr} within {SETUP_TIMEOUT_S:.0f} s "
                                      f"(exit {proc.returncode}): {child.tail()}")
        time.sleep(0.05)
    return child


def start_master(log_dir: Path, host: str = "127.0.0.1") -> tuple[_Child, int]:
    """``mooncake_master`` on free ports of ``host`` (loopback unless workers join from other hosts), tethered
    to the calling thread: (the child, its metrics port, on loopback)."""
    port, metrics_port = free_port(host), free_port()
    return _spawn("mooncake_master", [str(package_dir() / "mooncake_master"), f"--rpc_port={port}",
                                      f"--rpc_address={host}", f"--metrics_port={metrics_port}",
                                      f"--default_kv_lease_ttl={LEASE_MS}"],
                  f"{host}:{port}", log_dir), metrics_port


class MooncakeService:
    """One host's side: the master (unless one is given) and the memory owner, both tethered children. The
    router's host starts both; a host a worker joined from starts only its memory owner, mounted on the
    router's master. ``host``: the address they listen on and that the other hosts reach."""

    def __init__(self, master: str | None, segment_bytes: int, log_dir: Path, host: str = "127.0.0.1") -> None:
        bin_dir = package_dir()
        self.children: list[_Child] = []
        self.metrics_port: int | None = None
        self.log_dir = log_dir
        self.generation = 0                  # +1 at every restart of a part: workers open a new handle
        self._log: Callable[[str], None] = lambda line: print(f"reference_server: {line}", flush=True)
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._on_restart: Callable[[], None] | None = None
        seg = max(SEGMENT_MIN, segment_bytes)
        short = memory_shortfall(seg)
        if short:
            raise MooncakeUnavailable(short)
        try:
            if master is None:
                child, self.metrics_port = start_master(log_dir, host)
                self.children.append(child)
                master = child.addr
            elif not port_open(master):
                raise MooncakeUnavailable(f"no Mooncake master answers at {master}")
            self.master = master
            self.client_addr = f"{host}:{free_port(host)}"
            self.children.append(_spawn("mooncake_client", [
                str(bin_dir / "mooncake_client"), f"--host={host}", f"--port={self.client_addr.rpartition(':')[2]}",
                f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
                f"--global_segment_size={seg}"], self.client_addr, log_dir))
            self.segment_bytes = seg
        except BaseException:
            self.stop()
            raise

    # ---- state ----------------------------------------------------------------------------------

    def alive(self) -> dict[str, bool]:
        """Each part answers now (a TCP connect: the master may be another host's)."""
        return {"master": port_open(self.master), "client": port_open(self.client_addr)}

    def down(self) -> list[str]:
        """The parts that are down now, as ``/health`` names them: ``mooncake master`` / ``mooncake client``
        (a child of ours by its state, restarting or given up; another host's master by a TCP connect)."""
        ours = {c.name for c in self.children}
        out = [f"mooncake {c.name.split('_', 1)[1]}" for c in self.children if c.down or c.gave_up]
        if "mooncake_master" not in ours and not port_open(self.master):
            out.insert(0, "mooncake master")
        return out

    def master_gauges(self) -> dict[str, float]:
        """The master's own Prometheus gauges (our master only; {} when it cannot answer)."""
        if self.metrics_port is None:
            return {}
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1.0) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("master_") and "{" not in name:
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    # ---- supervision ----------------------------------------------------------------------------

    def watch(self, interval_s: float = WATCH_S, log: Callable[[str], None] | None = None,
              on_restart: Callable[[], None] | None = None) -> None:
        """Start the supervision thread (once): :meth:`check` every ``interval_s`` until :meth:`stop`;
        ``on_restart`` runs on it after each restart (a joined host re-attaches its worker's store)."""
        if self._watcher is not None:
            return
        if log is not None:
            self._log = log
        self._on_restart = on_restart

        def loop() -> None:
            while not self._stopping.wait(interval_s):
                try:
                    self.check()
                except Exception as exc:  # noqa: BLE001 - the watch must outlive any one check
                    self._log(f"the Mooncake supervision check failed: {type(exc).__name__}: {exc}")

        self._watcher = threading.Thread(target=loop, daemon=True, name="mooncake-watch")
        self._watcher.start()

    def check(self) -> None:
        """One pass: reap and log a child that exited, restart the ones due (on the watch thread)."""
        for c in self.children:
            if self._stopping.is_set():
                return
            now = time.monotonic()
            if c.gave_up:
                continue
            if not c.down:
                rc = c.proc.poll()             # reaps it: no zombie
                if rc is None:
                    if c.failures and now - c.started > STABLE_S:
                        c.failures = 0
                    continue
                lived = now - c.started
                if c.restarts and lived < STABLE_S:
                    c.failures += 1            # the last restart did not hold
                c.down = f"{c.name} (pid {c.proc.pid}) {describe_exit(rc)} after {lived:.1f} s"
                c.retry_at = now + _backoff(c.failures)
                self._died(c)
                self._log(f"{c.down}; restarting it" + (f" in {c.retry_at - now:.1f} s" if c.retry_at > now else ""))
            if now < c.retry_at:
                continue
            if c.failures >= RESTART_TRIES:
                c.gave_up = f"{c.failures} restarts in a row failed or did not last {STABLE_S:g} s ({c.down})"
                self._log(f"giving up on {c.name}: {c.gave_up}; the KV store stays down: every store call is a "
                          "miss (recomputed) until the server restarts")
                continue
            try:
                new = _spawn(c.name, c.argv, c.addr, self.log_dir)
            except MooncakeUnavailable as exc:
                c.failures += 1
                c.retry_at = time.monotonic() + _backoff(c.failures)
                self._log(f"restarting {c.name} failed ({exc}); next try in {_backoff(c.failures):.1f} s")
                continue
            if self._stopping.is_set():
                new.proc.kill()
                new.proc.wait()
                return
            c.proc, c.started, c.down = new.proc, new.started, ""
            c.restarts += 1
            if c.name == "mooncake_client":  # a new memory pool: every handle on the old one is broken
                self.generation += 1
            self._log(f"{c.name} restarted (pid {c.proc.pid}) on {c.addr}; restart {c.restarts}")
            if self._on_restart is not None:
                self._on_restart()

    def _died(self, child: _Child) -> None:
        """Hook: ``child`` was found dead (before its restart)."""

    def kill_master(self) -> None:
        """Test hook: the master dies as a crash would (SIGKILL)."""
        for c in self.children:
            if c.name == "mooncake_master":
                c.proc.kill()
                c.proc.wait()

    def stop(self) -> None:
        self._stopping.set()
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.terminate()
        for c in self.children:
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        self.children = []


def _backoff(failures: int) -> float:
    return 0.0 if failures <= 0 else min(BACKOFF_MAX_S, 0.5 * 2 ** (failures - 1))


class MooncakeOwner(MooncakeService):
    """The router's side (:class:`~reference_server.kv.backend.StoreOwner`): the service, supervised, reported as
    one store. It needs no worker's block layout (a router may have none of its own: every worker joins);
    ``capacity_bytes`` is the KV the store models (``--kv-store-gb``), ``segment_bytes`` the memory it takes."""

    backend = "mooncake"

    def __init__(self, master: str | None, capacity_bytes: int, segment_bytes: int, *, virtual: bool,
                 host: str = "127.0.0.1") -> None:
        self.logs = log_dir()
        super().__init__(master, segment_bytes, self.logs, host)
        self.capacity_bytes, self.virtual = capacity_bytes, virtual
        self._gauges: dict[str, float] = {}
        self._evicted_before = 0             # evictions counted by masters that have died since
        self._stored_before = 0              # blocks they stored
        self.watch()

    def check(self) -> None:
        super().check()
        if not self._stopping.is_set():
            # Read here, off the event loop, fresh within WATCH_S. A master that does not answer (dying, or just
            # restarted and not up yet) leaves the last answer of the live one in place: replaced by {}, the
            # dead master's stores would be lost from the carried total when it is found dead a pass later.
            gauges = self.master_gauges()
            if gauges:
                self._gauges = gauges

    def _died(self, child: _Child) -> None:
        if child.name == "mooncake_master":
            # What the dead master counted up to its last answer (puts in the last WATCH_S before its death
            # are not counted: nobody can ask it any more) is carried; the new master counts from 0.
            self._evicted_before += int(self._gauges.get("master_evicted_key_count", 0))
            self._stored_before += int(_stored(self._gauges))
            self._gauges = {}

    def attach_msg(self) -> dict[str, Any]:
        return {"backend": self.backend, "client": self.client_addr, "capacity": self.capacity_bytes,
                "segment": self.segment_bytes, "virtual": self.virtual, "master": self.master,
                "generation": self.generation}

    def join_msg(self) -> dict[str, Any]:
        """What a worker joining from another host needs first (in the router's ``welcome``): the master its
        own memory owner mounts on, and how much memory that host adds (as much as this one)."""
        return {"backend": self.backend, "master": self.master, "segment": self.segment_bytes}

    def stats(self, workers: list[dict[str, Any]]) -> StoreStats:
        """Every worker's counters (``workers``: their ``store`` dicts, those of workers gone included), with the
        master's occupancy and evictions. Capacity in blocks: what the master's memory (every host's segment)
        holds of values of :func:`~reference_server.kv.mooncake.value_bytes` each."""
        parts = [StoreStats(**w) for w in workers if w]
        nbytes = parts[0].block_nbytes if parts else 0        # every worker's the same: one engine
        capacity = parts[0].capacity_blocks if parts else 0
        total = self._gauges.get("master_total_capacity_bytes", 0)
        if nbytes and total:
            capacity = int(total // value_bytes(nbytes, self.virtual, self.capacity_bytes, self.segment_bytes))
        gauges = dict(self._gauges)
        gauges["master_evicted_key_count"] = gauges.get("master_evicted_key_count", 0) + self._evicted_before
        st = sum_stats(parts, capacity, nbytes, gauges)
        if self.metrics_port is None:
            return st                          # another host's master: the workers' count
        # What the master stored: a put that lost a race to an identical block is answered 0 by Mooncake, and
        # only the master knows it did not store it. Counted as the built-in store counts it: a duplicate.
        stored = self._stored_before + int(_stored(gauges))
        return dataclasses.replace(st, put_blocks=stored, put_bytes=stored * nbytes,
                                   duplicates=st.duplicates + max(0, st.put_blocks - stored))

    def close(self) -> None:
        """A clean stop: the children go, and their logs with them (a crash leaves them for a post-mortem)."""
        self.stop()
        shutil.rmtree(self.logs, ignore_errors=True)


def _stored(gauges: dict[str, float]) -> float:
    """Blocks a master stored: the items of the batch puts it completed (workers put only in batches)."""
    return gauges.get("master_batch_put_end_items_total", 0) - gauges.get("master_batch_put_end_failed_items_total", 0)


def segment_bytes(cfg: Any) -> int:
    """The memory a host's memory owner gives the store for ``--kv-store-gb`` (``cfg``: the server's
    :class:`~reference_server.config.ServerConfig`). Real KV: those bytes (at least Mooncake's 16 MiB). The sim
    engine's virtual KV: a block's value is its 8-byte sum, so room for exactly as many values as ``--kv-store-gb``
    holds blocks, as the built-in store keeps keys only for the same modeled capacity (by default 1,024 GB of
    modeled host DRAM: 16 MB here, where the modeled bytes themselves would be refused); a store too small for
    16 MiB of 8-byte values has its values padded (:func:`~reference_server.kv.mooncake.value_bytes`: 883,012
    bytes for the 19 blocks of 0.01 GB). Mooncake's allocator takes a value's bytes exactly (the master's
    ``master_allocated_bytes`` grows by 8 per 8-byte value, by 9 per 9-byte one)."""
    capacity = cfg.store_bytes()
    if cfg.engine != "sim":
        return capacity
    from reference_server.sim.profiles import load_model_profile

    model = load_model_profile(cfg.model_profile or cfg.model, cfg.model_set)    # as the sim worker loads it
    block = cfg.block_size * model.kv_bytes_per_token()
    blocks = capacity // block
    return blocks * value_bytes(block, True, capacity, SEGMENT_MIN) if blocks else SEGMENT_MIN


def memory_shortfall(nbytes: int) -> str | None:
    """Why this host cannot give the store ``nbytes`` now (more than its available memory), or None.
    Mooncake's memory owner would abort at start (``Failed to allocate segment memory``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None                       # not Linux: the memory owner's own error stands
    if nbytes <= avail:
        return None
    return (f"the Mooncake store's memory on this host would be {nbytes / 1e9:.2f} GB (--kv-store-gb) and this "
            f"host has {avail / 1e9:.2f} GB available: give a smaller --kv-store-gb")


def log_dir() -> Path:
    """Where the master's and memory owner's logs go (they log a line per connection)."""
    d = Path(os.environ.get("TMPDIR", "/tmp")) / f"paasbench-mooncake-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d
