"""One large host buffer, first-touched in parallel and pinned chunk by chunk.

Why not ``cudaHostAlloc``: it touches and pins serially in the driver, about
0.6 s per GiB on an H200, so a 200 GiB pool takes two minutes before the
server can start. :class:`HostArena` instead maps anonymous memory, touches
it from several threads (page faults dominate, and numpy's strided writes
release the GIL), then registers it with ``cudaHostRegister`` (about 0.03 s
per GiB), one chunk at a time, in a background thread. The prefix
``[0, ready_bytes)`` is usable as soon as its chunks are done, so a server can
start on the first chunks while the rest is still being pinned.

Lifecycle::

    arena = HostArena(64 << 30)          # returns at once (background=True)
    arena.wait_ready(1 << 30)            # first GiB touched and registered
    view = arena.torch(0, 1 << 30)       # zero-copy views; block until ready
    ...
    arena.close()                        # stop worker, unregister, unmap

Contracts:

* Views (:meth:`HostArena.numpy`, :meth:`HostArena.torch`) block until their
  range is ready: the toucher writes zeros, so handing out memory it has not
  reached yet would race with the caller's writes.
* Registration is per chunk of ``register_chunk_bytes``; a single CUDA copy
  that crosses a chunk boundary spans two registrations. Keep copies inside
  one chunk (pages never straddle a chunk when the chunk size is a multiple
  of the page size) or expect the driver to split them.
* :meth:`HostArena.close` unregisters exactly the chunks registered (never
  twice) and is idempotent. Views that outlive ``close`` keep the mapping
  alive (plain, unpinned memory) until they are dropped; every arena method
  after ``close`` raises ``RuntimeError``.
* Without CUDA (or ``pin=False``) the arena is the same object over plain
  memory: ``pinned`` is False and nothing is registered.
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

import numpy as np
import numpy.typing as npt
import torch
from tqdm import tqdm

from hostmem import cuda

logger = logging.getLogger(__name__)

__all__ = ["ArenaError", "HostArena"]

#: Arenas smaller than this never show a progress bar (pinning is sub-second).
PROGRESS_BAR_MIN_BYTES = 1 << 30
#: Seconds between INFO progress lines when no progress bar is shown.
PROGRESS_LOG_INTERVAL_S = 5.0
#: Touch granularity: one write per OS page faults the page in.
_PAGE = mmap.PAGESIZE


class ArenaError(RuntimeError):
    """Preparing (touching or registering) a chunk of the arena failed."""


class HostArena:
    """A host buffer of ``nbytes`` bytes, optionally pinned for CUDA.

    Args:
        nbytes: size in bytes (> 0).
        pin: register with CUDA; default ``cuda_available()``. ``True``
            without CUDA raises ``RuntimeError``.
        touch_threads: threads that first-touch each chunk in parallel.
        register_chunk_bytes: bytes touched and registered per step; the unit
            in which ``ready_bytes`` grows.
        background: prepare chunks in a background thread (the constructor
            returns at once); ``False`` prepares everything before returning
            and raises :class:`ArenaError` on failure.
        name: used in log lines and error messages.

    Thread safety: ``ready_bytes``/``wait_ready`` may be called from any
    thread; ``close`` from one.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        pin: bool | None = None,
        touch_threads: int = 8,
        register_chunk_bytes: int = 1 << 30,
        background: bool = True,
        name: str = "arena",
    ) -> None:
        if nbytes <= 0:
            raise ValueError(f"arena {name!r}: nbytes must be positive, got {nbytes}")
        if touch_threads <= 0:
            raise ValueError(f"arena {name!r}: touch_threads must be positive, got {touch_threads}")
        if register_chunk_bytes <= 0 or register_chunk_bytes % _PAGE:
            raise ValueError(
                f"arena {name!r}: register_chunk_bytes must be a positive multiple of {_PAGE}, "
                f"got {register_chunk_bytes}"
            )
        if pin is None:
            pin = cuda.cuda_available()
        elif pin and not cuda.cuda_available():
            raise RuntimeError(f"arena {name!r}: pin=True but CUDA is not available")
        self.name = name
        self._nbytes = int(nbytes)
        self._pin = bool(pin)
        self._touch_threads = touch_threads
        self._chunk = int(register_chunk_bytes)
        self._closed = False
        self._cond = threading.Condition()
        self._ready = 0  # guarded by _cond
        self._error: BaseException | None = None  # guarded by _cond
        self._stop = threading.Event()
        self._registered: list[tuple[int, int]] = []  # (offset, size), owned by the worker until joined
        self._mm: mmap.mmap | None = mmap.mmap(-1, self._nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError as exc:  # advisory only
                logger.debug("arena %r: MADV_HUGEPAGE refused: %s", name, exc)
        self._base: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)
        self._ptr = int(self._base.ctypes.data)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._prepare, name=f"hostmem-{name}", daemon=True)
            self._thread.start()
        else:
            self._prepare()
            if self._error is not None:
                self.close()
                raise ArenaError(str(self._error)) from self._error

    # -- preparation (worker) -------------------------------------------------

    def _prepare(self) -> None:
        """Touch and register chunk by chunk, publishing ``ready_bytes``.

        Runs in the worker thread (or the constructor). Records the first
        failure in ``_error`` and stops; never raises.
        """
        base = self._base
        assert base is not None, "arena mapped before preparation"
        show_bar = self._nbytes >= PROGRESS_BAR_MIN_BYTES and sys.stderr.isatty()
        bar = tqdm(
            total=self._nbytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"{'pinning' if self._pin else 'touching'} {self.name}",
            disable=not show_bar,
            leave=False,
        )
        t0 = last_log = time.monotonic()
        try:
            with ThreadPoolExecutor(self._touch_threads, thread_name_prefix=f"touch-{self.name}") as pool:
                for index, offset in enumerate(range(0, self._nbytes, self._chunk)):
                    if self._stop.is_set():
                        return
                    size = min(self._chunk, self._nbytes - offset)
                    try:
                        self._touch(pool, base, offset, size)
                        if self._pin:
                            cuda.host_register(self._ptr + offset, size)
                            self._registered.append((offset, size))
                    except Exception as exc:  # noqa: BLE001 - the worker's one boundary
                        what = (
                            f"arena {self.name!r}: preparing chunk {index} "
                            f"[{offset}, {offset + size}) failed: {exc}"
                        )
                        logger.error("%s", what, exc_info=True)
                        with self._cond:
                            self._error = ArenaError(what)
                            self._error.__cause__ = exc
                            self._cond.notify_all()
                        return
                    with self._cond:
                        self._ready = offset + size
                        self._cond.notify_all()
                    bar.update(size)
                    now = time.monotonic()
                    if not show_bar and now - last_log >= PROGRESS_LOG_INTERVAL_S:
                        last_log = now
                        logger.info(
                            "arena %r: %.1f / %.1f GiB ready (%.1f s)",
                            self.name, (offset + size) / 2**30, self._nbytes / 2**30, now - t0,
                        )
        finally:
            bar.close()
        logger.info(
            "arena %r: %.2f GiB %s in %.2f s",
            self.name, self._nbytes / 2**30, "touched and pinned" if self._pin else "touched",
            time.monotonic() - t0,
        )

    def _touch(self, pool: ThreadPoolExecutor, base: np.ndarray, offset: int, size: int) -> None:
        """Write one zero per OS page of ``[offset, offset + size)`` from the pool."""
        step = -(-size // self._touch_threads)
        step += -step % _PAGE  # slices start on page boundaries
        futures = [
            pool.submit(_touch_slice, base, lo, min(lo + step, offset + size))
            for lo in range(offset, offset + size, step)
        ]
        for f in futures:
            f.result()

    # -- readiness --------------------------------------------------------------

    @property
    def ready_bytes(self) -> int:
        """Bytes from offset 0 that are touched (and registered when pinned). O(1)."""
        with self._cond:
            return self._ready

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
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._ready < target:
                if self._error is not None:
                    raise self._error
                if self._closed or self._stop.is_set():
                    raise RuntimeError(f"arena {self.name!r} is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"arena {self.name!r}: {self._ready} of {target} bytes ready after {timeout} s"
                    )
                self._cond.wait(remaining)

    # -- properties and views ---------------------------------------------------

    @property
    def ptr(self) -> int:
        """Host base address of the arena."""
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

    @property
    def pinned(self) -> bool:
        """Whether the arena registers its memory with CUDA (see ``ready_bytes`` for how far)."""
        return self._pin

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

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
        """
        itemsize = torch.empty(0, dtype=dtype).element_size()
        length = self._span(offset, nbytes, itemsize)
        if length == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._mm, dtype=dtype, count=length // itemsize, offset=offset)

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Stop preparation, unregister what was registered, unmap. Idempotent.

        Waits for the worker to finish its current chunk. Unregistration
        failures are logged at WARNING and do not stop the rest. When views
        still reference the mapping, it stays mapped until they are dropped
        (logged at DEBUG). The arena counts as closed afterwards either way.
        """
        if self._closed:
            return
        self._stop.set()
        try:
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()
            self._unregister_all()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._base = None
            mm, self._mm = self._mm, None
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    logger.debug(
                        "arena %r: views still alive; memory is freed when they are dropped", self.name
                    )

    def _unregister_all(self) -> None:
        """Unregister each registered chunk exactly once."""
        while self._registered:
            offset, size = self._registered.pop()
            try:
                cuda.host_unregister(self._ptr + offset)
            except Exception as exc:  # noqa: BLE001 - teardown must reach every chunk
                logger.warning(
                    "arena %r: unregistering chunk [%d, %d) failed: %s",
                    self.name, offset, offset + size, exc,
                )

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
        state = "closed" if self._closed else f"ready={self._ready}"
        return f"HostArena(name={self.name!r}, nbytes={self._nbytes}, pinned={self._pin}, {state})"


def _touch_slice(base: np.ndarray, lo: int, hi: int) -> None:
    """Fault in the pages of ``base[lo:hi]`` by writing one zero per page."""
    base[lo:hi:_PAGE] = 0
