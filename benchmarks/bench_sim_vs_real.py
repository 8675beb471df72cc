"""How well the sim (cpu-local profile) predicts the real cpu engine on shapes the fit never saw.

    python benchmarks/bench_sim_vs_real.py [--device-profile cpu-local] [--repeats 7] [--threads 1]

Prints, per held-out step shape, the real engine's step time (fastest of interleaved repeats), the
sim's modeled time and their ratio; then one whole request (chunked prefill + decode) timed on the
real engine (per step, fastest of 5 runs) and on the sleeping sim engine, wall clock against wall clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device-profile", default="cpu-local")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads (as calibrate; 0 = BLAS default)")
    return ap.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.threads:  # before numpy loads: BLAS reads it once
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402

from reference_server.engine import SeqStep, create_engine  # noqa: E402
from reference_server.engine.cpu import CpuEngine  # noqa: E402
from reference_server.sim.calibrate import BLOCK, HELD_OUT, label, measure, single_threaded  # noqa: E402
from reference_server.sim.fit import predict  # noqa: E402
from reference_server.sim.profiles import load_device_profile, load_model_profile  # noqa: E402


def request_steps(engine, prompt: list[int], chunk: int, decode_steps: int,
                  clock=time.perf_counter) -> np.ndarray:
    """Time of each step of one request run alone: its prefill chunks, then its decode steps."""
    table = list(range(-(-(len(prompt) + decode_steps) // BLOCK)))
    steps = [(prompt[s:s + chunk], s) for s in range(0, len(prompt), chunk)]
    out, tok = [], 0
    for i in range(len(steps) + decode_steps):
        ids, start = steps[i] if i < len(steps) else ([tok], len(prompt) + i - len(steps))
        t0 = clock()
        tok = engine.step([SeqStep("r", ids, start, table)])[0]
        out.append(clock() - t0)
    return np.array(out)


def main(args: argparse.Namespace) -> None:
    model, device = load_model_profile(args.model), load_device_profile(args.device_profile)
    clock_name = "thread CPU" if single_threaded() else "wall-clock"
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; BLAS threads "
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')}; real steps timed in {clock_name} time; "
          f"profile {device.name}: {device.sources[0] if device.sources else ''}")

    real = CpuEngine(block_size=BLOCK, num_blocks=320, model=args.model)
    samples = measure(real, HELD_OUT, args.repeats, seed=7)
    sim_s = predict(model, device, [s.shape for s in samples])
    print(f"\n{'held-out shape':44} {'real ms':>9} {'sim ms':>9} {'sim/real':>9}")
    ratios = []
    for s, p in zip(samples, sim_s):
        ratios.append(p / s.seconds)
        print(f"{label(s.shape):44} {s.seconds * 1e3:9.2f} {p * 1e3:9.2f} {p / s.seconds:9.3f}")
    errs = [abs(r - 1) for r in ratios]
    print(f"step-time error: mean |sim/real - 1| = {100 * statistics.mean(errs):.1f}%, max {100 * max(errs):.1f}%, "
          f"geometric-mean ratio sim/real = {float(np.exp(np.mean(np.log(ratios)))):.3f}")

    prompt = np.random.default_rng(5).integers(0, 100_000, 3000).tolist()
    sim = create_engine("sim", block_size=BLOCK, num_blocks=320, model_profile=args.model,
                        device_profile=args.device_profile)
    n_chunks = -(-len(prompt) // 512)
    # per step, the fastest of 5 runs (the same rule as the step table: neighbours only ever add time)
    clock = time.thread_time if single_threaded() else time.perf_counter
    real_t = np.min([request_steps(real, prompt, 512, 64, clock) for _ in range(5)], axis=0)
    real_wall = np.min([request_steps(real, prompt, 512, 64) for _ in range(5)], axis=0)
    sim_t = request_steps(sim, prompt, 512, 64)

    def split(t: np.ndarray) -> tuple[float, float]:
        return float(t[:n_chunks].sum()), float(t[n_chunks:].sum())

    rt, rw, st = split(real_t), split(real_wall), split(sim_t)
    print("\none request, 3000-token prompt in 512-token chunks + 64 decode steps (real: per step, best of 5):")
    print(f"  real cpu engine ({clock_name}): TTFT {rt[0] * 1e3:.0f} ms, decode {rt[1] * 1e3:.0f} ms")
    print(f"  real cpu engine (wall clock): TTFT {rw[0] * 1e3:.0f} ms, decode {rw[1] * 1e3:.0f} ms")
    print(f"  sim, sleeping (wall clock):   TTFT {st[0] * 1e3:.0f} ms, decode {st[1] * 1e3:.0f} ms")
    print(f"  ratio sim/real ({clock_name}): TTFT {st[0] / rt[0]:.3f}, decode {st[1] / rt[1]:.3f}")

if __name__ == "__main__":
    main(ARGS)
