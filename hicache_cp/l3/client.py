"""`L3Client`: the L3 tier's io, one per cache rank.

It owns the store (`KVStore`), registers the L2 arenas with it once
(zero-copy: puts read and gets write the arena pages in place), and runs the
store's blocking calls on three worker threads so that the cache's thread
never blocks on the store longer than a stated deadline:

    lookup   existence checks (the caller waits up to `lookup_timeout_s`) and probes
    get      prefetch reads (the cache decides them at its polls)
    put      write-back in batches: skip keys already present, then put the rest

It also tracks the store's health, a two-state breaker:

    UP --a call failed with the store unreachable, or a lookup timed out--> DOWN
    DOWN --a probe (existence of one key) answered--> UP      (probe every retry_interval_s)

While DOWN no lookup, get or put is issued: L3 operations fail fast and the
cache keeps serving from L1 and L2. The first failure logs a WARNING, the
recovery an INFO line; counters count both.

Restore checks (`hicache_cp.checksum`, when given the host pool's checksum
arena): a put carries each page's stored checksums in the object's trailer
(`keys.checksum_chunks`), and a get, before it returns, recomputes the
checksum of every page and layer that landed and compares it with the
trailer's; a mismatch fails the get (an IntegrityError), so the prefetch
aborts on every rank and the object never becomes an L2 copy.

Threads: every method except the worker functions runs on the cache's
thread; metrics and health are touched only there (the integrity counters
are thread-safe).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import numpy as np

from hicache_cp import checksum
from hicache_cp.errors import IntegrityError
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.keys import KeyScheme, L3Object, checksum_chunks, chunk_list
from hicache_cp.l3.metrics import L3Metrics
from hicache_cp.l3.store import KVStore, L3Error, L3Timeout
from hicache_cp.layout import Part
from hicache_cp.metrics import IntegrityStats
from hicache_cp.pools import HostPool

logger = logging.getLogger(__name__)


class Health(enum.Enum):
    UP = "up"
    DOWN = "down"


@dataclass
class PutOutcome:
    """What one write-back call did on this rank."""

    keys_put: int = 0
    bytes_put: int = 0
    skipped_present: int = 0
    put_keys: list[str] = field(default_factory=list)
    errors: list[L3Error] = field(default_factory=list)


@dataclass(frozen=True)
class Region:
    """One registered host region: an L2 part's arena."""

    part: Part
    ptr: int
    nbytes: int


class L3Client:
    """See the module docstring. `regions` are the L2 arenas (one per part),
    `physical_pages` their page count per layer."""

    def __init__(
        self,
        store: KVStore,
        scheme: KeyScheme,
        config: L3Config,
        regions: Sequence[Region],
        physical_pages: int,
        metrics: L3Metrics,
        *,
        name: str = "l3",
        close_store: bool = True,
        checksums: HostPool | None = None,
        integrity: IntegrityStats | None = None,
    ) -> None:
        """`checksums`: the host pool whose checksum arena objects carry and gets are
        checked against (None: no trailer, no check; `scheme.checksums` must agree)."""
        self.store = store
        self.close_store = close_store  # False: the caller owns the store and closes it
        self.scheme = scheme
        self.config = config
        self.metrics = metrics
        self.name = name
        self.physical_pages = physical_pages
        self.bases = {r.part: r.ptr for r in regions}
        if (checksums is not None) != scheme.checksums:
            raise ValueError(f"{name}: the key scheme {'has' if scheme.checksums else 'lacks'} checksum trailers, "
                             f"the client {'lacks' if checksums is None else 'has'} a checksum arena")  # fmt: skip
        self.pool = checksums
        self.integrity = integrity or IntegrityStats()
        self.sums_bases = {} if checksums is None else {p.part: checksums.sums_address(p.part) for p in scheme.layout.parts}
        self.health = Health.UP
        self._next_probe = 0.0
        self._probe: Future | None = None
        self._probe_key = f"{scheme.prefix}/probe"
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self._registered: list[int] = []
        for r in regions:
            store.register(r.ptr, r.nbytes)
            self._registered.append(r.ptr)
        if checksums is not None and checksums.sums_arena is not None:
            store.register(checksums.sums_arena.ptr, checksums.sums_arena.nbytes)
            self._registered.append(checksums.sums_arena.ptr)
        self._lookup_ex = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-lookup")
        self._get_ex = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-get")
        self._puts = _PutBatcher(self._put_batch, name=f"{name}-put")
        self._closed = False

    @property
    def up(self) -> bool:
        return self.health is Health.UP and not self._closed

    # ---- calls ---------------------------------------------------------------------------

    def lookup(self, objects: Sequence[L3Object]) -> list[bool] | None:
        """Which objects exist; None when the store is down or the lookup
        failed or passed `lookup_timeout_s` (counted, health updated). Blocks
        at most that long."""
        if not objects:
            return []
        if not self.up:
            return None
        keys = [o.key for o in objects]
        self.metrics.l3_lookups += 1
        self.metrics.l3_lookup_keys += len(keys)
        fut = self._submit(self._lookup_ex, self.store.exists, keys)
        try:
            return fut.result(timeout=self.config.lookup_timeout_s)
        except FutureTimeout:
            self.failed(L3Timeout("exists", "lookup passed its deadline",
                                  details={"keys": len(keys), "timeout_s": self.config.lookup_timeout_s}))  # fmt: skip
        except L3Error as exc:
            self.failed(exc)
        return None

    def submit_get(self, objects: Sequence[L3Object], physical: Sequence[np.ndarray]) -> Future:
        """Read `objects` into their physical L2 pages; the future's result is
        the bytes read, its exception an L3Error. Caller checks `up` first."""
        self.metrics.l3_get_keys += len(objects)
        return self._submit(self._get_ex, self._get, list(objects), list(physical))

    def submit_put(self, objects: Sequence[L3Object], physical: Sequence[np.ndarray]) -> Future:
        """Write `objects` from their physical L2 pages, skipping keys already
        present; the future's result is a PutOutcome. Caller checks `up` first.

        Puts queued while the worker is busy go out together in one batch
        (one existence check, one put call): a few GIL hand-offs per batch
        instead of per job keep the writer up with a busy caller."""
        fut = self._puts.submit(list(objects), list(physical))
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def failed(self, exc: BaseException) -> None:
        """Count a failed store operation; open the breaker when the store is
        unreachable (logged here; other failures are logged by the caller)."""
        self.metrics.l3_failures += 1
        down = isinstance(exc, L3Timeout) or (isinstance(exc, L3Error) and exc.store_down)
        if down and self.health is Health.UP:
            self.health = Health.DOWN
            self._next_probe = time.monotonic() + self.config.retry_interval_s
            self.metrics.l3_down_events += 1
            logger.warning("%s: L3 store unreachable, serving from L1/L2 only until it answers: %s", self.name, exc)

    def tick(self) -> None:
        """Probe a down store when it is time; take a probe's answer. Non-blocking."""
        if self.health is Health.UP or self._closed:
            return
        now = time.monotonic()
        if self._probe is not None and self._probe.done():
            ok = not self._probe.cancelled() and self._probe.exception() is None
            self._probe = None
            if ok:
                self.health = Health.UP
                self.metrics.l3_resumed_events += 1
                logger.info("%s: L3 store answers again; L3 resumed", self.name)
                return
            self._next_probe = now + self.config.retry_interval_s
        if self._probe is None and now >= self._next_probe:
            self._probe = self._submit(self._lookup_ex, self.store.exists, [self._probe_key])

    # ---- worker functions (run on the worker threads) --------------------------------------

    def _chunks(self, objects: list[L3Object], physical: list[np.ndarray]) -> tuple[list, list]:
        ptrs, sizes = [], []
        for obj, phys in zip(objects, physical):
            p, s = chunk_list(obj.parts, phys, self.bases, self.physical_pages)
            if self.pool is not None:  # the checksum trailer
                tp, ts = checksum_chunks(obj.parts, phys, self.sums_bases, self.physical_pages)
                p, s = p + tp, s + ts
            ptrs.append(p)
            sizes.append(s)
        return ptrs, sizes

    def _get(self, objects: list[L3Object], physical: list[np.ndarray]) -> int:
        ptrs, sizes = self._chunks(objects, physical)
        keys = [o.key for o in objects]
        total = 0
        for lo, hi in call_spans(ptrs):
            total += self.store.get(keys[lo:hi], ptrs[lo:hi], sizes[lo:hi])
        if self.pool is not None:
            self._check(objects, physical)
            total -= sum(8 * len(o.positions) * sum(p.num_slots for p in o.parts) for o in objects)  # the KV bytes
        return total

    def _check(self, objects: list[L3Object], physical: list[np.ndarray]) -> None:
        """Every landed page and layer against its trailer's checksum (on the get worker,
        before the read counts); raises IntegrityError naming the first bad object."""
        pool = self.pool
        assert pool is not None
        first: IntegrityError | None = None
        for obj, phys in zip(objects, physical):
            for p in obj.parts:
                sums = pool.sums(p.part)
                bad = 0
                for slot, layer in enumerate(p.layer_ids):
                    got = checksum.checksums(pool.layer_view(p.part, slot)[phys], p.part, layer)
                    miss = np.flatnonzero(got != sums[slot, phys])
                    bad += len(miss)
                    if len(miss) and first is None:
                        first = IntegrityError(
                            f"L3 get: object {obj.key} differs from the checksums stored with it (pages: request "
                            "positions); the prefetch fails and its pages never become L2 copies", tier="l3",
                            part=p.part.value, layer=layer, rank=self.scheme.rank, pages=obj.positions[miss],
                            units=len(miss),
                        )  # fmt: skip
                self.integrity.count_checked("l3", len(phys) * p.num_slots)
                if bad:
                    self.integrity.count_failed("l3", p.part.value, bad)
        if first is not None:
            logger.warning("%s: %s", self.name, first)
            raise first

    def _put_batch(self, jobs: list[tuple[list[L3Object], list[np.ndarray]]]) -> list[PutOutcome | BaseException]:
        """One existence check and one put for the objects of several jobs;
        an outcome (or the error that quarantines it) per job."""
        objects = [o for objs, _ in jobs for o in objs]
        physical = [p for _, phys in jobs for p in phys]
        owner = [j for j, (objs, _) in enumerate(jobs) for _ in objs]
        outs: list[PutOutcome | BaseException] = [PutOutcome() for _ in jobs]
        present = self.store.exists([o.key for o in objects])
        todo = [i for i, p in enumerate(present) if not p]
        for i, p in enumerate(present):
            if p:
                outs[owner[i]].skipped_present += 1  # type: ignore[union-attr]
        if not todo:
            return outs
        ptrs, sizes = self._chunks([objects[i] for i in todo], [physical[i] for i in todo])
        keys = [objects[i].key for i in todo]
        errors: list[L3Error | None] = []
        for lo, hi in call_spans(ptrs):
            errors += self.store.put(keys[lo:hi], ptrs[lo:hi], sizes[lo:hi])
        for i, err in zip(todo, errors):
            out = outs[owner[i]]
            if isinstance(out, BaseException):
                continue
            if err is None:
                out.keys_put += 1
                out.bytes_put += objects[i].nbytes
                out.put_keys.append(objects[i].key)
            elif err.io_may_be_in_flight:
                outs[owner[i]] = err  # that job's pages are quarantined
            else:
                out.errors.append(err)
        return outs

    # ---- plumbing ------------------------------------------------------------------------

    def _submit(self, ex: ThreadPoolExecutor, fn, *args) -> Future:  # type: ignore[no-untyped-def]
        fut = ex.submit(fn, *args)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def close(self) -> bool:
        """Cancel queued calls, wait (up to `close_timeout_s`) for running ones,
        then unregister the arenas and close the store (if `close_store`).
        Returns False when a call is still running: the arenas must then stay
        mapped (leaked)."""
        if self._closed:
            return True
        self._closed = True
        for ex in (self._lookup_ex, self._get_ex):
            ex.shutdown(wait=False, cancel_futures=True)
        self._puts.shutdown()
        with self._lock:
            pending = list(self._pending)
        _, running = wait_futures(pending, timeout=self.config.close_timeout_s)
        if running:
            logger.error("%s: %d L3 calls still running after %.0f s; leaving the L2 arenas mapped",
                         self.name, len(running), self.config.close_timeout_s)  # fmt: skip
            return False
        for ptr in self._registered:
            try:
                self.store.unregister(ptr)
            except L3Error as exc:
                logger.warning("%s: %s", self.name, exc)
        if self.close_store:
            self.store.close()
        return True


#: Chunks (transfers) per store call. Mooncake's TCP transport rejects a
#: batch of more than about 2,000 transfers to one peer (TRANSFER_FAIL, which
#: would quarantine the pages for `unsafe_hold_s`), see docs/platform.md: stay well under.
MAX_CHUNKS_PER_CALL = 1000


def call_spans(ptrs: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Split objects (their chunk lists) into consecutive runs of at most
    MAX_CHUNKS_PER_CALL chunks; an object with more gets a call of its own."""
    spans: list[tuple[int, int]] = []
    lo, n = 0, 0
    for i, p in enumerate(ptrs):
        if n and n + len(p) > MAX_CHUNKS_PER_CALL:
            spans.append((lo, i))
            lo, n = i, 0
        n += len(p)
    if lo < len(ptrs):
        spans.append((lo, len(ptrs)))
    return spans


class _PutBatcher:
    """One worker thread that runs queued put jobs in batches.

    `submit` returns a Future per job; the worker takes every job queued so
    far (up to MAX_BATCH_KEYS objects), runs `run(batch)` and completes each
    job's future with its outcome, or with the exception `run` raised.
    `shutdown` cancels what has not started and lets the running batch end.
    """

    MAX_BATCH_KEYS = 4096

    def __init__(self, run, *, name: str) -> None:  # type: ignore[no-untyped-def]
        self._run = run
        self._jobs: deque[tuple[Future, list[L3Object], list[np.ndarray]]] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, objects: list[L3Object], physical: list[np.ndarray]) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._stop:
                fut.cancel()
                return fut
            self._jobs.append((fut, objects, physical))
            self._cv.notify()
        return fut

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if self._stop and not self._jobs:
                    return
                batch: list[tuple[Future, list[L3Object], list[np.ndarray]]] = []
                keys = 0
                while self._jobs and (not batch or keys + len(self._jobs[0][1]) <= self.MAX_BATCH_KEYS):
                    fut, objs, phys = self._jobs.popleft()
                    if fut.set_running_or_notify_cancel():
                        batch.append((fut, objs, phys))
                        keys += len(objs)
            if not batch:
                continue
            try:
                outs = self._run([(objs, phys) for _, objs, phys in batch])
            except BaseException as exc:  # every job of the batch failed alike
                for fut, _, _ in batch:
                    fut.set_exception(exc)
                continue
            for (fut, _, _), out in zip(batch, outs):
                if isinstance(out, BaseException):
                    fut.set_exception(out)
                else:
                    fut.set_result(out)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            for fut, _, _ in self._jobs:
                fut.cancel()
            self._jobs.clear()
            self._cv.notify_all()
