#!/bin/bash
# ci-small on the twin: curves, plan at 3/4 of what 2 + 2 instances carry by them, verification with 60 s windows
set -e
SLO=(--slo 'p90(ttft) <= 300ms' --slo 'p50(tpot) <= 30ms')
CARD=(--model-profile tiny --device-profile cpu-local --server-arg block_size=64 --server-arg kv_store_gb=1)
uptime
paasbench plan-curves --twin --workload ci-small "${CARD[@]}" --sim-time-scale 5 "${SLO[@]}" --context-buckets 3264 \
    --warmup 2 --step-duration 8 --rate-steps 1 --decode-output 32 --decode-steps 3 --out tiny.json > curves.log 2>&1
RPS=$(python - <<'PY'
from paasbench.plan import curves
from paasbench.plan.sizing import plan_slo, with_instances
from paasbench.plan.traffic import traffic_for
from paasbench.metrics.slo import parse_gates
from paasbench.sweep.source import Source
c = curves.load("tiny.json")
t = traffic_for(Source.from_workload("ci-small", None), "10 req/s")
cap = with_instances(t, c.pool("prefill"), c.pool("decode"), plan_slo(parse_gates(["p90(ttft) <= 300ms", "p50(tpot) <= 30ms"])), 2, 2)
print(round(0.75 * cap, 2))
PY
)
echo "traffic: $RPS req/s (3/4 of 2 + 2 instances by the curves)"
uptime
paasbench plan --traffic "$RPS req/s" --workload ci-small "${SLO[@]}" --curves tiny.json --verify \
    --verify-warmup 3 --verify-duration 60 --out plan > plan.log 2>&1 || echo "plan exit $?"
uptime
