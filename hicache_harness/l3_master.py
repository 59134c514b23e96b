"""A Mooncake Store master (and the memory it stores in) on loopback, for replays and tests.

`MooncakeMaster` runs the wheel's `mooncake_master` binary as a child
process bound to 127.0.0.1: its RPC port and its metrics port both on
loopback (`--metrics_host`; the metrics port binds 0.0.0.0 otherwise), no
HTTP metadata server (clients use the P2P handshake), and the `local_first`
allocation strategy (a client that lends memory puts into its own segment,
a memcpy). It can be killed and restarted on the same port (fault tests).
`StorageHolder` is a store client in this process that only lends memory,
so objects outlive the caches that wrote them. `l3_service(address)` gives
an address to use: the given one, or a master started here and stopped
when the block exits.

Note: the store *clients* (Mooncake's transfer engine inside every
`MooncakeStore`) listen on all interfaces whatever they are given; that is
Mooncake's (see docs/platform.md), and nothing here sends traffic to
anything but 127.0.0.1.

    python -m hicache_harness.l3_master      # run a master until Ctrl-C
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from hicache_harness import lifetime
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.store import MooncakeStore

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
#: Memory the harness lends the store when it starts the master itself.
DEFAULT_SEGMENT_BYTES = 256 << 20


def master_binary() -> str:
    """Path of `mooncake_master`: the one inside the installed `mooncake` package, else PATH."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = Path(loc) / "mooncake_master"
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    found = shutil.which("mooncake_master") or shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    if found is None:
        raise FileNotFoundError("mooncake_master not found: install mooncake-transfer-engine(-non-cuda)")
    return found


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class MooncakeMaster:
    """One `mooncake_master` process on loopback. Use as a context manager."""

    def __init__(
        self,
        port: int | None = None,
        *,
        log_path: Path | None = None,
        allocation_strategy: str = "local_first",
        lease_ttl_ms: int | None = None,
    ) -> None:
        self.host = LOOPBACK
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        #: local_first: a client that lends memory puts into its own segment (a memcpy, no transfer)
        self.allocation_strategy = allocation_strategy
        self.lease_ttl_ms = lease_ttl_ms
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false",
            f"--allocation_strategy={self.allocation_strategy}",
        ]
        if self.lease_ttl_ms is not None:
            cmd.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        return cmd

    def start(self) -> MooncakeMaster:
        """Start the process and wait until its RPC port accepts connections."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"master {self.address} is already running")
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ)
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            # Its own session (a Ctrl-C at the terminal is the parent's to handle),
            # SIGKILLed by the kernel if the parent dies without stopping it.
            self.proc = subprocess.Popen(lifetime.pdeathsig_command(self.command()), stdout=out,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        self._wait_ready()
        logger.info("Mooncake master %s started (pid %d)", self.address, self.proc.pid)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} at start "
                                   f"(port {self.port}; log: {self.log_path or 'not kept'})")  # fmt: skip
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                return
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"mooncake_master on {self.address} not ready after {READY_TIMEOUT_S} s")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: every object's metadata is lost with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self) -> None:
        """Start again on the same ports (after `kill` or `stop`)."""
        self.stop()
        self.start()

    def __enter__(self) -> MooncakeMaster:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StorageHolder:
    """A store client in this process that only lends memory to the store."""

    def __init__(self, address: str, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        cfg = L3Config(backend="mooncake", master=address, segment_bytes=segment_bytes, local_buffer_bytes=0)
        self.store = MooncakeStore.open(cfg, name="l3 storage holder")

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> StorageHolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def holder_process(address: str, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Iterator[int]:
    """A `StorageHolder` in a child process (objects then cross a real
    loopback connection, not a memcpy); yields its pid, stops it on exit."""
    code = (
        "import sys\n"
        "from hicache_harness.l3_master import StorageHolder\n"
        f"h = StorageHolder({address!r}, {int(segment_bytes)})\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
        "h.close()\n"
    )
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    proc = subprocess.Popen(lifetime.pdeathsig_command([sys.executable, "-c", code]), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"storage holder process failed to start (exit {proc.poll()})")
        yield proc.pid
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(timeout=STOP_TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def l3_service(address: str | None, holder_bytes: int = 0) -> Iterator[str]:
    """The master address to use: `address`, or a master started here on
    loopback (with a storage holder lending `holder_bytes`, if > 0) and
    stopped when the block exits."""
    if address is not None:
        yield address
        return
    with MooncakeMaster() as master:
        if holder_bytes:
            with StorageHolder(master.address, holder_bytes):
                yield master.address
        else:
            yield master.address


def main() -> int:
    logging.basicConfig(level=logging.INFO)
    try:
        with lifetime.stop_on_signals(), MooncakeMaster() as master, StorageHolder(master.address):
            print(f"Mooncake master on {master.address} (Ctrl-C to stop)", flush=True)
            while master.running:
                time.sleep(1)
    except lifetime.Interrupted as exc:
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
