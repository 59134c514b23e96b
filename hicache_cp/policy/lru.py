"""LRU: evict the least recently matched leaf first.

Predicts that a prefix not matched for the longest time is the least likely
to be matched next.
"""

from __future__ import annotations

from hicache_cp.policy.base import EvictionPolicy, register_policy
from hicache_cp.radix import Node


@register_policy("lru")
class LruPolicy(EvictionPolicy):
    def key(self, node: Node) -> float:
        return node.last_access
