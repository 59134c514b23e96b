"""Hardening round 4 (issue 48, items 3 and 4): what the input or the environment
gets wrong exits 2 with one line naming it, never 3 (a bug) and never silently.

Item 3: a full disk under an output file, a non-UTF-8 `--config`, `--hf-fault`
digits outside ASCII, an hf preset whose model this machine cannot hold, and
`--instances N --metrics-port P` (instance i now serves P + i). Item 4: values
that were accepted and then ignored or contradicted, now refused: `--spec-steps`
(unbounded, ignored without `--check-outputs`), PD and [l3] settings from any
source for a run without PD or L3, an --l3-* flag against --set of its field,
rdma without an RDMA device, a free-room target at or above its tier's
capacity, `[model_layout] name = 5`, and a decode-peer page the replay refuses.
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

from hicache_harness.cli import main

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
    # item 4: accepted, then ignored or contradicted
    ("spec-steps-unbounded", ["replay", "--engine", "hf", "--check-outputs", "2", "--spec-steps", "1000000"], None, [],
     "--spec-steps must be at most 64"),
    ("spec-steps-without-check-outputs", ["replay", "--engine", "hf", "--spec-steps", "2"], None, [],
     "it needs --check-outputs"),
    ("pd-timeout-from-toml-without-pd", ["replay", "--config"], _file("c.toml", "pd_timeout_s = 30\n"), [],
     "pd_timeout_s (from toml:"),
    ("pd-per-layer-from-set-without-pd", ["replay", "--set", "pd_per_layer=true"], None, [],
     "pd_per_layer (from cli) configures PD"),
    ("l3-master-without-l3", ["replay", "--config"], _file("c.toml", '[l3]\nmaster = "127.0.0.1:5000"\n'), [],
     "l3.master (from toml:"),
    ("l3-pages-per-object-without-l3", ["replay", "--set", "l3.pages_per_object=4"], None, [],
     "l3.pages_per_object (from cli) configures L3, which is off"),
    ("l3-master-flag-contradicts-set", ["replay", "--l3", "mooncake", "--set", "l3.master=127.0.0.1:5000",
                                        "--l3-master", "127.0.0.1:6000"], None, [],
     "--set l3.master=127.0.0.1:5000 contradicts --l3-master 127.0.0.1:6000"),
    ("l3-pages-flag-contradicts-set", ["replay", "--l3", "mooncake", "--set", "l3.pages_per_object=2",
                                       "--l3-pages-per-object", "4"], None, [],
     "--set l3.pages_per_object=2 contradicts --l3-pages-per-object 4"),
    ("l2-free-room-above-capacity", ["replay", "--set", "l2_free_room=100000"], None, [],
     "l2_free_room: 100000 pages kept free, but L2 holds"),
    ("l1-free-room-above-capacity", ["replay", "--config"], _file("c.toml", "l1_free_room = 100000\n"), [],
     "l1_free_room: 100000 pages kept free, but L1 holds"),
    ("model-layout-name-int", ["replay", "--config"], _file("c.toml", "[model_layout]\nname = 5\n"), [],
     "model_layout.name: expected a string, got 5 (from toml:"),
    ("decode-peer-misaligned-page", ["decode-peer", "--page-size", "3"], None, [],
     "layout: target_state page of 396 bytes is not a multiple of 8"),
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
    if argv[0] == "decode-peer":  # a valid key: the layout is what is wrong
        monkeypatch.setenv("HICACHE_CP_PD_AUTHKEY", "k" * 40)
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
    from hicache_harness.engines import hf_model

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


def test_a_pd_setting_from_the_environment_without_pd_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HICACHE_PD_TIMEOUT_S", "30")
    rc, err = _run(["replay", "--limit", "2"], tmp_path, capsys)
    assert rc == 2 and len(err) == 1 and "pd_timeout_s (from env:HICACHE_PD_TIMEOUT_S)" in err[0], err
    monkeypatch.setenv("HICACHE_L3_MASTER", "127.0.0.1:5000")
    monkeypatch.delenv("HICACHE_PD_TIMEOUT_S")
    rc, err = _run(["replay", "--limit", "2"], tmp_path, capsys)
    assert rc == 2 and len(err) == 1 and "l3.master (from env:HICACHE_L3_MASTER)" in err[0], err


def test_an_l3_section_turned_off_by_the_config_may_keep_its_settings(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """`enabled = false` beside the other [l3] fields: the config itself turned L3
    off, deliberately; the run goes on without L3."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text('[l3]\nenabled = false\nmaster = "127.0.0.1:5000"\n')
    rc, err = _run(["replay", "--limit", "2", "--config", str(tmp_path / "c.toml")], tmp_path, capsys)
    assert rc == 0, err


def test_rdma_needs_an_rdma_device(tmp_path: Path) -> None:
    """`l3.protocol = "rdma"` is refused on a host without one (the store fell back and
    the run recorded rdma), and accepted where /sys/class/infiniband lists one."""
    from hicache_cp.errors import ConfigError
    from hicache_cp.l3.config import L3Config
    from hicache_cp.l3.store import check_protocol, rdma_devices

    rdma = L3Config(backend="mooncake", protocol="rdma")
    with pytest.raises(ConfigError, match="l3.protocol: rdma, but this host has no RDMA device"):
        check_protocol(rdma, sys_root=tmp_path)
    (tmp_path / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
    assert rdma_devices(tmp_path) == ["mlx5_0"]
    check_protocol(rdma, sys_root=tmp_path)
    check_protocol(L3Config(backend="mooncake"), sys_root=tmp_path / "none")  # tcp needs nothing


def test_the_library_refuses_a_free_room_target_at_or_above_capacity() -> None:
    """Through `HiCache` itself (plug-ins build it without the replay's setup)."""
    from hicache_cp import Config, HiCache
    from hicache_cp.errors import ConfigError

    with pytest.raises(ConfigError, match="l2_free_room: 5000 pages kept free, but L2 holds"):
        HiCache(Config(model="tiny", l1_pages=64, host_budget_bytes=4 << 20, l2_free_room=5000))
    with pytest.raises(ConfigError, match="l1_free_room: 64 pages kept free, but L1 holds 63"):
        HiCache(Config(model="tiny", l1_pages=64, host_budget_bytes=4 << 20, l1_free_room=64))
    with HiCache(Config(model="tiny", l1_pages=64, host_budget_bytes=4 << 20, l1_free_room=62, l2_free_room=0.9)):
        pass
