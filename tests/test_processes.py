"""Nothing outlives a run, however its parent ends (issue 29, class 1).

Each case starts a real `hicache-cp replay` that has children (CP ranks, the
decode peer, L3 instances and their `mooncake_master`), waits until they are
all up and working, then ends the parent the three ways an operator does:

- SIGINT to the whole process group (Ctrl-C at a terminal): exit 130;
- SIGTERM to the parent alone (`kill`, a supervisor): exit 143;
- SIGKILL to the parent alone (OOM killer, `kill -9`): the kernel ends the
  children (PR_SET_PDEATHSIG).

and asserts, within 10 s: the exit code, no KeyboardInterrupt traceback, no
process of the run alive, and no POSIX semaphore of the run left in
/dev/shm (multiprocessing's `sem.mp-*` that a process of the run mapped
while it ran, and that no live process maps now). Semaphores are told apart
by who mapped them, not by when they appeared: on a shared host another
process's leak can appear in /dev/shm during the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest

from conftest import mooncake_store_available
from hicache_harness import lifetime

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
DEADLINE_S = 10.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /dev/shm are Linux")




# name -> (replay flags, children to wait for: substrings of their command lines or names)
CASES = {
    "cp2": (["--cp-size", "2"], 2),
    "pd": (["--pd"], 1),
    "instances2_l3": (["--instances", "2", "--l3", "mooncake"], 3),  # 2 instances + mooncake_master
}


def _trace(path: Path, n: int = 20000) -> Path:
    """A long trace (the run must still be going when the signal comes)."""
    with path.open("w") as f:
        for i in range(n):
            ids = [i % 97, 1000 + i % 13, 2000 + i]
            f.write(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}) + "\n")
    return path


def _sems() -> set[str]:
    return {p.name for p in SHM.glob("sem.mp-*")} if SHM.is_dir() else set()


def _mapped_sems(pids: Iterable[int] | None = None) -> set[str]:
    """sem.mp-* names that the processes `pids` (default: every live process) map."""
    out: set[str] = set()
    for pid in (p.pid for p in psutil.process_iter()) if pids is None else pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        out.update(line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/dev/shm/sem.mp-" in line)
    return out


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _workers(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The run's real children: not multiprocessing's resource tracker, nor the
    short-lived exec wrapper before it becomes mooncake_master."""
    out = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in cmd:
            out.append(p)
    return out


def _kill_all(parent: subprocess.Popen, children: Iterable[psutil.Process]) -> None:
    """A test's cleanup, whatever it asserted: the run and every process it started die."""
    for p in [parent, *children]:
        try:
            p.kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    parent.wait(timeout=10)


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return out


def _wait_or_dump_stacks(parent: subprocess.Popen[bytes], err_path: Path) -> int:
    """The exit code within DEADLINE_S; past it, fail with every thread's stack
    (the CLI prints them on SIGUSR1) and the end of stderr."""
    try:
        return parent.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        parent.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        pytest.fail(f"still running {DEADLINE_S} s after the signal; its stacks:\n{err_path.read_text()[-12000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
@pytest.mark.parametrize("case", list(CASES))
def test_an_ended_parent_leaves_nothing(case: str, sig: signal.Signals, tmp_path: Path) -> None:
    flags, expected_children = CASES[case]
    if "--l3" in flags and not mooncake_store_available():
        pytest.skip("mooncake (store and master) not installed")
    trace = _trace(tmp_path / "long.jsonl")
    out_json = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MC_LOG_LEVEL": "ERROR"}  # fmt: skip
    cmd = [sys.executable, "-m", "hicache_harness", "replay", "--trace", str(trace), "--no-verify", "--json", str(out_json),
           *flags]  # fmt: skip
    err_path = tmp_path / "stderr.txt"  # a file, not a pipe: a child left behind would hold a pipe open
    with err_path.open("wb") as err:
        parent = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                  start_new_session=True)  # fmt: skip
    seen: dict[int, psutil.Process] = {}
    owned: set[str] = set()  # semaphores a process of the run mapped
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            for p in _workers(_descendants(parent.pid)):
                seen.setdefault(p.pid, p)
            owned |= _mapped_sems([parent.pid, *seen])
            if len(_workers(_descendants(parent.pid))) >= expected_children:
                break
            assert parent.poll() is None, f"the run ended before its children were up: {err_path.read_text()[-2000:]}"
            time.sleep(0.2)
        else:
            pytest.fail(f"{case}: children not up within 180 s: {_alive(list(seen.values()))}")
        while "req/s" not in err_path.read_text(errors="replace"):  # the replay's progress bar: work started
            assert time.monotonic() < deadline, f"{case}: no progress within 180 s: {err_path.read_text()[-2000:]}"
            assert parent.poll() is None, err_path.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(1.0)  # into the work, every child past its start-up
        for p in _descendants(parent.pid):
            seen.setdefault(p.pid, p)
        owned |= _mapped_sems([parent.pid, *seen])
        assert parent.poll() is None, "the run finished before the signal: make the trace longer"
        t0 = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(parent.pid, sig)  # Ctrl-C: the terminal signals the whole foreground group
        else:
            os.kill(parent.pid, sig)
        rc = _wait_or_dump_stacks(parent, err_path)
        stderr = err_path.read_text(errors="replace")
        if sig == signal.SIGKILL:
            assert rc == -signal.SIGKILL
        else:
            assert rc == 128 + sig, f"exit {rc}, stderr:\n{stderr[-2000:]}"
            assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
        left: list[str] = []
        while time.monotonic() - t0 < DEADLINE_S:
            left = _alive(list(seen.values()))
            if not left:
                break
            time.sleep(0.1)
        assert left == [], f"{case} after {sig.name}: still running after {DEADLINE_S} s: {left}"
        assert not out_json.exists(), "an interrupted run wrote its report"
        assert not list(tmp_path.glob(".out.json.*")), "an interrupted run left a temporary file"
        stray: set[str] = set()
        while time.monotonic() - t0 < DEADLINE_S + 5:  # the resource tracker unlinks after the last child exits
            stray = (_sems() & owned) - _mapped_sems()
            if not stray:
                break
            time.sleep(0.2)
        assert stray == set(), f"{case} after {sig.name}: /dev/shm entries left: {sorted(stray)}"
    finally:
        _kill_all(parent, seen.values())


@pytest.mark.parametrize("delay_s", [0.3, 0.8])
def test_early_sigint_exits_130_in_one_line(delay_s: float) -> None:
    """Ctrl-C while the CLI is still importing (torch takes a second or more):
    exit 130 with one line, no KeyboardInterrupt traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "hicache_harness", "replay", "--limit", "3"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if "interrupted" in line], err


def test_an_interrupt_python_drops_inside_a_finalizer_is_delivered_again() -> None:
    """Python runs a signal handler inside finalizers too (`__del__`, a WeakSet's
    callback) and drops what it raises there: the run went on with the Ctrl-C
    spent, and took the next one for a Ctrl-C during its clean-up. The signal
    is delivered again once the finalizer has returned."""

    class Finalized:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the finalizer

    hook = sys.unraisablehook
    t0 = time.monotonic()
    with pytest.raises(lifetime.Interrupted) as caught, lifetime.stop_on_signals():
        Finalized()  # dropped at once
        time.sleep(5.0)  # the signal delivered again cuts this short
    assert caught.value.signum == signal.SIGINT
    assert time.monotonic() - t0 < 4.0
    assert sys.unraisablehook is hook


def test_sigusr1_prints_every_threads_stack_and_the_run_goes_on(tmp_path: Path) -> None:
    """`kill -USR1` on a run that looks stuck: every thread's Python stack on
    stderr, and the run carries on (a Ctrl-C still ends it with 130)."""
    err_path = tmp_path / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "hicache_harness", "replay", "--trace", str(_trace(tmp_path / "long.jsonl")), "--no-verify"]
    with err_path.open("wb") as err:
        parent = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while "req/s" not in err_path.read_text(errors="replace"):  # the replay's progress bar: work started
            assert time.monotonic() < deadline and parent.poll() is None, err_path.read_text()[-2000:]
            time.sleep(0.2)
        parent.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        assert parent.poll() is None, "SIGUSR1 ended the run"
        stacks = err_path.read_text(errors="replace")
        assert "(the main thread, here)" in stacks and "hicache_harness/replay" in stacks, stacks[-3000:]
        assert stacks.count("\nThread 0x") >= 2, stacks[-3000:]  # the replay's worker threads too
        parent.send_signal(signal.SIGINT)
        assert _wait_or_dump_stacks(parent, err_path) == 130
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


# A fresh interpreter (multiprocessing's resource tracker not yet running)
# starts one spawned child through `start_processes`; the child reports the
# signal mask it was born with, before `child_main` could change it.
_FIRST_SPAWN = """
import multiprocessing as mp, signal
from hicache_harness import lifetime

def report(conn):
    conn.send(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=report, args=(child,))
    lifetime.start_processes([proc])
    print(parent.recv())
    proc.join()
"""


def test_the_first_spawned_child_starts_with_interrupts_blocked(tmp_path: Path) -> None:
    """The first spawn of a run starts multiprocessing's resource tracker, which
    unblocks SIGINT and SIGTERM in the parent's thread once it is up; a child
    started after that took a Ctrl-C during its imports and printed a fatal
    error. Every child `start_processes` starts is born with both blocked."""
    script = tmp_path / "first_spawn.py"
    script.write_text(_FIRST_SPAWN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    blocked = set(json.loads(out.strip().splitlines()[-1]))
    assert {int(signal.SIGINT), int(signal.SIGTERM)} <= blocked, f"the child was born with {sorted(blocked)} blocked"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_while_the_decode_peer_starts_stops_it(sig: signal.Signals, tmp_path: Path) -> None:
    """The decode peer is signalled while it still starts (importing, registering
    its buffers): the run exits 128 + signal and the peer is gone within 10 s."""
    pytest.importorskip("mooncake.engine", reason="Mooncake TransferEngine not importable")
    trace = _trace(tmp_path / "long.jsonl", n=2000)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MC_LOG_LEVEL": "ERROR"}  # fmt: skip
    cmd = [sys.executable, "-m", "hicache_harness", "replay", "--trace", str(trace), "--no-verify", "--pd",
           "--json", str(tmp_path / "out.json")]  # fmt: skip
    err_path = tmp_path / "stderr.txt"
    with err_path.open("wb") as err:
        parent = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                  start_new_session=True)  # fmt: skip
    seen: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not seen:  # the peer's process exists: it is starting
            assert time.monotonic() < deadline and parent.poll() is None, err_path.read_text()[-2000:]
            seen = _workers(_descendants(parent.pid))
            time.sleep(0.02)
        t0 = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(parent.pid, sig)
        else:
            os.kill(parent.pid, sig)
        rc = _wait_or_dump_stacks(parent, err_path)
        stderr = err_path.read_text(errors="replace")
        assert rc == 128 + sig, f"exit {rc}, stderr:\n{stderr[-2000:]}"
        assert "Traceback" not in stderr, stderr[-2000:]
        left = _alive(seen)
        while left and time.monotonic() - t0 < DEADLINE_S:
            time.sleep(0.1)
            left = _alive(seen)
        assert left == [], f"the decode peer outlived the run: {left}"
    finally:
        _kill_all(parent, seen)
