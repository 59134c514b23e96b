"""Page-granular radix tree over token ids.

Keys are whole pages: a token sequence is cut into `page_size` tokens per
page (a partial last page is never cached). A node keeps the tokens of its
pages as one int64 array; children are found by the bytes of their first
page, and a match compares whole runs of tokens with one vectorised numpy
comparison per node. Lookups compare exact content, never a hash, and no
Python object is built per page.

Each node covers a run of pages and records where they live:

    device_pages  logical L1 pages, or None once evicted from L1
    host_pages    logical L2 pages, or None
    host_state    NONE / PENDING (backup in flight: invisible, not evictable)
                  / COMMITTED (every layer of every part landed)
    backup, load  the in-flight op touching the node, if any
    stale_load    the aborted load that made these L1 pages invalid: the
                  load's own nodes (listed by the op) until its request has
                  recomputed them (`HiCache.recomputed`), and the L1 nodes
                  below them for good; a stale node is no device hit, is never
                  backed up, and is replaced by a fresh insert or dropped
    lock_ref      requests using the node (counted on the whole root path)
    event_keys    the per-page keys an event log gave the node (`hicache_cp.events`),
                  computed once, split with the node

Invariants (`RadixTree.check_invariants`): device residency is closed
towards the root (a node with device pages has an ancestor chain of device
pages), page arrays have one entry per key page, `host_state` agrees with
`host_pages` and `backup`, lock counts never go negative and a parent's
count is at least its children's, and the two evictable sets equal their
definitions:

    device leaves: device pages, unlocked, no in-flight op, no child with device pages
    host leaves:   COMMITTED host copy, unlocked, not being loaded, no child with a host copy

`match` may split a node so that a match ends on a node boundary; it
documents that side effect and returns the path.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from hicache_cp.layout import Part

PageKey = bytes
"""A child's key in its parent: the bytes of its first page's tokens."""


class HostState(enum.Enum):
    NONE = "none"
    PENDING = "pending"
    COMMITTED = "committed"


_node_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Node:
    parent: Node | None
    tokens: np.ndarray  # int64 tokens of the node's pages: num_pages * page_size
    num_pages: int
    first_position: int  # request-absolute page position of the first page
    device_pages: np.ndarray | None = None
    host_pages: np.ndarray | None = None
    host_state: HostState = HostState.NONE
    host_parts: frozenset[Part] = frozenset()
    backup: object | None = None  # BackupOp while PENDING
    load: object | None = None  # LoadOp while loading
    stale_load: object | None = None  # the aborted LoadOp that made the L1 pages invalid
    children: dict[PageKey, Node] = field(default_factory=dict)
    lock_ref: int = 0
    hit_count: int = 0
    last_access: int = 0
    reuse_hint: int = 0  # the eviction policy's evidence of reuse, set at insert (hicache_cp.policy)
    event_keys: list | None = None  # the event log's per-page keys, once computed (hicache_cp.events)
    id: int = field(default_factory=lambda: next(_node_ids))

    def head(self) -> PageKey:
        """The key of this node in its parent: its first page's token bytes."""
        return self.tokens[: len(self.tokens) // self.num_pages].tobytes()

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    @property
    def host_visible(self) -> bool:
        return self.host_state is HostState.COMMITTED

    @property
    def end_position(self) -> int:
        return self.first_position + self.num_pages

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, pos={self.first_position}+{self.num_pages}, dev={self.on_device}, "
            f"host={self.host_state.value}, lock={self.lock_ref})"
        )


def whole_pages(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """The int64 tokens of the whole pages of `tokens` (a partial last page dropped)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    return tokens[: len(tokens) // page_size * page_size]


class RadixTree:
    """The tree structure, lock counts and evictable sets; no policy, no io."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node(parent=None, tokens=np.empty(0, np.int64), num_pages=0, first_position=0,
                         device_pages=np.empty(0, np.int64))
        self.root.lock_ref = 1  # the root is never evicted
        self.device_leaves: set[Node] = set()
        self.host_leaves: set[Node] = set()

    # ---- lookup ------------------------------------------------------------------------

    def match(self, tokens: np.ndarray) -> list[Node]:
        """The path of nodes whose pages prefix `tokens` (whole pages, int64), root excluded.

        Side effect: if the match ends inside a node, that node is split so the
        path ends on a boundary. O(tokens matched) in numpy, O(nodes on the
        path) in Python.
        """
        ps = self.page_size
        n = len(tokens) // ps
        path: list[Node] = []
        node, i = self.root, 0
        while i < n:
            child = node.children.get(tokens[i * ps : (i + 1) * ps].tobytes())
            if child is None:
                break
            k = _common_pages(child.tokens, tokens[i * ps :], ps)
            if k < child.num_pages:
                child = self.split(child, k)
            path.append(child)
            node, i = child, i + k
        return path

    def split(self, node: Node, n: int) -> Node:
        """Split `node` after its first `n` pages; return the new upper node.

        The upper node takes the first n pages of every page array and shares
        the node's in-flight ops (they list both halves afterwards).
        """
        assert 0 < n < node.num_pages, (node, n)
        parent = node.parent
        assert parent is not None
        cut = n * self.page_size
        upper = Node(
            parent=parent,
            tokens=node.tokens[:cut],
            num_pages=n,
            first_position=node.first_position,
            device_pages=None if node.device_pages is None else node.device_pages[:n],
            host_pages=None if node.host_pages is None else node.host_pages[:n],
            host_state=node.host_state,
            host_parts=node.host_parts,
            backup=node.backup,
            load=node.load,
            stale_load=node.stale_load,
            lock_ref=node.lock_ref,
            hit_count=node.hit_count,
            last_access=node.last_access,
            reuse_hint=node.reuse_hint,
            event_keys=None if node.event_keys is None else node.event_keys[:n],
        )
        node.tokens = node.tokens[cut:]
        if node.event_keys is not None:
            node.event_keys = node.event_keys[n:]
        node.num_pages -= n
        node.first_position += n
        if node.device_pages is not None:
            node.device_pages = node.device_pages[n:]
        if node.host_pages is not None:
            node.host_pages = node.host_pages[n:]
        parent.children[upper.head()] = upper
        upper.children[node.head()] = node
        node.parent = upper
        for op in (node.backup, node.load):
            if op is not None:
                op.nodes.append(upper)  # type: ignore[attr-defined]
        if node.stale_load is not None and node in node.stale_load.nodes:  # type: ignore[attr-defined]
            node.stale_load.nodes.append(upper)  # type: ignore[attr-defined]
        self.refresh(upper)
        self.refresh(node)
        return upper

    def add_child(self, parent: Node, tokens: np.ndarray, device_pages: np.ndarray | None) -> Node:
        """A new child of `parent` holding these whole pages (the tokens are copied).
        `device_pages` None: the node holds nothing yet (engine-owned L1 attaches a
        host copy to it next, `hicache_cp.cache.engine_l1`)."""
        n = len(tokens) // self.page_size
        assert n and n * self.page_size == len(tokens), (len(tokens), self.page_size)
        assert device_pages is None or n == len(device_pages), (n, len(device_pages))
        child = Node(
            parent=parent,
            tokens=np.array(tokens, dtype=np.int64),
            num_pages=n,
            first_position=parent.end_position,
            device_pages=device_pages,
        )
        return self._attach(parent, child)

    def add_host_child(
        self, parent: Node, tokens: np.ndarray, host_pages: np.ndarray, parts: frozenset[Part]
    ) -> Node:
        """A new child of `parent` whose pages live only in L2, committed with
        `parts` (an L3 prefetch landed them whole on every rank). The tokens
        are copied."""
        n = len(tokens) // self.page_size
        assert n and n * self.page_size == len(tokens) and n == len(host_pages), (len(tokens), len(host_pages))
        child = Node(
            parent=parent,
            tokens=np.array(tokens, dtype=np.int64),
            num_pages=n,
            first_position=parent.end_position,
            host_pages=host_pages,
            host_state=HostState.COMMITTED,
            host_parts=parts,
        )
        return self._attach(parent, child)

    def _attach(self, parent: Node, child: Node) -> Node:
        head = child.head()
        assert head not in parent.children, f"{parent} already has a child starting with these tokens"
        parent.children[head] = child
        self.refresh(child)
        self.refresh(parent)
        return child

    def remove_leaf(self, node: Node) -> Node:
        """Delete a node holding nothing; return its parent."""
        assert not node.children and node.device_pages is None and node.host_state is HostState.NONE, node
        parent = node.parent
        assert parent is not None
        del parent.children[node.head()]
        self.device_leaves.discard(node)
        self.host_leaves.discard(node)
        node.parent = None
        self.refresh(parent)
        return parent

    def prune(self, node: Node) -> None:
        """Remove `node` and then its ancestors while they hold nothing: no
        children, no device pages, no host copy, no lock. O(depth)."""
        while (
            node is not self.root
            and node.parent is not None
            and not node.children
            and node.device_pages is None
            and node.host_state is HostState.NONE
            and node.lock_ref == 0
        ):
            node = self.remove_leaf(node)

    # ---- locks -----------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Pin `node` and its ancestors (they become unevictable). O(depth)."""
        n: Node | None = node
        while n is not None and n is not self.root:
            n.lock_ref += 1
            if n.lock_ref == 1:
                self.refresh(n)
            n = n.parent

    def unlock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self.root:
            if n.lock_ref <= 0:
                raise AssertionError(f"unlock of unlocked {n}")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.refresh(n)
            n = n.parent

    # ---- evictable sets ----------------------------------------------------------------

    def refresh(self, node: Node) -> None:
        """Recompute `node`'s membership in both evictable sets. O(children)."""
        if node is self.root or node.parent is None:
            return
        free = node.lock_ref == 0 and node.load is None
        if free and node.on_device and node.backup is None and not any(c.on_device for c in node.children.values()):
            self.device_leaves.add(node)
        else:
            self.device_leaves.discard(node)
        if free and node.host_visible and not any(c.host_pages is not None for c in node.children.values()):
            self.host_leaves.add(node)
        else:
            self.host_leaves.discard(node)

    def refresh_family(self, node: Node) -> None:
        self.refresh(node)
        if node.parent is not None:
            self.refresh(node.parent)

    # ---- walking and checking -------------------------------------------------------------

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def check_invariants(self) -> None:
        expect_dev: set[Node] = set()
        expect_host: set[Node] = set()
        for n in self.nodes():
            p = n.parent
            assert p is not None and p.children.get(n.head()) is n, f"{n}: broken parent link"
            assert len(n.tokens) == n.num_pages * self.page_size > 0, f"{n}: {len(n.tokens)} tokens"
            assert n.first_position == p.end_position, f"{n}: position {n.first_position} != parent end {p.end_position}"
            for name, arr in (("device", n.device_pages), ("host", n.host_pages)):
                assert arr is None or len(arr) == n.num_pages, f"{n}: {name} pages {len(arr)} != {n.num_pages}"
            assert n.event_keys is None or len(n.event_keys) == n.num_pages, f"{n}: {len(n.event_keys)} event keys"
            if n.on_device:
                assert p.on_device, f"{n}: on device but parent {p} is not"
            assert n.lock_ref >= 0 and p.lock_ref >= n.lock_ref or p is self.root, f"{n}: lock counts {p.lock_ref} < {n.lock_ref}"
            if n.host_state is HostState.NONE:
                assert n.host_pages is None and n.backup is None and not n.host_parts, f"{n}: NONE with host data"
            elif n.host_state is HostState.PENDING:
                assert n.host_pages is not None and n.backup is not None, f"{n}: PENDING without pages or backup"
                assert n in n.backup.nodes, f"{n}: not listed by its backup"  # type: ignore[attr-defined]
            else:
                assert n.host_pages is not None and n.backup is None, f"{n}: COMMITTED with a backup in flight"
            if n.load is not None:
                assert n.on_device and n.host_visible, f"{n}: loading without device pages or a host copy"
            if n.stale_load is not None:
                assert n.on_device and n.load is None, f"{n}: stale without device pages, or being loaded"
            free = n.lock_ref == 0 and n.load is None
            if free and n.on_device and n.backup is None and not any(c.on_device for c in n.children.values()):
                expect_dev.add(n)
            if free and n.host_visible and not any(c.host_pages is not None for c in n.children.values()):
                expect_host.add(n)
        assert self.device_leaves == expect_dev, (
            f"device leaves drifted: extra {self.device_leaves - expect_dev}, missing {expect_dev - self.device_leaves}"
        )
        assert self.host_leaves == expect_host, (
            f"host leaves drifted: extra {self.host_leaves - expect_host}, missing {expect_host - self.host_leaves}"
        )


def _common_pages(node_tokens: np.ndarray, tokens: np.ndarray, page_size: int) -> int:
    """How many whole pages the two token arrays share from their start."""
    k = min(len(node_tokens), len(tokens)) // page_size * page_size
    a, b = node_tokens[:k], tokens[:k]
    if np.array_equal(a, b):
        return k // page_size
    return int(np.argmax(a != b)) // page_size
