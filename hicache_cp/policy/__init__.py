"""Eviction policies: which evictable leaf goes first.

A policy maps a node to a sort key; the smallest key is evicted first. Keys
use the cache's logical clock (one tick per `match_prefix`), never wall
time, so every CP rank computes the same order from the same metadata
(docs/invariants.md rule 7) and runs are reproducible. A policy may also learn from
hooks the cache calls on every match, insert and eviction (`base`).

Policies live one per module in this package and register by name; the
registry imports a built-in module only when its policy is asked for:

    lru           least recently matched first (`lru`)
    hit_weighted  LRU with a bonus per past hit (`hit_weighted`)
    reuse_lru     LRU that protects content seen twice, across evictions, and
                  first-timer classes it learns are reused (`reuse_lru`)

`bench/scripts/policy_sweep.py` compares them against the Belady bound, also under
`write_back` and with `l2_exclusive` (L1 and L2 holding disjoint pages: the
largest gain measured on the shared trace, see docs/design/eviction.md).
"""

from __future__ import annotations

import importlib

from hicache_cp.policy.base import EvictionPolicy, register_policy, registered

# Built-in policies: name -> module that registers it (imported on demand).
BUILTIN: dict[str, str] = {
    "lru": "hicache_cp.policy.lru",
    "hit_weighted": "hicache_cp.policy.hit_weighted",
    "reuse_lru": "hicache_cp.policy.reuse_lru",
}

__all__ = ["BUILTIN", "EvictionPolicy", "make_policy", "policy_names", "register_policy"]


def policy_names() -> list[str]:
    """Every policy that `make_policy` accepts."""
    return sorted(set(BUILTIN) | set(registered()))


def make_policy(name: str) -> EvictionPolicy:
    """A new instance of the policy `name`; ValueError listing the names otherwise."""
    if name in BUILTIN and name not in registered():
        importlib.import_module(BUILTIN[name])
    factory = registered().get(name)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; supported: {', '.join(policy_names())}")
    return factory()
