"""The eviction policy interface and its registry.

A policy orders the evictable leaves of each tier (`key_in`, by default
`key`: the smallest goes first) and may learn from what the cache tells it
through hooks. The cache calls them on every CP rank at the same step with
the same arguments:

    bind(page_size, l1_pages, l2_pages)  once, before any request
    on_match(pages, used, clock)         a request matched; `used` is the path it hits
    on_insert(pages, node, clock)        a request's computed pages formed `node`
    on_evict(node, tier, clock)          `node` just left `tier` ("l1" or "l2")

Hooks carry only replicated state (the logical clock, node metadata, request
positions and tokens), so a policy that learns from them still decides the
same on every rank (docs/invariants.md rule 7). A policy may write one thing into a
node: `Node.reuse_hint`, at `on_insert`. Every hook defaults to nothing, so
a policy that needs only `key` (LRU) overrides nothing else. Hooks run on
the request path: they must cost O(pages of the request) at most, in numpy
rather than a Python loop over pages.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import numpy as np

from hicache_cp.radix import Node


class EvictionPolicy(abc.ABC):
    """Orders evictable leaves; the smallest key is evicted first.

    Keys may read only node metadata that every CP rank holds identically
    (the logical clock, hit counts, positions) and what the hooks told the
    policy, never wall time or rank-local facts, so every rank evicts the
    same nodes in the same order.
    """

    name: str

    @abc.abstractmethod
    def key(self, node: Node) -> float:
        """Smaller keys are evicted first. Called at eviction time."""

    def key_in(self, node: Node, tier: str) -> float:
        """The key of `node` among `tier`'s leaves ("l1" or "l2"); `key` unless
        a policy orders the tiers differently."""
        return self.key(node)

    def bind(self, *, page_size: int, l1_pages: int, l2_pages: int) -> None:
        """The cache's page size and logical capacities in pages; called once,
        before any request."""

    def on_match(self, pages: np.ndarray, used: Sequence[Node], clock: int) -> None:
        """A request matched. `pages`: the tokens of its whole pages (int64,
        num_pages * page_size; do not modify); `used`: the path it hits, root
        excluded, whose `hit_count` and `last_access` are already updated;
        `clock`: the tick of this match."""

    def on_insert(self, pages: np.ndarray, node: Node, clock: int) -> None:
        """A request's computed pages formed the new leaf `node`. `pages`: the
        request's whole pages' tokens up to `node.end_position`."""

    def on_evict(self, node: Node, tier: str, clock: int) -> None:
        """`node` just left `tier` ("l1" or "l2"), before it is pruned."""


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {}


def register_policy(name: str) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    """Class decorator adding a policy to the registry under `name`."""

    def deco(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in _POLICIES:
            raise ValueError(f"eviction policy {name!r} registered twice")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return deco


def registered() -> dict[str, Callable[[], EvictionPolicy]]:
    """The policies registered so far (built-ins only once imported)."""
    return _POLICIES
