"""Eviction policies: which evictable leaf goes first.

A policy maps a node to a sort key; the smallest key is evicted first. Keys
use the cache's logical clock (one tick per `match_prefix`), never wall
time, so every CP rank computes the same order from the same metadata
(DOMAIN.md rule 7) and runs are reproducible.

Registered policies:

    lru           least recently matched first
    hit_weighted  LRU with a bonus per past hit: a prefix that multi-turn
                  sessions keep coming back to outlives one-off content that
                  was touched slightly later
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from hicache_cp.radix import Node


class EvictionPolicy(abc.ABC):
    name: str

    @abc.abstractmethod
    def key(self, node: Node) -> float:
        """Smaller keys are evicted first."""


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {}


def register_policy(name: str) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    def deco(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in _POLICIES:
            raise ValueError(f"eviction policy {name!r} registered twice")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return deco


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str) -> EvictionPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; supported: {', '.join(policy_names())}") from None


@register_policy("lru")
class LruPolicy(EvictionPolicy):
    def key(self, node: Node) -> float:
        return node.last_access


@register_policy("hit_weighted")
class HitWeightedPolicy(EvictionPolicy):
    """last_access + HIT_BONUS * min(hits, MAX_HITS).

    HIT_BONUS is in clock ticks (requests): one past hit is worth having been
    touched that many requests later. MAX_HITS caps the bonus so that a once
    hot prefix still ages out. Chosen on the public synthetic trace at L2 =
    10% of its footprint: bonuses of 4-8 ticks beat LRU slightly, 16 and more
    lose to it (hot prefixes then crowd out the next turn's context).
    """

    HIT_BONUS = 8
    MAX_HITS = 8

    def key(self, node: Node) -> float:
        return node.last_access + self.HIT_BONUS * min(node.hit_count, self.MAX_HITS)
