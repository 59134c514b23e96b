"""A command in a process session of its own, and nothing of it left running after it.

An engine's benchmark runs each configuration as a child process whose own children
(SGLang's scheduler and detokenizer, vLLM's engine core) could outlive it and keep the
GPU busy while the next configuration is timed. `run_in_session` starts the child with
`start_new_session`, waits for the child itself (its output goes through files, so a
survivor holding them open cannot hide the child's end), then kills every process still
in its session and says how many there were.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass
class ChildRun:
    """What `run_in_session` saw: the output (empty when not captured), the exit code
    (None: killed at the timeout) and how many processes of its session were still alive
    once it ended (then killed)."""

    stdout: str
    stderr: str
    returncode: int | None
    leftover: int


def run_in_session(cmd: list[str], timeout: float, capture: bool = True) -> ChildRun:
    """Run `cmd` in a session of its own under `timeout`; whatever of that session outlives
    it (or the timeout) is killed before this returns. `capture`: keep its output (else it
    goes where this process's goes)."""
    with contextlib.ExitStack() as files:
        out, err = (files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2)) if capture else (None, None)
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        leftover = kill_session(proc.pid)
        return ChildRun(_read(out), _read(err), code, leftover)


def _read(sink: IO[str] | None) -> str:
    if sink is None:
        return ""
    sink.seek(0)
    return sink.read()


def kill_session(sid: int) -> int:
    """SIGKILL every live process of session `sid` and wait (10 s at most) until they are
    gone; returns how many there were."""
    survivors = session_members(sid)
    for pid in survivors:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(survivors)


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes whose session id is `sid`, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, session
            members.append(int(entry))
    return members
