"""How well the sim (cpu-local profile) predicts the real cpu engine on shapes the fit never saw.

    python benchmarks/bench_sim_vs_real.py [--device-profile cpu-local] [--repeats 7]

Prints, per held-out step shape, the real engine's step time (fastest of interleaved repeats), the
sim's modeled time and their ratio; then one whole request (chunked prefill + decode) timed on the
real engine and on the sleeping sim engine, wall clock against wall clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from reference_server.engine import SeqStep, create_engine
from reference_server.engine.cpu import CpuEngine
from reference_server.sim.calibrate import BLOCK, HELD_OUT, label, measure
from reference_server.sim.fit import predict
from reference_server.sim.profiles import load_device_profile, load_model_profile


def request_wall(engine, prompt: list[int], chunk: int, decode_steps: int) -> tuple[float, float]:
    """(TTFT, decode seconds) of one request run alone through ``engine``."""
    table = list(range(-(-(len(prompt) + decode_steps) // BLOCK)))
    t0 = time.perf_counter()
    for s in range(0, len(prompt), chunk):
        tok = engine.step([SeqStep("r", prompt[s:s + chunk], s, table)])[0]
    ttft = time.perf_counter() - t0
    for i in range(decode_steps):
        tok = engine.step([SeqStep("r", [tok], len(prompt) + i, table)])[0]
    return ttft, time.perf_counter() - t0 - ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device-profile", default="cpu-local")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    model, device = load_model_profile(args.model), load_device_profile(args.device_profile)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; profile {device.name}: "
          f"{device.sources[0] if device.sources else ''}")

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
    request_wall(real, prompt[:600], 512, 4)  # warm-up
    best_real = min((request_wall(real, prompt, 512, 64) for _ in range(3)), key=sum)
    sim_wall = request_wall(sim, prompt, 512, 64)
    print(f"\none request, 3000-token prompt in 512-token chunks + 64 decode steps (wall clock, best of 3 for real):")
    print(f"  real cpu engine: TTFT {best_real[0] * 1e3:.0f} ms, decode {best_real[1] * 1e3:.0f} ms")
    print(f"  sim (sleeping):  TTFT {sim_wall[0] * 1e3:.0f} ms, decode {sim_wall[1] * 1e3:.0f} ms")
    print(f"  ratio sim/real:  TTFT {sim_wall[0] / best_real[0]:.3f}, decode {sim_wall[1] / best_real[1]:.3f}")


if __name__ == "__main__":
    main()
