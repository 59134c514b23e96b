"""Rebuild the cache's tree of host copies from a journal a previous engine left.

`adopt(entries, tree, allocator, parts)` turns the journal's COMMITTED
entries into committed host-only nodes of an empty tree and takes their
pages out of a fresh host allocator:

1. every entry's key must be the chain hash of its parent key and its tokens
   (a damaged entry would map a page to the wrong prefix: dropped), and its
   page a valid logical page; of two entries with the same key the later
   commit (`seq`) is kept;
2. the entries form a forest by parent key; walking it from the root key
   (position 0), each entry's position must be its parent's plus one;
   entries not reachable from the root are orphans (their prefix left L2
   before them: no request can match them) and are dropped;
3. each run of entries that continue one another without a branch becomes one
   node (`RadixTree.add_host_child`), committed with every part.

Every rank that adopts the same journal builds the same tree, creating its
nodes in the same order (entries are visited sorted by key), so node ids
and every later replicated decision agree. Returns the adopted nodes and the
pages dropped (the journal's writer frees them). The bytes are not read
here: every adopted page is checked before its first use
(`hicache_cp.cache.node_tier`). O(entries) hashes and numpy work, one Python
node per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from hashlib import blake2b

import numpy as np

from hicache_cp.keys import HASH_BYTES
from hicache_cp.layout import Part
from hicache_cp.node.journal import ROOT, Entries, seed
from hicache_cp.pools import LanePageAllocator
from hicache_cp.radix import Node, RadixTree


@dataclass
class Adoption:
    """What `adopt` made of a journal."""

    nodes: list[Node] = field(default_factory=list)
    pages: int = 0  # pages adopted
    dropped: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # entries not adopted
    damaged: int = 0  # of those: key, page or position inconsistent
    orphans: int = 0  # of those: unreachable from the root


def adopt(entries: Entries, tree: RadixTree, allocator: LanePageAllocator, parts: frozenset[Part]) -> Adoption:
    """See the module docstring. `tree` must be empty and `allocator` fresh."""
    assert not tree.root.children and allocator.used_pages == 0, "adoption needs an empty tree and allocator"
    by_key = _sound(entries, allocator.capacity, tree.page_size)
    damaged = len(entries) - len(by_key)
    keys, positions, seq = entries.keys, entries.positions.tolist(), entries.seq.tolist()
    children: dict[bytes, list[int]] = {}  # parent key -> entries continuing it at the next position
    for key in sorted(by_key):
        i = by_key[key]
        children.setdefault(entries.parents[i], []).append(i)
    out = Adoption(damaged=damaged)
    newest = max(seq, default=-1) + 1
    reached = np.zeros(len(entries), dtype=bool)
    stack: list[tuple[Node, bytes, int]] = [(tree.root, ROOT, -1)]  # (node, its key, its last position)
    while stack:
        parent, key, position = stack.pop()
        for i in children.get(key, ()):
            if positions[i] != position + 1:
                continue
            run = [i]
            while True:  # extend the run while it continues without a branch
                last = run[-1]
                nxt = [j for j in children.get(keys[last], ()) if positions[j] == positions[last] + 1]
                if len(nxt) != 1:
                    break
                run.append(nxt[0])
            idx = np.array(run, np.int64)
            node = tree.add_host_child(parent, entries.tokens[idx].reshape(-1), entries.pages[idx].copy(), parts)
            node.last_access = max(seq[j] for j in run) - newest  # commit order, before every new access
            reached[idx] = True
            out.nodes.append(node)
            stack.append((node, keys[run[-1]], positions[run[-1]]))
    out.orphans = len(by_key) - int(reached.sum())
    adopted = entries.pages[reached]
    allocator.adopt(adopted)
    out.pages = len(adopted)
    out.dropped = entries.pages[~reached]
    return out


def _sound(entries: Entries, capacity: int, page_size: int) -> dict[bytes, int]:
    """Key -> entry of the entries whose page is valid and whose key is the chain hash of
    their parent key and tokens; of two with one key, the later commit. O(entries) hashes."""
    tokens = entries.tokens.tobytes()
    step = page_size * 8
    pages, positions, seq = entries.pages.tolist(), entries.positions.tolist(), entries.seq.tolist()
    by_key: dict[bytes, int] = {}
    for i, key in enumerate(entries.keys):
        if not (1 <= pages[i] <= capacity and positions[i] >= 0):
            continue
        if blake2b(seed(entries.parents[i]) + tokens[i * step : (i + 1) * step], digest_size=HASH_BYTES).digest() != key:
            continue
        j = by_key.get(key)
        if j is None or seq[i] > seq[j]:
            by_key[key] = i
    return by_key
