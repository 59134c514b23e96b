"""Reference hit rates a trace replay is compared against.

All bounds count **blocks** of the trace's prefix chains, one block = one
cached page at the replay's tokens-per-block (for example one 64-token page
per 512-token trace block). A request's blocks are its *full* blocks only: a
partial tail block is never a whole page, so it is excluded from both hits and
totals.

Blocks are identified by their position in the **prefix trie** of the trace:
block ``i`` of a request is the node reached by the chain ``hash_ids[:i+1]``.
For a well-formed Mooncake trace (chained hash ids: an id always has the same
predecessor) trie nodes and hash ids are one to one; for a hand-made trace
that reuses an id after different prefixes, the trie view is what a radix tree
over :func:`hicache_harness.trace.request_tokens` would see, so the bounds stay
exact for it too.

- :func:`infinite_capacity_hit_rate`: unlimited cache, every block ever
  computed stays; the hit of a request is the longest prefix of its chain
  seen in any earlier request.
- :func:`belady_hit_rate`: offline optimal replacement (Belady's MIN) over a
  cache of ``capacity_blocks`` blocks, hits counted as the longest cached
  prefix of each request. See its docstring for exactly what it bounds.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hicache_harness.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class BoundResult:
    """Hit blocks over total (full) blocks; ``hit_rate`` is 0.0 for an empty trace."""

    hit_blocks: int
    total_blocks: int
    hit_rate: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.hit_blocks <= self.total_blocks:
            raise ValueError(
                f"need 0 <= hit_blocks <= total_blocks, got {self.hit_blocks}/{self.total_blocks}"
            )
        rate = self.hit_blocks / self.total_blocks if self.total_blocks else 0.0
        object.__setattr__(self, "hit_rate", rate)


@dataclass(frozen=True, slots=True)
class _Chains:
    """The trace flattened to trie-node accesses.

    ``nodes[offsets[r]:offsets[r+1]]`` are request ``r``'s full blocks as trie
    node ids (``0..n_nodes-1``); ``depth[v]`` is node ``v``'s block position.
    """

    nodes: np.ndarray  # int64, one entry per block access
    offsets: np.ndarray  # int64, len(requests) + 1
    depth: np.ndarray  # int64, one entry per node
    n_nodes: int


def _chains(requests: Sequence[TraceRequest]) -> _Chains:
    """Map every request's full-block chain to trie node ids. O(total blocks)."""
    child: dict[tuple[int, int], int] = {}
    flat: list[int] = []
    depth: list[int] = []
    offsets = [0]
    for r in requests:
        parent = -1
        for pos, b in enumerate(r.hash_ids[: r.full_blocks]):
            key = (parent, b)
            v = child.get(key)
            if v is None:
                v = len(depth)
                child[key] = v
                depth.append(pos)
            flat.append(v)
            parent = v
        offsets.append(len(flat))
    return _Chains(
        nodes=np.asarray(flat, dtype=np.int64),
        offsets=np.asarray(offsets, dtype=np.int64),
        depth=np.asarray(depth, dtype=np.int64),
        n_nodes=len(depth),
    )


def infinite_capacity_hit_rate(requests: Sequence[TraceRequest]) -> BoundResult:
    """Prefix hit rate with an unlimited cache.

    For each request, the hit is the longest prefix of its full-block chain
    that some earlier request also had; all of the request's blocks are then
    cached. No cache of any policy or capacity, page-granular at one page per
    block, can beat it. Complexity: O(total blocks) time and memory.
    """
    ch = _chains(requests)
    seen = np.zeros(ch.n_nodes, dtype=bool)
    hits = 0
    nodes = ch.nodes.tolist()
    offs = ch.offsets.tolist()
    for r in range(len(offs) - 1):
        chain = nodes[offs[r] : offs[r + 1]]
        for v in chain:
            if not seen[v]:
                break
            hits += 1
        seen[chain] = True
    return BoundResult(hit_blocks=hits, total_blocks=len(nodes))


def _next_use(nodes: np.ndarray, n_nodes: int) -> np.ndarray:
    """``nxt[t]`` = index of the next access to ``nodes[t]`` after ``t``, or
    ``len(nodes)`` (never again). One pass from the end, O(len(nodes))."""
    never = len(nodes)
    last = np.full(n_nodes, never, dtype=np.int64)
    nxt = np.empty(len(nodes), dtype=np.int64)
    lst = nodes.tolist()
    for t in range(len(lst) - 1, -1, -1):
        v = lst[t]
        nxt[t] = last[v]
        last[v] = t
    return nxt


def _belady(
    requests: Sequence[TraceRequest], capacity_blocks: int, bypass: bool
) -> tuple[int, int, int]:
    """Run MIN; return (prefix-rule hits, block-level hits, total blocks)."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    ch = _chains(requests)
    total = len(ch.nodes)
    if capacity_blocks == 0 or total == 0:
        return 0, 0, total
    nxt = _next_use(ch.nodes, ch.n_nodes).tolist()
    nodes = ch.nodes.tolist()
    depth = ch.depth.tolist()
    offs = ch.offsets.tolist()
    # cur[v] = next use of v while cached, -1 when not cached. Heap entries are
    # (-next_use, -depth, -node): the smallest entry is the block to evict
    # (farthest next use; ties, i.e. never used again, evict the deepest block
    # first, which keeps the cached set prefix-closed). Entries whose next use
    # no longer matches cur[] are stale and skipped when they surface.
    cur = [-1] * ch.n_nodes
    heap: list[tuple[int, int, int]] = []
    size = 0
    prefix_hits = block_hits = 0
    for r in range(len(offs) - 1):
        on_prefix = True
        for t in range(offs[r], offs[r + 1]):
            v = nodes[t]
            nu = nxt[t]
            entry = (-nu, -depth[v], -v)
            if cur[v] >= 0:
                block_hits += 1
                prefix_hits += on_prefix
                cur[v] = nu
                heapq.heappush(heap, entry)
                continue
            on_prefix = False
            if size == capacity_blocks:
                while cur[-heap[0][2]] != -heap[0][0]:
                    heapq.heappop(heap)  # stale
                if bypass and entry < heap[0]:
                    continue  # v itself is the farthest: do not cache it
                cur[-heapq.heappop(heap)[2]] = -1
                size -= 1
            cur[v] = nu
            heapq.heappush(heap, entry)
            size += 1
    return prefix_hits, block_hits, total


def belady_hit_rate(
    requests: Sequence[TraceRequest], capacity_blocks: int, *, bypass: bool = True
) -> BoundResult:
    """Offline optimal (Belady MIN) prefix hit rate at ``capacity_blocks`` blocks.

    Blocks are accessed in trace order, each request's full blocks root to
    leaf. A cached block is a hit only while every block before it in the
    request also hit (the prefix rule); a block after the first miss is a
    miss but is still offered to the cache and its next use updated. On a
    miss with a full cache, the block with the farthest next use is evicted
    (ties, which only occur between never-used-again blocks, evict the deepest
    block first). With ``bypass=True`` (default) the missed block itself is a
    candidate: if its own next use is the farthest it is not inserted.

    What it is, exactly:

    - ``bypass=True``: MIN with optional insertion, the optimal offline
      policy for maximising *block-level* hits in a cache of
      ``capacity_blocks`` unit blocks. Because a block's parent is always
      next used before the block itself, this policy never evicts a block
      whose child is cached nor caches a block without its parent, so its
      cached set is always prefix-closed and its prefix-rule hits equal its
      block-level hits. Hence it is an **upper bound** on the prefix hits of
      any page-granular cache of the same capacity at one page per block
      (LRU radix tree, write-through L1+L2 measured at the capacity of what
      it can serve, any insertion or eviction rule), since such a cache's
      prefix hits never exceed its block-level hits. For a tiered replay,
      compare against the capacity of all distinct pages it holds (for an
      inclusive L2, the L2 capacity).
    - ``bypass=False``: MIN with forced insertion (every accessed block is
      cached), the literal textbook variant. It can evict a parent block of
      the request in progress to make room for its child, leaving a cached
      block behind a missing one, so its prefix-rule hits may fall below its
      block-level hits: it is a reference point, not a proven bound.

    Never above :func:`infinite_capacity_hit_rate`; with ``bypass=True``,
    non-decreasing in ``capacity_blocks``.

    Complexity: O(B log B) time, O(B) memory for B total full blocks (the
    heap holds one entry per cached access, stale ones removed lazily); about
    0.15 s for the 118k full blocks of the public synthetic trace. Raises ``ValueError`` for a negative capacity.
    """
    prefix_hits, _, total = _belady(requests, capacity_blocks, bypass)
    return BoundResult(hit_blocks=prefix_hits, total_blocks=total)
