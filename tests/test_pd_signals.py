"""`replay --pd` interrupted: Ctrl-C (SIGINT to the whole process group) ends the run
within 10 s with exit 130 and leaves no process of the group; a parent killed with
SIGKILL takes its decode peer with it (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake TransferEngine not importable (libibverbs1?)")
pytestmark = [pytest.mark.mooncake, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def _group(pgid: int) -> list[tuple[int, str]]:
    """Live (pid, cmdline) of the processes in process group `pgid` (zombies excluded)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError):
            continue
    return out


def _long_trace(path: Path) -> Path:
    lines = [{"timestamp": i, "input_length": 1536, "output_length": 1, "hash_ids": [i % 40, 1000 + i % 97, 5000 + i]}
             for i in range(20000)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _start(tmp_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR"}
    cmd = [sys.executable, "-m", "hicache_cp", "replay", "--pd", "--trace", str(_long_trace(tmp_path / "t.jsonl"))]
    # A session of its own (so the signal goes to its group only), SIGINT at its default.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if any("multiprocessing" in cmd for _, cmd in _group(proc.pid)):  # the decode peer is up
            time.sleep(1.5)  # and requests are flowing
            return proc
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the decode peer never started: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")


def _wait_gone(pgid: int, timeout: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _group(pgid):
        time.sleep(0.2)
    return _group(pgid)


def test_ctrl_c_on_replay_pd_exits_130_and_leaves_nothing(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        rc = proc.wait(timeout=10)
        assert time.monotonic() - t0 < 10
        assert rc == 130, (rc, proc.stderr.read().decode()[-2000:] if proc.stderr else "")
        assert _wait_gone(proc.pid, 10) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid, _ in _group(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_sigkill_of_the_parent_takes_the_decode_peer_along(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    try:
        peers = [pid for pid, cmd in _group(proc.pid) if pid != proc.pid and "multiprocessing" in cmd]
        assert peers
        proc.kill()
        proc.wait(10)
        assert _wait_gone(proc.pid, 10) == []
    finally:
        for pid, _ in _group(proc.pid):
            os.kill(pid, signal.SIGKILL)
