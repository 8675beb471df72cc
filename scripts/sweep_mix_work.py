#!/usr/bin/env python3
"""What a rate-axis sweep step's window asks of the server, seed by seed: its mean output tokens (the decode side's
work), its traffic-side hit (the prefill side's) and, on the twin, the roofline bound over exactly those requests
(``reference_server.sim.capacity``). Seeds whose windows differ in these measure different workloads; the steady mix
draws each window to hold the workload's (``paasbench.sweep.mix``). docs/sweep.md, "The same workload mix at every
load", quotes its output; nothing is sent to a server.

    python scripts/sweep_mix_work.py --workload white-paper-agent --bucket 65536 --rate 3 --seeds 1-12
"""

from __future__ import annotations

import argparse

import numpy as np

from paasbench.metrics.verify import traffic_hit
from paasbench.sweep.embedded import server_args
from paasbench.sweep.source import Source
from paasbench.sweep.step import StepPlan, conditioned_poisson
from paasbench.trace.inspect import prefix_hits
from paasbench.trace.model import Trace
from reference_server.options import parse_flags, server_config
from reference_server.sim.capacity import RequestWork, estimate_capacity


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--bucket", type=int, help="context bucket in tokens (e.g. 65536)")
    ap.add_argument("--rate", type=float, required=True, help="req/s")
    ap.add_argument("--seeds", default="1-12", help="first-last")
    ap.add_argument("--response-s", type=float, default=5.0, help="the target's mean E2E near the rate (lanes)")
    a = ap.parse_args(argv)
    first, last = (int(x) for x in a.seeds.split("-"))
    print("seed\tout\thit\tbound req/s")
    outs, bounds = [], []
    for seed in range(first, last + 1):
        source = Source.from_workload(a.workload, seed)
        sweep = source.sweep_defaults        # the step the sweep would run (StepPlan.for_load: its window)
        plan = StepPlan("rate", float(sweep.get("warmup_s", 3.0)), float(sweep.get("duration_s", 15.0)), seed,
                        int(sweep.get("window_requests", 0)), a.response_s).for_load(a.rate)
        trace = plan.trace(source, a.bucket, plan.trace_size(a.rate), a.rate)
        sent = conditioned_poisson(trace, a.rate, plan.total_s, seed, plan.window, a.response_s).requests
        window = [plan.window[0] <= r.arrival_ms / 1e3 < plan.window[1] for r in sent]
        hits, _ = prefix_hits(Trace(sent, block_size=trace.block_size))   # infinite cache, in send order
        work = [RequestWork(r.input_length, int(h), r.output_length) for r, h, w in zip(sent, hits, window) if w]
        est = estimate_capacity(server_config(parse_flags(server_args(source.server))), work)
        outs.append(float(np.mean([w.output_tokens for w in work])))
        bounds.append(est.rps if est is not None else float("nan"))
        print(f"{seed}\t{outs[-1]:.0f}\t{100 * traffic_hit(sent, window, trace.block_size):.1f}%\t{bounds[-1]:.3f}")
    print(f"mean output tokens {min(outs):.0f}-{max(outs):.0f}; roofline bound {min(bounds):.2f}-{max(bounds):.2f} req/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
