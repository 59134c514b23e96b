"""The store adapter: Mooncake Store's integer return codes become exceptions here, once.

`KVStore` is the slice of a distributed object store the L3 tier uses: batch
existence, zero-copy batch put and get of objects assembled from several
buffers (one object = a list of (address, length) chunks, in order), and
buffer registration. `MooncakeStore` implements it over
`mooncake.store.MooncakeDistributedStore` (TCP on loopback in tests, RDMA in
production); nothing else in the project touches Mooncake Store's codes.

Every call blocks its calling thread (the L3 tier calls it from its worker
threads, never from the cache's thread) and is thread-safe. What a failure
means is carried by `L3Error`:

    store_down            the master (or a peer) is unreachable: the tier stops
                          issuing operations and probes until it answers
    io_may_be_in_flight   Mooncake may still move bytes after the call
                          returned (a transfer failure or an unknown code): the
                          buffers of that call must never be reused
                          (vLLM's Mooncake connector treats these codes alike)

Runs in: any process; one `MooncakeStore` per cache rank.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hicache_cp.errors import ConfigError, HiCacheError
from hicache_cp.l3.config import L3Config

logger = logging.getLogger(__name__)


class StoreCode(enum.IntEnum):
    """Mooncake Store's `ErrorCode` (mooncake-store/include/types.h), the values we meet."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200  # no space in any segment
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600  # e.g. the buffers are smaller than the object
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    UNAVAILABLE_IN_CURRENT_STATUS = -1010


_DOWN = frozenset({StoreCode.RPC_FAIL, StoreCode.RPC_TIMEOUT, StoreCode.CLIENT_NOT_FOUND,
                   StoreCode.UNAVAILABLE_IN_CURRENT_STATUS})  # fmt: skip
# Rejected before any byte moved, or after the transfer completed.
_SAFE = frozenset({
    StoreCode.BUFFER_OVERFLOW, StoreCode.SEGMENT_NOT_FOUND, StoreCode.CLIENT_NOT_FOUND,
    StoreCode.NO_AVAILABLE_HANDLE, StoreCode.INVALID_KEY, StoreCode.INVALID_PARAMS, StoreCode.ILLEGAL_CLIENT,
    StoreCode.REPLICA_IS_NOT_READY, StoreCode.OBJECT_NOT_FOUND, StoreCode.OBJECT_ALREADY_EXISTS,
    StoreCode.OBJECT_HAS_LEASE, StoreCode.LEASE_EXPIRED, StoreCode.RPC_FAIL, StoreCode.RPC_TIMEOUT,
    StoreCode.UNAVAILABLE_IN_CURRENT_STATUS,
})  # fmt: skip


def code_name(code: int) -> str:
    try:
        return StoreCode(code).name
    except ValueError:
        return f"UNKNOWN({code})"


@dataclass
class L3Error(HiCacheError):
    """An L3 store operation failed. `code` is Mooncake's (None: our own check
    failed, e.g. a short read or a deadline); `key` the first key concerned."""

    op: str
    what: str
    code: int | None = None
    key: str | None = None
    details: dict[str, object] = field(default_factory=dict)

    @property
    def store_down(self) -> bool:
        return self.code is not None and self.code in _DOWN

    @property
    def io_may_be_in_flight(self) -> bool:
        return self.code is not None and self.code not in _SAFE

    @property
    def missing(self) -> bool:
        return self.code == StoreCode.OBJECT_NOT_FOUND

    def __str__(self) -> str:
        ctx = [f"op={self.op}"]
        if self.code is not None:
            ctx.append(f"code={code_name(self.code)}")
        if self.key is not None:
            ctx.append(f"key={self.key}")
        ctx += [f"{k}={v}" for k, v in self.details.items()]
        return f"L3 {self.what} ({', '.join(ctx)})"


class L3Timeout(L3Error):
    """An L3 operation passed its deadline (the call itself may still be running)."""


Chunks = Sequence[int]


class KVStore(Protocol):
    """What the L3 tier needs from an object store. All methods block and are
    thread-safe; failures raise `L3Error` as documented per method."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Make [ptr, ptr + nbytes) usable for zero-copy put/get."""

    def unregister(self, ptr: int) -> None: ...

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is the object there? Raises L3Error if the lookup failed."""

    def put(self, keys: Sequence[str], ptrs: Sequence[Chunks], sizes: Sequence[Chunks]) -> list[L3Error | None]:
        """Store each key's object, assembled from its chunks in order.

        Per key: None (stored, or already there) or the L3Error of that key."""

    def get(self, keys: Sequence[str], ptrs: Sequence[Chunks], sizes: Sequence[Chunks]) -> int:
        """Read each key's object into its chunks, in order. Every object must
        fill its chunks exactly: a missing key, a short read or any failure
        raises L3Error naming the key (after the call returned: nothing of
        this call is in flight unless `io_may_be_in_flight`). Returns bytes read."""

    def close(self) -> None: ...


def reachable(master: str, timeout_s: float, name: str = "l3") -> None:
    """Raise L3Error within `timeout_s` unless something accepts TCP connections at
    `master` (HOST:PORT). Mooncake's own setup retries an absent master for
    about 100 s; this probe fails first, in one line."""
    host, _, port = master.rpartition(":")
    deadline = time.monotonic() + timeout_s
    error: OSError | None = None
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.05, min(1.0, timeout_s))):
                return
        except OSError as exc:
            error = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    raise L3Error("setup", f"no Mooncake master accepts connections at {master} within {timeout_s:g} s "
                           f"({error.strerror or error})", details={"master": master, "client": name})  # fmt: skip


def rdma_devices(sys_root: Path | str = Path("/sys")) -> list[str]:
    """The RDMA devices this host has (the names under /sys/class/infiniband), sorted."""
    root = Path(sys_root) / "class" / "infiniband"
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:  # no such class: no RDMA stack, no device
        return []


def check_protocol(config: L3Config, sys_root: Path | str = Path("/sys")) -> None:
    """ConfigError for `protocol = "rdma"` on a host with no RDMA device (the store
    would set up, fall back to another transport and be recorded as rdma)."""
    if config.protocol == "rdma" and not rdma_devices(sys_root):
        raise ConfigError(f"l3.protocol: rdma, but this host has no RDMA device ({Path(sys_root)}/class/infiniband "
                          "is empty or missing); use tcp")


class MooncakeStore:
    """`KVStore` over one `MooncakeDistributedStore` client (TCP or RDMA).

    `open` sets the client up with the P2P handshake (no metadata server)
    against `config.master`; `segment_bytes` is the memory this client lends
    the store (0: it only reads and writes objects others hold).
    """

    def __init__(self, client: Any, name: str) -> None:
        self.client = client  # the raw MooncakeDistributedStore (the benchmark's baseline uses it)
        self.name = name
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, config: L3Config, *, name: str = "l3") -> MooncakeStore:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise L3Error("setup", "mooncake.store is not importable (install mooncake-transfer-engine)",
                          details={"error": str(exc)}) from exc  # fmt: skip
        check_protocol(config)
        reachable(config.master, config.connect_timeout_s, name)
        client = MooncakeDistributedStore()
        rc = client.setup(
            config.local_hostname,
            "P2PHANDSHAKE",
            config.segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            config.device_name,
            config.master,
        )
        if rc != 0:
            raise L3Error("setup", "could not connect to the Mooncake master", code=rc,
                          details={"master": config.master, "client": name})  # fmt: skip
        logger.info("%s: connected to Mooncake master %s (segment %d B)", name, config.master, config.segment_bytes)
        return cls(client, name)

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self.client.register_buffer(ptr, nbytes)
        if rc != 0:
            raise L3Error("register", "register_buffer failed", code=rc, details={"ptr": hex(ptr), "bytes": nbytes})

    def unregister(self, ptr: int) -> None:
        rc = self.client.unregister_buffer(ptr)
        if rc != 0:
            raise L3Error("unregister", "unregister_buffer failed", code=rc, details={"ptr": hex(ptr)})

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self.client.batch_is_exist(list(keys))
        _check_len("exists", keys, codes)
        for key, c in zip(keys, codes):
            if c < 0:
                raise L3Error("exists", "lookup failed", code=c, key=key, details={"keys": len(keys)})
        return [c == 1 for c in codes]

    def put(self, keys: Sequence[str], ptrs: Sequence[Chunks], sizes: Sequence[Chunks]) -> list[L3Error | None]:
        if not keys:
            return []
        codes = self.client.batch_put_from_multi_buffers(list(keys), [list(p) for p in ptrs], [list(s) for s in sizes])
        _check_len("put", keys, codes)
        return [
            None if c in (StoreCode.OK, StoreCode.OBJECT_ALREADY_EXISTS) else L3Error("put", "put failed", code=c, key=k)
            for k, c in zip(keys, codes)
        ]

    def get(self, keys: Sequence[str], ptrs: Sequence[Chunks], sizes: Sequence[Chunks]) -> int:
        errors = self.get_each(keys, ptrs, sizes)
        for err in errors:
            if err is not None:
                if len(keys) > 1:
                    err.details["keys"] = len(keys)
                raise err
        return sum(sum(s) for s in sizes)

    def get_each(self, keys: Sequence[str], ptrs: Sequence[Chunks], sizes: Sequence[Chunks]) -> list[L3Error | None]:
        """`get` with a verdict per key (None: read in full) instead of raising
        for the first failure (SGLang's storage interface wants per-key results)."""
        if not keys:
            return []
        got = self.client.batch_get_into_multi_buffers(list(keys), [list(p) for p in ptrs], [list(s) for s in sizes])
        _check_len("get", keys, got)
        out: list[L3Error | None] = []
        for k, n, sz in zip(keys, got, sizes):
            want = sum(sz)
            if n == StoreCode.TRANSFER_FAIL:
                # Mooncake also answers TRANSFER_FAIL when the buffers do not add up to
                # the object (refused before any transfer): tell that apart, it is safe.
                size = self.client.get_size(k)
                if size >= 0 and size != want:
                    out.append(L3Error("get", "short read: the object is not the layout's size", key=k,
                                       details={"expected_bytes": want, "object_bytes": size}))  # fmt: skip
                    continue
            if n < 0:
                out.append(L3Error("get", "get failed", code=n, key=k))
            elif n != want:
                out.append(L3Error("get", "short read", key=k, details={"expected_bytes": want, "got_bytes": n}))
            else:
                out.append(None)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        rc = self.client.close()
        if rc != 0:
            logger.warning("%s: closing the Mooncake client returned %s", self.name, code_name(rc))


def _check_len(op: str, keys: Sequence[str], results: Sequence[int]) -> None:
    if len(results) != len(keys):
        raise L3Error(op, "the store answered for another number of keys",
                      details={"keys": len(keys), "answers": len(results)})  # fmt: skip
