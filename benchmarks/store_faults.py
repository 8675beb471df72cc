"""The store-fault probe of issue 30: the reference server on a shared KV store while parts of the store fail.

Why: docs/reference_server.md promises that a store fault is a miss, never an outage. This replays a slice of a
Mooncake trace against ``serve --engine sim`` (2 prefill + 2 decode workers by default; the user's defaults for
everything else: ``--heartbeat-timeout 3``, ``--request-timeout 600``, ``--kv-store-timeout 1``) and, at the
times given, kills a part of the store as a crash would (``kill -9``):

* ``--fault master@10``: the server's ``mooncake_master``, 10 s after the first request;
* ``--fault client@30``: its memory owner, ``mooncake_client``;
* no ``--fault``: nothing (a baseline; with a small ``--kv-store-gb``, the tiny-store row).

Every ``--sample`` seconds it reads ``/health`` (status, down list, restarts), ``/metrics`` (the store's
counters and gauges, the requests per pool) and the server's process tree from /proc (live and zombie
processes, workers, their RSS). After each kill it sends a *store probe* every second until the store is back:
a prompt short enough to be prefilled on a decode worker (which puts its blocks), then the same prompt with
20,000 more tokens, which a prefill worker takes and onboards the first one's blocks for from the store. That
needs the second prompt prefilled remotely whatever the load, so with a ``--fault`` the server routes by
``--routing threshold`` (every prompt over 1,000 uncached tokens goes to a prefill worker): under the default
cost rule an idle server prefills on the decode worker that already holds the prefix, nothing reads the store,
and a store that is back cannot be seen (a CI run: the memory owner killed at 28 s, the replay over at ~50 s,
no probe remote after that, the store never seen back). The
store is *back* at the first sample after the kill where a new process runs the killed part, /health names no
store part down, and both puts and store hits (``paasbench_kv_store_hit_blocks_total``) grew since the kill
(counters alone can grow on the last answers the dead part gave before the server noticed it gone).

It prints, and ``--json`` writes: failed requests and their kinds, the slowest request (intended send to its
end), how long /health was not ``ok``, each fault's store-back time and whether its process was reaped, the
most processes and workers at once, zombies, worker RSS, and the store's occupancy, evictions and puts per
stored block. The server's whole log goes to ``OUT/server.log``.

    python benchmarks/store_faults.py --trace trace.jsonl --fault master@10
    python benchmarks/store_faults.py --trace trace.jsonl --fault master@10 --fault client@30
    python benchmarks/store_faults.py --trace trace.jsonl --kv-store-gb 0.01
    python benchmarks/store_faults.py --trace trace.jsonl --kv-store builtin

Figures are from a shared machine unless you say otherwise: ``load`` in the output is ``/proc/loadavg`` at
the end of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paas_common.prometheus import parse  # noqa: E402
from paasbench.metrics.records import read_records  # noqa: E402
from reference_server.launcher import EmbeddedServer  # noqa: E402

FAULT_PROGRAMS = {"master": "mooncake_master", "client": "mooncake_client"}
BACK_WITHIN_S = 60.0        # how long after a kill the store probe keeps trying


def slice_trace(src: Path, start: int, count: int, dst: Path, output_cap: int | None = None) -> Path:
    """Lines ``[start, start + count)`` of a Mooncake JSONL trace, timestamps rebased to 0, output lengths capped
    at ``output_cap`` (a store fault is about prefixes: long decodes only lengthen the run)."""
    rows = [json.loads(line) for i, line in enumerate(src.open()) if start <= i < start + count]
    t0 = rows[0]["timestamp"]
    with dst.open("w") as fh:
        for r in rows:
            out = r["output_length"] if output_cap is None else min(output_cap, r["output_length"])
            fh.write(json.dumps({**r, "timestamp": r["timestamp"] - t0, "output_length": out}) + "\n")
    return dst


def tree(root: int) -> list[dict[str, Any]]:
    """Every process under ``root`` (root included): pid, ppid, command name, state, RSS KiB, command line."""
    procs: dict[int, dict[str, Any]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
            rss = 0
            with open(f"/proc/{d}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        procs[int(d)] = {"pid": int(d), "ppid": int(rest[1]), "comm": stat[stat.index("(") + 1:stat.rindex(")")],
                         "state": rest[0], "rss_kib": rss, "cmd": cmd}
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            out.append(procs[pid])
            todo.extend(p["pid"] for p in procs.values() if p["ppid"] == pid)
    return out


def is_worker(p: dict[str, Any]) -> bool:
    """A live worker process (multiprocessing spawn), not the resource tracker."""
    return p["state"] != "Z" and "multiprocessing.spawn" in p["cmd"] and "resource_tracker" not in p["cmd"]


def fetch(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 120.0) -> dict[str, Any]:
    """One non-streamed completion: its status and ``paasbench_timings``."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": False}).encode(),
        {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return {"status": r.status, **json.loads(r.read()).get("paasbench_timings", {})}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code}
    except OSError as exc:
        return {"status": 0, "error": str(exc)}


def store_probe(url: str, seed: int) -> dict[str, Any]:
    """A prompt prefilled on a decode worker (below --remote-prefill-threshold's default 1,000 uncached tokens),
    then it with 20,000 more tokens (prefilled on a prefill worker, which onboards the first one's blocks from
    the store when the store answers): the second's status and store hit."""
    rng = random.Random(seed)
    head = [rng.randrange(1000, 90000) for _ in range(990)]
    first = complete(url, head, 8)
    time.sleep(0.3)                           # the decode worker's put lands
    second = complete(url, head + [rng.randrange(1000, 90000) for _ in range(20000)], 2)
    return {"first": first.get("status"), "status": second.get("status"),
            "store_hit_tokens": second.get("store_hit_tokens", 0), "where": second.get("prefill_location")}


def figures(code: int, text: str) -> dict[str, float]:
    """The ``paasbench_kv_store_*`` series of a /metrics answer, and the requests waiting and running per pool
    and in the router ({} when it did not answer 200)."""
    tot: dict[str, float] = {}
    if code != 200:
        return tot
    for s in parse(text):
        if s.name.startswith("paasbench_kv_store_"):
            tot[s.name[len("paasbench_kv_store_"):]] = s.value
        elif s.name in ("paasbench_pool_sequences", "paasbench_requests_waiting", "paasbench_requests_running"):
            tot[s.name[len("paasbench_"):] + "".join(f"/{v}" for _, v in s.labels)] = s.value
    return tot


def kill_worker(url: str, before: dict[str, float], timeout_s: float = 120.0) -> dict[str, Any]:
    """``kill -9`` of decode-0, then the store's counters once its replacement serves: they must not go back."""
    old = json.loads(fetch(url + "/health")[1])["workers"]["decode-0"]["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = json.loads(fetch(url + "/health")[1])
        if body.get("status") == "ok" and body["workers"]["decode-0"]["pid"] != old:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    after = figures(*fetch(url + "/metrics"))
    keys = [k for k in before if k.endswith("_total")]
    return {"pid": old, "before": {k: before[k] for k in keys}, "after": {k: after.get(k) for k in keys}}


def parse_fault(value: str) -> tuple[str, float]:
    kind, _, at = value.partition("@")
    if kind not in FAULT_PROGRAMS or not at:
        raise argparse.ArgumentTypeError(f"{value!r}: expected master@SECONDS or client@SECONDS")
    return kind, float(at)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True, help="a Mooncake JSONL trace")
    ap.add_argument("--start", type=int, default=7700, help="first line of the slice (0-based)")
    ap.add_argument("--count", type=int, default=250, help="requests in the slice")
    ap.add_argument("--time-scale", type=float, default=0.5, help="paasbench run --time-scale")
    ap.add_argument("--output-cap", type=int, default=None, help="cap each request's output tokens")
    ap.add_argument("--fault", type=parse_fault, action="append", default=[], metavar="PART@SECONDS",
                    help="kill -9 master or client this many seconds after the first request (repeatable)")
    ap.add_argument("--deadline", type=float, default=600.0,
                    help="the client's first-byte and total timeout per request, seconds")
    ap.add_argument("--kv-store", default="mooncake")
    ap.add_argument("--kv-store-gb", default=None)
    ap.add_argument("--routing", choices=("cost", "threshold"), default=None,
                    help="serve --routing (default: threshold with a --fault, for the store probe; else the server's)")
    ap.add_argument("--prefill-workers", type=int, default=2)
    ap.add_argument("--decode-workers", type=int, default=2)
    ap.add_argument("--server-arg", action="append", default=[], help="one more serve argument (repeatable)")
    ap.add_argument("--kill-worker-after", action="store_true",
                    help="after the replay, kill -9 decode-0 and read the store's counters once it is back")
    ap.add_argument("--sample", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)

    out = args.out or Path(tempfile.mkdtemp(prefix="paasbench-store-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    trace = slice_trace(args.trace, args.start, args.count, out / "slice.jsonl", args.output_cap)
    serve = ["--engine", "sim", "--mode", "disaggregated", "--prefill-workers", str(args.prefill_workers),
             "--decode-workers", str(args.decode_workers), "--kv-store", args.kv_store, *args.server_arg]
    routing = args.routing or ("threshold" if args.fault else None)
    if routing is not None:
        serve += ["--routing", routing]
    if args.kv_store_gb is not None:
        serve += ["--kv-store-gb", str(args.kv_store_gb)]
    samples: list[dict[str, Any]] = []
    todo = sorted(args.fault, key=lambda f: f[1])
    faults: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    with EmbeddedServer(serve, startup_timeout_s=180) as srv:
        srv.log = deque(srv.log, maxlen=100_000)      # every line, for out/server.log
        root = srv.pid or 0
        run = [sys.executable, "-c", "from paasbench.cli import main; main()", "run", "--target", srv.url,
               "--trace", str(trace), "--mode", "trace", "--time-scale", str(args.time_scale),
               "--prompt-format", "token-ids", "--no-live", "--first-byte-timeout", str(args.deadline),
               "--total-timeout", str(args.deadline), "--out", str(out / "run")]
        client = subprocess.Popen(run, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        captured: list[str] = []
        reader = threading.Thread(target=lambda: captured.extend(client.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        t0 = time.monotonic()
        prober: threading.Thread | None = None
        while client.poll() is None or (faults and faults[-1].get("back_s") is None
                                         and time.monotonic() - t0 - faults[-1]["t"] < BACK_WITHIN_S):
            now = time.monotonic() - t0
            if todo and now >= todo[0][1]:
                kind, _ = todo.pop(0)
                victim = next((p for p in tree(root) if p["comm"] == FAULT_PROGRAMS[kind] and p["state"] != "Z"), None)
                if victim is not None:
                    os.kill(victim["pid"], signal.SIGKILL)
                    faults.append({"part": kind, "t": now, "pid": victim["pid"], "back_s": None})
            code, body = fetch(srv.url + "/health")
            try:
                health = json.loads(body)
            except ValueError:
                health = {"status": f"no answer ({code})"}
            t_m = time.monotonic()
            mcode, text = fetch(srv.url + "/metrics")
            metrics_s = time.monotonic() - t_m
            procs = tree(root)
            s = {"t": now, "status": health.get("status"), "down": health.get("down", []),
                 "restarts": health.get("restarts", 0), "store": figures(mcode, text), "metrics": mcode,
                 "metrics_s": metrics_s, "procs": sum(p["state"] != "Z" for p in procs),
                 "zombies": [f"{p['comm']}:{p['pid']}" for p in procs if p["state"] == "Z"],
                 "workers": sum(map(is_worker, procs)),
                 "worker_rss_mib": sum(p["rss_kib"] for p in procs if is_worker(p)) / 1024}
            samples.append(s)
            for f in faults:
                if f["back_s"] is not None:
                    continue
                if "at_kill" not in f:
                    f["at_kill"] = dict(next((x["store"] for x in reversed(samples[:-1]) if x["store"]), {}))
                got = s["store"]
                replaced = any(p["comm"] == FAULT_PROGRAMS[f["part"]] and p["pid"] != f["pid"] and p["state"] != "Z"
                               for p in procs)
                if (got and replaced and not any(d.startswith("mooncake") for d in s["down"])
                        and got.get("put_blocks_total", 0) > f["at_kill"].get("put_blocks_total", 0)
                        and got.get("hit_blocks_total", 0) > f["at_kill"].get("hit_blocks_total", 0)):
                    f["back_s"] = now - f["t"]
                    f["reaped"] = not any(z.endswith(f":{f['pid']}") for z in s["zombies"])
            pending = [f for f in faults if f["back_s"] is None]
            if pending and (prober is None or not prober.is_alive()):
                seed = len(probes)
                prober = threading.Thread(target=lambda seed=seed: probes.append(
                    {"t": time.monotonic() - t0, **store_probe(srv.url, 10_000 + seed)}), daemon=True)
                prober.start()
            time.sleep(args.sample)
        reader.join(5)
        if prober is not None:
            prober.join(120)
        time.sleep(1.0)
        final_store = figures(*fetch(srv.url + "/metrics"))
        worker_restart = kill_worker(srv.url, final_store) if args.kill_worker_after else None
        procs = tree(root)
        final_zombies = [f"{p['comm']}:{p['pid']}" for p in procs if p["state"] == "Z"]
        log = list(srv.log)
    (out / "server.log").write_text("\n".join(log) + "\n")
    recs = list(read_records(out / "run" / "records.jsonl"))
    summary = json.loads((out / "run" / "summary.json").read_text())
    failed = [r for r in recs if not r.ok]
    e2e = [((r.end_s or 0) - r.intended_send_s) for r in recs]
    not_ok = [s for s in samples if s["status"] != "ok"]
    occ = [s["store"]["occupancy_ratio"] for s in samples if "occupancy_ratio" in s["store"]]
    for f in faults:
        f.pop("at_kill", None)
    result = {
        "kv_store": args.kv_store, "kv_store_gb": args.kv_store_gb, "routing": routing or "server default",
        "faults": faults,
        "requests": len(recs), "failed": len(failed),
        "failed_kinds": sorted({f"{r.error_kind} {r.status}" for r in failed}),
        "max_e2e_s": max(e2e, default=0.0), "deadline_s": args.deadline, "client_exit": client.returncode,
        "not_ok_s": len(not_ok) * args.sample, "statuses": sorted({str(s["status"]) for s in samples}),
        "restarts": max((s["restarts"] for s in samples), default=0),
        "metrics_failed": sum(s["metrics"] != 200 for s in samples),
        "metrics_max_s": max((s["metrics_s"] for s in samples), default=0.0),
        "max_procs": max((s["procs"] for s in samples), default=0),
        "max_workers": max((s["workers"] for s in samples), default=0),
        "workers_configured": args.prefill_workers + args.decode_workers,
        "zombies_seen": sorted({z for s in samples for z in s["zombies"]}), "zombies_at_end": final_zombies,
        "worker_rss_mib": [round(samples[0]["worker_rss_mib"], 1) if samples else 0,
                           round(max((s["worker_rss_mib"] for s in samples), default=0), 1)],
        "hit": summary.get("prefix_hit_check"),     # the server's prefix hit and what the traffic offered
        "occupancy": occ, "max_occupancy": max(occ, default=0.0), "store": final_store, "probes": probes,
        # blocks written per block the store holds (what it means while nothing was evicted or lost)
        "puts_per_stored_block": (final_store.get("put_blocks_total", 0) / final_store["blocks"]
                                  if final_store.get("blocks") else None),
        "worker_restart": worker_restart,
        "load": open("/proc/loadavg").read().split()[:3],
    }
    for k in ("routing", "faults", "requests", "failed", "failed_kinds", "max_e2e_s", "hit", "statuses", "not_ok_s", "restarts",
              "metrics_failed", "max_procs", "max_workers", "zombies_seen", "zombies_at_end", "worker_rss_mib",
              "max_occupancy", "puts_per_stored_block", "worker_restart", "load"):
        print(f"{k}: {result[k]}")
    print("store:", {k: final_store.get(k) for k in ("capacity_blocks", "blocks", "occupancy_ratio",
                                                      "evictions_total", "put_blocks_total", "duplicates_total",
                                                      "hit_blocks_total", "errors_total", "timeouts_total")})
    print(f"server log: {os.path.relpath(out / 'server.log')}")
    if args.json:
        args.json.write_text(json.dumps({**result, "samples": samples}, indent=1))
    if client.returncode not in (0, 1):
        print("".join(captured[-20:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
