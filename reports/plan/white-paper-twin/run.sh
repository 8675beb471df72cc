#!/bin/bash
# the white paper's plan on the twin: S5000 prefill curves, H200 decode curves, the plan at 5.8M TPM, verified
WP=(--workload white-paper-agent --slo 'p50(ttft) <= 6000ms')
uptime; date
paasbench plan-curves --twin "${WP[@]}" --device-profile mtt-s5000 --pools prefill --context-buckets 64K,192K,400K -o s5000.json > s5000.log 2>&1 || echo "s5000 exit $?"
uptime; date
paasbench plan-curves --twin "${WP[@]}" --device-profile h200 --pools decode --decode-output 500 -o h200.json > h200.log 2>&1 || echo "h200 exit $?"
uptime; date
paasbench plan --traffic 5.8M "${WP[@]}" --prefill-curves s5000.json --decode-curves h200.json --verify --out plan > plan.log 2>&1 || echo "plan exit $?"
uptime; date
