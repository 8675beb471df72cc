#!/bin/bash
# ci-small on the twin at the traffic ../verified-2026-12-06 planned (24.33 req/s), on its curves, verified with each
# session's turn sent after the turn it follows (b8b86d0); 60 s windows
set -e
SLO=(--slo 'p90(ttft) <= 300ms' --slo 'p50(tpot) <= 30ms')
cp ../verified-2026-12-06/tiny.json .
uptime; date
paasbench plan --traffic "24.33 req/s" --workload ci-small "${SLO[@]}" --curves tiny.json --verify \
    --verify-warmup 3 --verify-duration 60 --out plan > plan.log 2>&1 || echo "plan exit $?"
uptime; date
