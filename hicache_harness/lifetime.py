"""Child processes never outlive the run, however the parent ends.

Every process the harness starts (CP ranks, L3 instances, the decode peer,
`mooncake_master`) is tied to its parent three ways:

- **Parent killed (SIGKILL, OOM)**: the child asked the kernel for
  `PR_SET_PDEATHSIG` = SIGKILL when it started (`child_main` for
  multiprocessing children, `pdeathsig_command` for executables), so it dies
  with the parent; it re-checks its parent pid after the call, in case the
  parent died first.
- **Parent interrupted (SIGINT, SIGTERM)**: `stop_on_signals` turns either
  signal into `Interrupted`, so every `finally` runs and stops its children
  (`stop_processes`: SIGTERM, then SIGKILL after a short grace); the CLI exits
  128 + the signal (130, 143). A second signal during the clean-up is
  recorded, not raised, so the clean-up itself is never cut short.
- **Ctrl-C at a terminal** reaches the whole process group: the children
  ignore SIGINT (they start with it blocked, `start_processes`, and then
  ignore it) and leave the shutdown to the parent, which would otherwise wait
  on peers that died half-way through a protocol. The parent defers both
  signals while it starts children (a start cut short leaves a child reading
  a truncated pickle), then unwinds. A signal whose `Interrupted` Python drops
  (raised inside a finalizer) is delivered again.
- **Never lost.** A signal that arrives while a module is being imported is
  deferred until the import is over (delivered again every few milliseconds):
  an exception raised there can cross a C++ extension's initialisation
  (torch's, through pybind11), which either swallows it, so the run went on
  and exited 0, or aborts the process. And should an `Interrupted` still be
  swallowed somewhere, the run cannot end as a success: `raise_if_interrupted`
  (called before any output file is committed and between requests) raises it
  again, and the CLI turns a recorded signal into 128 + signal whatever
  `run` returned.

Linux only (prctl); elsewhere the first two rules still hold.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import resource_tracker
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
#: How long a stopped child may take to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 3.0
_HANDLED = (signal.SIGINT, signal.SIGTERM)
#: A signal Python dropped is sent again after this long (its finalizer has returned by then).
_REDELIVER_AFTER_S = 0.01


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the parent: unwind, stop the children, exit 128 + signal.

    A BaseException, like KeyboardInterrupt, so that no `except Exception`
    turns an interrupt into an error report."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# ---- in the parent ---------------------------------------------------------------------------


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` (once) in the main thread while the block runs
    (deferred while an import runs; `raise_if_interrupted` raises it again inside the block)."""
    fired: list[int] = []

    deferred: list[int] = []  # the signal held back while an import runs
    timer: list[threading.Timer] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if fired:  # already unwinding: let the clean-up finish
            logger.warning("%s again while stopping; still stopping", signal.Signals(signum).name)
            return
        if _importing(frame):  # raising here may cross a C++ module's init: deliver it after the import
            deferred[:1] = deferred[:1] or [signum]
            if not timer or not timer[0].is_alive():
                timer[:] = [_deliver_again(deferred[0])]
            return
        signum = deferred[0] if deferred else signum
        if timer:
            timer[0].cancel()
        fired.append(signum)
        _signalled.append(signum)
        if _deferring:  # starting children: raised when the starts are done (`_signals_deferred`)
            _pending.append(signum)
            return
        raise Interrupted(signum)

    def unraisable(info: Any) -> None:
        """Python runs signal handlers inside finalizers and weakref callbacks
        too, and drops what they raise: the run would go on with the signal
        spent. Clear it and deliver it again, from a timer thread, once the
        main thread has left the finalizer (and this hook)."""
        exc = info.exc_value
        if not isinstance(exc, Interrupted):
            previous_hook(info)
            return
        logger.debug("%s dropped inside %r; delivering it again", exc, info.object)
        fired.clear()
        _deliver_again(exc.signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    _signalled.clear()
    old = {s: signal.signal(s, handler) for s in _HANDLED}
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for s, h in old.items():
            signal.signal(s, h)
        if timer:
            timer[0].cancel()
        _signalled.clear()


_deferring: list[bool] = []
_pending: list[int] = []
#: Signals `stop_on_signals` raised as `Interrupted` in this process (the first one counts).
_signalled: list[int] = []


def _importing(frame: FrameType | None) -> bool:
    """Whether the interrupted frame runs inside an import (importlib's frames are on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _deliver_again(signum: int) -> threading.Timer:
    """Send `signum` to the main thread again in `_REDELIVER_AFTER_S` (from a timer thread)."""
    again = threading.Timer(_REDELIVER_AFTER_S, signal.pthread_kill, (threading.main_thread().ident, signum))
    again.daemon = True
    again.start()
    return again


def signalled() -> int | None:
    """The signal `stop_on_signals` turned into `Interrupted` in this process, if any."""
    return _signalled[0] if _signalled else None


def raise_if_interrupted() -> None:
    """Raise `Interrupted` again if a signal came and its exception was swallowed on the way
    (so the run goes on): called where a run commits a result, never during clean-up."""
    if _signalled:
        raise Interrupted(_signalled[0])


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """An interrupt during the block is raised when it exits. The signals are
    also blocked in this thread, so a child forked meanwhile starts with them
    blocked (the mask survives fork and exec) until `child_main` takes over;
    the flag covers a signal the kernel hands to another thread."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(_HANDLED))
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a blocked one is handled here, now
    if _pending and not _deferring:
        raise Interrupted(_pending.pop())


def start_processes(procs: Sequence[Any]) -> None:
    """Start multiprocessing children whole: an interrupt waits until every
    start returned (a start cut short leaves a child reading a truncated
    pickle), and a Ctrl-C during their start-up reaches none of them."""
    # The first spawn of a run starts multiprocessing's resource tracker, which
    # unblocks SIGINT and SIGTERM in this thread when it is up: start it before
    # blocking, or the children started after it would take Ctrl-C mid-import.
    resource_tracker.ensure_running()
    with _signals_deferred():
        for p in procs:
            p.start()


def stop_processes(procs: Sequence[Any], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every live child, wait up to `grace_s` in all, SIGKILL the rest, reap."""
    procs = [p for p in procs if p.pid is not None]  # never started: nothing to stop
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(OSError, ValueError):
                p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(ValueError):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ValueError):
            if p.is_alive():
                p.kill()
                p.join(timeout=grace_s)
            if p.is_alive():
                logger.warning("child %s (pid %s) survived SIGKILL", p.name, p.pid)


# ---- in the child ----------------------------------------------------------------------------


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies; exit
    now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:
        os._exit(1)


def child_main(parent_pid: int, target: Callable[..., Any], *args: Any) -> Any:
    """A multiprocessing child's entry: tie it to `parent_pid`, leave Ctrl-C to the parent, run `target`."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_HANDLED))  # blocked by `start_processes`
    return target(*args)


# The executable form of `die_with_parent`: a `python -S -c` that sets the
# death signal and execs the real command (the setting survives exec).
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def pdeathsig_command(cmd: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """`cmd` wrapped so that the process it becomes is SIGKILLed when this process dies.

    (Not `preexec_fn`: it runs between fork and exec of a threaded parent, which
    Mooncake's threads make unsafe.)"""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-S", "-c", _EXEC_WITH_PDEATHSIG, str(parent_pid or os.getpid()), *cmd]
