"""Tests for hostmem.arena (CPU everywhere; CUDA registration where a GPU exists)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import hostmem.cuda
from hostmem.arena import ArenaError, HostArena
from hostmem.cuda import CudaError, cuda_available, host_get_flags

MIB = 1 << 20
gpu = pytest.mark.skipif(not cuda_available(), reason="needs CUDA")


def test_views_alias_the_same_bytes() -> None:
    with HostArena(4 * MIB, pin=False, touch_threads=2, register_chunk_bytes=MIB, name="alias") as arena:
        arena.wait_ready()
        n = arena.numpy()
        t = arena.torch()
        assert n.ctypes.data == arena.ptr == t.data_ptr()
        n[100:104] = [1, 2, 3, 4]
        assert t[100:104].tolist() == [1, 2, 3, 4]  # numpy write visible through torch
        t[5000] = 77
        assert n[5000] == 77  # torch write visible through numpy


def test_offsets_and_dtypes() -> None:
    with HostArena(2 * MIB, pin=False, touch_threads=2, register_chunk_bytes=MIB, name="offs") as arena:
        view = arena.numpy(MIB + 8, 64, dtype=np.int64)
        assert view.shape == (8,) and view.ctypes.data == arena.ptr + MIB + 8
        view[:] = np.arange(8)
        tv = arena.torch(MIB + 16, 16, dtype=torch.int64)
        assert tv.tolist() == [1, 2]
        assert arena.numpy(MIB, None).size == MIB  # defaults to the rest of the arena
        with pytest.raises(ValueError, match="outside"):
            arena.numpy(2 * MIB - 8, 16)
        with pytest.raises(ValueError, match="multiples"):
            arena.torch(4, 8, dtype=torch.int64)


def test_ready_bytes_and_wait_ready_plain_memory() -> None:
    arena = HostArena(8 * MIB, pin=False, touch_threads=3, register_chunk_bytes=MIB, name="ready")
    try:
        arena.wait_ready(MIB, timeout=30)
        assert arena.ready_bytes >= MIB
        arena.wait_ready(timeout=30)
        assert arena.ready_bytes == arena.nbytes == 8 * MIB
        assert arena.pinned is False
        with pytest.raises(ValueError):
            arena.wait_ready(9 * MIB)
        with pytest.raises(RuntimeError, match="not pinned"):
            arena.device_ptr(0)
    finally:
        arena.close()


def test_foreground_preparation_is_complete_on_return() -> None:
    with HostArena(3 * MIB + 4096, pin=False, background=False, register_chunk_bytes=MIB) as arena:
        assert arena.ready_bytes == arena.nbytes


def test_wait_ready_times_out_when_preparation_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    original = HostArena._touch

    def slow_touch(self, pool, base, offset, size):  # type: ignore[no-untyped-def]
        if offset >= MIB:
            gate.wait(10)
        original(self, pool, base, offset, size)

    monkeypatch.setattr(HostArena, "_touch", slow_touch)
    arena = HostArena(4 * MIB, pin=False, touch_threads=1, register_chunk_bytes=MIB, name="slow")
    try:
        arena.wait_ready(MIB, timeout=10)  # the first chunk is not gated
        with pytest.raises(TimeoutError, match="slow"):
            arena.wait_ready(timeout=0.05)
    finally:
        gate.set()
        arena.close()


def test_close_is_idempotent_and_use_after_close_raises() -> None:
    arena = HostArena(2 * MIB, pin=False, register_chunk_bytes=MIB, name="gone")
    kept = arena.numpy(0, 16)
    kept[:] = 5
    arena.close()
    arena.close()
    assert arena.closed
    assert kept.tolist() == [5] * 16  # a view that outlives close stays valid memory
    for use in (lambda: arena.numpy(), lambda: arena.torch(), lambda: arena.ptr, lambda: arena.wait_ready()):
        with pytest.raises(RuntimeError, match="arena 'gone' is closed"):
            use()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        HostArena(0, pin=False)
    with pytest.raises(ValueError, match="register_chunk_bytes"):
        HostArena(MIB, pin=False, register_chunk_bytes=1000)
    if not cuda_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            HostArena(MIB, pin=True)


def test_default_pin_follows_cuda_availability() -> None:
    with HostArena(MIB, register_chunk_bytes=MIB) as arena:
        assert arena.pinned == cuda_available()


def test_registration_failure_names_the_chunk_and_close_unregisters_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fake CUDA: chunk 2 fails to register; exactly chunks 0 and 1 are unregistered, once."""
    registered: list[int] = []
    unregistered: list[int] = []

    def fake_register(ptr: int, nbytes: int) -> None:
        if len(registered) == 2:
            raise CudaError("cudaHostRegister", 1)
        registered.append(ptr)

    monkeypatch.setattr(hostmem.cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(hostmem.cuda, "host_register", fake_register)
    monkeypatch.setattr(hostmem.cuda, "host_unregister", unregistered.append)
    arena = HostArena(4 * MIB, pin=True, touch_threads=2, register_chunk_bytes=MIB, name="fail")
    arena.wait_ready(2 * MIB, timeout=30)  # the prefix before the failure is usable
    with pytest.raises(ArenaError, match=r"chunk 2 \[2097152, 3145728\)"):
        arena.wait_ready(timeout=30)
    assert arena.ready_bytes == 2 * MIB
    arena.close()
    arena.close()
    assert sorted(unregistered) == registered == [arena._ptr, arena._ptr + MIB]

    with pytest.raises(ArenaError, match="chunk 2"):  # foreground: the constructor raises
        registered.clear()
        HostArena(4 * MIB, pin=True, background=False, register_chunk_bytes=MIB, name="fg")


@pytest.mark.gpu
@gpu
def test_registration_pins_and_close_unregisters() -> None:
    arena = HostArena(64 * MIB, pin=True, touch_threads=4, register_chunk_bytes=16 * MIB, name="gpu")
    arena.wait_ready(timeout=60)
    ptr = arena.ptr
    for offset in (0, 16 * MIB, 63 * MIB):
        host_get_flags(ptr + offset)  # succeeds only for pinned memory
    assert arena.device_ptr(0) != 0
    assert arena.device_ptr(MIB) == arena.device_ptr(0) + MIB
    arena.close()
    with pytest.raises(CudaError):
        host_get_flags(ptr)


@pytest.mark.gpu
@gpu
def test_pinned_view_copies_to_and_from_gpu() -> None:
    with HostArena(8 * MIB, pin=True, register_chunk_bytes=8 * MIB, name="copy") as arena:
        host = arena.torch(0, MIB)
        host.copy_(torch.arange(MIB, dtype=torch.int64).to(torch.uint8))
        dev = host.to("cuda", non_blocking=True)
        back = arena.torch(MIB, MIB)
        back.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, host)
        del host, back
