"""The preparation pipeline of a host arena: prefault its chunks in parallel, pin each as soon as it is prefaulted.

:class:`PinPipeline` makes the chunks of one buffer (``(offset, size)`` in
order, contiguous from 0) usable, in three overlapped steps:

1. **prefault**: each chunk is cut into slices (``slices``, one per touch
   thread); the slices of all chunks are queued at once, in chunk order, on
   ``touch_threads`` threads, which fault them in (``touch``);
2. **register**: as soon as every slice of a chunk is done, its
   ``cudaHostRegister`` is queued on ``register_threads`` threads, so the
   registration of chunk k overlaps the prefault of the chunks after it.
   Each registering (and, at close, unregistering) thread first makes the
   buffer's device current (a new thread starts on device 0);
3. **publish**: each finished chunk is handed to the pipeline's
   :class:`~hostmem.progress.ChunkProgress` (from the registration's done
   callback, in the registering thread; from the driver when nothing is
   pinned), which advances the ready prefix. A progress bar follows it for
   large buffers on a terminal, else an INFO line every few seconds.

Without a device (plain memory) step 2 is skipped; without ``touch`` step 1
is, and the registration faults the pages itself.

The pipeline knows scheduling, CUDA registration and timing, not memory: its
owner (:class:`hostmem.arena.HostArena`) supplies ``slices`` and ``touch``,
which know the mapping, and reads readiness from :attr:`PinPipeline.progress`.

Failure: the first exception of any step is recorded in the progress, naming
its chunk (``ArenaError``), and sets ``progress.stop``; tasks that have not
started return at once. :meth:`PinPipeline.run` is the one boundary that
catches anything else, so no waiter hangs on a chunk that will never come.

Teardown: :meth:`PinPipeline.close` stops the pipeline, waits for the running
tasks and unregisters exactly the chunks that were registered, each once.

Threads: :meth:`PinPipeline.start` (or :meth:`PinPipeline.run`) once, from the
owner; :meth:`PinPipeline.close` once, from one thread; the progress may be
read from any thread. ``slices`` runs in the driver (the thread of ``run``);
``touch`` runs in the touch threads, concurrently on disjoint ranges.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tqdm import tqdm

from hostmem import cuda
from hostmem.progress import ChunkProgress

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_REGISTER_THREADS",
    "MAX_TOUCH_THREADS",
    "PROGRESS_BAR_MIN_BYTES",
    "PROGRESS_LOG_INTERVAL_S",
    "PinPipeline",
    "SliceFn",
    "TouchFn",
    "default_touch_threads",
]

#: Prefault threads: the page clearing is memory-bound and stops scaling
#: around 16 threads on an H200 host; never more than the CPUs we may use.
MAX_TOUCH_THREADS = 16
#: Concurrent cudaHostRegister calls: four beat one, and with the prefault overlapped
#: more threads did not help (``hicache-cp bench-pinning``'s variants, docs/bench/pinning.md).
DEFAULT_REGISTER_THREADS = 4
#: Arenas smaller than this never show a progress bar (pinning is sub-second).
PROGRESS_BAR_MIN_BYTES = 1 << 30
#: Seconds between INFO progress lines when no progress bar is shown.
PROGRESS_LOG_INTERVAL_S = 5.0

#: ``touch(lo, hi)``: fault in ``[lo, hi)`` of the buffer (byte offsets); raises on failure.
TouchFn = Callable[[int, int], None]
#: ``slices(offset, size)``: the ``[lo, hi)`` pieces one chunk is prefaulted in, covering it.
SliceFn = Callable[[int, int], list[tuple[int, int]]]


def default_touch_threads() -> int:
    """``min(MAX_TOUCH_THREADS, CPUs this process may run on)`` (its affinity mask, else the CPU count)."""
    return min(MAX_TOUCH_THREADS, _usable_cpus())


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class PinPipeline:
    """Prefaults and registers the chunks of one buffer, publishing each in :attr:`progress`.

    Args:
        name: the owner's name, in thread names, log lines and errors.
        ptr: host address of byte 0 of the buffer.
        chunks: the preparation (and registration) units, in order, contiguous from 0.
        t0: ``time.perf_counter()`` at the owner's start; progress marks count from it.
        device: the CUDA device whose context registers the chunks; None for
            plain memory (nothing is registered).
        touch: the prefault of one slice; None: no prefault pass.
        slices: how one chunk is cut for the touch threads (only called with ``touch``).
        touch_threads: prefault threads (> 0).
        register_threads: concurrent registrations and unregistrations (> 0).
        summary: how the memory was prepared, for the final INFO line
            (``"thp pages, touch populate"``).

    Creates no thread until :meth:`start` or :meth:`run`.
    """

    def __init__(
        self,
        name: str,
        ptr: int,
        chunks: list[tuple[int, int]],
        t0: float,
        *,
        device: int | None,
        touch: TouchFn | None,
        slices: SliceFn,
        touch_threads: int,
        register_threads: int,
        summary: str,
    ) -> None:
        assert touch_threads > 0 and register_threads > 0, f"arena {name!r}: thread counts must be positive"
        self.name = name
        self._ptr = ptr
        self._chunks = chunks
        self._nbytes = sum(size for _, size in chunks)
        self._device = device
        self._touch = touch
        self._slices = slices
        self._touch_threads = touch_threads
        self._register_threads = register_threads
        self._summary = summary
        self._t0 = self._last_log = t0
        self._bar: tqdm | None = None  # the driver's; read by _on_chunk in any thread
        self._lock = threading.Lock()
        self._registered: list[tuple[int, int]] = []  # guarded by _lock
        self._thread: threading.Thread | None = None
        #: The ready prefix, the first failure and the timings (``*_busy_s``,
        #: ``first_chunk_s``, ``ready_s``, ``touch_done_s``); read from any thread.
        self.progress = ChunkProgress(chunks, f"arena {name!r}", t0, self._on_chunk)

    @property
    def pinned(self) -> bool:
        """Whether chunks are registered with CUDA."""
        return self._device is not None

    # -- driving ----------------------------------------------------------------

    def start(self) -> None:
        """Run the pipeline in a background (daemon) thread; returns at once."""
        assert self._thread is None, f"arena {self.name!r}: pipeline started twice"
        self._thread = threading.Thread(target=self.run, name=f"hostmem-{self.name}", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Prepare every chunk in the calling thread; returns when done, failed or stopped.

        The preparation's boundary: an unexpected exception fails the next
        unready chunk (so no waiter hangs) instead of dying silently in the
        thread. Never raises; the outcome is in :attr:`progress`.
        """
        try:
            self._drive()
        except Exception as exc:  # noqa: BLE001 - the worker thread's one boundary
            self.progress.fail(self.progress.ready_chunks, "preparing", exc)

    def _drive(self) -> None:
        """Prefault and register every chunk, publishing ``ready_bytes``.

        Prefault slices of all chunks are queued at once, in chunk order, on
        the touch pool; as each chunk's slices finish its registration is
        queued on the register pool. The first failure is recorded in the
        progress, naming the chunk, and stops the remaining tasks.
        """
        progress, stop = self.progress, self.progress.stop
        show_bar = self._nbytes >= PROGRESS_BAR_MIN_BYTES and sys.stderr.isatty()
        self._bar = tqdm(
            total=self._nbytes, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"{'pinning' if self.pinned else 'touching'} {self.name}", disable=not show_bar, leave=False,
        )
        touching = self._touch is not None
        toucher = ThreadPoolExecutor(self._touch_threads, thread_name_prefix=f"touch-{self.name}") if touching else None
        registrar = (
            ThreadPoolExecutor(self._register_threads, thread_name_prefix=f"register-{self.name}")
            if self.pinned else None
        )
        try:
            slices = [
                [toucher.submit(self._touch_slice, lo, hi) for lo, hi in self._slices(offset, size)]
                for offset, size in self._chunks
            ] if toucher is not None else []
            for index, (offset, size) in enumerate(self._chunks):
                if stop.is_set():
                    break
                if slices:
                    try:
                        took = [f.result() for f in slices[index]]
                    except Exception as exc:  # noqa: BLE001 - the worker's boundary for prefault failures
                        progress.fail(index, "prefaulting", exc)
                        break
                    if any(t is None for t in took):  # stopped meanwhile
                        break
                    progress.add_busy("touch_busy_s", sum(t for t in took if t is not None))
                    if index == len(self._chunks) - 1:
                        progress.mark("touch_done_s")
                if registrar is not None:
                    future = registrar.submit(self._register_chunk, index, offset, size)
                    future.add_done_callback(lambda f, i=index: self._registered_cb(i, f))
                else:
                    progress.chunk_done(index)
        finally:
            for pool in (toucher, registrar):
                if pool is not None:  # queued tasks run to the end unless stopping (then they return at once)
                    pool.shutdown(wait=True, cancel_futures=stop.is_set())
            self._bar.close()
        ready_s = progress.snapshot()[0].get("ready_s")
        if ready_s is not None:
            logger.info(
                "arena %r: %.2f GiB %s in %.2f s (%s)", self.name, self._nbytes / 2**30,
                "prefaulted and pinned" if self.pinned else "prefaulted", ready_s, self._summary,
            )

    # -- tasks (worker threads) -------------------------------------------------

    def _touch_slice(self, lo: int, hi: int) -> float | None:
        """Fault in ``[lo, hi)``; returns the seconds it took (None when stopped before starting)."""
        assert self._touch is not None, "touch tasks are queued only with a touch step"
        if self.progress.stop.is_set():
            return None
        t0 = time.perf_counter()
        self._touch(lo, hi)
        return time.perf_counter() - t0

    def _register_chunk(self, index: int, offset: int, size: int) -> float | None:
        """``cudaHostRegister`` one chunk (on the buffer's device); returns the seconds it
        took, or None when stopped before starting."""
        if self.progress.stop.is_set():
            return None
        t0 = time.perf_counter()
        if self._device is not None:
            cuda.set_device(self._device)
        cuda.host_register(self._ptr + offset, size)
        with self._lock:
            self._registered.append((offset, size))
        return time.perf_counter() - t0

    def _registered_cb(self, index: int, future: Future[float | None]) -> None:
        """Done callback of a registration (runs in the registering thread).

        A chunk whose registration finished counts as ready even when another
        chunk failed meanwhile: its registration is real (and undone at close).
        """
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            self.progress.fail(index, "registering", exc)
            return
        seconds = future.result()
        if seconds is None:
            return
        self.progress.add_busy("register_busy_s", seconds)
        self.progress.chunk_done(index)

    def _on_chunk(self, size: int, ready: int, now: float) -> None:
        """After each finished chunk: advance the progress bar, or log every few seconds."""
        bar = self._bar
        if bar is None:
            return
        bar.update(size)
        if bar.disable and self._t0 + now - self._last_log >= PROGRESS_LOG_INTERVAL_S:
            self._last_log = self._t0 + now
            logger.info("arena %r: %.1f / %.1f GiB ready (%.1f s)", self.name, ready / 2**30, self._nbytes / 2**30, now)

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Stop, wait for the driver (and so for the running tasks; queued ones are
        dropped), then unregister every registered chunk exactly once.

        Called once, from one thread (the driver's own thread is not joined).
        Unregistration failures are logged at WARNING and do not stop the rest.
        """
        self.progress.stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._unregister_all()

    def _unregister_all(self) -> None:
        """Unregister each registered chunk exactly once, from up to ``register_threads`` threads."""
        with self._lock:
            todo, self._registered = self._registered, []
        if not todo:
            return

        def unregister(chunk: tuple[int, int]) -> None:
            offset, size = chunk
            try:
                if self._device is not None:
                    cuda.set_device(self._device)
                cuda.host_unregister(self._ptr + offset)
            except Exception as exc:  # noqa: BLE001 - teardown must reach every chunk
                logger.warning(
                    "arena %r: unregistering chunk [%d, %d) failed: %s", self.name, offset, offset + size, exc
                )

        workers = min(self._register_threads, len(todo))
        if workers == 1:
            for chunk in todo:
                unregister(chunk)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix=f"unregister-{self.name}") as pool:
            for i, chunk in enumerate(todo):
                try:
                    pool.submit(unregister, chunk)
                except RuntimeError:  # at interpreter exit (an engine's atexit shutdown) no thread starts
                    for rest in todo[i:]:
                        unregister(rest)
                    break

    def forget_after_fork(self) -> None:
        """In a forked child: nothing registered here, no driver, progress closed; no CUDA calls."""
        self._lock = threading.Lock()  # the parent's locks may have been held at fork time
        self.progress.forget_after_fork()
        self._registered = []
        self._thread = None
