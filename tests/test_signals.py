"""No SIGINT or SIGTERM is ever lost: every mode exits 130 / 143 (issue 48, item 2).

Where a signal was lost: `stop_on_signals` raised `Interrupted` from wherever
the main thread was, and a signal handled while a module was being imported
ran inside a C++ extension's initialisation (torch's, through pybind11), which
either swallowed the exception (the run went on and exited 0) or aborted the
process; and after the CLI gave its signals back, `python -m hicache_cp`'s own
handler raised SystemExit inside the interpreter's wind-down, where it is
dropped (exit 0). Now a signal that comes during an import is held until the
import ends, a swallowed `Interrupted` is raised again before a result is
committed and at the CLI boundary, and the wind-down's handler ends the
process at once with 128 + signal.

The in-process tests are quick; the per-mode ones start real runs and are
marked slow (one start-up and one mid-run signal per mode, SIGINT and SIGTERM
alternating, so each mode costs two runs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hicache_cp.harness import lifetime

ROOT = Path(__file__).resolve().parent.parent


def test_a_signal_during_an_import_is_raised_after_the_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's body swallows every exception, as a C++ module's init does:
    the signal must not be raised inside it, and must end the block once the
    import is over."""
    (tmp_path / "swallowing_init.py").write_text(textwrap.dedent("""
        import signal
        raised_inside = False
        try:
            signal.raise_signal(signal.SIGTERM)  # the handler runs here, inside the import
            for _ in range(1000):
                pass
        except BaseException:  # noqa: BLE001 - what pybind11's module init does to it
            raised_inside = True
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "swallowing_init", raising=False)
    with pytest.raises(lifetime.Interrupted) as caught, lifetime.stop_on_signals():
        import swallowing_init  # noqa: F401

        time.sleep(10.0)  # the held signal cuts this short
    assert caught.value.signum == signal.SIGTERM
    assert sys.modules["swallowing_init"].raised_inside is False, "the interrupt was raised inside the import"


def test_a_swallowed_interrupt_still_exits_128_plus_signal(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A command whose code swallows the `Interrupted` and returns 0: the CLI still exits 143."""
    from hicache_cp.harness import cli
    from hicache_cp.harness.bench import alloc

    def swallowing_run(args: object) -> int:
        try:
            signal.raise_signal(signal.SIGTERM)
            time.sleep(0.01)
        except BaseException:  # noqa: BLE001 - the bug this guards against
            pass
        return 0

    monkeypatch.setattr(alloc, "run", swallowing_run)
    assert cli.main(["bench-alloc"]) == 143
    assert "interrupted by SIGTERM" in capsys.readouterr().err
    assert lifetime.signalled() is None  # the next command in this process starts clean


def test_an_interrupted_run_commits_no_output_file(tmp_path: Path) -> None:
    from hicache_cp.harness.outputs import write_json

    out = tmp_path / "r.json"
    with lifetime.stop_on_signals():
        try:
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.01)
        except lifetime.Interrupted:
            pass  # swallowed: the run goes on to write its report
        with pytest.raises(lifetime.Interrupted):
            write_json(out, {"ok": True})
    assert not out.exists() and not list(tmp_path.iterdir())


_WIND_DOWN = """
import atexit, os, runpy, signal, time
def late():  # registered first, so it runs last: the CLI's clean-up is long over
    os.kill(os.getpid(), signal.{sig})
    time.sleep(2.0)
atexit.register(late)
runpy.run_module("hicache_cp", run_name="__main__")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_the_interpreter_winds_down_is_not_lost(sig: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _WIND_DOWN.format(sig=sig), "replay", "--limit", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and f"interrupted by {sig}" in proc.stderr, proc.stderr[-2000:]
