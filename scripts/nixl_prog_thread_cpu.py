"""CPU seconds one idle NIXL agent burns, its progress thread on vs off (issue #22; run with vLLM's python).

vLLM's NixlConnector makes its agent with ``nixl_agent_config(num_threads=4, capture_telemetry=True)``, the
progress thread on; ``serve --engine vllm --device cpu`` turns it off (reference_server/vllm_connectors.py).
This makes the same agent (UCX backend) both ways, alternately, and prints the CPU time each used while idle.

    VENV/bin/python scripts/nixl_prog_thread_cpu.py [--rounds 2] [--idle-s 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
import uuid


_KEEP: list[object] = []


def one(prog_thread: bool, idle_s: float) -> float:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(enable_prog_thread=prog_thread, num_threads=4,
                                                            capture_telemetry=True))
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(idle_s)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    _KEEP.append(agent)              # alive until the process ends (tearing one down mid-progress can crash)
    return r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)   # a child: one agent
    a = ap.parse_args()
    if a.one:
        print(f"{one(a.one == 'on', a.idle_s):.3f}", flush=True)
        os._exit(0)                  # no teardown of the agent's threads: only the figure matters
    for _ in range(a.rounds):        # each agent in a fresh process, so one's threads do not bill the other
        for mode in ("on", "off"):
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--idle-s", str(a.idle_s)],
                                 capture_output=True, text=True, check=True).stdout.split()[-1]
            print(f"progress thread {mode}: {float(out):.2f} CPU s in {a.idle_s:g} s idle", flush=True)


if __name__ == "__main__":
    main()
