"""Hardening round 4 (issue 48, items 3 and 4): what the input or the environment
gets wrong exits 2 with one line naming it, never 3 (a bug) and never silently.

Item 3: a full disk under an output file, a non-UTF-8 `--config`, `--hf-fault`
digits outside ASCII, an hf preset whose model this machine cannot hold, and
`--instances N --metrics-port P` (instance i now serves P + i). Item 4: values
that were accepted and then ignored or contradicted, now refused.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache_cp.harness.cli import main

Setup = Callable[[Path], list[str]]


def _file(name: str, data: str | bytes) -> Setup:
    def make(d: Path) -> list[str]:
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        return [str(d / name)]

    return make


# (id, argv before the setup's paths, setup or None, argv after, expected message fragment)
CASES: list[tuple[str, list[str], Setup | None, list[str], str]] = [
    ("config-not-utf8", ["replay", "--config"], _file("c.toml", b"l1_pages = 64\n# caf\xe9\n"), [],
     "not UTF-8 text"),
    ("hf-fault-superscript-layer", ["replay", "--engine", "hf", "--hf-fault", "corrupt:target_kv:\u00b2@0"], None, [],
     "expected KIND:PART:LAYER@RANK"),
    ("hf-fault-arabic-indic-rank", ["replay", "--engine", "hf", "--hf-fault", "corrupt:target_kv:0@\u0661"], None, [],
     "expected KIND:PART:LAYER@RANK"),
    ("hf-fault-fullwidth-nth", ["replay", "--engine", "hf", "--hf-fault", "corrupt:target_kv:0@0#\uff12"], None, [],
     "expected KIND:PART:LAYER@RANK"),
]


def _run(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse's own errors end the process
        rc = int(exit_.code or 0)
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(case, tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    _, before, setup, after, fragment = case
    monkeypatch.chdir(tmp_path)
    inputs = setup(tmp_path) if setup else []
    written = set(os.listdir(tmp_path))
    argv = [*before, *inputs, *after]
    if argv[0] == "replay" and "--json" not in argv:
        argv += ["--json", str(tmp_path / "report.json")]
    rc, err = _run(argv, tmp_path, capsys)
    assert rc == 2, err
    assert len(err) == 1 and fragment in err[0], err
    assert set(os.listdir(tmp_path)) == written, "a failed command left files behind"


# ---- item 3: a full disk is the environment's fault -------------------------------------------

@contextlib.contextmanager
def _full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, filled: every write there fails with ENOSPC (root only)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        with contextlib.suppress(OSError), (mnt / "filler").open("wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@contextlib.contextmanager
def _file_size_limit(tmp_path: Path) -> Iterator[Path]:
    """RLIMIT_FSIZE of 1 KiB for this process while the block runs: a larger write
    fails with EFBIG (Python ignores SIGXFSZ), like a quota that runs out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        yield tmp_path
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


OUTPUTS = {
    "replay-json": (["replay", "--limit", "3"], "--json", "r.json"),
    "replay-plot": (["replay", "--limit", "3"], "--plot", "p.png"),
    "bench-alloc-json": (["bench-alloc", "--ops", "50"], "--json", "a.json"),
}


@pytest.mark.parametrize("full", ["tmpfs", "file-size-limit"])
@pytest.mark.parametrize("output", list(OUTPUTS))
def test_a_full_disk_under_an_output_exits_2(output: str, full: str, tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    argv, flag, name = OUTPUTS[output]
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    with (_full_tmpfs if full == "tmpfs" else _file_size_limit)(tmp_path) as d:
        before = set(os.listdir(d))
        rc, err = _run([*argv, flag, str(d / name)], tmp_path, capsys)
        after = set(os.listdir(d))
    assert rc == 2, err
    assert any(f"{d / name}: cannot write" in line for line in err), err
    assert not any("internal error" in line for line in err), err
    assert after == before, "a failed write left a file behind"


# ---- item 3: --instances with --metrics-port ---------------------------------------------------

def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    pytest.skip("no two consecutive free ports")


@pytest.mark.slow
def test_instances_with_a_metrics_port_serve_one_port_each(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Both instances bound P (the second failed: exit 3); instance i now serves P + i."""
    pytest.importorskip("prometheus_client")
    monkeypatch.chdir(tmp_path)
    port = _free_port_pair()
    rc, err = _run(["replay", "--instances", "2", "--limit", "4", "--metrics-port", str(port),
                    "--json", str(tmp_path / "r.json")], tmp_path, capsys)  # fmt: skip
    assert rc == 0, err
    assert (tmp_path / "r.json").exists()


# ---- item 3: a model this machine cannot hold ----------------------------------------------------

def test_a_gpu_size_preset_on_a_cpu_host_is_refused_before_it_is_built(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """dsv32-width on a CPU host with 16 GiB available: refused from the memory its
    weights take, before building them (a build hangs the host or feeds a rank to
    the OOM killer). The memory reading is the test's; the model is never built."""
    pytest.importorskip("transformers")
    import hostmem.sizing as sizing
    from hicache_cp.harness.engines import hf_model

    gib = 1 << 30
    reading = sizing.HostMemory(sizing.MemorySource.MEMINFO, 24 * gib, 16 * gib, 0, 24 * gib, 16 * gib)
    monkeypatch.setattr(sizing, "host_memory", lambda *a, **k: reading)

    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was built")

    monkeypatch.setattr(hf_model, "build", never)
    monkeypatch.chdir(tmp_path)
    for cp in ("1", "2"):
        rc, err = _run(["replay", "--engine", "hf", "--hf-preset", "dsv32-width", "--device", "cpu", "--limit", "1",
                        "--cp-size", cp, "--json", str(tmp_path / "r.json")], tmp_path, capsys)  # fmt: skip
        assert rc == 2, err
        assert len(err) == 1 and "the model" in err[0] and f"of {cp} rank(s)" in err[0], err
    assert os.listdir(tmp_path) == []
    assert hf_model.build_bytes("dsv32-width") > 20 * gib > 100 * hf_model.build_bytes("tiny")
