"""``paasbench plan`` on the embedded twin, end to end and CI-sized: both probes on a one-prefill, one-decode twin of
the tiny model on this machine's fitted card (cpu-local, one card a machine), a plan for a ci-small traffic that two
prefill instances carry and one prefill instance cannot, and its verification -- the plan passes its SLO, one
prefill machine fewer and one decode machine fewer each fail (docs/plan.md, "Verification").

The traffic keeps clear of where an instance count flips: three quarters of what two instances of each pool carry
by the curves, but no more than four fifths of what two prefill and one decode carry. At three quarters alone (26.1
req/s, once the plan stopped charging for early turns) the traffic sat at the model's one-decode limit (decode
occupancy 1.0035 instances at that rate's mix, by reports/plan/ci-small-twin/verified-2026-12-06/tiny.json, where
2 + 1 instances carry 26.63 req/s of the 10 req/s mix), the plan
bought two decode instances, and one decode instance passed a 10 s window at p50 TPOT 27 ms against 30: a
verdict within the model's error, not a wrong plan.

Shapes and steps are small on purpose: the twin runs 5x slower than the card it models (``--sim-time-scale 5``) so
that the router's and the client's host time is a fifth of what it would be beside the modeled steps, and every
step is a few seconds. The decode probe runs at the three contexts the traffic decodes at (the default): measured at
3,264 alone, the curve scaled the streams an instance holds down by context past it, the plan bought two decode
instances where one held the traffic (p50 TPOT 27 ms against 30), and one decode machine fewer passed. The
acceptance figures (predicted capacity against verified, with full-length steps) are in
reports/plan/ (docs/plan.md, "Measured")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PAASBENCH = [sys.executable, "-c", "from paasbench.cli import main; main()"]
SLO = ["--slo", "p90(ttft) <= 300ms", "--slo", "p50(tpot) <= 30ms"]
CARD = ["--model-profile", "tiny", "--device-profile", "cpu-local", "--server-arg", "block_size=64",
        "--server-arg", "kv_store_gb=1"]

pytestmark = pytest.mark.timeout(600)


def paasbench(*args: str, timeout_s: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PAASBENCH, *args], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "COLUMNS": "200"})


def test_twin_probes_plan_and_verification(tmp_path: Path):
    curves = tmp_path / "tiny.json"
    res = paasbench("plan-curves", "--twin", "--workload", "ci-small", *CARD, "--sim-time-scale", "5", *SLO,
                    "--context-buckets", "3264", "--warmup", "2", "--step-duration", "8",
                    "--rate-steps", "1", "--decode-output", "32", "--decode-steps", "3", "--out", str(curves))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(curves.read_text())
    assert data["made_by"]["twin"]["sim_time_scale"] == 5.0 and data["made_by"]["twin"]["extra"] == {"kv_store_gb": "1"}
    point = data["pools"]["prefill"]["prefill"][0]
    assert point["service_s"] > 0 and point["busy_service_s"] > 0 and point["steps"]
    assert data["pools"]["decode"]["decode"][0]["max_active"] >= 2

    # the capacity of two instances of each pool, from the curves: plan at 3/4 of it
    from paasbench.plan import curves as curves_mod
    from paasbench.plan.sizing import plan_slo, with_instances
    from paasbench.plan.traffic import traffic_for
    from paasbench.metrics.slo import parse_gates
    from paasbench.sweep.source import Source

    c = curves_mod.load(curves)
    t = traffic_for(Source.from_workload("ci-small", None), "10 req/s")
    slo = plan_slo(parse_gates(SLO[1::2]))
    cap = with_instances(t, c.pool("prefill"), c.pool("decode"), slo, 2, 2)
    one_decode = with_instances(t, c.pool("prefill"), c.pool("decode"), slo, 2, 1)
    assert cap > 5.0 and one_decode > 5.0
    rps = round(min(0.75 * cap, 0.8 * one_decode), 2)
    res = paasbench("plan", "--traffic", f"{rps} req/s", "--workload", "ci-small", *SLO, "--curves", str(curves),
                    "--verify", "--verify-warmup", "3", "--verify-duration", "10", "--no-verify-capacity",
                    "--out", str(tmp_path / "plan"))
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    pools = {p["role"]: p["instances"] for p in plan["plan"]["pools"]}
    assert pools["prefill"] == 2 and pools["decode"] in (1, 2), res.stdout
    v = plan["verify"]
    runs = {r["role"]: r for r in v["runs"]}
    assert runs["planned"]["passed"], res.stdout + res.stderr
    prefill_fewer, decode_fewer = runs["one prefill machine fewer"], runs["one decode machine fewer"]
    assert not prefill_fewer["passed"] and "skipped" not in prefill_fewer, res.stdout   # 1 prefill instance, run
    assert not decode_fewer["passed"], res.stdout       # run, or (1 decode instance planned) no such deployment
    assert runs["planned"]["primed"]["requests"] > 0 and runs["planned"]["server_hit"] > 0.8
    assert res.returncode == 0 and v["plan_passes"] and v["fewer_fail"]
    assert "Verification on the twin" in (tmp_path / "plan" / "plan.md").read_text()
