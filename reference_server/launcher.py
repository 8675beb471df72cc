"""Run the reference server as a child process tree, for the sweep and for tests.

``EmbeddedServer`` starts ``python -m reference_server --port 0 ...`` in its own process group,
waits for its ``READY http://HOST:PORT`` line and for ``/health`` to say it serves, and on exit stops the whole
group (router and every worker): SIGTERM, then SIGKILL after a grace period. The server is tethered
to the process that started it (:mod:`paas_common.lifetime`), and its workers to it, so a SIGKILLed
caller or router leaves no orphans either. The ``PROCS`` line the server prints before READY names
every process of its tree with its ports (``.procs``): what a test checks is gone after a kill.

Ready means serving: ``/health`` answers 200, ``ok`` or ``degraded`` (a worker down or restarting, requests still
served). ``unavailable`` (503: no decode worker up) is not ready: a worker that died at start leaves the server
there, and a sweep would measure refusals. The one caller who wants that state is a router whose decode workers
join from other hosts (``--decode-workers 0``): it has none until they join, after it started, so it asks
``until="answering"``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Any, Sequence

from paas_common.lifetime import tether


class ServerStartError(RuntimeError):
    pass


UNTIL = ("serving", "answering")   # /health ok or degraded; any /health answer (unavailable too)


class EmbeddedServer:
    def __init__(self, args: Sequence[str] = (), *, startup_timeout_s: float = 120.0, python: str | None = None,
                 env: dict[str, str] | None = None, until: str = "serving") -> None:
        if until not in UNTIL:
            raise ValueError(f"until must be one of {', '.join(UNTIL)}, got {until!r}")
        args = list(args)
        if "--port" not in args and not any(a.startswith("--port=") for a in args):
            args += ["--port", "0"]     # the server binds a free port and names it on its READY line
        self.args = args
        self.startup_timeout_s = startup_timeout_s
        self.python = python or sys.executable
        self.env = env
        self.until = until
        self.url: str = ""
        self.proc: subprocess.Popen[str] | None = None
        self.log: deque[str] = deque(maxlen=200)    # last lines of the server's output, for error messages
        self.procs: dict[str, dict[str, Any]] = {}  # name -> {"pid", "ports"}, from the PROCS line

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "EmbeddedServer":
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Its own session, so a terminal's Ctrl-C reaches only us and we stop it in order; tethered, so
        # it still dies with us when we are SIGKILLed (the tree then unwinds from the router down).
        self.proc = subprocess.Popen([self.python, "-m", "reference_server", *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     **tether().popen_kwargs(env))
        ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready.wait(0.1):
            if self.proc.poll() is not None:
                self.stop()
                raise ServerStartError(f"reference server exited with {self.proc.returncode}:\n" + "\n".join(self.log))
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"reference server not ready after {self.startup_timeout_s:.0f}s:\n"
                                       + "\n".join(self.log))
        while True:   # READY is printed after the socket is bound; wait for /health to say it serves
            if self.proc.poll() is not None:
                self.stop()
                raise ServerStartError(f"reference server exited with {self.proc.returncode}:\n" + "\n".join(self.log))
            state = self._health_state()
            if state in ("ok", "degraded") or (self.until == "answering" and state != "no answer"):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"reference server printed READY but its /health says {state} after "
                                       f"{self.startup_timeout_s:.0f}s:\n" + "\n".join(self.log))
            time.sleep(0.1)

    def _health_state(self) -> str:
        """``/health``'s ``status`` (ok, degraded, unavailable), or ``no answer``."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                body = r.read()
        except urllib.error.HTTPError as exc:   # 503 carries the state too
            body = exc.read()
        except OSError:
            return "no answer"
        try:
            return str(json.loads(body).get("status") or "no status")
        except (ValueError, AttributeError):
            return "no status"

    def _pump(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.log.append(line)
            if line.startswith("PROCS ") and not ready.is_set():
                self.procs = json.loads(line.split(" ", 1)[1])
            elif not ready.is_set() and line.startswith("READY "):
                self.url = line.split(" ", 1)[1].strip()
                ready.set()

    def stop(self, grace_s: float = 10.0) -> None:
        proc = self.proc
        if proc is None:
            return
        pgid = proc.pid   # start_new_session: the group id is the router's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:   # anything still in the group (a stuck worker) is killed outright
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)
        deadline = time.monotonic() + 2.0   # let the kernel finish the kills before we report stopped
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        if proc.stdout is not None:
            proc.stdout.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> "EmbeddedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
