"""ChainHashes: the L3 object keys' chain hashes of tree nodes and requests.

An object's key ends with the chain hash of its group's last page
(`hicache_cp.l3.keys`), a hash over every token before it. Both L3 flows need
them: a prefetch for the request's positions past its L2 prefix
(`request`), a write-back for a node's pages (`node`). The hash at each node's
end is memoised, so a request or node costs the pages it adds, not its whole
prefix.

Runs in: the cache's thread.
"""

from __future__ import annotations

from hicache_cp.cache.state import CacheState
from hicache_cp.l3.keys import PositionHashes, chain_hashes
from hicache_cp.match import MatchResult
from hicache_cp.radix import Node

#: End-of-node chain hashes kept (node id -> hash); cleared when it grows past this.
_HASH_MEMO_LIMIT = 1 << 18


class ChainHashes:
    """Chain hashes of one cache rank's tree, memoised at node ends."""

    def __init__(self, state: CacheState) -> None:
        self.s = state
        self._end_hash: dict[int, tuple[int, bytes]] = {}

    def end_of(self, node: Node) -> bytes:
        """Chain hash of `node`'s last page (b"" for the root). Memoised per node."""
        chain: list[Node] = []
        n: Node | None = node
        h = b""
        while n is not None and n is not self.s.tree.root:
            memo = self._end_hash.get(n.id)
            if memo is not None and memo[0] == n.end_position:
                h = memo[1]
                break
            chain.append(n)
            n = n.parent
        if len(self._end_hash) > _HASH_MEMO_LIMIT:
            self._end_hash.clear()
        for n in reversed(chain):
            h = chain_hashes(n.tokens, self.s.layout.page_size, h)[-1]
            self._end_hash[n.id] = (n.end_position, h)
        return h

    def node(self, node: Node) -> list[bytes]:
        """Chain hash of every page of `node`, in order."""
        parent = node.parent
        base = self.end_of(parent) if parent is not None else b""
        hashes = chain_hashes(node.tokens, self.s.layout.page_size, base)
        self._end_hash[node.id] = (node.end_position, hashes[-1])
        return hashes

    def request(self, m: MatchResult, lo: int, hi: int) -> PositionHashes:
        """Chain hashes of the request's positions [lo, hi), from the deepest
        node of its matched path that ends at or before `lo`."""
        anchor: Node = m.last_node
        while anchor is not self.s.tree.root and anchor.end_position > lo:
            anchor = anchor.parent  # type: ignore[assignment]
        base = anchor.end_position if anchor is not self.s.tree.root else 0
        h0 = self.end_of(anchor) if anchor is not self.s.tree.root else b""
        ps = self.s.layout.page_size
        hashes = chain_hashes(m.tokens[base * ps : hi * ps], ps, h0)
        return PositionHashes(lo, hashes[lo - base :])

