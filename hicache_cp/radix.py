"""Page-granular radix tree over token ids.

Keys are whole pages: a token sequence is cut into `page_size` tokens per
page (a partial last page is never cached) and each page is keyed by its
tokens' bytes, so lookups compare exact content, never a hash alone.

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


class HostState(enum.Enum):
    NONE = "none"
    PENDING = "pending"
    COMMITTED = "committed"


_node_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Node:
    parent: Node | None
    key: list[PageKey]
    first_position: int  # request-absolute page position of key[0]
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
    id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def num_pages(self) -> int:
        return len(self.key)

    @property
    def on_device(self) -> bool:
        return self.device_pages is not None

    @property
    def host_visible(self) -> bool:
        return self.host_state is HostState.COMMITTED

    @property
    def end_position(self) -> int:
        return self.first_position + len(self.key)

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, pos={self.first_position}+{len(self.key)}, dev={self.on_device}, "
            f"host={self.host_state.value}, lock={self.lock_ref})"
        )


def page_keys(tokens: np.ndarray, page_size: int) -> list[PageKey]:
    """Cut tokens into whole-page keys (a partial last page is dropped)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    n = len(tokens) // page_size
    flat = tokens[: n * page_size].reshape(n, page_size)
    return [row.tobytes() for row in flat]


class RadixTree:
    """The tree structure, lock counts and evictable sets; no policy, no io."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node(parent=None, key=[], first_position=0, device_pages=np.empty(0, np.int64))
        self.root.lock_ref = 1  # the root is never evicted
        self.device_leaves: set[Node] = set()
        self.host_leaves: set[Node] = set()

    # ---- lookup ------------------------------------------------------------------------

    def match(self, keys: list[PageKey]) -> list[Node]:
        """The path of nodes whose keys prefix `keys`, root excluded.

        Side effect: if the match ends inside a node, that node is split so the
        path ends on a boundary. O(number of pages matched).
        """
        path: list[Node] = []
        node, i = self.root, 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            n = _common_prefix(child.key, keys, i)
            if n < len(child.key):
                child = self.split(child, n)
            path.append(child)
            node, i = child, i + n
        return path

    def split(self, node: Node, n: int) -> Node:
        """Split `node` after its first `n` pages; return the new upper node.

        The upper node takes the first n pages of every page array and shares
        the node's in-flight ops (they list both halves afterwards).
        """
        assert 0 < n < len(node.key), (node, n)
        parent = node.parent
        assert parent is not None
        upper = Node(
            parent=parent,
            key=node.key[:n],
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
        )
        node.key = node.key[n:]
        node.first_position += n
        if node.device_pages is not None:
            node.device_pages = node.device_pages[n:]
        if node.host_pages is not None:
            node.host_pages = node.host_pages[n:]
        parent.children[upper.key[0]] = upper
        upper.children[node.key[0]] = node
        node.parent = upper
        for op in (node.backup, node.load):
            if op is not None:
                op.nodes.append(upper)  # type: ignore[attr-defined]
        if node.stale_load is not None and node in node.stale_load.nodes:  # type: ignore[attr-defined]
            node.stale_load.nodes.append(upper)  # type: ignore[attr-defined]
        self.refresh(upper)
        self.refresh(node)
        return upper

    def add_child(self, parent: Node, keys: list[PageKey], device_pages: np.ndarray) -> Node:
        assert keys and len(keys) == len(device_pages), (len(keys), len(device_pages))
        assert keys[0] not in parent.children
        child = Node(parent=parent, key=list(keys), first_position=parent.end_position, device_pages=device_pages)
        parent.children[keys[0]] = child
        self.refresh(child)
        self.refresh(parent)
        return child

    def remove_leaf(self, node: Node) -> Node:
        """Delete a node holding nothing; return its parent."""
        assert not node.children and node.device_pages is None and node.host_state is HostState.NONE, node
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[0]]
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
            assert p is not None and p.children.get(n.key[0]) is n, f"{n}: broken parent link"
            assert n.first_position == p.end_position, f"{n}: position {n.first_position} != parent end {p.end_position}"
            for name, arr in (("device", n.device_pages), ("host", n.host_pages)):
                assert arr is None or len(arr) == len(n.key), f"{n}: {name} pages {len(arr)} != key pages {len(n.key)}"
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


def _common_prefix(a: list[PageKey], b: list[PageKey], start: int) -> int:
    n = 0
    limit = min(len(a), len(b) - start)
    while n < limit and a[n] == b[start + n]:
        n += 1
    return n
