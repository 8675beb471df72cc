#!/bin/bash
# the white paper's plan at 5.8M TPM, verified with each session's turn sent after the turn it follows (b8b86d0),
# on the curves ../busy-floor measured (the probes send no sessions: the lanes do not change them)
set -e
WP=(--workload white-paper-agent --slo 'p50(ttft) <= 6000ms')
cp ../busy-floor/s5000.json ../busy-floor/h200.json .
uptime; date
paasbench plan --traffic 5.8M "${WP[@]}" --prefill-curves s5000.json --decode-curves h200.json --verify --out plan > plan.log 2>&1 || echo "plan exit $?"
uptime; date
