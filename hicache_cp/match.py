"""`MatchResult`: what `match_prefix` found for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hicache_cp.ops import LoadOp, LoadState
from hicache_cp.radix import Node


@dataclass
class MatchResult:
    """What `match_prefix` found. `last_node` is locked until `release`.

    The lengths are fixed at match time. `host_nodes` is the continuation as
    of the match: another request's match may split those nodes later, so
    `load_back` must come right after `match_prefix` (it checks).
    """

    tokens: np.ndarray  # the request's whole pages: int64, num_pages * page_size
    num_pages: int  # whole pages of the request
    device_pages: np.ndarray  # logical L1 pages of the device-resident prefix
    host_nodes: list[Node]  # committed L2-only continuation, in order
    last_node: Node
    waits: list[LoadOp] = field(default_factory=list)  # loads the device prefix still depends on
    host_len: int = field(init=False)  # pages of the host continuation
    l3_len: int = 0  # of those, pages an L3 prefetch fetched for this request (cache.tier3)
    l3_checked: bool = False  # the L3 continuation was looked up (prefetch ran)
    request: object = None  # what the match is for (a request id): named in the ops' warnings
    #: The page position from which the host copies' identity was checked (`match_prefix`'s
    #: `checked_from`: an engine that owns L1 loads nothing below its own prefix).
    checked_from: int = 0

    def __post_init__(self) -> None:
        self.host_len = sum(n.num_pages for n in self.host_nodes)

    @property
    def device_len(self) -> int:
        return len(self.device_pages)

    @property
    def prefix_failed(self) -> bool:
        """A load this device prefix waited on aborted: the prefix KV this
        request read is invalid and it must recompute (its own pages are
        already stale and their backups fail)."""
        return any(op.state is LoadState.ABORTED for op in self.waits)

    @property
    def matched_pages(self) -> int:
        return self.device_len + self.host_len

    @property
    def host_pages(self) -> np.ndarray:
        if not self.host_nodes:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([n.host_pages for n in self.host_nodes])  # type: ignore[misc]
