"""No SIGINT or SIGTERM is ever lost: every mode exits 130 / 143 (issue 48, item 2).

Where a signal was lost: `stop_on_signals` raised `Interrupted` from wherever
the main thread was, and a signal handled while a module was being imported
ran inside a C++ extension's initialisation (torch's, through pybind11), which
either swallowed the exception (the run went on and exited 0) or aborted the
process; and after the CLI gave its signals back, `python -m hicache_harness`'s own
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

from hicache_harness import lifetime

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
    from hicache_harness import cli
    from hicache_harness.bench import alloc

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
    from hicache_harness.outputs import write_json

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
runpy.run_module("hicache_harness", run_name="__main__")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_the_interpreter_winds_down_is_not_lost(sig: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _WIND_DOWN.format(sig=sig), "replay", "--limit", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and f"interrupted by {sig}" in proc.stderr, proc.stderr[-2000:]


# mode -> (command after `python -m hicache_harness`, children a working run has, what stderr shows once it works)
MODES = {
    "pd": (["replay", "--pd"], 1, "req/s"),
    "cp2": (["replay", "--cp-size", "2"], 2, "req/s"),
    "l3_instances2": (["replay", "--l3", "mooncake", "--instances", "2"], 3, "req/s"),
    "hf_cp2": (["replay", "--engine", "hf", "--cp-size", "2"], 2, "req/s"),
    "decode_peer": (["decode-peer", "--pages", "64"], 0, ""),
}


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["start-up", "mid-run"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_exits_128_plus_the_signal(mode: str, phase: str, tmp_path: Path) -> None:
    """SIGINT to the process group (Ctrl-C) at start-up, SIGTERM to the parent mid-run
    (modes alternate which phase gets which): exit 128 + signal within seconds, no
    traceback, no child left, no report written."""
    import psutil
    from test_processes import _alive, _descendants, _kill_all, _trace, _wait_or_dump_stacks, _workers

    from conftest import mooncake_store_available

    command, children, working = MODES[mode]
    if "--l3" in command and not mooncake_store_available():
        pytest.skip("mooncake (store and master) not installed")
    if mode in ("pd", "decode_peer", "l3_instances2"):
        pytest.importorskip("mooncake.engine", reason="Mooncake TransferEngine not importable")
    flip = list(MODES).index(mode) % 2
    sig = (signal.SIGINT, signal.SIGTERM)[(phase == "mid-run") ^ flip]
    out_json = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "hicache_harness", *command]
    if command[0] == "replay":
        cmd += ["--trace", str(_trace(tmp_path / "long.jsonl", n=4000)), "--no-verify", "--json", str(out_json)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR",
           "HICACHE_CP_PD_AUTHKEY": "k" * 40}  # fmt: skip
    err_path = tmp_path / "stderr.txt"
    out_path = tmp_path / "stdout.txt"
    with err_path.open("wb") as err, out_path.open("wb") as out:
        parent = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=err, start_new_session=True)
    seen: dict[int, psutil.Process] = {}

    def look() -> int:
        for p in _workers(_descendants(parent.pid)):
            seen.setdefault(p.pid, p)
        return len(_workers(_descendants(parent.pid)))

    try:
        deadline = time.monotonic() + 240
        if phase == "start-up":  # the first child exists (or, without children, the CLI is importing)
            while look() < min(1, children):
                assert time.monotonic() < deadline and parent.poll() is None, err_path.read_text()[-2000:]
                time.sleep(0.02)
            time.sleep(0.3 if children == 0 else 0.0)
        else:  # every child up and the work going on
            def working_now() -> bool:
                text = err_path.read_text(errors="replace") + out_path.read_text(errors="replace")
                return look() >= children and (working in text if working else "control" in text)

            while not working_now():
                assert time.monotonic() < deadline, f"{mode}: not working within 240 s: {err_path.read_text()[-2000:]}"
                assert parent.poll() is None, err_path.read_text()[-2000:]
                time.sleep(0.2)
            time.sleep(1.0)
            look()
        assert parent.poll() is None, "the run finished before the signal: make the trace longer"
        if sig == signal.SIGINT:
            os.killpg(parent.pid, sig)
        else:
            os.kill(parent.pid, sig)
        t0 = time.monotonic()
        rc = _wait_or_dump_stacks(parent, err_path)
        stderr = err_path.read_text(errors="replace")
        assert rc == 128 + sig, f"{mode} {phase} {sig.name}: exit {rc}, stderr:\n{stderr[-3000:]}"
        assert "Traceback" not in stderr and "Fatal Python error" not in stderr, stderr[-3000:]
        left = _alive(list(seen.values()))
        while left and time.monotonic() - t0 < 10:
            time.sleep(0.1)
            left = _alive(list(seen.values()))
        assert left == [], f"{mode} {phase}: still running after the signal: {left}"
        assert not out_json.exists(), "an interrupted run wrote its report"
    finally:
        _kill_all(parent, seen.values())
