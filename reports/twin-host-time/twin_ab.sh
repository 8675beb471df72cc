#!/bin/bash
# Before vs after: one sim twin server (GLM-5.2-FP8 x MTT S5000) from each of two checkouts in turn, the same bounded
# run against each (30 requests of 16K tokens, 1 req/s, 128 output tokens), two rounds; prints wall vs modeled p50s.
#   reports/twin-host-time/twin_ab.sh BEFORE_CHECKOUT AFTER_CHECKOUT OUT_DIR     (python: the dev venv's, on PATH)
set -u
mkdir -p "$3"; base=$(cd "$1" && pwd); new=$(cd "$2" && pwd); out=$(cd "$3" && pwd)
for round in 1 2; do
for side in before after; do
  if [ $side = before ]; then root=$base; else root=$new; fi
  cd $root; export PYTHONPATH=$root
  log=$out/$side-$round.server.log
  python -c "from paasbench.cli import main; main()" serve --engine sim --model-profile glm-5.2-fp8 --device-profile mtt-s5000 --port 0 > $out/$side-$round.ready 2> $log &
  pid=$!
  for i in $(seq 1 120); do grep -q READY $out/$side-$round.ready && break; sleep 1; done
  url=$(grep READY $out/$side-$round.ready | awk '{print $2}')
  load=$(cut -d' ' -f1 /proc/loadavg)
  rm -rf $out/$side-$round
  python -c "from paasbench.cli import main; main()" run --target $url --mode constant --rate 1 --max-requests 30 --isl 16384 --osl 128 --prompt-format token-ids --out $out/$side-$round --no-live > $out/$side-$round.run.log 2>&1
  kill -TERM $pid; wait $pid 2>/dev/null
  python - $out/$side-$round $side $round $load <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1]); s = json.loads((d / "summary.json").read_text())
p = lambda k: s[k]["p50"]
print(f"{sys.argv[2]:6} round {sys.argv[3]} load {sys.argv[4]}: TTFT wall {p('ttft_ms'):.0f} modeled {p('modeled_ttft_ms'):.0f} ms; "
      f"TPOT wall {p('tpot_ms'):.1f} modeled {p('modeled_tpot_ms'):.1f} ms; E2E wall {p('e2e_ms'):.0f} modeled {p('modeled_e2e_ms'):.0f} ms; "
      f"host_bound_share {s.get('host_bound_share')}", flush=True)
PY
done; done
