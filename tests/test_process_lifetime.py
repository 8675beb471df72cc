"""Nothing outlives the command that started it (paas_common.lifetime).

Per entry point -- ``python -m reference_server``, ``paasbench serve``, ``paasbench sweep`` with its
embedded server -- the top process is killed (SIGKILL: no chance to clean up; SIGTERM/SIGINT: the
clean stop) and within 5 s every process of its tree is gone and every port it listened on is free,
checked by the pids and ports the tree printed itself. The two mechanisms are also tested alone: the
lifeline pipe (what other platforms and non-main-thread children get) and the start-up check for a
parent that died before the parent-death signal was armed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from proctree import Lines, alive, cleanup, port_free, sweep_server_tree, wait_gone

from paas_common.lifetime import ENV, ORPHANED_EXIT

PY = sys.executable
ENTRY = {"module": [PY, "-m", "reference_server"],
         "serve": [PY, "-c", "from paasbench.cli import main; main()", "serve"]}
SERVER = ["--port", "0", "--mode", "disaggregated", "--workers", "2", "--block-size", "64", "--kv-transport", "tcp"]
SWEEP = [PY, "-c", "from paasbench.cli import main; main()", "sweep", "--workload", "ci-small",
         "--slo", "p50(ttft) <= 60s", "--start", "1", "--max-steps", "1", "--warmup", "0.5", "--step-duration", "2",
         "--bisect-steps", "0", "--context-buckets", "none"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------------------- the mechanisms alone

def test_lifeline_alone_takes_a_child_whose_parent_was_killed():
    # The middle process starts its child from a non-main thread, so the child does not arm the
    # parent-death signal (the kernel would fire it when that thread ends): only the pipe holds it.
    middle = textwrap.dedent("""
        import subprocess, sys, threading, time
        from paas_common.lifetime import tether
        def start():
            t = tether()
            code = "from paas_common.lifetime import die_with_parent; die_with_parent(); import time; time.sleep(120)"
            p = subprocess.Popen([sys.executable, "-c", code], **t.popen_kwargs())
            print(p.pid, int(t.pdeathsig), flush=True)
        th = threading.Thread(target=start); th.start(); th.join()
        time.sleep(120)
    """)
    proc = subprocess.Popen([PY, "-c", middle], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        m = Lines(proc).until(r"^(\d+) (\d)$", 30)
        child, pdeathsig = int(m.group(1)), m.group(2)
        assert pdeathsig == "0" and alive(child)
        time.sleep(0.5)                                  # the child is past its start-up check
        assert alive(child)
        proc.kill()
        proc.wait()
        assert wait_gone([child], 5.0) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_child_whose_parent_died_before_it_armed_the_signal_exits_at_once():
    r, w = os.pipe()
    try:
        # The tether names a parent that is not this child's parent any more (the race: the parent
        # died between the fork and prctl, and the child was re-parented).
        env = {**_env(), ENV: f"{os.getpid() + 10**6}:{r}:1"}
        res = subprocess.run([PY, "-c", "from paas_common.lifetime import die_with_parent; die_with_parent(); "
                                        "import time; time.sleep(60)"], env=env, pass_fds=(r,), timeout=30)
        assert res.returncode == ORPHANED_EXIT
    finally:
        os.close(r)
        os.close(w)


# ---------------------------------------------------------------------------- the entry points

@pytest.mark.parametrize("entry,sig", [("module", signal.SIGKILL), ("serve", signal.SIGKILL),
                                       ("serve", signal.SIGTERM), ("module", signal.SIGINT)],
                         ids=["module-SIGKILL", "serve-SIGKILL", "serve-SIGTERM", "module-SIGINT"])
def test_server_tree_goes_with_its_router(entry, sig):
    proc = subprocess.Popen(ENTRY[entry] + SERVER, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())
    pids: list[int] = []
    try:
        lines = Lines(proc)
        procs = json.loads(lines.until(r"^PROCS (.*)$", 120).group(1))
        lines.until(r"^READY ", 60)
        assert {"router", "prefill-0", "decode-0"} <= set(procs) and procs["router"]["pid"] == proc.pid
        pids += [p["pid"] for p in procs.values()]
        ports = [port for p in procs.values() for port in p["ports"]]
        assert len(ports) >= 4                            # HTTP + 2 control ports + the decode worker's KV port
        assert all(alive(p) for p in pids) and not any(port_free(p) for p in ports)
        proc.send_signal(sig)
        code = proc.wait(timeout=5)
        assert wait_gone(pids, 5.0) == []
        assert [p for p in ports if not port_free(p)] == []
        if sig != signal.SIGKILL:
            assert code == 0, "\n".join(lines.seen)     # a clean stop
    finally:
        cleanup(proc, pids)


def test_sweep_killed_takes_its_embedded_server_and_resume_starts_clean(tmp_path):
    out = tmp_path / "resume"
    proc = subprocess.Popen(SWEEP + ["--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env())
    pids: list[int] = []
    try:
        lines = Lines(proc)
        tree, ports = sweep_server_tree(lines.until(r"embedded server .* pids: ", 120).string)
        pids += [proc.pid, *tree.values()]
        assert {"router", "prefill-0", "decode-0"} <= set(tree)
        deadline = time.monotonic() + 60
        while not (out / "step-000").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)                                   # mid-step: the server is under load
        assert all(alive(p) for p in pids), "\n".join(lines.seen)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_gone(pids, 5.0) == []                 # before: the router and its workers lived on
        assert [p for p in ports if not port_free(p)] == []
    finally:
        cleanup(proc, pids)

    res = subprocess.run(SWEEP + ["--out", str(out), "--resume"], capture_output=True, text=True, timeout=120,
                         env=_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((out / "sweep.json").read_text())["status"] == "done"
    line = next(ln for ln in res.stdout.splitlines() if "pids: " in ln)
    again, _ = sweep_server_tree(line)
    assert not set(again.values()) & set(tree.values())
    assert wait_gone(list(again.values()), 5.0) == []     # and the resumed sweep's server went with it

