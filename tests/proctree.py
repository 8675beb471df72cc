"""Is a process tree gone? Checked by the pids and ports the tree recorded itself, never by name.

A zombie counts as gone: it holds no CPU, memory or port, only a table slot until its parent (or
init) reaps it.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after waiting up to ``timeout_s`` for all of them to go."""
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def cleanup(proc: subprocess.Popen[str], pids: list[int]) -> None:
    """Whatever a failing test left behind: ``proc`` and the pids its tree recorded, SIGKILLed."""
    proc.kill()
    proc.wait()
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port (a TIME_WAIT connection does not count: SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def foreground() -> None:
    """``preexec_fn`` for a child a test will Ctrl-C: SIGINT at its default action, as a terminal's foreground
    job has it, whatever this test process inherited. A suite started as a background job of a non-interactive
    shell (``pytest &`` in a script) runs with SIGINT ignored, its children inherit that across exec, and a
    program that finds SIGINT ignored keeps it so (Python does, so does asyncio): there the child's "Ctrl-C"
    was never heard and it ran to its end (the README's test command failed 2 of 919 so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Lines:
    """A child's stdout, line by line, with a timeout on each wait."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def until(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first line matching ``pattern``; fails if none comes within ``timeout_s`` or the output ends."""
        for line in self._lines(timeout_s, f"no line matching {pattern!r}"):
            if line is None:
                raise AssertionError(f"output ended before {pattern!r}:\n" + "\n".join(self.seen[-40:]))
            if m := re.search(pattern, line):
                return m
        raise AssertionError("unreachable")

    def to_end(self, timeout_s: float) -> list[str]:
        """Every line up to the end of the output (all writers gone); fails if it does not end in time."""
        for line in self._lines(timeout_s, "output did not end"):
            if line is None:
                return self.seen
        raise AssertionError("unreachable")

    def _lines(self, timeout_s: float, failure: str) -> Iterator[str | None]:
        """The next lines (each kept in ``seen``), then None at the end of the output; bounded by ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{failure} within {timeout_s}s:\n" + "\n".join(self.seen[-40:])) from None
            if line is not None:
                self.seen.append(line)
            yield line


def sweep_server_tree(line: str) -> tuple[dict[str, int], list[int]]:
    """Pids and ports from the sweep's ``embedded server URL  pids: router 1 (8000), prefill-0 2 (9000), ...`` line."""
    url, _, listing = line.partition("pids:")
    pids, ports = {}, [int(re.search(r":(\d+)\s*$", url.split("server", 1)[1].strip()).group(1))]
    for item in listing.split(","):
        m = re.match(r"\s*(\S+) (\d+)(?: \(([\d ]+)\))?", item)
        assert m, line
        pids[m.group(1)] = int(m.group(2))
        ports += [int(p) for p in (m.group(3) or "").split()]
    return pids, sorted(set(ports))
