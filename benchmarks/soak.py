"""Bounded soak: a faulty server under steady load, watching for leaks and lost requests.

Why: a fault matrix proves each failure is handled once; a soak shows that handling thousands of them
leaks nothing. It starts ``paasbench serve --engine cpu`` (1 prefill + 2 decode workers, loopback) with
5% mixed faults (HTTP 500/503/429, reset, stall, malformed SSE, truncated JSON, zero tokens, KV
corruption, a killed prefill worker) plus one decode-worker kill halfway, and drives it with
``paasbench run`` (Poisson arrivals) in a subprocess. With ``--store-fault-every S`` the shared KV store
fails too, every S seconds: on ``--kv-store mooncake`` its master and its memory owner are killed (SIGKILL)
in turn; on the built-in store this process holds the store's lock (``flock`` on its segment, as a wedged
writer would) for ``--store-hold`` seconds. It samples RSS and open file descriptors of the client and of
every server process (router, workers, their restarted replacements) and prints them after warm-up, at the
first quarter and at the end, then checks that every request the client sent is in records.jsonl, that every
one the server drew a fault for is accounted for, and that each worker process alive from the first quarter of the load to its end
kept its private RSS (``RssAnon``; RSS also counts the store segment's pages a worker touched, bounded by the
segment) within ``--rss-tolerance`` (5%) over that time: a leak grows with the load's length, pools and arenas
that fill once grow early and stop (the first quarter's growth is printed beside). Every 2 s sample goes to
``samples.jsonl``.

    python benchmarks/soak.py                 # ~2 minutes
    python benchmarks/soak.py --duration 15   # a quick look
    python benchmarks/soak.py --duration 1800 --kv-store mooncake --store-fault-every 120   # issue 30's soak
    python benchmarks/soak.py --duration 1800 --kv-store builtin --store-fault-every 120

Figures are from a shared machine unless you say otherwise: RSS and fd counts are exact, rates are not.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))     # store_faults.tree: the server's process tree

from paasbench.metrics.records import read_records  # noqa: E402
from reference_server.launcher import EmbeddedServer  # noqa: E402

MIX = ["http_500", "http_503", "http_429", "reset", "stall", "malformed_sse", "truncated_json", "zero_tokens",
       "kv_corrupt", "kill_prefill"]


def fault_spec(total_prob: float, kill_at: int) -> dict:
    rules: list[dict] = [{"kind": "kill_decode", "every": kill_at, "times": 1, "after_tokens": 2}]
    for kind in MIX:
        rule = {"kind": kind, "prob": total_prob / len(MIX), "seconds": 4.0 if kind == "stall" else 1.0}
        if kind == "kill_prefill":
            rule["times"] = 1
        rules.append(rule)
    return {"seed": 1, "rules": rules}


def proc_stats(pid: int) -> tuple[int, int, int, int] | None:
    """(RSS KiB, open fds, private RSS KiB, shared-memory RSS KiB) of a live process, from /proc.

    RSS counts the pages of the shared KV store's segment a worker has touched, and a worker touches more of them as
    the store fills (the built-in store's 50 MB segment: a decode worker's RSS rose 170.7 -> 227.4 MiB over 900 s);
    those are bounded by the segment's size. A leak is private memory (``RssAnon``) that keeps growing."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in fh)
                   if k in ("VmRSS", "RssAnon", "RssShmem")}
        return kib["VmRSS"], len(os.listdir(f"/proc/{pid}/fd")), kib.get("RssAnon", 0), kib.get("RssShmem", 0)
    except (OSError, KeyError, ValueError):
        return None


def snapshot(pids: dict[str, int]) -> dict[str, tuple[int, int, int, int]]:
    """Per process, named ``role:pid`` (a restarted worker is a new row): :func:`proc_stats`."""
    out = {}
    for name, pid in pids.items():
        st = proc_stats(pid)
        if st is not None:
            out[f"{name}:{pid}"] = st
    return out


def fd_kinds(pid: int) -> Counter:
    """What a process's open fds point at: socket, pipe, anon_inode, or a file path."""
    kinds: Counter = Counter()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            kinds[target.split(":")[0] if ":" in target else target] += 1
    except OSError:
        pass
    return kinds


class StoreFaults(threading.Thread):
    """Every ``every`` seconds one store fault: Mooncake's master or memory owner killed (in turn), or the
    built-in store's lock held for ``hold`` seconds. ``done`` lists what it did and when."""

    def __init__(self, backend: str, router_pid: int, every: float, hold: float) -> None:
        super().__init__(daemon=True, name="store-faults")
        self.backend, self.router_pid, self.every, self.hold = backend, router_pid, every, hold
        self.done: list[str] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        from store_faults import tree

        parts = ["mooncake_master", "mooncake_client"]
        n = 0
        while not self.stop.wait(self.every):
            at = f"{time.monotonic() - self.t0:.0f} s"
            if self.backend == "mooncake":
                part = parts[n % 2]
                victim = next((p for p in tree(self.router_pid) if p["comm"] == part and p["state"] != "Z"), None)
                if victim is not None:
                    os.kill(victim["pid"], signal.SIGKILL)
                    self.done.append(f"{at}: kill -9 {part} (pid {victim['pid']})")
            else:
                seg = glob.glob(f"/dev/shm/*_{self.router_pid}_store*")
                if seg:
                    fd = os.open(seg[0], os.O_RDWR)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX)
                        self.stop.wait(self.hold)
                    finally:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        os.close(fd)
                    self.done.append(f"{at}: store lock held {self.hold:g} s")
            n += 1


def rss_growth(base: dict[str, tuple[int, ...]], end: dict[str, tuple[int, ...]]) -> dict[str, float]:
    """Private RSS (``RssAnon``) at ``end`` over that at ``base``, minus 1, of each worker process alive at both
    (``role:pid``)."""
    return {k: end[k][2] / base[k][2] - 1 for k in base
            if k in end and k.split(":")[0] not in ("router", "client", "resource-tracker") and base[k][2]}


def server_pids(url: str, router_pid: int) -> dict[str, int]:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:    # loopback caller: the worker list too
        body = json.loads(r.read())
    return {"router": router_pid, **{name: w["pid"] for name, w in body.get("workers", {}).items()}}


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so the server's and the client's cleanup runs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=110.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before the baseline sample")
    ap.add_argument("--rate", type=float, default=6.0, help="requests/s (Poisson)")
    ap.add_argument("--fault-rate", type=float, default=0.05)
    ap.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    ap.add_argument("--kv-store", choices=["builtin", "mooncake"], default="builtin")
    ap.add_argument("--store-fault-every", type=float, default=0.0,
                    help="seconds between store faults (0: none; see the docstring)")
    ap.add_argument("--store-hold", type=float, default=5.0, help="built-in store: seconds its lock is held")
    ap.add_argument("--rss-tolerance", type=float, default=0.05,
                    help="largest private-RSS growth of a worker from the load's first quarter to its end")
    args = ap.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="paasbench-soak-"))
    expected = args.rate * args.duration
    spec = fault_spec(args.fault_rate, kill_at=max(2, int(expected / 2)))
    serve = ["--mode", "disaggregated", "--workers", "3", "--prefill-workers", "1", "--block-size", "16",
             "--routing", "threshold", "--remote-prefill-threshold", "100", "--heartbeat-interval", "0.5",
             "--heartbeat-timeout", "2", "--request-timeout", "30", "--fault-spec", json.dumps(spec),
             # small KV pools and store: they fill (first-touch pages) during warm-up, so later growth is a leak
             "--kv-budget-mb", "16", "--kv-store-gb", "0.05", "--kv-store", args.kv_store]
    samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
    idle: dict[str, tuple[int, int]] = {}
    before: dict[str, tuple[int, int]] = {}
    router_fds_before: Counter = Counter()
    router_fds_after: Counter = Counter()
    with EmbeddedServer(serve, startup_timeout_s=180) as srv:
        run = [sys.executable, "-c", "from paasbench.cli import main; main()", "run", "--target", srv.url, "--out", str(out / "run"),
               "--isl", "normal:300:80", "--osl", "16", "--rate", str(args.rate), "--duration", str(args.duration),
               "--warmup", str(args.warmup), "--first-byte-timeout", "20", "--idle-timeout", "3",
               "--total-timeout", "40", "--goodput", "ttft:3000", "--no-live", "--seed", "1"]
        before = snapshot(server_pids(srv.url, srv.pid or 0))
        router_fds_before = fd_kinds(srv.pid or 0)
        store_faults = StoreFaults(args.kv_store, srv.pid or 0, args.store_fault_every, args.store_hold)
        if args.store_fault_every > 0:
            store_faults.start()
        t0 = time.monotonic()
        client = subprocess.Popen(run, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        captured: list[str] = []
        reader = threading.Thread(target=lambda: captured.extend(client.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        try:
            while client.poll() is None:
                try:
                    pids = server_pids(srv.url, srv.pid or 0)
                except OSError:
                    pids = {}
                samples.append((time.monotonic() - t0, snapshot({"client": client.pid, **pids})))
                time.sleep(2.0)
        finally:                 # stopped early (Ctrl-C, SIGTERM): the client goes with the server, not orphaned
            if client.poll() is None:
                client.terminate()
                client.wait(30)
        reader.join(5)
        store_faults.stop.set()
        time.sleep(2.0)        # the server with nothing in flight: what it holds on to
        idle = snapshot(server_pids(srv.url, srv.pid or 0))
        router_fds_after = fd_kinds(srv.pid or 0)
        with urllib.request.urlopen(srv.url + "/admin/faults", timeout=5) as r:
            fired = json.loads(r.read())
    rc = client.returncode

    base = next((s for t, s in samples if t >= args.warmup), samples[0][1])
    quarter = next((s for t, s in samples if t >= args.warmup + args.duration / 4), samples[-1][1])
    end = samples[-1][1]
    with open(out / "samples.jsonl", "w") as fh:      # every 2 s: seconds since the load began, proc_stats()
        for t, snap in samples:
            fh.write(json.dumps({"t_s": round(t, 1), "procs": snap}) + "\n")
    print(f"soak: {args.duration:g} s at {args.rate:g} req/s, {args.fault_rate:.0%} mixed faults, "
          f"warm-up {args.warmup:g} s; client exit {rc}; output {os.path.relpath(out)}")
    print("RSS MiB after warm-up, at the first quarter and at the end (under load), private (RssAnon) and "
          "shared-memory (RssShmem: the store's segment) at the end; open fds with the server idle before the load, after warm-up, "
          "at the end, and idle after the load:")
    heads = ("RSS warm", "RSS 1/4", "RSS end", "anon warm", "anon 1/4", "anon end", "shmem end",
             "fds before", "fds warm", "fds end", "fds after")
    print(f"{'process':<18} " + " ".join(f"{h:>10}" for h in heads))
    for name in sorted(set(before) | set(base) | set(end) | set(idle)):
        snaps = (base.get(name), quarter.get(name), end.get(name))
        cols = [f"{v[0] / 1024:.1f}" if v else "-" for v in snaps]
        cols += [f"{v[2] / 1024:.1f}" if v else "-" for v in snaps]
        cols += [f"{snaps[2][3] / 1024:.1f}" if snaps[2] else "-"]
        cols += [str(v[1]) if v else "-" for v in (before.get(name), base.get(name), end.get(name), idle.get(name))]
        print(f"{name:<18} " + " ".join(f"{c:>10}" for c in cols))

    grew = {k: router_fds_after[k] - router_fds_before[k] for k in router_fds_after | router_fds_before
            if router_fds_after[k] != router_fds_before[k]}
    print(f"router fds, idle after vs idle before, by kind: {grew or 'no change'}")

    # a leak grows with the load's length; pools and allocator arenas that fill once grow early and stop. So the
    # verdict is the growth from the first quarter to the end (a worker's pools and arenas fill for its first
    # minutes: up to 150 s into a 30-minute soak), and the first quarter's is shown beside it
    first, growth = rss_growth(base, quarter), rss_growth(quarter, end)
    worst = max(growth.items(), key=lambda kv: kv[1], default=("-", 0.0))
    flat = bool(growth) and worst[1] <= args.rss_tolerance
    print(f"worker private RSS of the {len(growth)} worker processes alive from the first quarter to the end: largest "
          f"growth {100 * worst[1]:+.1f}% ({worst[0]}); {'flat' if flat else 'NOT flat'} within "
          f"{100 * args.rss_tolerance:g}%; first quarter (warm-up to 1/4): "
          + (", ".join(f"{k} {100 * v:+.1f}%" for k, v in sorted(first.items())) or "-")
          + f"; every sample in {os.path.relpath(out / 'samples.jsonl')}")
    if store_faults.done:
        print(f"store faults ({args.kv_store}): {len(store_faults.done)}: " + "; ".join(store_faults.done))

    recs = list(read_records(out / "run" / "records.jsonl"))
    kinds = Counter(r.error_kind or "ok" for r in recs)
    summary = json.loads((out / "run" / "summary.json").read_text())
    indices = sorted(r.index for r in recs)
    print(f"records: {len(recs)} (indices 0..{indices[-1] if indices else -1}, "
          f"{'no gaps' if indices == list(range(len(recs))) else 'GAPS'}); outcomes {dict(sorted(kinds.items()))}")
    print(f"server: requests_seen {fired['requests_seen']}, faults fired {fired['fired']}")
    print(f"summary (after warm-up): requests {summary['requests']}, error_rate {summary['error_rate']:.4f}, "
          f"goodput_ratio {summary.get('goodput_ratio')}")
    ok = indices == list(range(len(recs))) and "cancelled" not in kinds and fired["requests_seen"] <= len(recs)
    print("every request accounted for" if ok else "NOT every request accounted for")
    if rc not in (0, 1):
        print("".join(captured[-20:]))
    return 0 if ok and flat else 1


if __name__ == "__main__":
    sys.exit(main())
