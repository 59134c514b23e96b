"""Every listener the project opens binds loopback (issue 29, class 2).

A real `replay --cp-size 2 --metrics-port P` run is sampled while it works:
every listening socket of the parent and its ranks (torch.distributed's
store, gloo's pairs, each rank's metrics endpoint) must be on 127.0.0.1, and
the store and both metrics ports must be among them. The Mooncake master the
harness starts binds loopback for its RPC and metrics ports.

Mooncake's TransferEngine (inside every store client and the PD engine)
listens on 0.0.0.0 and [::] in the installed wheel whatever it is given
(`MC_TCP_BIND_ADDRESS` and `MC_LEGACY_RPC_PORT_BINDING` were tried): the
README's security notes say so, and `test_mooncake_client_wildcards_are_the_documented_ones`
holds that exception to exactly those sockets.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import mooncake_store_available

ROOT = Path(__file__).resolve().parent.parent


def _listeners(pids: list[int]) -> dict[int, set[tuple[str, int]]]:
    out: dict[int, set[tuple[str, int]]] = {}
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        out[pid] = {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return out


def _loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def _free_port_pair() -> int:
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port < 65000:
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.slow
def test_cp_run_listens_on_loopback_only(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    with trace.open("w") as f:
        for i in range(20000):
            ids = [i % 97, 1000 + i % 13, 2000 + i]
            f.write(json.dumps({"timestamp": i, "input_length": 1536, "output_length": 1, "hash_ids": ids}) + "\n")
    port = _free_port_pair()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "hicache_harness", "replay", "--trace", str(trace), "--no-verify", "--cp-size", "2",
           "--metrics-port", str(port)]  # fmt: skip
    with (tmp_path / "err.txt").open("wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    seen: dict[int, set[tuple[str, int]]] = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            pids = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
            for pid, socks in _listeners(pids).items():
                seen.setdefault(pid, set()).update(socks)
            ports = {p for socks in seen.values() for _, p in socks}
            if {port, port + 1} <= ports and len([s for s in seen.values() if s]) >= 2:
                time.sleep(1.0)  # one more sample once every rank is serving
                for pid, socks in _listeners(pids).items():
                    seen.setdefault(pid, set()).update(socks)
                break
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-2000:]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    every = {s for socks in seen.values() for s in socks}
    assert {port, port + 1} <= {p for _, p in every}, f"metrics endpoints not seen: {every}"
    assert len(every) >= 4, f"expected the store, gloo's pairs and two metrics endpoints, saw {every}"
    wide = sorted(s for s in every if not _loopback(s[0]))
    assert wide == [], f"listening beyond loopback: {wide}"




@pytest.mark.slow
@pytest.mark.skipif(not mooncake_store_available(), reason="mooncake (store and master) not installed")
def test_mooncake_master_listens_on_loopback_and_client_wildcards_are_the_documented_ones() -> None:
    from hicache_harness.l3_master import MooncakeMaster, StorageHolder

    with MooncakeMaster() as master:
        assert master.proc is not None
        socks = _listeners([master.proc.pid])[master.proc.pid]
        assert {master.port, master.metrics_port} <= {p for _, p in socks}
        assert all(_loopback(ip) for ip, _ in socks), socks
        before = _listeners([os.getpid()])[os.getpid()]
        with StorageHolder(master.address):
            after = _listeners([os.getpid()])[os.getpid()]
    engine = after - before
    wide = {s for s in engine if not _loopback(s[0])}
    # The TransferEngine's handshake and data sockets, and nothing else: if a
    # Mooncake upgrade makes them bindable, this fails and the README note goes.
    assert 1 <= len(wide) <= 2 and {ip for ip, _ in wide} <= {"0.0.0.0", "::"}, engine
    readme = (ROOT / "README.md").read_text()
    assert "TransferEngine" in readme and "0.0.0.0" in readme, "the README's security notes must say it"
