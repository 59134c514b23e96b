"""Stateful and random stress tests of HiCache: random protocol interleavings
with every invariant checked after every step.

`Driver` owns one cache (or two CP ranks driven with identical calls) and
exposes one method per action; the hypothesis machine and the seeded stress
loop both drive it. Actions:

    new request   match (+ lock) -> load_back -> alloc_device -> reserve_backup
    target / draft layer hook of one open request, in any interleaving
    insert, release, abandon (a request that stops mid-forward)
    twin requests (two requests computing overlapping prefixes: the longer
        one's insert finds the first pages present, held or not, with or
        without a host copy)
    poll, copies land (some or all queued copies of one direction run)
    fail next copy of one direction, abort_backup, ensure_free under pressure

For hypothesis the copy engine's worker threads are replaced by manual
executors (a test double): a copy runs only when a "copies land" rule (or a
forward's wait on its load) runs it, so every example is deterministic. The
stress loop keeps the real worker threads.

Invariants checked after every step (besides `HiCache.check_invariants`,
which covers page ownership, leaks, evictable sets and op bookkeeping):

    * locked nodes keep their L1 pages (every node with lock_ref > 0, and
      every node on an open request's path, is on the device)
    * match_prefix never returns a pending host copy: every host node of a
      match is COMMITTED, has no backup and holds every part
    * after ensure_free each tier is at or above its free-room target, or
      nothing more is evictable
    * CP: both ranks' trees (structure, page ids, host states, locks) and
      op states are identical after every step, also when only one rank's
      copy fails
    * at the end, with everything released and drained, evicting to the
      whole capacity returns every page of both tiers
    * an insert with a live write-through backup trims it, never drops it:
      every node on its path that took the request's pages has a host copy
      (PENDING on that backup, at the matching host pages, or one it had),
      a node that kept the tree's pages has a host copy or another holder,
      and the backup's nodes and spare pages partition its reservation
    * bytes (every rank, its own pages): each forward writes known bytes
      into its new L1 pages; every load agreed DONE must have brought back
      exactly those bytes, every part, every layer

`CudaCacheMachine` runs the same machine on the CUDA copy engines (real
streams and events, pinned host pool), without injected copy failures.
`ExclusiveCacheMachine` (one rank and two) runs it under write_back with
`l2_exclusive`: an allocation may wait for its victims' backups (a poll, so
the ranks' protocol calls run in lockstep threads, and a blocking wait runs
the queued copies it needs).
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).parent))

from conftest import Request, TwoRankAgreement, expected_bytes, tiny_config, tokens_of, tree_snapshot  # noqa: E402
from hicache_cp.cache import HiCache
from hicache_cp.cache.lifecycle import prefix_loads  # noqa: E402
from hicache_cp.cp import mapping as cp_mapping  # noqa: E402
from hicache_cp.config import WritePolicy  # noqa: E402
from hicache_harness.bench.io_variants import register_bench_backends  # noqa: E402
from hicache_cp.io.base import Direction  # noqa: E402
from hicache_cp.layout import Model, Part, PartLayout  # noqa: E402
from hicache_cp.ops import BackupState, LoadState  # noqa: E402
from hicache_cp.radix import HostState  # noqa: E402

STEPS_RUN = {"hypothesis": 0, "hypothesis_cp": 0, "hypothesis_cuda": 0}
EVENTS: dict[str, dict[str, int]] = {}  # per machine: summed cache metrics of its examples (coverage)
_COUNTED = ("backups_committed", "backups_aborted", "loads_done", "loads_aborted", "l2_hit_pages",
            "evictions_l1", "evictions_l2", "backups_all_layer", "l1_alloc_failures", "backup_pages_trimmed")
VERIFIED = dict.fromkeys(STEPS_RUN, 0)  # loaded pages whose bytes were compared, per machine


class _LazyFuture(cf.Future):  # type: ignore[type-arg]
    """A queued copy that a blocking wait runs (with every copy queued before it),
    as a real worker would have by then: `settle` inside an eviction (write_back)
    waits on copies the machine has not landed yet."""

    def __init__(self, executor: ManualExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> None:
        self._executor.run_until(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._executor.run_until(self)
        return super().exception(timeout)


class ManualExecutor:
    """Stands in for a copy worker: jobs run in submission order, only when asked
    (or when a blocking wait needs one: `_LazyFuture`)."""

    def __init__(self) -> None:
        self.queue: deque[tuple[cf.Future[None], Callable[..., None], tuple[Any, ...]]] = deque()

    def submit(self, fn: Callable[..., None], *args: Any) -> cf.Future[None]:
        fut: cf.Future[None] = _LazyFuture(self)
        self.queue.append((fut, fn, args))
        return fut

    def run_until(self, fut: cf.Future[None]) -> None:
        """Run queued jobs in order until `fut` is done (nothing if it is not queued)."""
        while not fut.done() and any(f is fut for f, _, _ in self.queue):
            self.run(1)

    def run(self, k: int | None = None) -> None:
        n = len(self.queue) if k is None else min(k, len(self.queue))
        for _ in range(n):
            fut, fn, args = self.queue.popleft()
            fut.set_running_or_notify_cancel()
            try:
                fn(*args)
            except BaseException as exc:  # a failed copy
                fut.set_exception(exc)
            else:
                fut.set_result(None)

    def shutdown(self, wait: bool = True) -> None:
        self.run()


class FailNext:
    """Fault hook: fail the next `pending[direction]` copies of a direction."""

    def __init__(self) -> None:
        self.pending = {d: 0 for d in Direction}
        self.failed = 0
        self._lock = threading.Lock()

    def __call__(self, direction: Direction, part: Part, layer: int) -> None:
        with self._lock:
            if self.pending[direction] > 0:
                self.pending[direction] -= 1
                self.failed += 1
                raise RuntimeError(f"injected failure: {direction.value} {part.value} layer {layer}")


def lockstep(calls: list[Callable[[], Any]]) -> list[Any]:
    """One call per CP rank, run concurrently (rank 0 here, the others on
    threads) so that a collective inside them (an eviction's settle under
    write_back) meets every rank; returns their results in rank order."""
    if len(calls) == 1:
        return [calls[0]()]
    out: list[Any] = [None] * len(calls)
    err: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # re-raised in the caller
            err.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(calls))]
    for t in threads:
        t.start()
    try:
        run(0)
    finally:
        for t in threads:
            t.join(timeout=60)
    if err:
        raise err[0]
    return out


class OpenRequest:
    """One request on every rank (identical calls), with its forward progress."""

    def __init__(self, reqs: list[Request]) -> None:
        self.reqs = reqs
        self.next_target = 0
        self.draft_done = False
        self.inserted = False

    @property
    def forward_done(self) -> bool:
        return self.next_target == self.reqs[0].cache.layout.num_layers(Model.TARGET) and self.draft_done


class Driver:
    def __init__(
        self,
        *,
        ranks: int = 1,
        manual: bool = True,
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        l1_pages: int = 13,
        host_pages: int = 24,
        io_backend: str = "cpu",
        l2_exclusive: bool = False,
    ) -> None:
        self.cuda = io_backend != "cpu"
        self.manual = manual and not self.cuda
        self.faults = FailNext()
        agreements: list[Any] = list(TwoRankAgreement.pair()) if ranks == 2 else [None]
        self.caches: list[HiCache] = []
        self.execs: list[dict[Direction, ManualExecutor]] = []
        self.write = write_known_bytes  # every rank writes and checks the pages it owns
        self.verified_pages = 0
        for rank in range(ranks):
            cfg = tiny_config(
                l1_pages=l1_pages, host_pages=host_pages, cp_size=ranks, write_policy=write_policy,
                io_backend=io_backend, pin_host=self.cuda,
                l2_exclusive=l2_exclusive and write_policy is WritePolicy.WRITE_BACK,
            )  # fmt: skip
            cache = HiCache(cfg, agreement=agreements[rank], rank=rank, device="cuda" if self.cuda else "cpu")
            if not self.cuda:  # the fault hook is the cpu backend's test double
                # In CP only the last rank fails copies: the others must follow it.
                cache.engine.fault = self.faults if rank == ranks - 1 else None  # type: ignore[attr-defined]
            if self.manual:
                ex = {d: ManualExecutor() for d in Direction}
                for w in cache.engine._workers.values():  # type: ignore[attr-defined]
                    w.shutdown(wait=True)
                cache.engine._workers = ex  # type: ignore[attr-defined]
                self.execs.append(ex)
            self.caches.append(cache)
        self.open: list[OpenRequest] = []
        self.all_parts = frozenset(p.part for p in self.caches[0].layout.parts)

    @property
    def cache(self) -> HiCache:
        return self.caches[0]

    # ---- actions ---------------------------------------------------------------------------

    def new_request(self, pages: list[int], fail_load: bool = False) -> None:
        """With `fail_load` the first copy of this request's load fails (on the last rank)."""
        tokens = tokens_of(*pages)
        reqs = [Request(c, tokens) for c in self.caches]
        if fail_load and self.manual:
            self.copies_land(Direction.H2D)  # earlier loads land as they are
        for r in reqs:
            r.match()
            self._check_match(r)
        lockstep([lambda r=r: r.load_back() for r in reqs])  # write_back may poll inside (a collective)
        if fail_load and self.manual:
            self.faults.pending[Direction.H2D] = 1
            self.copies_land(Direction.H2D)
            self.faults.pending[Direction.H2D] = 0
        ok = lockstep([r.alloc for r in reqs])
        assert len(set(ok)) == 1, f"ranks disagree on alloc: {ok}"
        if not ok[0]:
            for r in reqs:
                r.abandon()
            return
        for r in reqs:
            r.reserve()
        assert len({r.bk is None for r in reqs}) == 1, "ranks disagree on reserve_backup"
        self.open.append(OpenRequest(reqs))

    def target_hook(self, i: int) -> None:
        o = self._pick(i, lambda o: not o.inserted and o.next_target < self.cache.layout.num_layers(Model.TARGET))
        if o is None:
            return
        self._let_loads_land()
        for r in o.reqs:
            r.target_layer(o.next_target, self.write)
        o.next_target += 1

    def draft_hook(self, i: int) -> None:
        o = self._pick(i, lambda o: not o.inserted and not o.draft_done)
        if o is None:
            return
        self._let_loads_land()
        for r in o.reqs:
            r.draft_layer(0, self.write)
        o.draft_done = True

    def insert(self, i: int) -> None:
        o = self._pick(i, lambda o: not o.inserted and o.forward_done)
        if o is None:
            return
        live = [r.bk is not None and r.bk.state in (BackupState.RESERVED, BackupState.WRITING) for r in o.reqs]
        for r, was_live in zip(o.reqs, live):
            r.insert()
            check_trimmed(r, was_live)
        o.inserted = True

    def twin_requests(
        self, pages: list[int], extra: list[int], abort_first: bool, release_first: bool, fail_load: bool = False
    ) -> None:
        """Two requests computing overlapping prefixes (`pages`, then `pages + extra`):
        both match before either inserts, the shorter inserts first, so the longer
        one's insert finds its first pages present. With `abort_first` the first
        has no host copy; with `release_first` nobody holds it at that insert;
        `fail_load` fails the first copy of the first one's load."""
        if len(self.open) > 2:
            return
        n0 = len(self.open)
        self.new_request(pages, fail_load=fail_load)
        self.new_request(pages + extra)
        if len(self.open) != n0 + 2:
            return  # L1 could not take one of them: they stay open as they are
        a, b = self.open[n0], self.open[n0 + 1]
        forward = self.cache.layout.num_layers(Model.TARGET) + 1  # every target layer, then the draft's
        self.advance(n0, forward)
        self.advance(n0 + 1, forward)
        if abort_first:
            for r in a.reqs:
                if r.bk is not None and r.bk.state in (BackupState.RESERVED, BackupState.WRITING):
                    r.cache.abort_backup(r.bk)
        self.advance(self.open.index(a), 1)  # insert
        if release_first:
            self.copies_land()
            self.poll()
            self.advance(self.open.index(a), 1)  # release
        self.check()
        self.advance(self.open.index(b), 1)  # insert: the first pages are in the tree

    def release(self, i: int) -> None:
        o = self._pick(i, lambda o: o.inserted)
        if o is None:
            return
        if self.write is not None:
            # Like a server: the load is decided before the request ends, and an
            # aborted one is recomputed before its pages are unlocked.
            load = o.reqs[0].load
            while load is not None and load.active:
                self.copies_land(Direction.H2D)
                self.poll()
            for r in o.reqs:
                recompute_aborted_load(r)
                self.verified_pages += check_loaded_bytes(r)
        for r in o.reqs:
            r.release()
        self.open.remove(o)

    def abandon(self, i: int) -> None:
        """A request stops mid-forward: abort its reservation, free its pages, unlock."""
        o = self._pick(i, lambda o: not o.inserted)
        if o is None:
            return
        for r in o.reqs:  # an aborted load's stale pages stay behind: the cache must cope
            r.abandon()
        self.open.remove(o)

    def advance(self, i: int, steps: int = 1) -> None:
        """Take request i through its next `steps` protocol steps in order:
        target layers, the draft layer, insert, release."""
        if not self.open:
            return
        o = self.open[i % len(self.open)]
        for _ in range(steps):
            if o not in self.open:
                return
            nt = self.cache.layout.num_layers(Model.TARGET)
            if o.next_target < nt:
                self.target_hook(self._rank_index(o, lambda x: not x.inserted and x.next_target < nt))
            elif not o.draft_done:
                self.draft_hook(self._rank_index(o, lambda x: not x.inserted and not x.draft_done))
            elif not o.inserted:
                self.insert(self._rank_index(o, lambda x: not x.inserted and x.forward_done))
            else:
                self.release(self._rank_index(o, lambda x: x.inserted))

    def _rank_index(self, o: OpenRequest, pred: Callable[[OpenRequest], bool]) -> int:
        return [x for x in self.open if pred(x)].index(o)

    def poll(self) -> None:
        if len(self.caches) == 2:
            from conftest import poll_both

            poll_both(*self.caches)
        else:
            self.cache.poll()

    def copies_land(self, direction: Direction | None = None, k: int | None = None) -> None:
        """Run k queued copies of one direction (all of both directions when None)."""
        if self.manual:
            for ex in self.execs:
                for d, e in ex.items():
                    if direction is None or d is direction:
                        e.run(k)
        else:
            for c in self.caches:
                backups, loads = c.in_flight()
                for op in [*backups, *loads]:
                    for t in list(op.inflight):
                        try:
                            t.wait()
                        except Exception:
                            pass

    def fail_next(self, direction: Direction) -> None:
        """Fail the next copy of `direction` (with manual executors: only when one is
        queued, so a failure hits a copy already in flight rather than a later op).
        CUDA engines have no fault hook: a no-op there."""
        if self.cuda or (self.manual and not self.execs[-1][direction].queue):
            return
        self.faults.pending[direction] = 1

    def abort_backup(self, i: int) -> None:
        active = [
            k for k, op in enumerate(self.cache.in_flight()[0]) if op.state.value in ("reserved", "writing")
        ]
        if not active:
            return
        k = active[i % len(active)]
        for c in self.caches:
            c.abort_backup(c.in_flight()[0][k])

    def ensure_free(self, l1_target: int, l2_target: int) -> None:
        for c in self.caches:
            c.config.l1_free_room = l1_target
            c.config.l2_free_room = l2_target
            c.ensure_free()
            l1, l2 = c.device_pool.allocator, c.host_pool.allocator
            # write_back: L1 victims being backed up leave L1 when their backups
            # commit; ensure_free does not wait for them, and counts them as freed.
            leaving = 0
            if c.config.write_policy is WritePolicy.WRITE_BACK:
                leaving = sum(op.num_pages for op in c.in_flight()[0] if not op.layerwise and op.active and op.nodes)
            # Evict to the target, or until nothing more is evictable.
            assert l1.free_pages + leaving >= min(l1_target, l1.capacity) or not c.tree.device_leaves, (
                f"L1 free {l1.free_pages} (+{leaving} leaving) < target {l1_target} with evictable {c.tree.device_leaves}"
            )
            assert l2.free_pages >= min(l2_target, l2.capacity) or not c.tree.host_leaves, (
                f"L2 free {l2.free_pages} < target {l2_target} with evictable {c.tree.host_leaves}"
            )

    # ---- checks ------------------------------------------------------------------------------

    def _check_match(self, r: Request) -> None:
        m = r.m
        assert m is not None
        for node in m.host_nodes:
            assert node.host_state is HostState.COMMITTED and node.backup is None, f"pending host copy visible: {node}"
            assert node.host_parts == self.all_parts, f"partial host hit: {node} has {node.host_parts}"
            assert not node.on_device
        assert m.device_len + m.host_len <= m.num_pages

    def check(self) -> None:
        for c in self.caches:
            c.check_invariants()
            for n in c.tree.nodes():
                if n.lock_ref > 0:
                    assert n.on_device, f"locked {n} lost its L1 pages"
        for o in self.open:
            for r in o.reqs:
                node = r.held_node
                while node is not None and node is not r.cache.tree.root:
                    assert node.on_device and node.parent is not None, f"held {node} evicted"
                    assert node.lock_ref > 0, f"held {node} not locked"
                    node = node.parent
        if len(self.caches) == 2:
            a, b = self.caches
            assert tree_snapshot(a) == tree_snapshot(b), "CP ranks' trees diverged"
            sa = [(op.state, op.num_pages) for op in a.in_flight()[0] + a.in_flight()[1]]  # type: ignore[operator]
            sb = [(op.state, op.num_pages) for op in b.in_flight()[0] + b.in_flight()[1]]  # type: ignore[operator]
            assert sa == sb, f"CP ranks' ops diverged: {sa} vs {sb}"
            for x, y in zip(a.in_flight()[0], b.in_flight()[0]):
                assert np.array_equal(x.host_pages, y.host_pages)

    def finish(self) -> None:
        """Land everything, close every request, drain, then evict all: no page leaks."""
        self.copies_land()
        for o in list(self.open):
            if o.inserted:
                self.release(0 if o is self.open[0] else self.open.index(o))
            else:
                for r in o.reqs:
                    r.abandon()
                self.open.remove(o)
        for _ in range(4):
            self.copies_land()
            self.poll()
        self.check()
        for c in self.caches:
            assert c.in_flight() == ([], []), c.in_flight()
        # write_back: L1 eviction backs up first and evicts after the commit, a
        # tree level a round (a tree may be deeper than any fixed count of rounds)
        for _ in range(len(list(self.caches[0].tree.nodes())) + 4):
            self.ensure_free(10**6, 10**6)
            self.copies_land()
            self.poll()
            self.check()
        for c in self.caches:
            assert c.in_flight() == ([], []), c.in_flight()
            assert c.device_pool.allocator.free_pages == c.device_pool.allocator.capacity
            assert c.host_pool.allocator.free_pages == c.host_pool.allocator.capacity
            assert list(c.tree.nodes()) == []
        self.check()

    def close(self) -> None:
        for c in self.caches:
            if not self.cuda:
                c.engine.fault = None  # type: ignore[attr-defined]
            c.close()

    # ---- helpers ------------------------------------------------------------------------------

    def _pick(self, i: int, pred: Callable[[OpenRequest], bool]) -> OpenRequest | None:
        cands = [o for o in self.open if pred(o)]
        return cands[i % len(cands)] if cands else None

    def _let_loads_land(self) -> None:
        """A forward waits on its loads: with manual executors the H2D copies must run."""
        if self.manual:
            self.copies_land(Direction.H2D)


# ---- bytes -------------------------------------------------------------------------------------


def _owned(cache: HiCache, pages: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's share of a request chunk: (physical pages, request positions)."""
    return cp_mapping.owned_pages(pages, cache.rank, cache.cp_size, first)


def _write_pages(cache: HiCache, tokens: np.ndarray, pages: np.ndarray, first: int, part: PartLayout, layer: int) -> None:
    physical, positions = _owned(cache, pages, first)
    if not len(physical):
        return
    rows = [expected_bytes(tokens, int(pos), part.part, layer, part.page_bytes) for pos in positions]
    buf = cache.device_pool.layer(part.part, part.slot(layer))
    buf[torch.from_numpy(physical).to(buf.device)] = torch.from_numpy(np.stack(rows)).to(buf.device)


def write_known_bytes(req: Request, model: Model, layer: int) -> None:
    """The forward of `layer`: known bytes into the request's new L1 pages (any device)."""
    m = req.m
    assert m is not None and req.new is not None
    if len(req.new):
        for p in req.cache.layout.parts_of(model):
            if p.has_layer(layer):
                _write_pages(req.cache, req.tokens, req.new, m.matched_pages, p, layer)


def check_trimmed(req: Request, was_live: bool) -> None:
    """Right after `req`'s insert: a backup live before it was trimmed to the
    nodes that took its pages, never dropped (unless it sits on a stale prefix)."""
    bk, m, node = req.bk, req.m, req.node
    assert m is not None and node is not None and req.new is not None
    if bk is None or not was_live or prefix_loads(node)[1]:
        return  # no live backup, or one computed on a prefix whose load aborted (it aborts)
    tree, start = req.cache.tree, m.matched_pages
    while node is not tree.root and node.end_position > start:
        lo = node.first_position - start
        mine = node.device_pages is not None and np.array_equal(node.device_pages, req.new[lo : lo + node.num_pages])
        if node.backup is bk:
            assert mine and np.array_equal(node.host_pages, bk.host_pages[lo : lo + node.num_pages]), (
                f"rank {req.cache.rank}: {node} is pending on backup {bk.id} but holds other pages"
            )
        if mine:
            assert node.host_state is not HostState.NONE, f"rank {req.cache.rank}: {node} took the pages, got no copy"
        else:  # the tree kept its pages: they have a copy, or another request holds them (our lock is 1)
            assert node.host_state is not HostState.NONE or node.lock_ref > 1 or node.stale_load is not None, (
                f"rank {req.cache.rank}: {node} kept unheld L1 pages without a host copy"
            )
        node = node.parent  # type: ignore[assignment]
    if bk.state is BackupState.FAILING:  # aborted at insert: only when no node took its pages without a copy
        assert not bk.nodes, f"backup {bk.id} aborted with nodes {bk.nodes}"
        return
    held = sum(n.num_pages for n in bk.nodes) + len(bk.spare_host_pages)
    assert held == bk.num_pages, f"backup {bk.id}: nodes and spare hold {held} of {bk.num_pages} pages"


def recompute_aborted_load(req: Request) -> None:
    """What a server does when a load aborts: recompute the loaded pages in place."""
    load = req.load
    if load is not None and load.state is LoadState.ABORTED:
        for p in req.cache.layout.parts:
            for layer in p.layer_ids:
                _write_pages(req.cache, req.tokens, load.device_pages, load.first_position, p, layer)
        req.cache.recomputed(load)


def check_loaded_bytes(req: Request) -> int:
    """A load agreed DONE brought back exactly what the forward wrote, every part
    and layer, on this rank's pages. Returns the number of pages checked."""
    load = req.load
    if load is None or load.state is not LoadState.DONE:
        return 0
    cache = req.cache
    physical, positions = _owned(cache, load.device_pages, load.first_position)
    for p in cache.layout.parts:
        for layer in p.layer_ids:
            buf = cache.device_pool.layer(p.part, p.slot(layer))
            got = buf[torch.from_numpy(physical).to(buf.device)].cpu().numpy()
            for row, pos in zip(got, positions):
                want = expected_bytes(req.tokens, int(pos), p.part, layer, p.page_bytes)
                assert np.array_equal(row, want), (
                    f"loaded bytes differ: page {pos}, part {p.part.value}, layer {layer}, rank {cache.rank}"
                )
    return len(physical)


# ---- hypothesis ---------------------------------------------------------------------------------

# Small alphabets so prefixes are shared: the first page is one of two.
PAGE_IDS = st.tuples(st.integers(0, 1), st.lists(st.integers(0, 2), max_size=4)).map(lambda t: [t[0], *t[1]])
INDEX = st.integers(0, 7)
TARGET = st.integers(0, 14)


class CacheMachine(RuleBasedStateMachine):
    ranks = 1
    counter = "hypothesis"
    l1_pages = 13  # physical pages per rank, the dummy page included

    def __init__(self) -> None:
        super().__init__()
        self.d: Driver | None = None

    @initialize(policy=st.sampled_from(list(WritePolicy)))
    def start(self, policy: WritePolicy) -> None:
        self.d = Driver(ranks=self.ranks, write_policy=policy, l1_pages=self.l1_pages)

    @rule(pages=PAGE_IDS, fail_load=st.integers(0, 3))
    def new_request(self, pages: list[int], fail_load: int) -> None:
        assert self.d is not None
        if len(self.d.open) < 4:
            self.d.new_request(pages, fail_load=fail_load == 0)

    @rule(i=INDEX)
    def target_hook(self, i: int) -> None:
        self.d.target_hook(i)  # type: ignore[union-attr]

    @rule(i=INDEX)
    def draft_hook(self, i: int) -> None:
        self.d.draft_hook(i)  # type: ignore[union-attr]

    @rule(i=INDEX)
    def insert(self, i: int) -> None:
        self.d.insert(i)  # type: ignore[union-attr]

    @rule(i=INDEX)
    def release(self, i: int) -> None:
        self.d.release(i)  # type: ignore[union-attr]

    @rule(i=INDEX)
    def abandon(self, i: int) -> None:
        self.d.abandon(i)  # type: ignore[union-attr]

    @rule(pages=PAGE_IDS, fail_load=st.integers(0, 5))
    def full_request(self, pages: list[int], fail_load: int) -> None:
        """A whole request: new, forward, insert, copies land, poll, release."""
        assert self.d is not None
        if len(self.d.open) < 4:
            self.d.new_request(pages, fail_load=fail_load == 0)
            if self.d.open and self.d.open[-1].reqs[0].tokens.size == len(pages) * 16:
                self.d.advance(len(self.d.open) - 1, 6)
                self.d.copies_land()
                self.d.poll()
                self.d.advance(len(self.d.open) - 1, 1)

    @rule(pages=PAGE_IDS, extra=st.lists(st.integers(0, 2), min_size=1, max_size=2), abort_first=st.booleans(),
          release_first=st.booleans(), fail_load=st.integers(0, 3))  # fmt: skip
    def twin_requests(
        self, pages: list[int], extra: list[int], abort_first: bool, release_first: bool, fail_load: int
    ) -> None:
        self.d.twin_requests(pages, extra, abort_first, release_first, fail_load == 0)  # type: ignore[union-attr]

    @rule(i=INDEX, steps=st.integers(1, 7))
    def advance(self, i: int, steps: int) -> None:
        self.d.advance(i, steps)  # type: ignore[union-attr]

    @rule()
    def poll(self) -> None:
        self.d.poll()  # type: ignore[union-attr]

    @rule(direction=st.sampled_from(list(Direction)), k=st.integers(1, 8))
    def some_copies_land(self, direction: Direction, k: int) -> None:
        self.d.copies_land(direction, k)  # type: ignore[union-attr]

    @rule()
    def copies_land_and_poll(self) -> None:
        self.d.copies_land()  # type: ignore[union-attr]
        self.d.poll()  # type: ignore[union-attr]

    # Failures and aborts act one draw in four, so that most backups can commit.
    @rule(direction=st.sampled_from(list(Direction)), act=st.integers(0, 3))
    def fail_next_copy(self, direction: Direction, act: int) -> None:
        if act == 0 or direction is Direction.H2D:  # loads are rarer than backups
            self.d.fail_next(direction)  # type: ignore[union-attr]

    @rule(i=INDEX, act=st.integers(0, 3))
    def abort_backup(self, i: int, act: int) -> None:
        if act == 0:
            self.d.abort_backup(i)  # type: ignore[union-attr]

    @rule(l1=TARGET, l2=TARGET)
    def ensure_free(self, l1: int, l2: int) -> None:
        self.d.ensure_free(l1, l2)  # type: ignore[union-attr]

    @invariant()
    def invariants_hold(self) -> None:
        if self.d is not None:
            STEPS_RUN[self.counter] += 1
            self.d.check()

    def teardown(self) -> None:
        if self.d is not None:
            events = EVENTS.setdefault(self.counter, {})
            for k in _COUNTED:
                events[k] = events.get(k, 0) + int(self.d.cache.stats()[k])  # type: ignore[call-overload]
            VERIFIED[self.counter] += self.d.verified_pages
            try:
                self.d.finish()
            finally:
                self.d.close()


class CpCacheMachine(CacheMachine):
    ranks = 2
    counter = "hypothesis_cp"
    l1_pages = 10  # 18 logical pages over two ranks: enough L1 pressure for host hits


class ExclusiveCacheMachine(CacheMachine):
    """write_back with l2_exclusive: loads drop L2 copies, evictions wait for backups."""

    counter = "hypothesis_exclusive"
    host_pages = 12  # logical: L2 smaller than L1 + L2's usual, so that L2 evicts too

    @initialize()
    def start(self) -> None:  # type: ignore[override]
        self.d = Driver(ranks=self.ranks, write_policy=WritePolicy.WRITE_BACK, l1_pages=self.l1_pages,
                        host_pages=self.host_pages, l2_exclusive=True)  # fmt: skip


class ExclusiveCpCacheMachine(ExclusiveCacheMachine):
    ranks = 2
    counter = "hypothesis_exclusive_cp"
    l1_pages = 10


class CudaCacheMachine(CacheMachine):
    """The same machine on a CUDA engine: real streams and events, a smaller budget."""

    counter = "hypothesis_cuda"

    @initialize(policy=st.sampled_from(list(WritePolicy)), backend=st.sampled_from(["hybrid", "kernel", "direct", "staging"]))
    def start(self, policy: WritePolicy, backend: str) -> None:  # type: ignore[override]
        register_bench_backends()  # the benchmark-only engines too
        self.d = Driver(write_policy=policy, io_backend=backend, l1_pages=9, host_pages=16)


_settings = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=True)

def _run_machine(machine: type[CacheMachine], **limits: int) -> tuple[int, dict[str, int], int]:
    """Run a state machine here and now; return (steps, events, byte-checked pages).

    Each test runs its own machine, so what it asserts about the run does not
    depend on which other tests ran before it in the process."""
    counter = machine.counter
    STEPS_RUN[counter] = 0
    VERIFIED[counter] = 0
    EVENTS[counter] = {}
    run_state_machine_as_test(machine, settings=settings(**limits, **_settings))  # type: ignore[arg-type]
    print(f"\n{counter}: {STEPS_RUN[counter]} steps, {VERIFIED[counter]} loaded pages byte-checked, "
          f"events {EVENTS[counter]}")
    return STEPS_RUN[counter], EVENTS[counter], VERIFIED[counter]


def _assert_covered(events: dict[str, int], keys: tuple[str, ...]) -> None:
    # The machines are derandomized: these guard against one silently degenerating.
    for k in keys:
        assert events.get(k, 0) > 0, f"the machine never reached {k}: {events}"


def test_cache_machine() -> None:
    steps, events, verified = _run_machine(CacheMachine, max_examples=200, stateful_step_count=100)
    assert steps >= 10_000, f"only {steps} hypothesis steps ran"
    _assert_covered(events, ("backups_committed", "backups_aborted", "loads_done", "loads_aborted", "l2_hit_pages",
                             "backup_pages_trimmed"))  # fmt: skip
    assert verified > 0, "no loaded page was ever byte-checked"


@pytest.mark.parametrize(
    "machine,covered",
    [(ExclusiveCacheMachine, ("evictions_l2", "loads_aborted")), (ExclusiveCpCacheMachine, ())],
)
def test_exclusive_cache_machine(machine: type[CacheMachine], covered: tuple[str, ...]) -> None:
    """l2_exclusive (one rank, and two CP ranks with identical trees after every
    step): every invariant after every step, loaded bytes checked. (Which
    examples the CP machine draws depends on the tests run before it in the
    process; L2 evictions are asserted on the one-rank machine.)"""
    steps, events, verified = _run_machine(machine, max_examples=40, stateful_step_count=80)
    assert steps >= 1_500, f"only {steps} steps ran"
    _assert_covered(events, ("backups_committed", "loads_done", "l2_hit_pages", "backups_all_layer", *covered))
    assert verified > 0, "no loaded page was ever byte-checked"


def test_cp_cache_machine() -> None:
    """Two CP ranks driven with identical calls: identical trees after every
    step, and every rank byte-checks the loaded pages it owns."""
    # 100 examples: with twin requests among the rules, 60 (derandomized) drew no aborted load.
    steps, events, verified = _run_machine(CpCacheMachine, max_examples=100, stateful_step_count=80)
    assert steps >= 2_000, f"only {steps} two-rank steps ran"
    _assert_covered(events, ("backups_committed", "backups_aborted", "loads_done", "loads_aborted", "l2_hit_pages",
                             "backup_pages_trimmed"))  # fmt: skip
    assert verified > 0, "no loaded page was ever byte-checked on the two ranks"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_machine() -> None:
    """The same machine on the CUDA engines: real steps, byte-checked loads."""
    steps, events, verified = _run_machine(CudaCacheMachine, max_examples=40, stateful_step_count=60)
    assert steps >= 500
    _assert_covered(events, ("backups_committed", "loads_done"))
    assert verified > 0


# ---- CP: one rank's copy fails ------------------------------------------------------------------


def test_cp_one_rank_failure_aborts_both() -> None:
    d = Driver(ranks=2)
    try:
        c0, c1 = d.caches
        d.new_request([1, 2, 3, 0])
        d.faults.pending[Direction.D2H] = 1  # rank 1's next D2H copy fails; rank 0's copies succeed
        o = d.open[0]
        for _ in range(4):
            d.target_hook(0)
        d.draft_hook(0)
        d.insert(0)
        d.copies_land()
        d.check()
        assert d.faults.failed == 1
        bk0, bk1 = o.reqs[0].bk, o.reqs[1].bk
        assert bk0 is not None and bk1 is not None
        assert bk0.local_vote().ok and not bk1.local_vote().ok  # only rank 1 saw the failure
        d.poll()
        d.check()
        # Both ranks aborted together: same state, same released pages, identical trees.
        assert bk0.state is bk1.state and bk0.state.value == "aborted"
        for c in (c0, c1):
            assert c.host_pool.allocator.free_pages == c.host_pool.allocator.capacity
            assert c.metrics.backups_aborted == 1 and c.metrics.backups_committed == 0
        node0, node1 = o.reqs[0].node, o.reqs[1].node
        assert node0 is not None and node1 is not None
        assert node0.host_state is node1.host_state is HostState.NONE
        # Each rank copied only the pages it owns.
        assert tree_snapshot(c0) == tree_snapshot(c1)
        d.release(0)
        d.finish()
    finally:
        d.close()


# ---- seeded plain-random stress ------------------------------------------------------------


def stress(
    seed: int, steps: int, *, ranks: int = 1, manual: bool = False, policy: WritePolicy | None = None,
    exclusive: bool = False,
) -> int:
    """Random protocol actions with the real (threaded) copy engine; returns steps run."""
    rng = random.Random(seed)
    policy = policy or rng.choice(list(WritePolicy))
    d = Driver(ranks=ranks, manual=manual, write_policy=policy, l2_exclusive=exclusive)
    actions: list[tuple[float, Callable[[], None]]] = [
        (6, lambda: d.new_request([rng.randrange(2)] + [rng.randrange(3) for _ in range(rng.randint(0, 4))]) if len(d.open) < 4 else None),
        (10, lambda: d.target_hook(rng.randrange(8))),
        (4, lambda: d.draft_hook(rng.randrange(8))),
        (4, lambda: d.insert(rng.randrange(8))),
        (1, lambda: d.twin_requests([rng.randrange(2)] + [rng.randrange(3) for _ in range(rng.randint(0, 3))],
                                    [rng.randrange(3) for _ in range(rng.randint(1, 2))], rng.random() < 0.5,
                                    rng.random() < 0.5)),  # fmt: skip
        (4, lambda: d.release(rng.randrange(8))),
        (1, lambda: d.abandon(rng.randrange(8))),
        (4, d.poll),
        (4, lambda: d.advance(rng.randrange(8), rng.randint(1, 7))),
        (2, lambda: (d.copies_land(), d.poll())),
        (0.5, lambda: d.fail_next(rng.choice(list(Direction)))),
        (0.3, lambda: d.abort_backup(rng.randrange(8))),
        (2, lambda: d.ensure_free(rng.randrange(15), rng.randrange(15))),
    ]
    weights = [w for w, _ in actions]
    try:
        for _ in range(steps):
            _, act = rng.choices(actions, weights)[0]
            act()
            d.check()
        d.finish()
    finally:
        d.close()
    return steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_stress(seed: int) -> None:
    stress(seed, 1500)


def test_seeded_stress_cp() -> None:
    stress(7, 800, ranks=2, manual=True)


@pytest.mark.parametrize("ranks", [1, 2])
def test_seeded_stress_write_back_exclusive(ranks: int) -> None:
    """write_back with l2_exclusive: evictions that wait for their backups
    (settle inside alloc, in lockstep on CP ranks) and loads that drop L2 copies."""
    stress(11, 800, ranks=ranks, manual=ranks == 2, policy=WritePolicy.WRITE_BACK, exclusive=True)


def test_seeded_stress_deep_tree_drains_whole() -> None:
    """A soak seed (write_back, two ranks) whose final eviction, a tree level a
    round, takes 14 rounds: every page still comes back."""
    stress(1197, 1500, ranks=2, manual=True, policy=WritePolicy.WRITE_BACK, exclusive=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="seeded random stress of HiCache (threaded copy engine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    args = ap.parse_args()
    n = stress(args.seed, args.steps, ranks=args.ranks, manual=args.ranks == 2)
    print(f"ok: {n} steps, seed {args.seed}, ranks {args.ranks}")
