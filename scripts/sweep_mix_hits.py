#!/usr/bin/env python3
"""The traffic-side prefix hit of a rate-axis sweep step's window, by load: the first ``n`` requests of the step's
trace against the steady-state lanes the sweep sends (``paasbench.sweep.mix``). docs/sweep.md, "The same workload
mix at every load", quotes its output (and the trace's mean turn gap, which sets the lanes); nothing is sent to a server.

    python scripts/sweep_mix_hits.py --workload ci-small --warmup 3 --duration 15 --rates 0.5,1,2,4,8,16,32
"""

from __future__ import annotations

import argparse

from paasbench.metrics.verify import traffic_hit
from paasbench.sweep.mix import sessions_of, turn_gap_s
from paasbench.sweep.source import Source
from paasbench.sweep.step import StepPlan, conditioned_poisson, conditioned_times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--bucket", type=int, help="context bucket in tokens (e.g. 65536)")
    ap.add_argument("--warmup", type=float, required=True)
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--rates", required=True, help="comma-separated req/s")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    source = Source.from_workload(a.workload, a.seed)
    gap = turn_gap_s(sessions_of(source.trace_for(a.bucket, requests=256)))
    print(f"mean gap between a session's turns: {gap:.2f} s\nreq/s\tfirst n\tlanes")
    for rate in (float(x) for x in a.rates.split(",")):
        plan = StepPlan("rate", a.warmup, a.duration, a.seed).for_load(rate)
        # the trace the sweep gives the step (StepPlan.trace: 3x its requests + 64, the sessions its lanes need)
        trace = plan.trace(source, a.bucket, plan.trace_size(rate), rate)
        times = conditioned_times(rate, plan.total_s, a.seed)
        n = len(times)
        in_window = [plan.window[0] <= t < plan.window[1] for t in times]
        head = trace.requests[:n]
        first_n = traffic_hit(head, in_window[:len(head)], trace.block_size)
        sent = conditioned_poisson(trace, rate, plan.total_s, a.seed, plan.window)     # what the step plans
        lanes = traffic_hit(sent.requests, [plan.window[0] <= r.arrival_ms / 1e3 < plan.window[1]
                                            for r in sent.requests], trace.block_size)
        print(f"{rate:g}\t{100 * first_n:.1f}%\t{100 * lanes:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
