"""Shared fixtures for the cache tests: a tiny config, a cache factory and a
request driver that follows the protocol of `hicache_cp.cache` step by step.

The tiny preset has every part (target KV on 4 layers, target NSA state on
layers 0 and 2, one draft layer with KV and state) and 16-token pages, so one
logical page is 1664 host bytes and a few hundred pages cost nothing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from hicache_cp.cp.agreement import Agreement
from hicache_cp.cache import HiCache, MatchResult
from hicache_cp.config import Config
from hicache_cp.io.base import Direction
from hicache_cp.layout import Model, Part
from hicache_cp.ops import BackupOp, LoadOp, Vote
from hicache_cp.radix import Node

PAGE = 16  # tokens per page of the tiny config

FaultHook = Callable[[Direction, Part, int], None]


def tiny_config(**overrides: Any) -> Config:
    """The tiny preset with invariant checks on; `host_pages` sizes L2 in logical pages."""
    host_pages = overrides.pop("host_pages", 64)
    values: dict[str, Any] = dict(
        model="tiny",
        page_size=PAGE,
        l1_pages=32,
        l1_free_room=0,
        l2_free_room=0,
        debug_checks=True,
        io_backend="cpu",
        pin_host=False,
    )
    values.update(overrides)
    layout = Config(**{k: v for k, v in values.items() if k in ("model", "page_size")}).layout()
    # Physical host pages per rank = budget // bytes_per_page (page 0 is the dummy).
    values.setdefault("host_budget_bytes", (host_pages + 1) * layout.bytes_per_page)
    return Config(**values)


@pytest.fixture
def make_cache() -> Iterator[Callable[..., HiCache]]:
    """Factory: make_cache(l1_pages=, host_pages=, fault=, write_policy=, **config)."""
    made: list[HiCache] = []

    def factory(*, fault: FaultHook | None = None, agreement: Agreement | None = None, rank: int = 0, **cfg: Any) -> HiCache:
        cache = HiCache(tiny_config(**cfg), agreement=agreement, rank=rank, engine_options={"fault": fault})
        made.append(cache)
        return cache

    yield factory
    for c in made:
        c.engine.fault = None  # type: ignore[attr-defined]
        c.close()


# ---- fault hooks ---------------------------------------------------------------------------


class Faults:
    """A scriptable fault hook: fail the next n copies, fail one (direction, part, layer),
    or hold every copy at a gate until `open()` (a slow copy engine)."""

    def __init__(self) -> None:
        self.fail_next = 0
        self.fail_on: set[tuple[Direction, Part, int]] = set()
        self.fail_direction: Direction | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.seen: list[tuple[Direction, Part, int]] = []
        self._lock = threading.Lock()

    def __call__(self, direction: Direction, part: Part, layer: int) -> None:
        self.gate.wait(timeout=30)
        with self._lock:
            self.seen.append((direction, part, layer))
            if (direction, part, layer) in self.fail_on:
                raise RuntimeError(f"injected failure: {direction.value} {part.value} layer {layer}")
            if self.fail_next > 0 and (self.fail_direction is None or self.fail_direction is direction):
                self.fail_next -= 1
                raise RuntimeError(f"injected failure: {direction.value} {part.value} layer {layer}")

    def hold(self) -> None:
        self.gate.clear()

    def open(self) -> None:
        self.gate.set()


# ---- the request protocol ------------------------------------------------------------------

STEPS = ("match", "load", "alloc", "reserve", "target", "draft", "insert", "poll", "release", "ensure_free")


@dataclass
class Request:
    """One request driven through the protocol; fields fill in as steps run."""

    cache: HiCache
    tokens: np.ndarray
    m: MatchResult | None = None
    load: LoadOp | None = None
    new: np.ndarray | None = None
    bk: BackupOp | None = None
    node: Node | None = None
    done: list[str] = field(default_factory=list)
    target_layers_done: list[int] = field(default_factory=list)
    draft_layers_done: list[int] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return len(self.tokens) // self.cache.layout.page_size

    @property
    def held_node(self) -> Node | None:
        """The node this request's lock sits on."""
        if self.node is not None:
            return self.node
        return self.m.last_node if self.m is not None else None

    def match(self) -> None:
        self.m = self.cache.match_prefix(self.tokens)
        self.done.append("match")

    def load_back(self) -> None:
        assert self.m is not None
        self.load = self.cache.load_back(self.m)
        self.done.append("load")

    def alloc(self) -> bool:
        assert self.m is not None
        n = self.num_pages - self.m.matched_pages
        self.new = self.cache.alloc_device(n, self.m.matched_pages)
        self.done.append("alloc")
        return self.new is not None

    def reserve(self) -> None:
        assert self.m is not None and self.new is not None
        self.bk = self.cache.reserve_backup(self.new, self.m.matched_pages)
        self.done.append("reserve")

    def target_layer(self, layer: int, write: Callable[[Request, Model, int], None] | None = None) -> None:
        if self.load is not None:
            self.load.wait_layer(layer, Model.TARGET)
        if write is not None:
            write(self, Model.TARGET, layer)
        self.cache.on_layer_end(Model.TARGET, layer, [self.bk])
        self.target_layers_done.append(layer)

    def draft_layer(self, layer: int, write: Callable[[Request, Model, int], None] | None = None) -> None:
        if self.load is not None:
            self.load.wait_layer(layer, Model.DRAFT)
        if write is not None:
            write(self, Model.DRAFT, layer)
        self.cache.on_layer_end(Model.DRAFT, layer, [self.bk])
        self.draft_layers_done.append(layer)

    def forward(self, write: Callable[[Request, Model, int], None] | None = None, draft: bool = True) -> None:
        for layer in range(self.cache.layout.num_layers(Model.TARGET)):
            self.target_layer(layer, write)
        self.done.append("target")
        if draft:
            for layer in range(self.cache.layout.num_layers(Model.DRAFT)):
                self.draft_layer(layer, write)
            self.done.append("draft")

    def insert(self) -> Node:
        assert self.m is not None and self.new is not None
        self.node = self.cache.insert(self.m, self.new, backup=self.bk)
        self.done.append("insert")
        return self.node

    def release(self) -> None:
        node = self.held_node
        assert node is not None
        self.cache.release(node)
        self.done.append("release")

    def abandon(self) -> None:
        """A request that stops before `insert`: give back what it holds."""
        if self.bk is not None and self.bk.active and not self.bk.nodes:
            self.cache.abort_backup(self.bk)
        if self.new is not None and "insert" not in self.done:
            self.cache.free_device(self.new)
            self.new = None
        if "release" not in self.done and self.m is not None:
            self.release()


def run_request(
    cache: HiCache,
    tokens: np.ndarray,
    *,
    stop_after: str | None = None,
    write: Callable[[Request, Model, int], None] | None = None,
    wait_load: bool = True,
    settle: bool = True,
) -> Request:
    """Drive one request through the protocol of /tmp/smoke.py.

    `stop_after` names the last step to run (one of STEPS); the returned
    `Request` can be continued by hand. `write(req, model, layer)` runs before
    each layer hook (to put known bytes into L1). With `settle` the poll step
    first waits for every submitted copy (so backups commit at that poll);
    with `wait_load` it polls until the request's load is no longer active.
    """
    if stop_after is not None and stop_after not in STEPS:
        raise ValueError(f"unknown step {stop_after!r}; steps: {STEPS}")
    r = Request(cache, np.asarray(tokens, dtype=np.int64))

    def stop(step: str) -> bool:
        return stop_after == step

    r.match()
    if stop("match"):
        return r
    r.load_back()
    if stop("load"):
        return r
    ok = r.alloc()
    assert ok, "L1 could not take the request"
    if stop("alloc"):
        return r
    r.reserve()
    if stop("reserve"):
        return r
    for layer in range(cache.layout.num_layers(Model.TARGET)):
        r.target_layer(layer, write)
    r.done.append("target")
    if stop("target"):
        return r
    for layer in range(cache.layout.num_layers(Model.DRAFT)):
        r.draft_layer(layer, write)
    r.done.append("draft")
    if stop("draft"):
        return r
    r.insert()
    if stop("insert"):
        return r
    if settle:
        land(cache)
    else:
        cache.poll()
    while wait_load and r.load is not None and r.load.active:
        land(cache)
    r.done.append("poll")
    if stop("poll"):
        return r
    r.release()
    if stop("release"):
        return r
    cache.ensure_free()
    r.done.append("ensure_free")
    return r


# ---- helpers -------------------------------------------------------------------------------


def wait_copies(cache: HiCache, timeout: float = 30.0) -> None:
    """Block until every ticket of every in-flight op finished (landed or failed)."""
    backups, loads = cache.in_flight()
    deadline = time.monotonic() + timeout
    for op in [*backups, *loads]:
        for t in list(op.inflight):
            while t.query().value == "pending":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"copy {t.describe()} still pending after {timeout} s")
                time.sleep(0.0005)


def land(cache: HiCache) -> None:
    """Let every submitted copy finish, then poll once."""
    wait_copies(cache)
    cache.poll()


def _evict_all(cache, field: str, pool) -> None:  # type: ignore[no-untyped-def]
    """Raise one tier's free-room target to its whole pool for one ensure_free."""
    old = getattr(cache.config, field)
    setattr(cache.config, field, pool.allocator.capacity)
    try:
        cache.ensure_free()
    finally:
        setattr(cache.config, field, old)


def evict_all_l1(cache) -> None:  # type: ignore[no-untyped-def]
    _evict_all(cache, "l1_free_room", cache.device_pool)


def evict_all_l2(cache) -> None:  # type: ignore[no-untyped-def]
    _evict_all(cache, "l2_free_room", cache.host_pool)


def tokens_of(*page_ids: int) -> np.ndarray:
    """A token sequence whose pages are identified by `page_ids` (equal id, equal page)."""
    return np.concatenate([np.full(PAGE, i, dtype=np.int64) for i in page_ids]) if page_ids else np.empty(0, np.int64)


def fill_pattern(req: Request, model: Model, layer: int) -> None:
    """Write a byte pattern derived from (part, layer, request position) into the
    request's new L1 pages: what a forward would have computed."""
    cache, m = req.cache, req.m
    assert m is not None and req.new is not None
    for p in cache.layout.parts_of(model):
        if not p.has_layer(layer):
            continue
        view = cache.device_pool.layer_view(p.part, p.slot(layer))
        for i, page in enumerate(req.new):
            pos = m.matched_pages + i
            view[page] = expected_bytes(req.tokens, pos, p.part, layer, p.page_bytes)


def expected_bytes(tokens: np.ndarray, pos: int, part: Part, layer: int, nbytes: int) -> np.ndarray:
    """Deterministic content of one page: depends on its tokens, part and layer."""
    seed = int(tokens[pos * PAGE]) * 1009 + pos * 31 + list(Part).index(part) * 7 + layer
    return ((np.arange(nbytes, dtype=np.int64) * 13 + seed) % 251).astype(np.uint8)


def tree_snapshot(cache: HiCache) -> list[tuple[Any, ...]]:
    """Structure of the tree in a rank-independent form (for CP comparisons)."""
    out = []

    def walk(node: Node, depth: int) -> None:
        for key in sorted(node.children):
            c = node.children[key]
            out.append(
                (
                    depth,
                    c.first_position,
                    c.num_pages,
                    None if c.device_pages is None else tuple(int(x) for x in c.device_pages),
                    None if c.host_pages is None else tuple(int(x) for x in c.host_pages),
                    c.host_state.value,
                    tuple(sorted(p.value for p in c.host_parts)),
                    c.lock_ref,
                    c.backup is not None,
                    c.load is not None,
                )
            )
            walk(c, depth + 1)

    walk(cache.tree.root, 0)
    return out


class TwoRankAgreement(Agreement):
    """A fake CP group of two ranks in one process: each rank's `reduce` deposits
    its votes and returns the element-wise MIN once both ranks arrived. Poll the
    two caches from two threads (`poll_both`)."""

    class _Shared:
        def __init__(self) -> None:
            self.votes: dict[int, list[Vote]] = {}
            self.barrier = threading.Barrier(2, timeout=30)
            self.calls = 0

    def __init__(self, rank: int, shared: TwoRankAgreement._Shared) -> None:
        self.rank = rank
        self.world_size = 2
        self.shared = shared

    @classmethod
    def pair(cls) -> tuple[TwoRankAgreement, TwoRankAgreement]:
        s = cls._Shared()
        return cls(0, s), cls(1, s)

    def reduce(self, votes: Sequence[Vote]) -> list[Vote]:
        s = self.shared
        s.votes[self.rank] = list(votes)
        s.barrier.wait()
        a, b = s.votes[0], s.votes[1]
        if len(a) != len(b):
            raise AssertionError(f"ranks disagree on the number of ops: {len(a)} vs {len(b)}")
        out = [Vote(ok=x.ok and y.ok, settled=x.settled and y.settled) for x, y in zip(a, b)]
        s.barrier.wait()  # both read before the next round overwrites
        if self.rank == 0:
            s.calls += 1
        return out

    def min_int(self, value: int) -> int:
        s = self.shared
        s.votes[self.rank] = [value]  # type: ignore[list-item]
        s.barrier.wait()
        out = min(s.votes[0][0], s.votes[1][0])  # type: ignore[type-var]
        s.barrier.wait()
        return out  # type: ignore[return-value]


def poll_both(c0: HiCache, c1: HiCache) -> None:
    """Poll two CP ranks in lockstep (rank 1 on a helper thread)."""
    err: list[BaseException] = []

    def other() -> None:
        try:
            c1.poll()
        except BaseException as exc:  # re-raised in the caller
            err.append(exc)

    t = threading.Thread(target=other)
    t.start()
    try:
        c0.poll()
    finally:
        t.join(timeout=60)
    if err:
        raise err[0]


def mooncake_store_available() -> bool:
    """Mooncake Store's client and its master binary are installed (tests that start a master)."""
    try:
        from hicache_harness.l3_master import master_binary

        master_binary()
        import mooncake.store  # noqa: F401
    except (ImportError, FileNotFoundError):
        return False
    return True


# ---- the node tier's segments -----------------------------------------------------------------


@pytest.fixture
def seg_name(request: pytest.FixtureRequest) -> Iterator[str]:
    """A segment name of this test and process; the test fails if it leaves the segment in /dev/shm."""
    from hostmem.segment import SHM_DIR

    name = f"hicache-cp-test-{os.getpid()}-{request.node.name[:40]}".replace("[", "-").replace("]", "")
    yield name
    if (SHM_DIR / name).exists():
        (SHM_DIR / name).unlink()
        pytest.fail(f"{name} was left in /dev/shm")
