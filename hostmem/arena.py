"""One large host buffer on huge pages, prefaulted and pinned in parallel, usable while it grows.

Why not ``cudaHostAlloc``: the driver touches and pins serially, about 0.45 s
per GiB on an H200, so a 220 GB pool keeps a restarted prefill server without
L2 for a minute and a half. :class:`HostArena` instead:

1. maps anonymous memory (:class:`hostmem.mapping.Mapping`), asking for huge
   pages (THP ``madvise`` where enabled, or hugetlbfs where reserved) and
   ``MADV_DONTFORK``. With 2 MiB pages there are 512x fewer faults to take
   and pages to pin;
2. prefaults it from ``touch_threads`` threads (``MADV_POPULATE_WRITE``, or
   one write per page where the kernel lacks it), chunk after chunk of
   ``register_chunk_bytes``;
3. registers each chunk with ``cudaHostRegister`` from ``register_threads``
   threads as soon as that chunk is prefaulted, so registration of chunk k
   overlaps the prefault of the chunks after it. With ``touch="none"`` the
   registration itself faults the pages in (several chunks at once).

The prefix ``[0, ready_bytes)`` is usable as soon as its chunks are done, so
a server can start on the first chunks while the rest is still being pinned.
Steps 2 and 3 are the arena's :class:`hostmem.pinning.PinPipeline`; this module
keeps the buffer: mapping, views, the ready range, close and fork handling.

Lifecycle::

    arena = HostArena(64 << 30)          # returns at once (background=True)
    arena.wait_ready(1 << 30)            # first GiB prefaulted and registered
    view = arena.torch(0, 1 << 30)       # zero-copy views; block until ready
    arena.timings, arena.huge_page_bytes()   # what it cost, what the kernel gave
    ...
    arena.close()                        # stop workers, unregister, unmap

Contracts:

* Views (:meth:`HostArena.numpy`, :meth:`HostArena.torch`) block until their
  range is ready: the ``write`` prefault writes zeros, so handing out memory
  it has not reached yet would race with the caller's writes.
* **Registration is per chunk** (:meth:`HostArena.chunks`). A single CUDA
  copy whose host range crosses a chunk boundary spans two registrations,
  and the driver rejects it (``cudaErrorInvalidValue``, seen on the H200).
  Cut copies at chunk boundaries: ``hicache_cp.io.runs.split_at_chunks`` does
  it for the copy engines. A GPU kernel reading through the device pointer
  is not affected.
* :meth:`HostArena.close` unregisters exactly the chunks registered (never
  twice) and is idempotent. Views that outlive ``close`` keep the mapping
  alive (plain, unpinned memory) until they are dropped; every arena method
  after ``close`` raises ``RuntimeError``.
* **Fork**: an arena belongs to the process that made it. The range is
  ``MADV_DONTFORK`` (not even mapped in a child), and in a forked child the
  arena object is closed at once, without CUDA calls or ``munmap``; views
  made before the fork must not be used there.
* Without CUDA (or ``pin=False``) the arena is the same object over plain
  memory: ``pinned`` is False and nothing is registered.
"""

from __future__ import annotations

import enum
import logging
import os
import time
import weakref
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import numpy.typing as npt
import torch

from hostmem import cuda
from hostmem.mapping import BASE_PAGE, HugePages, Mapping, populate_supported
from hostmem.pinning import DEFAULT_REGISTER_THREADS, PinPipeline, default_touch_threads
from hostmem.progress import ArenaError
from hostmem.segment import SegmentRegion

logger = logging.getLogger(__name__)

__all__ = ["ArenaError", "ArenaTimings", "HostArena", "HugePages", "TouchMode"]


class TouchMode(str, enum.Enum):
    """How the arena faults its pages in before registering them."""

    #: ``POPULATE`` where the kernel has it (Linux 5.14+), else ``WRITE``.
    AUTO = "auto"
    #: ``madvise(MADV_POPULATE_WRITE)`` per slice: the kernel faults without user writes.
    POPULATE = "populate"
    #: one zero written per page from numpy (releases the GIL).
    WRITE = "write"
    #: no prefault: ``cudaHostRegister`` faults the pages itself (plain memory: on first use).
    NONE = "none"


#: What ``touch="auto"`` means for a pinned arena (plain arenas always
#: prefault with ``POPULATE``): the fastest to a whole pool of the three modes
#: measured by ``hicache-cp bench-pinning`` (docs/bench/pinning.md); ``NONE``, where
#: cudaHostRegister faults the pages itself on one thread, is several times slower.
PINNED_AUTO_TOUCH = TouchMode.WRITE


@dataclass(frozen=True)
class ArenaTimings:
    """Where an arena's preparation time went. Seconds from the constructor's start
    unless named ``*_busy_s`` (thread-seconds summed over tasks); None until reached.

    ``first_chunk_s``: first chunk usable. ``ready_s``: whole arena usable
    (when pinned: the last registration finished). ``touch_done_s``: the last
    prefault finished; with registration overlapped, ``ready_s`` follows it
    by about one chunk's registration, not by all of them. ``close_s``: time
    :meth:`HostArena.close` took (unregister + unmap).
    """

    map_s: float
    advise_s: float
    first_chunk_s: float | None = None
    ready_s: float | None = None
    touch_done_s: float | None = None
    touch_busy_s: float = 0.0
    register_busy_s: float = 0.0
    close_s: float | None = None


class HostArena:
    """A host buffer of ``nbytes`` bytes, optionally pinned for CUDA.

    Args:
        nbytes: size in bytes (> 0).
        pin: register with CUDA; default ``cuda_available()``. ``True``
            without CUDA raises ``RuntimeError``.
        touch_threads: prefault threads; default ``min(16, usable CPUs)``.
        register_chunk_bytes: bytes per ``cudaHostRegister`` and per step of
            ``ready_bytes``; a multiple of the base page (4 KiB).
        background: prepare in background threads (the constructor returns at
            once); ``False`` prepares everything before returning and raises
            :class:`ArenaError` on failure.
        name: used in log lines and error messages.
        huge_pages: :class:`HugePages` (or its value) to ask for; works without.
        touch: :class:`TouchMode` (or its value); ``auto`` is ``PINNED_AUTO_TOUCH``
            when pinned, ``populate`` otherwise (``write`` before Linux 5.14).
        register_threads: concurrent registrations (``DEFAULT_REGISTER_THREADS``).
        dontfork: ``MADV_DONTFORK`` the range (see the module doc).
        memory: a region of a shared segment (:meth:`hostmem.segment.Segment.region`)
            to use instead of a new anonymous mapping: its contents are kept
            (``touch`` ``auto`` prefaults with ``populate``, or not at all;
            ``write`` is refused), ``huge_pages`` and ``dontfork`` are the
            segment's, and :meth:`close` unregisters but leaves it mapped.

    Thread safety: ``ready_bytes``/``wait_ready``/``timings`` may be called
    from any thread; ``close`` from one.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        pin: bool | None = None,
        touch_threads: int | None = None,
        register_chunk_bytes: int = 1 << 30,
        background: bool = True,
        name: str = "arena",
        huge_pages: HugePages | str = HugePages.AUTO,
        touch: TouchMode | str = TouchMode.AUTO,
        register_threads: int = DEFAULT_REGISTER_THREADS,
        dontfork: bool = True,
        memory: SegmentRegion | None = None,
    ) -> None:
        t0 = time.perf_counter()
        self._closed = True  # until the mapping exists: __del__ and close() are no-ops
        if nbytes <= 0:
            raise ValueError(f"arena {name!r}: nbytes must be positive, got {nbytes}")
        if touch_threads is None:
            touch_threads = default_touch_threads()
        if touch_threads <= 0 or register_threads <= 0:
            raise ValueError(
                f"arena {name!r}: touch_threads and register_threads must be positive, "
                f"got {touch_threads} and {register_threads}"
            )
        if register_chunk_bytes <= 0 or register_chunk_bytes % BASE_PAGE:
            raise ValueError(
                f"arena {name!r}: register_chunk_bytes must be a positive multiple of {BASE_PAGE}, "
                f"got {register_chunk_bytes}"
            )
        huge_pages, touch = HugePages(huge_pages), TouchMode(touch)
        if memory is not None:
            if memory.nbytes != nbytes:
                raise ValueError(f"arena {name!r}: {nbytes} bytes asked, the region has {memory.nbytes}")
            if touch is TouchMode.WRITE:
                raise ValueError(f"arena {name!r}: touch write would zero the shared region's contents")
            if touch is TouchMode.AUTO:  # prefault keeping the contents, or let registration fault
                touch = TouchMode.POPULATE if populate_supported() else TouchMode.NONE
        if pin is None:
            pin = cuda.cuda_available()
        elif pin and not cuda.cuda_available():
            raise RuntimeError(f"arena {name!r}: pin=True but CUDA is not available")
        explicit_touch = touch is not TouchMode.AUTO
        if touch is TouchMode.AUTO:
            touch = PINNED_AUTO_TOUCH if pin else TouchMode.POPULATE
        if touch is TouchMode.POPULATE and not populate_supported():
            level = logging.WARNING if explicit_touch else logging.DEBUG
            logger.log(level, "arena %r: MADV_POPULATE_WRITE unsupported (Linux < 5.14); prefaulting by writes", name)
            touch = TouchMode.WRITE
        self.name = name
        self._nbytes = int(nbytes)
        self._pin = bool(pin)
        self._touch_mode = touch
        self._touch_threads = int(touch_threads)
        self._register_threads = int(register_threads)
        self._chunk = int(register_chunk_bytes)
        self._chunks = [(o, min(self._chunk, self._nbytes - o)) for o in range(0, self._nbytes, self._chunk)]
        # The device whose context registers: worker threads would otherwise use device 0.
        device = cuda.get_device() if self._pin else None
        self._owner_pid = os.getpid()
        self._map: Mapping | SegmentRegion | None = memory or Mapping(
            self._nbytes, huge_pages, dontfork=dontfork, align=self._chunk, name=f"arena {name!r}"
        )
        self._base: np.ndarray | None = np.frombuffer(
            self._map.mm, dtype=np.uint8, count=self._nbytes, offset=self._map.lead
        )
        self._ptr = self._map.addr
        self._pins = PinPipeline(
            name, self._ptr, self._chunks, t0, device=device,
            touch=self._touch_slice if touch is not TouchMode.NONE else None, slices=self._slices,
            touch_threads=self._touch_threads, register_threads=self._register_threads,
            summary=f"{self._map.obtained.value} pages, touch {touch.value}",
        )
        self._progress = self._pins.progress  # the ready range: read here, written by the pipeline
        self._closed = False
        _LIVE.add(self)
        if background:
            self._pins.start()
        else:
            self._pins.run()
            error = self._progress.error
            if error is not None:
                self.close()
                raise error

    # -- memory operations of the preparation (called by the pipeline) ----------

    def _slices(self, offset: int, size: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` pieces of one chunk, one per touch thread, on huge page boundaries."""
        assert self._map is not None, "open arena has a mapping"
        granule = self._map.granule
        step = -(-size // self._touch_threads)
        step += -step % granule
        return [(lo, min(lo + step, offset + size)) for lo in range(offset, offset + size, step)]

    def _touch_slice(self, lo: int, hi: int) -> None:
        """Fault in ``[lo, hi)`` as ``touch_mode`` says (runs in a touch thread; slices are disjoint)."""
        m, base = self._map, self._base
        assert m is not None and base is not None, "arena mapped while preparing"
        if self._touch_mode is TouchMode.POPULATE:
            end = min(-(-hi // m.page_size) * m.page_size, len(m.mm) - m.lead)  # whole pages of the mapping
            m.populate(lo, end - lo)
        else:
            base[lo:hi:m.page_size] = 0

    # -- readiness --------------------------------------------------------------

    @property
    def ready_bytes(self) -> int:
        """Bytes from offset 0 that are prefaulted (and registered when pinned). O(1)."""
        return self._progress.ready_bytes

    def wait_ready(self, nbytes: int | None = None, timeout: float | None = None) -> None:
        """Block until ``[0, nbytes)`` is ready (default: the whole arena).

        Returns at once when already ready, even if a later chunk failed.
        Raises :class:`ArenaError` (naming the failed chunk) when preparation
        failed before reaching ``nbytes``, ``TimeoutError`` after ``timeout``
        seconds, and ``RuntimeError`` when closed.
        """
        self._check_open()
        target = self._nbytes if nbytes is None else int(nbytes)
        if not 0 <= target <= self._nbytes:
            raise ValueError(f"arena {self.name!r}: cannot wait for {target} of {self._nbytes} bytes")
        self._progress.wait(target, timeout)

    @property
    def timings(self) -> ArenaTimings:
        """A snapshot of where preparation time went (see :class:`ArenaTimings`). O(1)."""
        m = self._map
        marks, busy = self._progress.snapshot()
        return ArenaTimings(
            map_s=m.map_s if m else 0.0, advise_s=m.advise_s if m else 0.0,
            **{k: marks.get(k) for k in ("first_chunk_s", "ready_s", "touch_done_s", "close_s")},
            **{k: busy.get(k, 0.0) for k in ("touch_busy_s", "register_busy_s")},
        )

    # -- properties and views ---------------------------------------------------

    @property
    def ptr(self) -> int:
        """Host base address of the arena (aligned to its huge page size when it has huge pages)."""
        self._check_open()
        return self._ptr

    @property
    def nbytes(self) -> int:
        """Size of the arena in bytes."""
        return self._nbytes

    @property
    def register_chunk_bytes(self) -> int:
        """Bytes per cudaHostRegister call. A single DMA must not cross a chunk
        boundary: each chunk is its own registration, and the driver rejects a
        copy spanning two (cudaErrorInvalidValue, seen on the H200)."""
        return self._chunk

    def chunks(self) -> list[tuple[int, int]]:
        """The registration units ``(offset, size)``, in order: ``[k * chunk, ...)``,
        the last one shorter when ``nbytes`` is not a multiple. One DMA must stay in one."""
        return list(self._chunks)

    @property
    def pinned(self) -> bool:
        """Whether the arena registers its memory with CUDA (see ``ready_bytes`` for how far)."""
        return self._pin

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (or this is a forked child's copy)."""
        return self._closed

    @property
    def huge_pages(self) -> HugePages:
        """What the mapping got: ``THP`` (advised; see :meth:`huge_page_bytes`), ``HUGETLB`` or ``NONE``."""
        return self._map.obtained if self._map is not None else HugePages.NONE

    @property
    def page_size(self) -> int:
        """Bytes one fault maps for sure: the hugetlbfs page size, else the base page."""
        return self._map.page_size if self._map is not None else BASE_PAGE

    @property
    def touch_mode(self) -> TouchMode:
        """How pages are prefaulted (``AUTO`` resolved)."""
        return self._touch_mode

    @property
    def register_threads(self) -> int:
        return self._register_threads

    @property
    def touch_threads(self) -> int:
        return self._touch_threads

    @property
    def dontfork(self) -> bool:
        """Whether ``MADV_DONTFORK`` was applied."""
        return self._map.dontfork if self._map is not None else False

    def huge_page_bytes(self) -> int:
        """Bytes of the arena backed by huge pages now, from ``/proc/self/smaps``.

        Tens of milliseconds for a large base-page arena; not for hot paths.
        """
        self._check_open()
        assert self._map is not None, "open arena has a mapping"
        return self._map.huge_bytes()

    def vm_flags(self) -> frozenset[str]:
        """The kernel's VmFlags of the arena's mapping (``dc``: not copied on fork, ``hg``: huge advised)."""
        self._check_open()
        assert self._map is not None, "open arena has a mapping"
        return self._map.vm_flags()

    def device_ptr(self, offset: int = 0) -> int:
        """Device address of byte ``offset``, from ``cudaHostGetDevicePointer``.

        Blocks until ``offset`` is ready. Raises ``RuntimeError`` when the
        arena is not pinned or closed; ``ValueError`` when out of range.
        """
        self._check_open()
        if not self._pin:
            raise RuntimeError(f"arena {self.name!r} is not pinned: no device pointer")
        if not 0 <= offset < self._nbytes:
            raise ValueError(f"arena {self.name!r}: offset {offset} outside [0, {self._nbytes})")
        self.wait_ready(offset + 1)
        return cuda.host_get_device_pointer(self._ptr + offset)

    def _span(self, offset: int, nbytes: int | None, itemsize: int) -> int:
        """Validate a view request and return its byte length."""
        self._check_open()
        length = self._nbytes - offset if nbytes is None else int(nbytes)
        if offset < 0 or length < 0 or offset + length > self._nbytes:
            raise ValueError(
                f"arena {self.name!r}: view [{offset}, {offset + length}) outside [0, {self._nbytes})"
            )
        if offset % itemsize or length % itemsize:
            raise ValueError(
                f"arena {self.name!r}: view offset {offset} and size {length} must be multiples of "
                f"the item size {itemsize}"
            )
        self.wait_ready(offset + length)
        return length

    def numpy(
        self, offset: int = 0, nbytes: int | None = None, dtype: npt.DTypeLike = np.uint8
    ) -> np.ndarray:
        """Zero-copy numpy view of ``[offset, offset + nbytes)``; blocks until ready.

        ``nbytes`` defaults to the rest of the arena. O(1); allocates no
        buffer. The view keeps the mapping alive past :meth:`close`.
        """
        dt = np.dtype(dtype)
        length = self._span(offset, nbytes, dt.itemsize)
        assert self._base is not None, "open arena has a base view"
        return self._base[offset : offset + length].view(dt)

    def torch(
        self, offset: int = 0, nbytes: int | None = None, dtype: torch.dtype = torch.uint8
    ) -> torch.Tensor:
        """Zero-copy CPU tensor over ``[offset, offset + nbytes)`` (``torch.frombuffer``).

        Blocks until ready. O(1); allocates no buffer. When the arena is
        pinned and ready the tensor's memory is page-locked, so
        ``copy_(..., non_blocking=True)`` to and from CUDA runs asynchronously
        (torch's ``is_pinned()`` may still say False for registered memory).
        A copy must not cross a registration chunk (see :meth:`chunks`).
        """
        itemsize = torch.empty(0, dtype=dtype).element_size()
        length = self._span(offset, nbytes, itemsize)
        if length == 0:
            return torch.empty(0, dtype=dtype)
        assert self._map is not None, "open arena has a mapping"
        return torch.frombuffer(self._map.mm, dtype=dtype, count=length // itemsize, offset=self._map.lead + offset)

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Stop preparation, unregister what was registered, unmap. Idempotent.

        Waits for the running prefault/registration tasks (queued ones are
        dropped). Unregisters from ``register_threads`` threads, each chunk
        exactly once; failures are logged at WARNING and do not stop the
        rest. When views still reference the mapping, it stays mapped until
        they are dropped (logged at DEBUG). The arena counts as closed
        afterwards either way. In a forked child it only marks the arena closed.
        """
        if self._closed:
            return
        if os.getpid() != self._owner_pid:
            self._forget_in_child()
            return
        t0 = time.perf_counter()
        try:
            self._pins.close()  # stop, wait for the running tasks, unregister each chunk once
        finally:
            self._closed = True
            self._progress.close()
            self._base = None
            m = self._map
            if m is not None:
                try:
                    m.release()
                except BufferError:
                    logger.debug("arena %r: views still alive; memory is freed when they are dropped", self.name)
            self._progress.mark("close_s", time.perf_counter() - t0)
            _LIVE.discard(self)

    def _forget_in_child(self) -> None:
        """In a forked child: closed, no CUDA calls, no munmap (the range is the parent's)."""
        self._pins.forget_after_fork()  # fresh locks, nothing registered here, progress closed
        self._closed = True
        self._base = None
        if self._map is not None:
            _INHERITED.append(self._map.mm)  # never unmapped here: with DONTFORK it is not mapped at all
            self._map = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"arena {self.name!r} is closed")

    def __enter__(self) -> HostArena:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort during garbage collection
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"ready={self._progress.ready_bytes}"
        return (
            f"HostArena(name={self.name!r}, nbytes={self._nbytes}, pinned={self._pin}, "
            f"huge_pages={self.huge_pages.value}, {state})"
        )


#: Open arenas of this process, so a forked child can close its copies.
_LIVE: weakref.WeakSet[HostArena] = weakref.WeakSet()
#: mmap objects a forked child inherited: kept forever so their finalizer never
#: unmaps an address range the child does not own.
_INHERITED: list[object] = []


def _after_fork_in_child() -> None:
    for arena in list(_LIVE):
        arena._forget_in_child()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
