"""Measure the real engine's step times on this machine and fit a device profile (``cpu-local``).

Fit and check use different shapes: the sim's error is reported on prefill lengths, decode batch
sizes/contexts and mixed batches that the fit never saw. The engine is the built-in ``tiny`` on numpy by
default; ``--model DIR --backend torch --device cuda`` fits an accelerator running a checkpoint (timed in
wall-clock time: every step ends with its token ids on the host, i.e. with the device synchronized).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import yaml

from reference_server.engine.base import SeqStep
from reference_server.engine.cpu import CpuEngine
from reference_server.sim.fit import fit_device, predict
from reference_server.sim.profiles import PROFILE_DTYPE, DeviceProfile, load_model_profile, model_profile_of

Shape = list[tuple[int, int]]   # [(new tokens, start position), ...]: one engine step
BLOCK = 256


def decode(batch: int, ctx: int) -> Shape:
    return [(1, ctx)] * batch


FIT_SHAPES: list[Shape] = ([[(n, 0)] for n in (128, 512, 1024, 2048, 4096)] + [[(512, 2048)]]
                           + [decode(b, c) for b in (1, 2, 4, 8, 16) for c in (128, 1024, 4096)]
                         + [[(1024, 0)] + decode(8, 1024)])
HELD_OUT: list[Shape] = ([[(n, 0)] for n in (256, 1536, 3072)] + [[(1024, 1024)]]
                         + [decode(2, 2048), decode(6, 1536), decode(8, 512), decode(8, 3000), decode(12, 256)]
                         + [[(256, 0)] + decode(4, 1024)])


def label(shape: Shape) -> str:
    pre = [f"prefill {n}" + (f" after {p}" if p else "") for n, p in shape if n > 1]
    dec = [p for n, p in shape if n == 1]
    parts = pre + ([f"decode {len(dec)}x ctx {dec[0]}"] if dec else [])
    return " + ".join(parts)


@dataclass
class Sample:
    shape: Shape
    seconds: float       # fastest of the repeats: the engine's own cost, not the neighbours' load
    spread: float        # (median - min) / min of the repeats: how noisy this machine was


def single_threaded() -> bool:
    """BLAS runs in the calling thread: the step's thread CPU time is then its wall time on an idle core."""
    return all(os.environ.get(v) == "1" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"))


def step_clock(engine: CpuEngine | None = None) -> Callable[[], float]:
    """Thread CPU time when single-threaded on a CPU -- immune to neighbours taking the core, the dominant
    noise on a shared machine -- else wall time (multi-threaded BLAS spreads the work over other threads;
    an accelerator works outside this thread)."""
    on_cpu = engine is None or engine.be.kind == "cpu"
    return time.thread_time if on_cpu and single_threaded() else time.perf_counter


def measure(engine: CpuEngine, shapes: Sequence[Shape], repeats: int, seed: int = 0,
            progress: Callable[[int, int], None] | None = None) -> list[Sample]:
    """Fastest time of ``engine.step`` per shape (:func:`step_clock`). Repeats run in rounds over all
    shapes, so a neighbour's burst on this shared machine hits one repeat of many shapes rather than
    every repeat of one, and the minimum is the repeatable figure (the median mostly measures the
    neighbours). The pool's contents do not change the cost of attention, so contexts are taken as cached.
    ``progress(done, total)`` is told after every engine step (warm-ups included)."""
    clock = step_clock(engine)
    total, done = len(shapes) * (repeats + 1), 0
    tell = progress or (lambda done, total: None)
    rng = np.random.default_rng(seed)
    vocab = min(100_000, engine.shape.vocab_size)
    batches = []
    for shape in shapes:
        batch, next_block = [], 0
        for i, (n, start) in enumerate(shape):
            nb = -(-(start + n) // BLOCK)
            table = [(next_block + j) % engine.num_blocks for j in range(nb)]
            next_block += nb
            batch.append(SeqStep(f"c{i}", rng.integers(0, vocab, n).tolist(), start, table))
        batches.append(batch)
        engine.step(batch)  # warm-up: first-touch page faults, BLAS buffers
        done += 1
        tell(done, total)
    times: list[list[float]] = [[] for _ in shapes]
    for _ in range(repeats):
        for i, batch in enumerate(batches):
            t0 = clock()
            engine.step(batch)
            times[i].append(clock() - t0)
            done += 1
            tell(done, total)
    return [Sample(shape, min(t), (statistics.median(t) - min(t)) / min(t)) for shape, t in zip(shapes, times)]


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Host memory copy bandwidth: what a shared-memory KV hand-off between local processes costs."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass
class Calibration:
    device: DeviceProfile
    fit: list[tuple[Sample, float]]        # (measured, sim seconds)
    held_out: list[tuple[Sample, float]]
    elapsed_s: float

    @staticmethod
    def errors(rows: list[tuple[Sample, float]]) -> list[float]:
        return [abs(pred - s.seconds) / s.seconds for s, pred in rows]

    def rows(self) -> list[dict]:
        """One row per measured shape: measured and sim step time, the sim's error, the repeats' noise."""
        return [{"set": kind, "shape": label(s.shape), "measured_ms": s.seconds * 1e3, "sim_ms": p * 1e3,
                 "error_pct": 100 * (p - s.seconds) / s.seconds, "noise_pct": 100 * s.spread}
                for kind, pairs in (("fit", self.fit), ("held-out", self.held_out)) for s, p in pairs]

    def summary(self, profile: Path, load_avg: float) -> dict:
        """The held-out error against the 10% goal and the fitted rates, as ``paasbench calibrate --json``
        prints them (``load_avg``: the 1-minute load average before the run)."""
        err = Calibration.errors(self.held_out)
        d = self.device
        linear = next(iter(d.tflops.values()))      # the one dtype the fit ran in (fp32 on a CPU, bf16 on a GPU)
        return {"profile": str(profile), "elapsed_s": self.elapsed_s, "load_avg_1m_before": load_avg,
                "cpus": os.cpu_count(), "held_out_mean_abs_error_pct": 100 * statistics.mean(err),
                "held_out_max_abs_error_pct": 100 * max(err), "goal_pct": 10.0,
                "fitted": {"linear_gflops": linear * 1e3, "attention_gflops": linear * 1e3 * d.attn_mfu,
                           "weight_gbps": d.hbm_tbps * 1e3, "kv_gbps": d.hbm_tbps * 1e3 * d.kv_mbu,
                           "overlap": d.overlap, "gemm_weight_passes": d.gemm_weight_passes,
                           "step_overhead_ms": d.step_overhead_s * 1e3, "seq_overhead_ms": d.seq_overhead_s * 1e3,
                           "memcpy_gbps": d.network_gbps}}


def run_calibration(model: str = "tiny", quick: bool = False, seed: int = 0, backend: str = "numpy",
                    device: str = "cpu", progress: Callable[[int, int], None] | None = None) -> Calibration:
    t0 = time.perf_counter()
    engine = CpuEngine(block_size=BLOCK, num_blocks=320, model=model, seed=seed, backend=backend, device=device)
    dtype = PROFILE_DTYPE[engine.be.dtype_name]
    # the built-in models have bundled profiles (a test keeps them equal to the engine's configs)
    profile = (load_model_profile(model) if backend == "numpy" and not engine.cfg.vocab
               else model_profile_of(engine.cfg, engine.be.dtype_name, engine.shape.kv_dtype))
    repeats = 5 if quick else 11
    # one interleaved measurement of both sets: fit and check see the same machine conditions
    samples = measure(engine, FIT_SHAPES + HELD_OUT, repeats, seed, progress)
    fit_samples, held = samples[:len(FIT_SHAPES)], samples[len(FIT_SHAPES):]
    kind = engine.be.kind
    base = DeviceProfile(
        name=f"{kind}-local", tflops={dtype: 0.0}, hbm_tbps=0.0, cards=1,
        hbm_gb=round((engine.be.memory() or (0, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")))[1] / 1e9, 1),
        network_gbps=round(memcpy_gbps(), 2),
        description=f"this machine's real engine ({engine.cfg.name}, {backend} {engine.be.dtype_name} on "
                    f"{engine.be.device}), fitted by paasbench calibrate",
        sources=[f"paasbench calibrate{' --quick' if quick else ''} on {platform.node() or 'localhost'}, "
                 f"{os.cpu_count()} CPUs, BLAS threads {os.environ.get('OPENBLAS_NUM_THREADS', 'default')} "
                 f"({'thread CPU' if single_threaded() else 'wall'} time), "
                 f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"])
    device = fit_device(profile, base, [s.shape for s in fit_samples], [s.seconds for s in fit_samples], dtype=dtype)
    pf = predict(profile, device, [s.shape for s in fit_samples])
    ph = predict(profile, device, [s.shape for s in held])
    return Calibration(device, list(zip(fit_samples, pf)), list(zip(held, ph)), time.perf_counter() - t0)


def write_profile(cal: Calibration, path: Path) -> None:
    d = cal.device
    err = Calibration.errors(cal.held_out)
    data = {
        "name": d.name, "description": d.description, "sources": d.sources, "cards": d.cards,
        "tflops": {k: float(f"{v:.6g}") for k, v in d.tflops.items()}, "hbm_tbps": float(f"{d.hbm_tbps:.6g}"),
        "hbm_gb": d.hbm_gb, "network_gbps": d.network_gbps, "mfu": 1.0, "attn_mfu": float(f"{d.attn_mfu:.6g}"),
        "mbu": 1.0, "kv_mbu": float(f"{d.kv_mbu:.6g}"), "overlap": float(f"{d.overlap:.4g}"),
        "gemm_weight_passes": float(f"{d.gemm_weight_passes:.4g}"),
        "step_overhead_s": float(f"{d.step_overhead_s:.6g}"), "seq_overhead_s": float(f"{d.seq_overhead_s:.6g}"),
    }
    header = ("# Fitted by `paasbench calibrate`: effective rates of the cpu engine on this machine (not hardware peaks):\n"
              "# tflops.<dtype> = linear-layer FLOP/s, attn_mfu = attention FLOP/s as a fraction of it, hbm_tbps = weight\n"
              "# bytes/s (kv_mbu: KV bytes/s as a fraction of it), gemm_weight_passes = weight reads of a multi-row matmul\n"
              "# (BLAS packing) vs a one-row one, overlap of compute and memory time, overheads per step and per sequence;\n"
              "# network_gbps = memcpy bandwidth (shared-memory KV hand-off).\n"
              f"# Held-out error of the sim vs the real engine: mean {100 * statistics.mean(err):.1f}%, "
              f"max {100 * max(err):.1f}% over {len(err)} shapes.\n")
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
