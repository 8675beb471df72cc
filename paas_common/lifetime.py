"""Nothing outlives the process that started it.

A CI job cancelled, an OOM kill, a closed terminal: the process that started a child may end by
SIGKILL, with no chance to stop anything. Two mechanisms make its children follow it anyway:

* **Parent-death signal** (Linux): the child asks the kernel for SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), then checks ``getppid()`` once, because the parent may have died
  between the fork and that call. The kernel sends the signal when the *thread* that forked the child
  exits, so it is used only for children started from the main thread.
* **Lifeline** (everywhere): the parent holds the write end of a pipe it never writes; the child
  blocks reading the read end in a daemon thread. The kernel closes the write end however the parent
  ends, the read returns EOF, and the child exits. This covers other platforms, children started from
  other threads, and processes that cannot take the signal from their own parent.

Each child applies both to itself and gives its own children their own tether, so a whole tree
(sweep → embedded server → workers) unwinds from whichever process dies. A clean stop (SIGTERM,
SIGINT) stays each program's own business: this only handles the parent vanishing.

Parent side: ``tether()`` and, for an exec'd child, ``tether().popen_kwargs()`` (a native program that cannot
call ``die_with_parent``, e.g. ``mooncake_master``: ``native_popen_kwargs()``, the parent-death signal alone); a multiprocessing
(spawn) child receives the ``Tether`` among its arguments. Child side: ``die_with_parent(tether)``
first thing, or ``die_with_parent()`` to take the tether from the environment.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

ENV = "PAASBENCH_TETHER"        # "PARENT_PID:FD:PDEATHSIG(0|1)" for an exec'd child
ORPHANED_EXIT = 70              # exit status of a child whose parent vanished
_PR_SET_PDEATHSIG = 1

_pipe: tuple[int, int, int] | None = None    # (owner pid, read fd, write fd) of this process's lifeline
_lock = threading.Lock()


@dataclass(frozen=True)
class Tether:
    """What a child needs to follow its parent: the parent's pid and the read end of its lifeline.

    Pickles for a multiprocessing spawn child with the descriptor itself (like a ``Connection``)."""

    parent_pid: int
    fd: int
    pdeathsig: bool = True      # the parent forks from its main thread: the signal is safe to use

    def popen_kwargs(self, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``subprocess.Popen`` keyword arguments that hand this tether to an exec'd child."""
        child_env = dict(os.environ if env is None else env)
        child_env[ENV] = f"{self.parent_pid}:{self.fd}:{int(self.pdeathsig)}"
        return {"env": child_env, "pass_fds": (self.fd,)}

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (_rebuild, (self.parent_pid, DupFd(self.fd), self.pdeathsig))


def _rebuild(parent_pid: int, dup: Any, pdeathsig: bool) -> Tether:
    return Tether(parent_pid, dup.detach(), pdeathsig)


def tether() -> Tether:
    """Parent side: this process's lifeline, made on first use and held open until the process ends."""
    global _pipe
    with _lock:
        if _pipe is None or _pipe[0] != os.getpid():     # a forked copy makes its own
            r, w = os.pipe()                             # both ends close-on-exec: no other child holds w
            _pipe = (os.getpid(), r, w)
        return Tether(os.getpid(), _pipe[1], threading.current_thread() is threading.main_thread())


def die_with_parent(t: Tether | None = None) -> bool:
    """Child side: exit as soon as the parent that gave ``t`` is gone. Without ``t``, the tether comes
    from the environment (and is removed from it, so this process's own children do not take it).
    Returns whether a tether was found."""
    if t is None:
        t = _from_env()
        if t is None:
            return False
    if t.pdeathsig and sys.platform.startswith("linux"):
        _set_pdeathsig(signal.SIGKILL)
    if os.getppid() != t.parent_pid:       # it died before the signal was armed
        os._exit(ORPHANED_EXIT)
    os.set_inheritable(t.fd, False)
    threading.Thread(target=_watch, args=(t.fd,), name="lifeline", daemon=True).start()
    return True


def native_popen_kwargs() -> dict[str, Any]:
    """``subprocess.Popen`` keyword arguments for a native child (not Python, so no lifeline thread): the kernel
    SIGKILLs it when this process's calling thread ends (call it from the main thread), and it exits at once
    if this process is already gone. Linux only; elsewhere nothing (the caller stops it on a clean exit)."""
    if not sys.platform.startswith("linux"):
        return {}
    parent = os.getpid()

    def arm() -> None:                       # runs in the child between fork and exec
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(ORPHANED_EXIT)
    return {"preexec_fn": arm}


def stop(proc: "subprocess.Popen[Any]", grace_s: float = 5.0) -> None:
    """A clean stop of a child (SIGTERM), then SIGKILL if it has not exited within ``grace_s``; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _from_env() -> Tether | None:
    raw = os.environ.pop(ENV, None)
    if not raw:
        return None
    pid, fd, sig = raw.split(":")
    return Tether(int(pid), int(fd), sig == "1")


def _set_pdeathsig(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 1)
        except InterruptedError:
            continue
        except OSError:
            return                       # the descriptor was closed here: nothing to watch
        if not data:                     # EOF: every write end is closed, the parent is gone
            os._exit(ORPHANED_EXIT)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Inside, SIGTERM does what Ctrl-C does, so with-blocks unwind (an embedded server stopped, sweep.json
    saved, a run's in-flight requests recorded ``cancelled`` and its summary written) instead of the process
    dying where it stands; the previous handler comes back."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):      # asyncio.run's cancels the main task, which unwinds; the default raises
        handler(signal.SIGINT, frame)
        return
    try:                       # SIGINT ignored (a script's `cmd &`): leave the event loop between callbacks,
        loop = asyncio.get_running_loop()   # so asyncio.run cancels the tasks and they unwind
    except RuntimeError:
        raise KeyboardInterrupt from None
    loop.call_soon_threadsafe(_raise_keyboard_interrupt)


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@contextmanager
def ctrl_c_interrupts() -> Iterator[None]:
    """Inside, on an event loop's thread, a Ctrl-C stops the synchronous work in hand at once.

    Under ``asyncio.run`` the first Ctrl-C only cancels the main task, which takes effect at its next ``await``;
    synchronous work on the loop's thread (a launch cost, a tokenizer loaded and a prompt tape built before the
    first request) ran to its end first: a Ctrl-C 1 s into 10 s of it was acted on 9 s later. Here the handler
    does what asyncio's does (count it, cancel the main task) and then raises ``CancelledError`` where the work
    stands, which unwinds it as that cancel would have at the next ``await``. Only around code that does not
    yield to the loop: raised in the loop's own machinery, it would break the loop. Anywhere else (not the main
    thread, SIGINT ignored) it changes nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        previous(signum, frame)          # the default handler raises KeyboardInterrupt here itself
        raise asyncio.CancelledError()

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


__all__ = ["Tether", "tether", "die_with_parent", "native_popen_kwargs", "sigterm_unwinds", "ctrl_c_interrupts",
           "describe_exit", "ENV", "ORPHANED_EXIT"]

def describe_exit(returncode: int | None) -> str:
    """A child's end as a log line says it: ``exited with code 1``, ``was killed by signal 9 (SIGKILL)`` (a
    ``subprocess`` or ``multiprocessing`` return code: negative for a signal)."""
    if returncode is None:
        return "exited (exit code unknown)"
    if returncode < 0:
        try:
            return f"was killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
