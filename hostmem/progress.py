"""Readiness of a buffer prepared chunk by chunk: the usable prefix, the first failure, the timings.

Chunks finish out of order when several threads prepare them; a reader may
use only the contiguous prefix of finished chunks. :class:`ChunkProgress`
keeps that prefix, the first failure (naming its chunk) and the moments
worth reporting, under one condition variable:

* writers (preparation threads): :meth:`ChunkProgress.chunk_done`,
  :meth:`ChunkProgress.fail`, :meth:`ChunkProgress.mark`,
  :meth:`ChunkProgress.add_busy`;
* readers (any thread): :attr:`ChunkProgress.ready_bytes`,
  :meth:`ChunkProgress.wait`, :meth:`ChunkProgress.snapshot`;
* :attr:`ChunkProgress.stop` is set by a failure or by :meth:`close`; tasks
  that have not started check it and return at once.

Cost: O(1) amortised per finished chunk (the prefix only moves forward).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["ArenaError", "ChunkProgress"]


class ArenaError(RuntimeError):
    """Preparing (prefaulting or registering) a chunk of the arena failed."""


class ChunkProgress:
    """The ready prefix over ``chunks`` (``(offset, size)`` in order, contiguous from 0).

    Args:
        chunks: the preparation units.
        name: the owner's name, for messages (``"arena 'L2 target_kv rank 0'"``).
        t0: ``time.perf_counter()`` at the owner's start; marks are relative to it.
        on_chunk: called outside the lock after each finished chunk with
            ``(chunk size, ready bytes, seconds since t0)`` (progress bars, logs).
    """

    def __init__(
        self,
        chunks: list[tuple[int, int]],
        name: str,
        t0: float,
        on_chunk: Callable[[int, int, float], None] | None = None,
    ) -> None:
        assert chunks and chunks[0][0] == 0, f"{name}: chunks must start at 0"
        self.name = name
        self.stop = threading.Event()
        self._chunks = chunks
        self._t0 = t0
        self._on_chunk = on_chunk
        self._cond = threading.Condition()
        self._done = [False] * len(chunks)  # guarded by _cond
        self._ready = 0  # guarded by _cond: bytes of the ready prefix
        self._ready_chunks = 0  # guarded by _cond
        self._error: ArenaError | None = None  # guarded by _cond
        self._closed = False  # guarded by _cond
        self._marks: dict[str, float] = {}  # guarded by _cond
        self._busy: dict[str, float] = {}  # guarded by _cond

    # -- writers ----------------------------------------------------------------

    def chunk_done(self, index: int) -> None:
        """Chunk ``index`` is usable; advance the prefix over finished chunks.

        Marks ``first_chunk_s`` and ``ready_s`` (all chunks) when reached.
        """
        size = self._chunks[index][1]
        with self._cond:
            self._done[index] = True
            while self._ready_chunks < len(self._chunks) and self._done[self._ready_chunks]:
                offset, length = self._chunks[self._ready_chunks]
                self._ready, self._ready_chunks = offset + length, self._ready_chunks + 1
            now = time.perf_counter() - self._t0
            if self._ready_chunks >= 1:
                self._marks.setdefault("first_chunk_s", now)
            if self._ready_chunks == len(self._chunks):
                self._marks.setdefault("ready_s", now)
            ready = self._ready
            self._cond.notify_all()
        if self._on_chunk is not None:
            self._on_chunk(size, ready, now)

    def fail(self, index: int, doing: str, exc: BaseException) -> None:
        """Record the first failure (naming chunk ``index``), log it, and set :attr:`stop`."""
        offset, size = self._chunks[index]
        what = f"{self.name}: {doing} chunk {index} [{offset}, {offset + size}) failed: {exc}"
        with self._cond:
            first = self._error is None
            if first:
                self._error = ArenaError(what)
                self._error.__cause__ = exc
            self.stop.set()
            self._cond.notify_all()
        if first:
            logger.error("%s", what, exc_info=exc)

    def mark(self, key: str, seconds: float | None = None) -> None:
        """Record moment ``key`` (seconds since t0, or ``seconds`` as given); the first record wins."""
        with self._cond:
            self._marks.setdefault(key, time.perf_counter() - self._t0 if seconds is None else seconds)

    def add_busy(self, key: str, seconds: float) -> None:
        """Add ``seconds`` of one task to the total ``key`` (thread-seconds)."""
        with self._cond:
            self._busy[key] = self._busy.get(key, 0.0) + seconds

    def close(self) -> None:
        """Stop and wake every waiter; later waits for unready bytes raise ``RuntimeError``."""
        with self._cond:
            self._closed = True
            self.stop.set()
            self._cond.notify_all()

    # -- readers ----------------------------------------------------------------

    @property
    def ready_bytes(self) -> int:
        """Bytes of the ready prefix. O(1)."""
        with self._cond:
            return self._ready

    @property
    def ready_chunks(self) -> int:
        """Chunks in the ready prefix (the index of the first unready chunk). O(1)."""
        with self._cond:
            return min(self._ready_chunks, len(self._chunks) - 1)

    @property
    def error(self) -> ArenaError | None:
        """The first failure, or None."""
        with self._cond:
            return self._error

    def wait(self, target: int, timeout: float | None = None) -> None:
        """Block until the prefix covers ``target`` bytes.

        Returns at once when it does, even if a later chunk failed. Raises
        :class:`ArenaError` when preparation failed before ``target``,
        ``RuntimeError`` when closed or stopped, ``TimeoutError`` after
        ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._ready < target:
                if self._error is not None:
                    raise self._error
                if self._closed or self.stop.is_set():
                    raise RuntimeError(f"{self.name} is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self.name}: {self._ready} of {target} bytes ready after {timeout} s")
                self._cond.wait(remaining)

    def snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        """Copies of ``(marks, busy)``."""
        with self._cond:
            return dict(self._marks), dict(self._busy)

    def forget_after_fork(self) -> None:
        """In a forked child: fresh lock (the parent's may have been held at fork), closed."""
        self._cond = threading.Condition()
        self.stop = threading.Event()
        self.stop.set()
        self._closed = True
