"""The one adapter over Mooncake's TransferEngine and its integer return codes.

Mooncake's Python binding never raises: every call returns an int (0 ok, -1
failure) and batch submission returns a batch id (0 = failure). This module
is the only place that reads those codes; everything above it sees a typed
:class:`TransferError` carrying the peer, the operation and the counts
(docs/contributing.md, conventions).

Runs in: any process that moves PD bytes (the prefill sender and the decode
peer each own one adapter, hence one engine).

Protocol::

    eng = TransferEngineAdapter()                 # initialise (tcp, P2PHANDSHAKE)
    eng.register(ptr, nbytes)                     # every source and destination buffer
    batch = eng.submit_write(peer, srcs, dsts, lens)   # async; may wait for older batches
    eng.wait(batch, timeout=...)                  # raises TransferError / TransferTimeout
    eng.abandon(batch)                            # give up on a batch (room aborted)
    eng.close()                                   # unregister everything registered here

In-flight cap (docs/platform.md pitfall): more than ~2,000 transfers queued to one
peer are rejected and past ~3,000 the engine can no longer reach that peer.
The adapter keeps at most ``max_in_flight`` (default 1,000) transfers in
flight per peer: it splits a submission into engine batches of at most that
many transfers and, before submitting, waits for the oldest outstanding
batches to that peer until the new one fits. Such an early wait records the
batch's outcome; the owner's :meth:`wait` reports it later.

``get_batch_transfer_status`` blocks until a batch ends and releases the GIL.
:meth:`wait` with a timeout runs it on a helper thread so that the caller
can give up at a deadline; a batch given up on (``abandon``) is drained by a
reaper thread, so the in-flight accounting stays true without blocking the
caller. Mooncake's own transfer timeout (``MC_TRANSFER_TIMEOUT``, about 30 s
on TCP against a stopped peer) bounds how long the reaper waits.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Sequence

from hicache_cp.errors import HiCacheError

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "Batch", "TransferEngineAdapter", "TransferError", "TransferTimeout"]

#: Transfers kept in flight per peer. Half the ~2,000 at which Mooncake's TCP
#: transport starts rejecting, so a second submitter cannot push it over.
DEFAULT_MAX_IN_FLIGHT = 1000


@dataclass
class TransferError(HiCacheError):
    """A Mooncake call failed. Carries the peer, the operation and the counts."""

    op: str
    peer: str | None = None
    code: int | None = None
    transfers: int | None = None
    nbytes: int | None = None
    detail: str = ""
    #: A submission refused part-way: the engine batches submitted before the
    #: refusal (still in flight; their owner must drain them before reusing pages).
    batch: Batch | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        ctx = [f"{k}={v}" for k, v in (("peer", self.peer), ("code", self.code),
                                          ("transfers", self.transfers), ("bytes", self.nbytes)) if v is not None]
        msg = f"mooncake {self.op} failed ({', '.join(ctx)})"
        return f"{msg}: {self.detail}" if self.detail else msg


@dataclass
class TransferTimeout(TransferError):
    """A wait passed its deadline; the batch is still in flight in the engine."""


@dataclass(eq=False)
class _EngineBatch:
    batch_id: int
    transfers: int
    nbytes: int
    status: int | None = None  # None while unwaited; 0 ok; -1 failed
    future: Future[int] | None = None  # the one engine wait for this batch id
    done_at: float | None = None  # perf_counter when the engine wait returned


@dataclass
class Batch:
    """One :meth:`TransferEngineAdapter.submit_write`: engine batches to one peer."""

    peer: str
    parts: list[_EngineBatch] = field(default_factory=list)
    abandoned: bool = False

    @property
    def transfers(self) -> int:
        return sum(p.transfers for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def done(self) -> bool:
        return all(p.status is not None for p in self.parts)

    @property
    def done_at(self) -> float | None:
        """When the last engine batch ended (perf_counter), None until all did."""
        times = [p.done_at for p in self.parts]
        return None if any(t is None for t in times) else max(times, default=None)  # type: ignore[type-var]


class TransferEngineAdapter:
    """Mooncake TransferEngine with typed errors and a per-peer in-flight cap.

    Thread safety: submit/wait/abandon may be called from several threads
    (a lock guards the in-flight queues; engine waits run outside it).
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        from mooncake.engine import TransferEngine  # imported here: optional dependency

        self.hostname = hostname
        self.max_in_flight = max_in_flight
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransferError("initialize", code=rc,
                                detail=f"{hostname} {metadata_server} {protocol} {device_name!r}")
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self._in_flight: dict[str, deque[_EngineBatch]] = {}
        self._waiter = ThreadPoolExecutor(max_workers=16, thread_name_prefix="mc-wait")
        self._watch_q: queue.Queue[Batch | None] = queue.Queue()
        self._watcher: threading.Thread | None = None
        self._closed = False

    # -- memory ------------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        """Register [ptr, ptr + nbytes) for transfers. Idempotent per ptr."""
        if nbytes <= 0:
            raise ValueError(f"cannot register {nbytes} bytes at {ptr:#x}")
        if self._registered.get(ptr) == nbytes:
            return
        if ptr in self._registered:
            raise ValueError(f"{ptr:#x} already registered with {self._registered[ptr]} bytes, not {nbytes}")
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransferError("register_memory", code=rc, nbytes=nbytes, detail=f"address {ptr:#x}")
        self._registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        if ptr not in self._registered:
            raise ValueError(f"{ptr:#x} is not registered with this adapter")
        rc = self.engine.unregister_memory(ptr)
        nbytes = self._registered.pop(ptr)
        if rc != 0:
            raise TransferError("unregister_memory", code=rc, nbytes=nbytes, detail=f"address {ptr:#x}")

    @property
    def registered(self) -> dict[int, int]:
        return dict(self._registered)

    # -- writes ------------------------------------------------------------
    def submit_write(self, peer: str, srcs: Sequence[int], dsts: Sequence[int], lens: Sequence[int]) -> Batch:
        """Submit writes src[i] -> peer's dst[i] of lens[i] bytes; returns at once.

        Splits into engine batches of at most ``max_in_flight`` and first waits
        for this peer's oldest batches until the new one fits under the cap.
        Raises TransferError if the engine refuses a batch; engine batches
        already submitted for this call stay in flight, are drained by the
        reaper (`abandon`) and travel with the error (`TransferError.batch`):
        the caller tracks them like any batch of its own before it reuses the
        pages they read or write.
        """
        n = len(srcs)
        if not n == len(dsts) == len(lens):
            raise ValueError(f"{peer}: {len(srcs)} sources, {len(dsts)} destinations, {len(lens)} lengths")
        batch = Batch(peer)
        step = self.max_in_flight
        for lo in range(0, n, step):
            s, d, ln = list(srcs[lo:lo + step]), list(dsts[lo:lo + step]), list(lens[lo:lo + step])
            self._make_room(peer, len(s))
            nbytes = sum(ln)
            bid = self.engine.batch_transfer_async_write(peer, s, d, ln)
            if bid == 0:
                self.abandon(batch)
                raise TransferError("batch_transfer_async_write", peer=peer, code=0, transfers=len(s), nbytes=nbytes,
                                    detail=f"engine refused batch {lo // step + 1} of {-(-n // step)}",
                                    batch=batch if batch.parts else None)
            eb = _EngineBatch(bid, len(s), nbytes)
            with self._lock:
                self._in_flight.setdefault(peer, deque()).append(eb)
            batch.parts.append(eb)
        return batch

    def wait(self, batch: Batch, timeout: float | None = None) -> None:
        """Block until every engine batch of `batch` ends; raise if any failed.

        With `timeout` (seconds) raises TransferTimeout when it passes; the
        batch then stays in flight and the caller should `abandon` it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for eb in batch.parts:
            if eb.status is None:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._wait_one(batch.peer, eb, remaining)
        failed = [eb for eb in batch.parts if eb.status != 0]
        if failed:
            raise TransferError(
                "get_batch_transfer_status", peer=batch.peer, code=failed[0].status,
                transfers=sum(eb.transfers for eb in failed), nbytes=sum(eb.nbytes for eb in failed),
                detail=f"{len(failed)} of {len(batch.parts)} engine batches failed "
                       f"({batch.transfers} transfers, {batch.nbytes} bytes submitted)")

    def write(self, peer: str, srcs: Sequence[int], dsts: Sequence[int], lens: Sequence[int],
              timeout: float | None = None) -> None:
        """Synchronous write: submit + wait."""
        self.wait(self.submit_write(peer, srcs, dsts, lens), timeout)

    def watch(self, batch: Batch) -> None:
        """Have `batch` waited for in the background now, so `Batch.done` and
        `Batch.done_at` turn true when it lands without anyone blocking.

        One watcher thread waits the watched batches in submission order (one
        engine wait at a time: Mooncake's status call spins a core while it
        waits, and a thread per batch starved the transfer threads on small
        machines)."""
        if self._closed:
            return
        with self._lock:
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_loop, name="mc-watch", daemon=True)
                self._watcher.start()
        self._watch_q.put(batch)

    def _watch_loop(self) -> None:
        while True:
            batch = self._watch_q.get()
            if batch is None or self._closed:
                return
            for eb in batch.parts:
                try:
                    self._wait_one(batch.peer, eb, None)
                except TransferError:
                    if self._closed:  # close() cancelled the waits still queued
                        return
                    raise

    def drain(self, batch: Batch, timeout: float) -> bool:
        """Wait up to `timeout` s for `batch` to end, landed or failed; never
        raises for a failed batch. True when every engine batch of it ended."""
        try:
            self.wait(batch, timeout)
        except TransferTimeout:
            return False
        except TransferError:
            pass
        return batch.done

    def abandon(self, batch: Batch) -> None:
        """Stop waiting for `batch`; a reaper thread drains its engine batches."""
        batch.abandoned = True
        if self._closed:
            return
        for eb in batch.parts:
            with self._lock:
                if eb.status is None and eb.future is None:
                    eb.future = self._waiter.submit(self._engine_wait, batch.peer, eb)

    def in_flight(self, peer: str) -> int:
        with self._lock:
            return sum(eb.transfers for eb in self._in_flight.get(peer, ()))

    # -- notifications -----------------------------------------------------
    def notify(self, peer: str, name: str, msg: str, src: int, dst: int, nbytes: int) -> None:
        """Write nbytes src -> dst on `peer` and deliver (name, msg) to its `notifies()`."""
        from mooncake.engine import TransferNotify, TransferOpcode

        rc = self.engine.transfer_sync(peer, src, dst, nbytes, TransferOpcode.Write, TransferNotify(name, msg))
        if rc != 0:
            raise TransferError("transfer_sync(notify)", peer=peer, code=rc, transfers=1, nbytes=nbytes, detail=name)

    def notifies(self) -> list[tuple[str, str]]:
        """Notifications received since the last call, as (name, msg)."""
        return [(n.name, n.msg) for n in self.engine.get_notifies()]

    # -- teardown ----------------------------------------------------------
    def close(self) -> None:
        """Unregister every buffer registered here; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._watch_q.put(None)
        self._waiter.shutdown(wait=False, cancel_futures=True)
        errors = []
        for ptr in list(self._registered):
            try:
                self.unregister(ptr)
            except TransferError as exc:
                errors.append(str(exc))
        if errors:
            logger.warning("transfer engine %s: %d unregister failures: %s", self.session_id, len(errors), errors[:4])

    def __enter__(self) -> TransferEngineAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------
    def _make_room(self, peer: str, n: int) -> None:
        """Wait for this peer's oldest batches until n more transfers fit."""
        while True:
            with self._lock:
                q = self._in_flight.get(peer)
                if not q or sum(eb.transfers for eb in q) + n <= self.max_in_flight:
                    return
                oldest = q[0]
            self._wait_one(peer, oldest, None)

    def _wait_one(self, peer: str, eb: _EngineBatch, timeout: float | None) -> None:
        """Wait for one engine batch. Each batch id is waited by exactly one
        helper-thread call (a second engine wait on a finished id is invalid);
        every waiter shares its future."""
        if eb.status is not None:
            return
        closed = TransferError("get_batch_transfer_status", peer=peer, transfers=eb.transfers, nbytes=eb.nbytes,
                               detail="the adapter was closed before this batch's wait ran")
        with self._lock:
            if eb.future is None:
                try:
                    eb.future = self._waiter.submit(self._engine_wait, peer, eb)
                except RuntimeError:  # the waiter pool shut down
                    raise closed from None
            fut = eb.future
        try:
            fut.result(timeout=timeout)
        except FutureTimeout:
            raise TransferTimeout("get_batch_transfer_status", peer=peer, transfers=eb.transfers,
                                  nbytes=eb.nbytes, detail=f"no completion within {timeout:.3f} s") from None
        except CancelledError:  # close() cancelled the wait before it ran
            raise closed from None

    def _engine_wait(self, peer: str, eb: _EngineBatch) -> int:
        status = int(self.engine.get_batch_transfer_status([eb.batch_id]))
        with self._lock:
            eb.done_at = time.perf_counter()
            eb.status = status
            q = self._in_flight.get(peer)
            if q is not None and eb in q:
                q.remove(eb)
        return status


def quiet_mooncake_logs(verbose: int = 0) -> None:
    """Keep Mooncake's own logging (its MC_LOG_LEVEL and glog's level) to
    errors unless `verbose` or the operator chose a level. Call it before the
    first TransferEngine is made; child processes inherit it."""
    if verbose:
        return
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOG_minloglevel", "2")
