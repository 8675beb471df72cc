"""A stand-in for ``paasbench run`` in the client probe's tests: a client whose CPU in each phase is known.

It spends ``FAKE_LAUNCH_CPU_S`` of CPU before its first request and ``FAKE_EXPORT_CPU_S`` after its last response
(what imports and the summary's export cost a real run), and ``FAKE_WORK_CPU_S`` of CPU on each response (then
``FAKE_GAP_S`` asleep before the next request), one request at a time over one keep-alive connection to the probe
target. It writes what it
measured of itself (``time.process_time``, ``time.monotonic``) to ``OUT/truth.json`` and a summary with the fields
the probe reads to ``OUT/summary.json``. Only the closed-loop run (``--concurrency``) spends the phase costs.

    python tests/probe_fake_client.py run --target URL --out DIR --max-requests N [--concurrency C] [...]
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from pathlib import Path


IDLE_S = 0.2


def burn(cpu_s: float) -> None:
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass


def main(argv: list[str]) -> None:
    argv = [a for a in argv if a != "--no-live"]   # "run", then --flag value pairs (--no-live has no value)
    args = dict(zip(argv[1::2], argv[2::2]))
    closed = "--concurrency" in args
    env = lambda name: float(os.environ.get(name) or 0) if closed else 0.0
    out = Path(args["--out"])
    out.mkdir(parents=True, exist_ok=True)
    host, port = args["--target"].removeprefix("http://").split(":")
    n = int(args["--max-requests"])
    burn(env("FAKE_LAUNCH_CPU_S"))
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps({"model": "probe", "prompt": "a b c", "max_tokens": 4})
    truth: dict[str, float] = {"first_send_monotonic": time.monotonic(), "cpu_before_first_send": time.process_time()}
    for i in range(n):
        conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        # sent: the client waits for the answer, spending nothing, until the target has written it
        if i == 0:
            truth["cpu_after_first_send"] = time.process_time()
        if i == n - 1:
            truth["cpu_after_last_send"] = time.process_time()
        resp = conn.getresponse().read()
        assert resp.endswith(b"data: [DONE]\n\n"), resp[-80:]
        if i == 0:
            truth["first_response_monotonic"] = time.monotonic()
        burn(env("FAKE_WORK_CPU_S"))                  # what a client does with a response: the last one too
        if i < n - 1:
            time.sleep(env("FAKE_GAP_S"))
    conn.close()                                      # as a run closes its session once every stream is done
    truth["cpu_after_close"] = time.process_time()
    time.sleep(IDLE_S)                                # idle while the target reads our CPU: no race in the truth
    truth["export_start_monotonic"] = time.monotonic()
    burn(env("FAKE_EXPORT_CPU_S"))
    (out / "truth.json").write_text(json.dumps(truth))
    (out / "summary.json").write_text(json.dumps({"error_rate": 0.0, "schedule_lag_ms": {"p50": 0.0, "p90": 0.0,
                                                                                          "p99": 0.0}}))


if __name__ == "__main__":
    main(sys.argv[1:])
