"""KV cache events: what the cache tells a KV-aware router about the blocks it holds.

A router in front of several servers sends a request to the server that
holds its prefix; it learns what each holds from events about blocks (one
block is one page here):

    BlockStored(medium, keys, parent, tokens)   these pages became visible in a tier
    BlockRemoved(medium, keys, reason)          these pages left it
    AllCleared()                                every block announced before is gone

When each is sent (the contract; tests/test_events.py checks it):

    HOST (L2)    stored when a backup commits (every layer of every part landed
                 on every rank), never earlier, and when an L3 prefetch commits
                 its pages into L2; an aborted backup sends nothing. removed when
                 the copy leaves L2 for any reason: eviction, `l2_exclusive`
                 dropping a loaded copy, a failed integrity check; every one goes
                 through `CacheState.drop_host_copy`.
    STORE (L3)   stored when a write-back's put retired on this rank with every
                 object stored (or found present); removed when a lookup finds an
                 object this cache announced missing (the store evicted it).
    DEVICE (L1)  only where the cache owns L1 (the reference server): stored when
                 a node gets L1 pages (insert, load-back), removed at L1 eviction.
                 An engine that owns its device pages (SGLang, vLLM) publishes its
                 GPU tier itself; the cache then never holds device pages.
    AllCleared   when a cache is built with a log: a restart, or a reset (which
                 builds a new cache); after a restart, HOST stored follows for
                 every copy the node tier adopted, parents first
                 (`HiCache.attach_events`).

Keys: one per page, chained over the prefix (a page's key depends on every
token before it), made by a `BlockKeyer` that the engine integration gives:
the hash the engine itself gives that block (SGLang's page hash chain,
vLLM's block hash), so a router joins these events with the engine's own
GPU-tier events. A node's keys are computed once and kept on it
(`Node.event_keys`, split with the node), chained on its parent's last key:
a page is hashed once in its life. The default keyer is the L3 key chain
(`hicache_cp.l3.keys.chain_hashes`).

Delivery: to `sink` as they happen (SGLang: its own recorder, so they keep
their order among its GPU-tier events), or queued for `take()` (vLLM's
connector `take_events`, the harness's publisher). Encoding into an
engine's wire format belongs to its integration (`integrations/sglang/events`,
`integrations/vllm/events`): the library imports no engine.

Runs in: the cache's thread. Cost: nothing without a log; with one, one
keyer call per new node (O(its tokens)) and one small object per event.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hicache_cp.keys import chain_hashes
from hicache_cp.radix import Node

Key = Hashable
"""One page's key: whatever the keyer makes (bytes, a hex string, an int)."""


class Medium(enum.Enum):
    """Where the announced blocks live."""

    DEVICE = "device"  # L1, only when the cache owns it
    HOST = "host"  # L2: pinned host memory
    STORE = "store"  # L3: the shared store (Mooncake Store)


class Removal(enum.Enum):
    """Why blocks left a tier (for logs and counters; the wire formats carry none)."""

    EVICTED = "evicted"  # the tier's eviction
    EXCLUSIVE = "exclusive"  # l2_exclusive: loaded into L1, the L2 copy dropped
    INTEGRITY = "integrity"  # a failed check dropped a corrupt copy
    MISSING = "missing"  # L3: a lookup found an announced object gone


@dataclass(slots=True)
class BlockStored:
    medium: Medium
    keys: list[Key]  # one per page, in position order
    parent: Key | None  # key of the page before the first (None: the first page of a prefix)
    tokens: np.ndarray  # int64, len(keys) * page_size: the pages' tokens
    first_position: int  # request position of the first page


@dataclass(slots=True)
class BlockRemoved:
    medium: Medium
    keys: list[Key]
    reason: Removal


@dataclass(slots=True, frozen=True)
class AllCleared:
    pass


Event = BlockStored | BlockRemoved | AllCleared
Sink = Callable[[Event], None]


class BlockKeyer(Protocol):
    """Makes the engine's keys of whole pages."""

    def chain(self, parent: Key | None, tokens: np.ndarray, page_size: int) -> list[Key]:
        """The key of each whole page of `tokens` (int64), the first chained on
        `parent` (None: position 0). Must equal what the engine computes for
        the same prefix. O(tokens)."""


class ChainKeyer:
    """hicache-cp's own prefix chain: blake2b-128 per page (the L3 keys' chain)."""

    def chain(self, parent: Key | None, tokens: np.ndarray, page_size: int) -> list[Key]:
        return list(chain_hashes(tokens, page_size, parent if isinstance(parent, bytes) else b""))


class EventLog:
    """The events of one cache (see the module docstring).

    `media` selects which tiers are announced (default all). `blocks` counts
    the pages announced per (medium, "stored" | "removed") and `seconds` the
    time spent keying and emitting, for the metrics.
    """

    def __init__(self, keyer: BlockKeyer | None = None, *, sink: Sink | None = None,
                 media: Iterable[Medium] = tuple(Medium)) -> None:  # fmt: skip
        self.keyer: BlockKeyer = keyer or ChainKeyer()
        self.sink = sink
        self.media = frozenset(media)
        self.page_size = 0
        self.blocks: Counter[tuple[str, str]] = Counter()
        self.cleared_count = 0
        self.seconds = 0.0  # wall time the cache's thread spent keying and emitting (metrics, benchmarks)
        self._queue: list[Event] = []

    def bind(self, page_size: int) -> None:
        """Called by the cache that takes this log (also after a reset, with a new cache)."""
        if self.page_size and self.page_size != page_size:
            raise ValueError(f"event log keyed {self.page_size}-token pages; this cache has {page_size}")
        self.page_size = page_size

    def wants(self, medium: Medium) -> bool:
        return medium in self.media

    # ---- keys --------------------------------------------------------------------------

    def keys_of(self, node: Node) -> list[Key]:
        """The keys of `node`'s pages (the root: none). Computed once per node on
        its whole root path, then read from `node.event_keys`. O(new tokens)."""
        if node.event_keys is not None:
            return node.event_keys
        chain: list[Node] = []
        n = node
        while n.event_keys is None and n.parent is not None:
            chain.append(n)
            n = n.parent
        parent = n.event_keys[-1] if n.parent is not None and n.event_keys else None
        for m in reversed(chain):
            m.event_keys = self.keyer.chain(parent, m.tokens, self.page_size)
            assert len(m.event_keys) == m.num_pages, (m, len(m.event_keys))
            parent = m.event_keys[-1]
        return node.event_keys  # type: ignore[return-value]

    def parent_key(self, node: Node) -> Key | None:
        """The key of the page before `node`'s first (None at position 0)."""
        p = node.parent
        return self.keys_of(p)[-1] if p is not None and p.parent is not None else None

    def run_of(self, node: Node, lo: int) -> tuple[list[Key], Key | None, np.ndarray]:
        """Keys and tokens of positions [lo, node.end) on `node`'s root path, and the
        key before `lo`. O(nodes on the run)."""
        ps = self.page_size
        keys: list[list[Key]] = []
        tokens: list[np.ndarray] = []
        n: Node | None = node
        while n is not None and n.parent is not None and n.end_position > lo:
            off = max(0, lo - n.first_position)
            keys.append(self.keys_of(n)[off:])
            tokens.append(n.tokens[off * ps :])
            if off:
                return _joined(keys), self.keys_of(n)[off - 1], np.concatenate(tokens[::-1])
            n = n.parent
        parent = self.keys_of(n)[-1] if n is not None and n.parent is not None else None
        return _joined(keys), parent, np.concatenate(tokens[::-1]) if tokens else np.empty(0, np.int64)

    # ---- emitting ----------------------------------------------------------------------

    def stored(self, medium: Medium, node: Node) -> None:
        """`node`'s pages became visible in `medium`."""
        if medium in self.media:
            t0 = time.perf_counter()
            self._emit(BlockStored(medium, list(self.keys_of(node)), self.parent_key(node), node.tokens,
                                   node.first_position))  # fmt: skip
            self.seconds += time.perf_counter() - t0

    def removed(self, medium: Medium, node: Node, reason: Removal) -> None:
        """`node`'s pages left `medium`."""
        if medium in self.media:
            t0 = time.perf_counter()
            self._emit(BlockRemoved(medium, list(self.keys_of(node)), reason))
            self.seconds += time.perf_counter() - t0

    def stored_run(self, medium: Medium, keys: list[Key], parent: Key | None, tokens: np.ndarray,
                   first_position: int) -> None:  # fmt: skip
        if medium in self.media and keys:
            self._emit(BlockStored(medium, keys, parent, tokens, first_position))

    def removed_keys(self, medium: Medium, keys: list[Key], reason: Removal) -> None:
        if medium in self.media and keys:
            self._emit(BlockRemoved(medium, keys, reason))

    def cleared(self) -> None:
        """Everything announced before is gone (a new cache: restart or reset)."""
        self.cleared_count += 1
        self._emit(AllCleared())

    def _emit(self, event: Event) -> None:
        if not isinstance(event, AllCleared):
            kind = "stored" if isinstance(event, BlockStored) else "removed"
            self.blocks[(event.medium.value, kind)] += len(event.keys)
        if self.sink is not None:
            self.sink(event)
            return
        tail = self._queue[-1] if self._queue else None
        if isinstance(event, BlockRemoved) and isinstance(tail, BlockRemoved) and tail.medium is event.medium:
            tail.keys.extend(event.keys)  # coalesced, as the engines' recorders do
            return
        self._queue.append(event)

    def take(self) -> list[Event]:
        """The queued events, oldest first; the queue is emptied (without a sink)."""
        out, self._queue = self._queue, []
        return out


def _joined(parts: list[list[Key]]) -> list[Key]:
    out: list[Key] = []
    for p in reversed(parts):
        out.extend(p)
    return out
