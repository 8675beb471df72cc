"""One white-paper 64K rate step per ``RATE:RESPONSE_S`` on the embedded twin: how many sessions it played, and how
much of its window the runner sent other than planned (``mix.lanes_wanted``; docs/sweep.md, "Sessions in flight
follow the target's answer time").

Why: a step whose sessions are all busy when a send time comes sends the first turn of a session planned later in
its place (``paasbench.load.schedule.Turns``), so the window holds more first turns (each a miss past the shared
prefix) than its mix, and near the plan's end sends wait for their sessions. This prints, per step, the first turns
planned for the window and those sent in it, the window requests that waited over 0.25 s for their session, and the
window's traffic-side hit against the workload's. ``RESPONSE_S`` is the mean E2E the lanes are sized with
(``StepPlan.response_s``; 0: the trace's turn gap alone).

    python benchmarks/step_lanes.py --out runs/step-lanes 2.646:13.6 2.646:17.65   # about 6 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paasbench.metrics import slo  # noqa: E402
from paasbench.metrics.records import read_records  # noqa: E402
from paasbench.sweep.embedded import embedded_server, prime_concurrency, server_section  # noqa: E402
from paasbench.sweep.settings import step_client  # noqa: E402
from paasbench.sweep.source import Source, fresh_prefixes, parse_buckets  # noqa: E402
from paasbench.sweep.step import StepPlan, run_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="+", metavar="RATE:RESPONSE_S")
    ap.add_argument("--bucket", default="64K")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="runs/step-lanes")
    a = ap.parse_args()
    source = Source.from_workload("white-paper-agent", a.seed)
    bucket = parse_buckets(a.bucket)[0]
    sweep = source.sweep_defaults
    base = StepPlan("rate", float(sweep["warmup_s"]), float(sweep["duration_s"]), seed=a.seed,
                    window_requests=int(sweep["window_requests"]))
    gates = slo.parse_gates(source.slo)
    section = server_section(source.server, source.max_context_tokens())
    client = step_client({"prompt_format": "auto", "target": None, "api": None, "model": None, "api_key": None},
                         {"warmup_s": base.warmup_s, "step_duration_s": base.duration_s}, section)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with embedded_server(section) as srv:
        client = dataclasses.replace(client, target=srv.url)
        for i, case in enumerate(a.cases):
            rate, response = (float(x) for x in case.split(":"))
            plan = dataclasses.replace(base.for_load(rate), response_s=response)
            trace = fresh_prefixes(plan.trace(source, bucket, plan.trace_size(rate), rate), 100 + i)
            sent, _ = plan.schedule(trace, rate)
            planned = [r for r in sent.requests if plan.warmup_s <= r.arrival_ms / 1e3 < plan.total_s]
            step_dir = out / f"{i}-{rate:g}-{response:g}"
            entry = run_step(trace, plan, rate, client, step_dir, gates=gates, meta={},
                             prime_concurrency=prime_concurrency(section))
            window = [r for r in read_records(step_dir / "records.jsonl")
                      if plan.warmup_s <= r.intended_send_s < plan.total_s]
            summ = entry["summary"]
            print(json.dumps({
                "rate": rate, "response_s": response, "lanes": entry["lanes"], "passed": entry["passed"],
                "reasons": entry["saturation"].get("reasons"),
                "first_turns_planned": sum((r.turn or 0) == 0 for r in planned), "planned": len(planned),
                "first_turns_sent": sum((r.turn or 0) == 0 for r in window), "sent": len(window),
                "waited": sum((r.turn_wait_s or 0) > 0.25 for r in window),
                "traffic_hit": entry["traffic_hit_ratio"], "workload_hit": entry["target_hit_ratio"],
                "ttft_p50_ms": (summ.get("ttft_ms") or {}).get("p50"),
                "e2e_mean_ms": (summ.get("e2e_ms") or {}).get("mean"),
                "primed": entry["primed"], "wall_s": round(entry["wall_s"], 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
