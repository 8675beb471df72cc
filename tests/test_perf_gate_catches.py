"""The twin gate catches a regression in a real code path, seen through its own measurement.

``--debug-step-slowdown`` multiplies the twin's modeled step time by 1.1: the very figure the gate holds to 5%, so
catching it only shows the gate's arithmetic. ``--debug-reuse-shortfall 1`` instead breaks the KV path the way an
off-by-one would: every allocation reuses one cached block fewer than it matched, so the engine computes those
64 tokens again. Nothing multiplies any figure: the modeled prefill grows only because the twin's cost model
charges the extra tokens it was really given, and the prefix hit falls because the server's usage counts what it
really reused. The probe is the A/B's twin probe (``paasbench.gate.ab.PROBES``) at concurrency 1, judged by
``paasbench gate`` with the perf gate's twin tolerance (5%).
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from paasbench.cli import main
from paasbench.gate.ab import PROBES
from reference_server.launcher import EmbeddedServer

REQUESTS = "8"


def probe_run(out, extra: list[str]) -> dict:
    with EmbeddedServer([*PROBES["twin"], *extra], startup_timeout_s=90) as server:
        res = CliRunner().invoke(main, ["run", "--target", server.url, "--workload", "ci-small", "--concurrency", "1",
                                        "--max-requests", REQUESTS, "--out", str(out), "--no-live"])
    assert res.exit_code == 0, res.output
    return json.loads((out / "summary.json").read_text())


def test_twin_gate_fails_a_kv_reuse_regression(tmp_path):
    base = probe_run(tmp_path / "a", [])
    slow = probe_run(tmp_path / "b", ["--debug-reuse-shortfall", "1"])
    # The regression is real work: fewer tokens reused (the server's own count), more prefill tokens modeled.
    assert slow["prefix_hit_ratio"] < base["prefix_hit_ratio"]
    res = CliRunner().invoke(main, ["gate", "--baseline", str(tmp_path / "a"), "--current", str(tmp_path / "b"),
                                    "--paired", "--tolerance", "5%", "--metric", "modeled_ttft_ms.p50",
                                    "--metric", "modeled_tpot_ms.p50", "--markdown", str(tmp_path / "gate.md")])
    assert res.exit_code == 99, res.output
    rows = {line.split("|")[1].strip(): line for line in (tmp_path / "gate.md").read_text().splitlines()
            if line.startswith("| modeled")}
    assert "regression" in rows["modeled TTFT p50 (ms)"]      # the prefill computed the dropped block again
    assert "regression" not in rows["modeled TPOT p50 (ms)"]  # decode untouched: the gate names the right figure
