"""`hicache_harness.sessions`: an engine benchmark's child runs in a session of its own, and
whatever of it outlives it is killed and counted before the next configuration runs."""

from __future__ import annotations

import sys
from pathlib import Path

from hicache_harness.sessions import run_in_session, session_members


def _gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_child_s_survivor_is_killed_and_counted(tmp_path: Path) -> None:
    """A child that leaves a process behind holding its output open (as an engine whose
    scheduler outlives it): the child's end is seen at once, the survivor is killed and
    counted, and the child's output is kept."""
    pidfile = tmp_path / "grandchild"
    script = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('RESULT done')")  # fmt: skip
    run = run_in_session([sys.executable, "-c", script], timeout=60)
    assert run.returncode == 0 and run.leftover == 1 and "RESULT done" in run.stdout
    assert _gone(int(pidfile.read_text()))


def test_a_clean_child_leaves_nothing_and_a_hung_one_is_killed_with_its_session() -> None:
    clean = run_in_session([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                           timeout=60)  # fmt: skip
    assert (clean.returncode, clean.leftover, clean.stdout, clean.stderr) == (3, 0, "out\n", "err\n")
    hung = run_in_session([sys.executable, "-c", "import time; time.sleep(600)"], timeout=1)
    assert hung.returncode is None and hung.leftover == 0


def test_session_members_sees_only_that_session() -> None:
    import os

    assert os.getpid() in session_members(os.getsid(0))
    assert os.getpid() not in session_members(os.getsid(0) + 1) and session_members(-1) == []


def test_an_uncaptured_child_writes_where_this_process_does(capfd) -> None:
    """capture=False: the child's output reaches this process's own stdout (the engine
    benches stream a run's progress there), and the record holds none of it."""
    import sys

    from hicache_harness.sessions import run_in_session

    run = run_in_session([sys.executable, "-c", "print('streamed')"], timeout=30, capture=False)
    assert run.returncode == 0 and run.stdout == "" and run.leftover == 0
    assert "streamed" in capfd.readouterr().out
