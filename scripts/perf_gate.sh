#!/usr/bin/env bash
# The perf-gate workflow's steps (.github/workflows/perf-gate.yml), runnable locally and from .ci/run:
#   1. a CI-sized sweep on the embedded reference server (writes OUT/sweep.json, report.html, report.md),
#   2. the gate: the sweep's SLO and regression against the committed baseline, with the workflow's tolerances.
#
#   scripts/perf_gate.sh            # full: sweep + gate (a few minutes on 2 cores)
#   scripts/perf_gate.sh --quick    # no sweep: render + gate the committed baseline against itself (seconds);
#                                   # checks the report/gate commands and the baseline file, not performance
#
# Env: PERF_OUT (default runs/perf-gate), PERF_TOLERANCE (default 35%, as in the workflow), PERF_TIME_BUDGET (s).
# Exit: 0 pass, 99 SLO breach or regression, 2 bad input, 1 the sweep itself failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${PERF_OUT:-runs/perf-gate}
TOL=${PERF_TOLERANCE:-35%}
BASELINE=reports/baseline/ci-small.json
gate_args=(--tolerance "$TOL" --metric-tolerance max_input_tpm=50% --metric-tolerance ttft_ms.p99=50% --metric-tolerance itl_ms.p90=50%)

if [ "${1:-}" = "--quick" ]; then
  mkdir -p "$OUT"
  paasbench report "$BASELINE" -o "$OUT" || exit $?
  paasbench gate --baseline "$BASELINE" --current "$BASELINE" "${gate_args[@]}" --markdown "$OUT/gate.md" >/dev/null || exit $?
  echo "perf-gate (quick): report and gate OK -> $OUT/report.html"
  exit 0
fi

sweep_rc=0
paasbench sweep --workload ci-small --out "$OUT" --time-budget "${PERF_TIME_BUDGET:-900}" || sweep_rc=$?
if [ ! -f "$OUT/sweep.json" ]; then
  echo "perf-gate: the sweep wrote no sweep.json (exit $sweep_rc)" >&2
  if [ "$sweep_rc" -ne 0 ]; then exit "$sweep_rc"; fi
  exit 1                                   # a "successful" sweep with nothing to gate is not a pass
fi
gate_rc=0
paasbench gate --baseline "$BASELINE" --current "$OUT" "${gate_args[@]}" --markdown "$OUT/gate.md" || gate_rc=$?
echo "perf-gate: sweep exit $sweep_rc, gate exit $gate_rc; report: $OUT/report.html"
if [ "$sweep_rc" -ne 0 ]; then exit "$sweep_rc"; fi
exit "$gate_rc"
