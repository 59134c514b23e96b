"""Shared helpers of the L3 tests (no tests here).

- `l3env`: a real `mooncake_master` on 127.0.0.1 with a free port, a
  storage holder and a few store clients, started by the test module and
  always stopped.
- `l3_cache(store, settings)`: a tiny-config `HiCache` whose L3 tier runs on
  one of those clients (each test uses its own key namespace).
- `GatedStore`: the real store with gates before get and put, so a test can
  kill the master while a call is about to run (a test double *around* the
  real thing, never instead of it).
- `MemoryStore`: an in-memory `KVStore` double with injectable faults, for
  the property tests that need thousands of fast steps.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from conftest import PAGE, expected_bytes, tiny_config

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

mooncake_store = pytest.importorskip("mooncake.store", reason="Mooncake Store (mooncake-transfer-engine) not installed")

from hicache_cp.cache import HiCache  # noqa: E402
from hicache_harness.l3_master import MooncakeMaster  # noqa: E402
from hicache_cp.l3.store import KVStore, L3Error, MooncakeStore, StoreCode  # noqa: E402

SEGMENT = 64 << 20
CLIENTS = 4


class L3Env:
    """A master, a storage holder lending SEGMENT and CLIENTS store clients,
    shared by the tests of one module (a client's teardown costs ~1 s)."""

    def __init__(self) -> None:
        from hicache_harness.l3_master import StorageHolder
        from hicache_cp.l3.config import L3Config

        self.master = MooncakeMaster().start()
        self.holder = StorageHolder(self.master.address, SEGMENT)
        cfg = L3Config(backend="mooncake", master=self.master.address, local_buffer_bytes=0)
        self.stores = [MooncakeStore.open(cfg, name=f"test client {i}") for i in range(CLIENTS)]

    def settings(self, **kw: Any) -> dict[str, Any]:
        """[l3] settings with a namespace of their own (tests never see each other's keys)."""
        values: dict[str, Any] = dict(backend="mooncake", master=self.master.address, local_buffer_bytes=0,
                                      prefetch_timeout_s=5.0, lookup_timeout_s=2.0, retry_interval_s=0.2,
                                      close_timeout_s=10.0, namespace=f"t{os.getpid()}x{time.monotonic_ns()}")  # fmt: skip
        values.update(kw)
        return values

    def close(self) -> None:
        closers = [threading.Thread(target=c.close) for c in [*self.stores, self.holder]]  # ~1 s each: at once
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout=30)
        self.master.stop()


@pytest.fixture(scope="module")
def l3env() -> Iterator[L3Env]:
    env = L3Env()
    try:
        yield env
    finally:
        env.close()


def l3_cache(store: KVStore, settings: dict[str, Any], **cfg: Any) -> HiCache:
    """A tiny cache whose L3 tier runs on `store` with these [l3] settings
    (one page per object unless they say otherwise: the scenarios count pages)."""
    if settings.get("pages_per_object") is None:
        settings = {**settings, "pages_per_object": 1}
    return HiCache(tiny_config(l3=settings, **cfg), l3_store=store)


def flush_writes(cache: HiCache, timeout: float = 20.0) -> None:
    """Poll until every write-back job retired."""
    deadline = time.monotonic() + timeout
    cache.settle()
    while cache.l3 is not None and cache.l3.writes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"write-back still in flight after {timeout} s")
        time.sleep(0.002)
        cache.poll()


def until(cond, cache: HiCache, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Poll `cache` until `cond()` holds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not reached after {timeout} s")
        time.sleep(0.005)
        cache.poll()


def verify_l1(cache: HiCache, tokens: np.ndarray, positions: Sequence[int], l1_pages: np.ndarray) -> int:
    """Byte mismatches of the pages at `positions` (held in `l1_pages`) against
    what computing them gives (`conftest.expected_bytes`)."""
    bad = 0
    for pos, page in zip(positions, l1_pages):
        for p in cache.layout.parts:
            for slot, layer in enumerate(p.layer_ids):
                got = cache.device_pool.layer_view(p.part, slot)[page]
                if not np.array_equal(got, expected_bytes(tokens, pos, p.part, layer, p.page_bytes)):
                    bad += 1
    return bad


class GatedStore:
    """The real store, with a gate before each get and put (open by default)."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.get_gate = threading.Event()
        self.put_gate = threading.Event()
        self.get_gate.set()
        self.put_gate.set()
        self.get_waiting = threading.Event()
        self.put_waiting = threading.Event()

    def register(self, ptr: int, nbytes: int) -> None:
        self.inner.register(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        self.inner.unregister(ptr)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists(keys)

    def put(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        self.put_waiting.set()
        self.put_gate.wait(30)
        return self.inner.put(keys, ptrs, sizes)

    def get(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        self.get_waiting.set()
        self.get_gate.wait(30)
        return self.inner.get(keys, ptrs, sizes)

    def close(self) -> None:
        self.inner.close()


class MemoryStore:
    """An in-memory `KVStore` double (thread-safe) with injectable faults.

    `down`: every call raises RPC_FAIL; `lose(key)`: a key vanishes after
    the lookup (the get then misses); `short`: gets read half of an object."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.down = False
        self.short = False
        self.drop_on_get: set[str] = set()
        self.puts = 0
        self.gets = 0

    def _check(self, op: str) -> None:
        if self.down:
            raise L3Error(op, "injected: store down", code=StoreCode.RPC_FAIL)

    def register(self, ptr: int, nbytes: int) -> None:
        pass

    def unregister(self, ptr: int) -> None:
        pass

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check("exists")
        with self.lock:
            return [k in self.objects for k in keys]

    def put(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        self._check("put")
        out: list[L3Error | None] = []
        for k, ps, ss in zip(keys, ptrs, sizes):
            data = b"".join(ctypes.string_at(p, s) for p, s in zip(ps, ss))
            with self.lock:
                self.objects.setdefault(k, data)
                self.puts += 1
            out.append(None)
        return out

    def get(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        self._check("get")
        total = 0
        for k, ps, ss in zip(keys, ptrs, sizes):
            with self.lock:
                if k in self.drop_on_get:
                    self.objects.pop(k, None)
                data = self.objects.get(k)
                self.gets += 1
            if data is None:
                raise L3Error("get", "get failed", code=StoreCode.OBJECT_NOT_FOUND, key=k)
            want = sum(ss)
            if self.short:
                data = data[: len(data) // 2]
            if len(data) != want:
                raise L3Error("get", "short read", key=k, details={"expected_bytes": want, "got_bytes": len(data)})
            off = 0
            for p, s in zip(ps, ss):
                ctypes.memmove(p, data[off : off + s], s)
                off += s
            total += want
        return total

    def close(self) -> None:
        pass


def pages_tokens(*ids: int) -> np.ndarray:
    return np.concatenate([np.full(PAGE, i, dtype=np.int64) for i in ids])
