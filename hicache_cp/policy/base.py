"""The eviction policy interface and its registry."""

from __future__ import annotations

import abc
from collections.abc import Callable

from hicache_cp.radix import Node


class EvictionPolicy(abc.ABC):
    """Orders evictable leaves; the smallest `key` is evicted first.

    Keys may read only node metadata that every CP rank holds identically
    (the logical clock, hit counts, positions), never wall time or rank-local
    facts, so every rank evicts the same nodes in the same order.
    """

    name: str

    @abc.abstractmethod
    def key(self, node: Node) -> float:
        """Smaller keys are evicted first."""


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
