"""Tests for hostmem.arena (CPU everywhere; CUDA registration where a GPU exists).

The pipeline tests replace the four CUDA calls the arena makes (register,
unregister, get/set device) with a recording fake, so the order and
concurrency of prefaulting and registration are checked on CPU; the GPU tests
at the end check the same against the real driver.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hostmem.arena
import hostmem.cuda
import hostmem.pinning
from hostmem.arena import ArenaError, HostArena, TouchMode
from hostmem.cuda import CudaError, cuda_available, host_get_flags
from hostmem.mapping import HugePages, Mapping, populate_supported, thp_mode, thp_size
from hostmem.progress import ChunkProgress

MIB = 1 << 20
gpu = pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
thp = pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")


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
        assert [size for _, size in arena.chunks()] == [MIB, MIB, MIB, 4096]


@pytest.mark.parametrize("touch", [TouchMode.POPULATE, TouchMode.WRITE, TouchMode.NONE])
@pytest.mark.parametrize("huge", [HugePages.AUTO, HugePages.THP, HugePages.NONE])
def test_every_prefault_and_page_mode_gives_a_whole_zeroed_writable_arena(touch: TouchMode, huge: HugePages) -> None:
    size = 6 * MIB + 8192  # a partial last chunk and a partial last huge page
    with HostArena(size, pin=False, touch_threads=3, register_chunk_bytes=2 * MIB, huge_pages=huge, touch=touch) as arena:
        arena.wait_ready(timeout=30)
        expected = TouchMode.WRITE if touch is TouchMode.POPULATE and not populate_supported() else touch
        assert arena.touch_mode is expected
        assert arena.huge_pages in (HugePages.THP, HugePages.NONE)  # no hugetlbfs pool asked for
        view = arena.numpy()
        assert not view.any()  # fresh anonymous memory reads zero after any prefault
        view[::4096] = 9
        assert int(view.sum()) == 9 * len(range(0, size, 4096))
        t = arena.timings
        assert t.first_chunk_s is not None and t.ready_s is not None and t.first_chunk_s <= t.ready_s
        if touch is not TouchMode.NONE:
            assert t.touch_done_s is not None and t.touch_done_s <= t.ready_s and t.touch_busy_s > 0


@thp
def test_thp_arena_is_aligned_advised_and_backed_by_huge_pages() -> None:
    size = 16 * MIB
    with HostArena(size, pin=False, touch_threads=2, register_chunk_bytes=4 * MIB, huge_pages="thp", touch="write") as arena:
        arena.wait_ready(timeout=30)
        assert arena.huge_pages is HugePages.THP
        assert arena.ptr % thp_size() == 0  # every 2 MiB of the arena can be one huge page
        assert "hg" in arena.vm_flags()
        huge = arena.huge_page_bytes()  # read back from /proc/self/smaps
        assert 0 < huge <= size and huge % thp_size() == 0


def test_base_pages_are_not_advised_huge() -> None:
    with HostArena(4 * MIB, pin=False, register_chunk_bytes=MIB, huge_pages="none") as arena:
        assert arena.huge_pages is HugePages.NONE
        assert "hg" not in arena.vm_flags()
        assert arena.page_size == mmap.PAGESIZE


def test_hugetlb_request_falls_back_when_the_pool_cannot_serve_it(
    tmp_path, caplog: pytest.LogCaptureFixture  # type: ignore[no-untyped-def]
) -> None:
    """A pool that claims free pages: MAP_HUGETLB is really tried; without real pages it falls back loudly."""
    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nHugePages_Free: 64\nHugepagesize: 2048 kB\n")
    with caplog.at_level("WARNING", logger="hostmem.mapping"):
        m = Mapping(8 * MIB, HugePages.HUGETLB, align=MIB << 1, proc_root=tmp_path, name="tlb")
    try:
        if m.obtained is HugePages.HUGETLB:  # this machine really has a hugetlbfs pool
            assert m.page_size == 2 * MIB and m.addr % (2 * MIB) == 0
        else:
            assert "hugetlb huge pages not used" in caplog.text
            assert m.obtained in (HugePages.THP, HugePages.NONE)
    finally:
        m.mm.close()
    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nHugePages_Free: 0\nHugepagesize: 2048 kB\n")
    m = Mapping(8 * MIB, HugePages.AUTO, proc_root=tmp_path, name="auto")
    assert m.obtained is not HugePages.HUGETLB  # AUTO never takes hugetlbfs it cannot cover
    m.mm.close()


def test_dontfork_is_applied_and_can_be_turned_off() -> None:
    with HostArena(2 * MIB, pin=False, register_chunk_bytes=MIB) as arena:
        assert arena.dontfork and "dc" in arena.vm_flags()  # dc: the kernel will not copy it on fork
    with HostArena(2 * MIB, pin=False, register_chunk_bytes=MIB, dontfork=False) as arena:
        assert not arena.dontfork and "dc" not in arena.vm_flags()


def _mapped_in_this_process(lo: int, hi: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start < hi and end > lo:
                return True
    return False


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("dontfork", [True, False])
def test_a_forked_child_neither_inherits_nor_breaks_the_arena(dontfork: bool) -> None:
    """A real fork. The child: the arena is closed (no CUDA, no munmap) and, with
    DONTFORK, its range is not mapped at all. The parent: unaffected, same bytes."""
    arena = HostArena(4 * MIB, pin=False, touch_threads=2, register_chunk_bytes=MIB, dontfork=dontfork, name="forked")
    try:
        arena.wait_ready(timeout=30)
        view = arena.numpy()
        view[:] = 5
        lo, hi = arena.ptr, arena.ptr + arena.nbytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded process" (3.12+)
            pid = os.fork()
        if pid == 0:  # the child: report by exit status only, touch nothing
            code = 0
            try:
                if not arena.closed:
                    code |= 1
                if _mapped_in_this_process(lo, hi) == dontfork:
                    code |= 2
                arena.close()  # a no-op here, must not raise
                try:
                    arena.numpy()
                    code |= 4
                except RuntimeError:
                    pass
            except BaseException:  # noqa: BLE001 - the child must exit, whatever happens
                code |= 8
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child exit status {status:#x}"
        assert not arena.closed and _mapped_in_this_process(lo, hi)
        assert (view == 5).all()
        view[:] = 6  # the parent still owns and writes its pages
        assert (arena.numpy(0, 16) == 6).all()
        del view
    finally:
        arena.close()


@pytest.fixture
def slow_arena(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[HostArena, threading.Event]]:
    """An arena of 4 MiB whose preparation stops after the first MiB until the gate opens."""
    gate = threading.Event()
    original = HostArena._touch_slice

    def slow_touch(self, lo, hi):  # type: ignore[no-untyped-def]
        if lo >= MIB:
            gate.wait(10)
        return original(self, lo, hi)

    monkeypatch.setattr(HostArena, "_touch_slice", slow_touch)
    arena = HostArena(4 * MIB, pin=False, touch_threads=1, register_chunk_bytes=MIB, touch="write", name="slow")
    try:
        arena.wait_ready(MIB, timeout=10)  # the first chunk is not gated
        yield arena, gate
    finally:
        gate.set()
        arena.close()


def test_wait_ready_times_out_when_preparation_is_slow(slow_arena: tuple[HostArena, threading.Event]) -> None:
    arena, _ = slow_arena
    with pytest.raises(TimeoutError, match="slow"):
        arena.wait_ready(timeout=0.05)
    assert arena.ready_bytes == MIB


def test_a_view_waits_for_the_bytes_it_covers(slow_arena: tuple[HostArena, threading.Event]) -> None:
    """A view is handed out only once its bytes are prepared (pinned: registered, so a
    DMA into it cannot fail); a view of what is ready already does not wait."""
    arena, gate = slow_arena
    assert len(arena.numpy(0, MIB)) == MIB  # ready: at once
    views: list[np.ndarray] = []
    waiter = threading.Thread(target=lambda: views.append(arena.numpy(0, 2 * MIB)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not views  # the second MiB is still being prepared
    gate.set()
    waiter.join(10)
    assert len(views[0]) == 2 * MIB and arena.ready_bytes >= 2 * MIB


def test_close_is_idempotent_and_use_after_close_raises() -> None:
    arena = HostArena(2 * MIB, pin=False, register_chunk_bytes=MIB, name="gone")
    kept = arena.numpy(0, 16)
    kept[:] = 5
    arena.close()
    arena.close()
    assert arena.closed and arena.timings.close_s is not None
    assert kept.tolist() == [5] * 16  # a view that outlives close stays valid memory
    for use in (lambda: arena.numpy(), lambda: arena.torch(), lambda: arena.ptr, lambda: arena.wait_ready()):
        with pytest.raises(RuntimeError, match="arena 'gone' is closed"):
            use()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        HostArena(0, pin=False)
    with pytest.raises(ValueError, match="register_chunk_bytes"):
        HostArena(MIB, pin=False, register_chunk_bytes=1000)
    with pytest.raises(ValueError, match="register_threads"):
        HostArena(MIB, pin=False, register_threads=0)
    with pytest.raises(ValueError, match="bogus"):
        HostArena(MIB, pin=False, huge_pages="bogus")
    with pytest.raises(ValueError, match="bogus"):
        HostArena(MIB, pin=False, touch="bogus")
    if not cuda_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            HostArena(MIB, pin=True)


def test_default_pin_follows_cuda_availability() -> None:
    with HostArena(MIB, register_chunk_bytes=MIB) as arena:
        assert arena.pinned == cuda_available()


# -- the pipeline, with a recording fake in place of the CUDA calls -----------------------------


@dataclass
class FakeCuda:
    """Records registrations; ``hook(offset_chunk_index)`` runs inside each one (may block or raise)."""

    base: int = 0
    chunk: int = MIB
    registered: list[int] = field(default_factory=list)
    unregistered: list[int] = field(default_factory=list)
    devices: list[int] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    hook: Callable[[int], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    arenas: list[HostArena] = field(default_factory=list)
    based: threading.Event = field(default_factory=threading.Event)  # set once `base` is known

    def index(self, ptr: int) -> int:
        return (ptr - self.base) // self.chunk

    def register(self, ptr: int, nbytes: int) -> None:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            assert self.based.wait(10), "the test never told the fake the arena's base"
            if self.hook is not None:
                self.hook(self.index(ptr))
            with self.lock:
                self.registered.append(ptr)
        finally:
            with self.lock:
                self.in_flight -= 1

    def unregister(self, ptr: int) -> None:
        with self.lock:
            self.unregistered.append(ptr)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    fake = FakeCuda()
    monkeypatch.setattr(hostmem.cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(hostmem.cuda, "host_register", fake.register)
    monkeypatch.setattr(hostmem.cuda, "host_unregister", fake.unregister)
    monkeypatch.setattr(hostmem.cuda, "get_device", lambda: 3)
    monkeypatch.setattr(hostmem.cuda, "set_device", fake.devices.append)
    yield fake
    for arena in fake.arenas:  # closed before the real CUDA calls come back, even when a test failed
        arena.close()


def _pinned(fake: FakeCuda, nbytes: int, **kwargs) -> HostArena:  # type: ignore[no-untyped-def]
    """A fake-pinned arena whose chunk indices the fake can compute (registrations wait for its base)."""
    kwargs.setdefault("register_chunk_bytes", MIB)
    fake.chunk = kwargs["register_chunk_bytes"]
    fake.based.clear()
    arena = HostArena(nbytes, pin=True, name="fake", **kwargs)
    fake.arenas.append(arena)
    fake.base = arena.ptr
    fake.based.set()
    return arena


def test_auto_touch_is_the_pinned_default_when_pinned_and_a_prefault_otherwise(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hostmem.arena, "PINNED_AUTO_TOUCH", TouchMode.NONE)
    arena = _pinned(fake_cuda, 2 * MIB)
    assert arena.touch_mode is TouchMode.NONE
    arena.wait_ready(timeout=30)
    with HostArena(MIB, pin=False, register_chunk_bytes=MIB) as plain:
        assert plain.touch_mode is (TouchMode.POPULATE if populate_supported() else TouchMode.WRITE)


def test_registration_failure_names_the_chunk_and_close_unregisters_once(fake_cuda: FakeCuda) -> None:
    """Chunk 2 fails to register; exactly chunks 0 and 1 are registered, and unregistered once."""

    def fail_chunk_2(index: int) -> None:
        if index == 2:
            raise CudaError("cudaHostRegister", 1)

    fake_cuda.hook = fail_chunk_2
    arena = _pinned(fake_cuda, 4 * MIB, touch_threads=2, register_threads=1)
    arena.wait_ready(2 * MIB, timeout=30)  # the prefix before the failure is usable
    with pytest.raises(ArenaError, match=r"registering chunk 2 \[2097152, 3145728\)"):
        arena.wait_ready(timeout=30)
    assert arena.ready_bytes == 2 * MIB
    arena.close()
    arena.close()
    assert sorted(fake_cuda.unregistered) == fake_cuda.registered == [arena._ptr, arena._ptr + MIB]

    calls = []

    def fail_third_call(index: int) -> None:  # the foreground arena's base is unknown until it returns
        calls.append(index)
        if len(calls) == 3:
            raise CudaError("cudaHostRegister", 1)

    fake_cuda.hook = fail_third_call
    fake_cuda.based.set()
    with pytest.raises(ArenaError, match="chunk 2"):  # foreground: the constructor raises
        HostArena(4 * MIB, pin=True, background=False, register_chunk_bytes=MIB, register_threads=1, name="fg")


def test_parallel_registration_failure_still_unregisters_exactly_what_was_registered(fake_cuda: FakeCuda) -> None:
    def fail_chunk_5(index: int) -> None:
        time.sleep(0.001)
        if index == 5:
            raise CudaError("cudaHostRegister", 2)

    fake_cuda.hook = fail_chunk_5
    arena = _pinned(fake_cuda, 12 * MIB, touch="none", register_threads=4)
    with pytest.raises(ArenaError, match="chunk 5"):
        arena.wait_ready(timeout=30)
    assert arena.ready_bytes <= 5 * MIB
    arena.close()
    assert sorted(fake_cuda.unregistered) == sorted(fake_cuda.registered)
    assert fake_cuda.base + 5 * MIB not in fake_cuda.registered
    assert len(set(fake_cuda.unregistered)) == len(fake_cuda.unregistered)  # never twice


def test_registrations_run_concurrently_on_the_arenas_device(fake_cuda: FakeCuda) -> None:
    """With two registering threads, two registrations are in the driver at once (a barrier proves it)."""
    barrier = threading.Barrier(2, timeout=10)

    def meet(index: int) -> None:
        if index < 2:
            barrier.wait()  # raises BrokenBarrierError if the registrations were serial

    fake_cuda.hook = meet
    arena = _pinned(fake_cuda, 4 * MIB, touch="none", register_threads=2)
    arena.wait_ready(timeout=30)
    assert fake_cuda.max_in_flight == 2
    assert set(fake_cuda.devices) == {3}  # workers register on the constructor's device, not device 0
    t = arena.timings
    assert t.register_busy_s > 0
    arena.close()
    assert sorted(fake_cuda.unregistered) == sorted(fake_cuda.registered) and len(fake_cuda.registered) == 4


def test_close_at_interpreter_exit_unregisters_every_chunk_on_its_own_thread(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM closes its connector from an atexit hook, where a thread pool refuses new work
    ("cannot schedule new futures after interpreter shutdown"): close still unregisters
    every registered chunk, once."""
    arena = _pinned(fake_cuda, 4 * MIB, touch="none", register_threads=2)
    arena.wait_ready(timeout=30)

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(hostmem.pinning.ThreadPoolExecutor, "submit", refuse)
    arena.close()
    assert sorted(fake_cuda.unregistered) == sorted(fake_cuda.registered) and len(fake_cuda.registered) == 4


def test_registration_of_early_chunks_overlaps_the_prefault_of_later_ones(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefault of the last chunk waits until chunk 0 is registered: a pipeline that
    registered only after prefaulting everything would stall here and time out."""
    chunk0_registered = threading.Event()
    original = HostArena._touch_slice

    def touch(self, lo, hi):  # type: ignore[no-untyped-def]
        if lo >= 3 * MIB:
            assert chunk0_registered.wait(10), "chunk 0 was not registered while later chunks were prefaulted"
        return original(self, lo, hi)

    def registered(index: int) -> None:
        if index == 0:
            chunk0_registered.set()

    monkeypatch.setattr(HostArena, "_touch_slice", touch)
    fake_cuda.hook = registered
    arena = _pinned(fake_cuda, 4 * MIB, touch="write", touch_threads=1, register_threads=1)
    arena.wait_ready(timeout=30)
    t = arena.timings
    assert t.touch_done_s is not None and t.ready_s is not None and t.touch_done_s <= t.ready_s
    arena.close()


def test_ready_prefix_waits_for_a_slow_first_chunk(fake_cuda: FakeCuda) -> None:
    """Chunks finish out of order; ready_bytes covers only the contiguous prefix."""
    release = threading.Event()

    def slow_first(index: int) -> None:
        if index == 0:
            release.wait(10)

    fake_cuda.hook = slow_first
    arena = _pinned(fake_cuda, 4 * MIB, touch="none", register_threads=4)
    deadline = time.monotonic() + 10
    while len(fake_cuda.registered) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(fake_cuda.registered) == 3  # chunks 1-3 are registered ...
    assert arena.ready_bytes == 0  # ... but nothing is usable before chunk 0
    release.set()
    arena.wait_ready(timeout=30)
    assert arena.ready_bytes == 4 * MIB
    arena.close()


def test_close_while_preparing_stops_and_unregisters_what_was_registered(fake_cuda: FakeCuda) -> None:
    started = threading.Event()
    release = threading.Event()

    def block_chunk_1(index: int) -> None:
        if index == 1:
            started.set()
            release.wait(10)

    fake_cuda.hook = block_chunk_1
    arena = _pinned(fake_cuda, 16 * MIB, touch="none", register_threads=1)
    assert started.wait(10)
    closer = threading.Thread(target=arena.close)
    closer.start()
    time.sleep(0.05)
    release.set()  # the in-flight registration completes; nothing after it starts
    closer.join(10)
    assert arena.closed
    assert len(fake_cuda.registered) == 2  # chunks 0 and 1, not the 14 queued after them
    assert sorted(fake_cuda.unregistered) == sorted(fake_cuda.registered)


@settings(max_examples=40, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 5 * MIB), st.integers(1, 3 * MIB)), min_size=1, max_size=8),
    chunk_pages=st.integers(1, 300),
)
def test_copies_cut_by_split_at_chunks_stay_inside_one_registration(runs: list[tuple[int, int]], chunk_pages: int) -> None:
    """The cross-chunk limit: the copy engines cut DMA runs with split_at_chunks at the
    arena's register_chunk_bytes; every piece must fall inside one of the arena's chunks()."""
    from hicache_cp.io.runs import split_at_chunks

    nbytes = 8 * MIB + 12288
    chunk = chunk_pages * 4096 * 4
    with HostArena(nbytes, pin=False, register_chunk_bytes=chunk, touch="none", name="split") as arena:
        bounds = arena.chunks()
        host = np.array([min(h, nbytes - 1) for h, _ in runs], dtype=np.int64)
        sizes = np.array([min(n, nbytes - h) for h, (_, n) in zip(host.tolist(), runs)], dtype=np.int64)
        h, _, n = split_at_chunks(host, np.zeros_like(host), sizes, arena.register_chunk_bytes)
        for a, s in zip(h.tolist(), n.tolist()):
            assert any(o <= a and a + s <= o + size for o, size in bounds), (a, s, chunk)
        assert int(n.sum()) == int(sizes.sum())


def test_an_unexpected_error_in_preparation_fails_loudly_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self, offset, size):  # type: ignore[no-untyped-def]
        raise RuntimeError("bug in the pipeline")

    monkeypatch.setattr(HostArena, "_slices", broken)
    with HostArena(2 * MIB, pin=False, register_chunk_bytes=MIB, touch="write", name="bug") as arena:
        with pytest.raises(ArenaError, match=r"arena 'bug': preparing chunk 0 .*bug in the pipeline"):
            arena.wait_ready(timeout=10)


@settings(max_examples=60, deadline=None)
@given(order=st.permutations(range(7)), sizes=st.lists(st.integers(1, 100), min_size=7, max_size=7))
def test_progress_ready_prefix_is_the_contiguous_done_prefix(order: list[int], sizes: list[int]) -> None:
    """Chunks finished in any order: after every step ready_bytes is the end of the
    longest prefix of finished chunks, and first_chunk_s/ready_s appear exactly when due."""
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    chunks = list(zip(offsets, sizes))
    seen: list[tuple[int, int]] = []
    progress = ChunkProgress(chunks, "p", time.perf_counter(), lambda size, ready, now: seen.append((size, ready)))
    done: set[int] = set()
    for index in order:
        progress.chunk_done(index)
        done.add(index)
        prefix = next((k for k in range(len(chunks)) if k not in done), len(chunks))
        expect = sum(sizes[:prefix])
        assert progress.ready_bytes == expect and seen[-1] == (sizes[index], expect)
        marks, _ = progress.snapshot()
        assert ("first_chunk_s" in marks) == (0 in done)
        assert ("ready_s" in marks) == (len(done) == len(chunks))
    progress.wait(sum(sizes), timeout=0)  # returns at once: everything is ready


# -- GPU ------------------------------------------------------------------------------------


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
@pytest.mark.parametrize("touch", ["populate", "write", "none"])
def test_every_prefault_mode_pins_with_parallel_registration(touch: str) -> None:
    """Every chunk pinned; DMA into memory the CPU never touched (touch="none": the
    registration faulted it in) lands in the arena's own pages, and the kernel's shared
    zero page is not what got pinned (a fresh page still reads zero)."""
    chunk = 8 * MIB
    with HostArena(64 * MIB, pin=True, register_chunk_bytes=chunk, touch=touch, register_threads=4, name="par") as arena:
        arena.wait_ready(timeout=60)
        src = torch.randint(0, 256, (chunk,), dtype=torch.uint8, device="cuda")
        for offset, _ in arena.chunks():
            host_get_flags(arena.ptr + offset)
            arena.torch(offset, chunk).copy_(src, non_blocking=True)  # D2H, one copy per chunk
        torch.cuda.synchronize()
        for offset, _ in arena.chunks():
            assert torch.equal(arena.torch(offset, chunk).to("cuda"), src)  # H2D back, same bytes
        fresh = mmap.mmap(-1, 1 << 16)
        assert fresh.read(1 << 16) == bytes(1 << 16)
        fresh.close()


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


@pytest.mark.gpu
@gpu
def test_cross_chunk_copy_is_the_documented_limit_and_cut_copies_work() -> None:
    """One copy across two registration chunks is rejected by the driver (the documented
    limit; if this starts to pass, the driver lifted it); the same bytes cut at the chunk
    boundary with split_at_chunks copy exactly."""
    from hicache_cp.io.runs import split_at_chunks

    chunk = 4 * MIB
    with HostArena(2 * chunk, pin=True, register_chunk_bytes=chunk, name="cross") as arena:
        arena.wait_ready(timeout=60)
        lo, n = chunk - MIB, 2 * MIB  # straddles the boundary
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        with pytest.raises(RuntimeError):
            arena.torch(lo, n).copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        torch.cuda.synchronize()
        h, d, s = split_at_chunks(np.array([lo]), np.array([0]), np.array([n]), chunk)
        assert len(s) == 2
        for a, b, size in zip(h.tolist(), d.tolist(), s.tolist()):
            arena.torch(a, size).copy_(src[b : b + size], non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(arena.torch(lo, n).clone().to("cuda"), src)  # clone: pageable, one copy is fine
