"""A machine-speed fingerprint, recorded with every sweep, so the gate can tell a slower machine from slower code.

Why: the committed-baseline gate (``scripts/perf_gate.sh baseline``) judges a sweep on the embedded cpu server
against one recorded on another machine. The same code (826.10K TPM from both the baseline's revision and main,
measured the same day) showed "engine CPU per prefill token 155 → 312 µs" and "TTFT p50 50 → 132 ms" because the
runner was about twice as slow as the machine the baseline came from. Without a measure of the machine, no
tolerance separates the two.

What: the CPU time of a fixed numpy workload shaped like the cpu engine's own work — one 256-token prefill chunk
of the built-in ``tiny`` model (2 layers, hidden 128, 4 query / 2 KV heads of 32, FFN 384: the QKV, attention,
output and FFN matmuls, softmax, SiLU), float32, fixed weights — run in a fresh single-threaded subprocess
(``OPENBLAS_NUM_THREADS=1``: per-core speed, and the caller's BLAS settings and state do not leak in). It is timed
in *thread CPU time*, which a neighbour taking the core does not inflate, in :data:`BLOCKS` blocks; the figure is
the fastest block (the machine's own speed; cache and memory-bandwidth contention only ever add) and the spread
is the median block over the fastest, the fingerprint's own noise on this occasion. About 0.5 s of CPU in all.

Plus what the machine is: the CPU model (``/proc/cpuinfo``), logical CPUs and the ones this process may use.
Recorded in ``sweep.json`` ``meta.machine``; ``paasbench gate`` compares the two sides' (paasbench/gate/compare.py,
docs/slo.md "Across machines").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

BLOCKS = 48            # timed blocks; the fastest is the figure (many short ones: one is likely undisturbed)
ITERS = 1              # workload iterations per block (one is ~10 ms of CPU on the dev box)
SCHEMA = "paasbench.machine/1"
# How far apart two fingerprints of one machine read, as a factor: 1 + NOISE_FLOOR either way. Measured on the
# shared 2-core dev box (one AMD EPYC VM): the committed baseline's sweep read 13.21 ms per iteration, a quick
# start's on the same box days later 7.87 (×1.68, both at load 1–2), ten fresh ones 10.2–14.1 at load 2 and
# 13.7–17.8 at load 16 (`python -m paasbench.gate.fingerprint --repeat 10`, reports/gate-acceptance/
# fingerprint-noise.txt): the host's own speed moves that much under a VM. So ×/÷1.70. The noise used is the
# larger of this and either fingerprint's own spread (docs/slo.md "Across machines").
NOISE_FLOOR = 0.70


@dataclass(frozen=True, slots=True)
class Machine:
    cpu_model: str | None        # /proc/cpuinfo "model name" (None off Linux)
    logical_cpus: int | None
    usable_cpus: int | None      # sched_getaffinity: what this process may run on
    seconds_per_iter: float | None   # the fingerprint: CPU seconds of one workload iteration, fastest block
    spread: float | None             # median block / fastest block − 1
    schema: str = SCHEMA

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> "Machine | None":
        raw = (meta or {}).get("machine")
        if not isinstance(raw, dict):
            return None

        def num(key: str, *, zero_ok: bool = False) -> float | None:
            v = raw.get(key)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > 0 or (zero_ok and v == 0))
            return float(v) if ok else None

        cpus, usable = num("logical_cpus"), num("usable_cpus")
        model = raw.get("cpu_model")
        return cls(model if isinstance(model, str) else None, int(cpus) if cpus else None,
                   int(usable) if usable else None, num("seconds_per_iter"), num("spread", zero_ok=True))


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model"):
                    return value.strip() or None
    except OSError:
        pass
    return platform.processor() or None


def _usable() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def describe(*, timed: bool = True) -> Machine:
    """This machine; with ``timed``, its fingerprint too (a subprocess, about 1 s; None figures if it fails)."""
    seconds = spread = None
    if timed:
        seconds, spread = _measure_in_subprocess()
    return Machine(cpu_model(), os.cpu_count(), _usable(), seconds, spread)


def _measure_in_subprocess() -> tuple[float | None, float | None]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, "-c", "from paasbench.gate.fingerprint import _child; _child()"],
                              env=env, capture_output=True, text=True, timeout=120)
        out = json.loads(done.stdout)
        return float(out["seconds_per_iter"]), float(out["spread"])
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return None, None


def _child() -> None:
    print(json.dumps(dict(zip(("seconds_per_iter", "spread"), measure()))))


def measure(blocks: int = BLOCKS, iters: int = ITERS) -> tuple[float, float]:
    """(CPU seconds per iteration in the fastest block, median block / fastest − 1), in this process's thread."""
    import statistics
    import time

    import numpy as np

    rng = np.random.default_rng(0)
    t, hidden, heads, kv_heads, hd, ffn, layers = 256, 128, 4, 2, 32, 384, 2
    f32 = np.float32
    w = [{"qkv": rng.standard_normal((hidden, (heads + 2 * kv_heads) * hd), dtype=f32) * f32(0.05),
          "o": rng.standard_normal((heads * hd, hidden), dtype=f32) * f32(0.05),
          "up": rng.standard_normal((hidden, 2 * ffn), dtype=f32) * f32(0.05),
          "down": rng.standard_normal((ffn, hidden), dtype=f32) * f32(0.05)} for _ in range(layers)]
    x0 = rng.standard_normal((t, hidden), dtype=f32)
    mask = np.triu(np.full((t, t), -np.inf, dtype=f32), 1)

    def chunk() -> float:
        x = x0
        for lw in w:
            qkv = x @ lw["qkv"]
            q = qkv[:, :heads * hd].reshape(t, heads, hd).transpose(1, 0, 2)
            k = qkv[:, heads * hd:(heads + kv_heads) * hd].reshape(t, kv_heads, hd).transpose(1, 0, 2)
            v = qkv[:, (heads + kv_heads) * hd:].reshape(t, kv_heads, hd).transpose(1, 0, 2)
            k, v = np.repeat(k, heads // kv_heads, axis=0), np.repeat(v, heads // kv_heads, axis=0)
            s = q @ k.transpose(0, 2, 1) * f32(hd ** -0.5) + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            a = (s / s.sum(axis=-1, keepdims=True)) @ v
            x = x + a.transpose(1, 0, 2).reshape(t, heads * hd) @ lw["o"]
            g, u = np.split(x @ lw["up"], 2, axis=1)
            x = x + (g / (1 + np.exp(-g)) * u) @ lw["down"]
        return float(x[0, 0])

    chunk()                                             # warm: first-touch pages, BLAS init
    times = []
    for _ in range(blocks):
        c0 = time.thread_time()
        for _ in range(iters):
            chunk()
        times.append((time.thread_time() - c0) / iters)
    fastest = min(times)
    return fastest, statistics.median(times) / fastest - 1


@dataclass(frozen=True, slots=True)
class Speed:
    """How the current side's machine compares with the baseline's."""

    ratio: float | None      # current speed / baseline speed (0.5: the current machine is half as fast); None: unknown
    noise: float             # the ratio is known to within a factor 1 + noise either way
    same_cpu_model: bool | None
    reason: str              # one sentence for the gate's notes, with its one conclusion

    @property
    def differs(self) -> bool:
        """The machines differ in speed beyond the fingerprints' noise, or cannot be told apart at all."""
        if self.ratio is None:
            return self.same_cpu_model is not True
        return abs(math.log(self.ratio)) > math.log1p(self.noise) or self.same_cpu_model is False

    def widened(self, tolerance: float) -> float:
        """The tolerance a change normalised by :attr:`ratio` must exceed to be beyond ``tolerance`` for every
        ratio the fingerprint allows (ratio / (1 + noise) to ratio × (1 + noise)): (1 + tol)(1 + noise) − 1."""
        return (1 + tolerance) * (1 + self.noise) - 1


def compare_machines(base: Machine | None, cur: Machine | None) -> Speed | None:
    """None when neither side says what machine it ran on (results from before fingerprints: judged as before)."""
    if base is None and cur is None:
        return None
    same = None
    if base is not None and cur is not None and base.cpu_model and cur.cpu_model:
        same = base.cpu_model == cur.cpu_model
    timed = [m is not None and m.seconds_per_iter is not None for m in (base, cur)]
    if same and not any(timed):       # two runs (runs record no timed fingerprint) on one CPU model
        return Speed(None, NOISE_FLOOR, same, f"both sides ran on {cur.cpu_model} (no speed fingerprint: runs "
                                              "record the CPU only): judged as one machine")
    if not all(timed):
        which = "baseline" if base is None or base.seconds_per_iter is None else "current result"
        return Speed(None, NOISE_FLOOR, same, f"the {which} carries no machine-speed fingerprint (recorded before "
                                             "paasbench measured one, or it failed): the two machines cannot be "
                                             "placed, so nothing the machine sets is called")
    noise = max(NOISE_FLOOR, base.spread or 0.0, cur.spread or 0.0)
    ratio = base.seconds_per_iter / cur.seconds_per_iter
    speed = Speed(ratio, noise, same, "")
    measured = (f"machine speed, current vs baseline: ×{ratio:.2f} by the fingerprint "
                f"({base.seconds_per_iter * 1e3:.2f} → {cur.seconds_per_iter * 1e3:.2f} ms per workload iteration)")
    band = f"the ×/÷{1 + noise:.2f} within which one machine reads itself"
    if same is False:
        verdict = f"; different CPUs ({base.cpu_model} vs {cur.cpu_model}): judged as different machines"
    elif speed.differs:
        verdict = f", beyond {band}: judged as machines of different speed"
    else:
        verdict = f", within {band}: judged as one machine"
    return dataclasses.replace(speed, reason=measured + verdict)


def main(argv: list[str] | None = None) -> int:
    """``python -m paasbench.gate.fingerprint [--repeat N]``: N fresh fingerprints and their spread."""
    import argparse
    import time

    ap = argparse.ArgumentParser(description="Measure this machine's fingerprint N times (each a fresh subprocess).")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    figures = []
    for i in range(args.repeat):
        t0 = time.perf_counter()
        m = describe()
        wall = time.perf_counter() - t0
        if m.seconds_per_iter is None:
            print("fingerprint failed", file=sys.stderr)
            return 1
        figures.append(m.seconds_per_iter)
        print(f"{i + 1}: {m.seconds_per_iter * 1e3:.3f} ms/iter, own spread {m.spread * 100:.1f}%, "
              f"{wall:.2f} s wall, load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{m.cpu_model}, {m.logical_cpus} CPUs ({m.usable_cpus} usable); fastest {min(figures) * 1e3:.3f}, "
          f"slowest {max(figures) * 1e3:.3f} ms/iter: max/min − 1 = {(max(figures) / min(figures) - 1) * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
