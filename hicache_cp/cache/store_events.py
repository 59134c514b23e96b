"""StoreEvents: the L3 tier's KV cache events (medium STORE, `hicache_cp.events`).

    queued(job, node, lo, hi) a write-back of positions [lo, hi) up to `node` was submitted:
                            its pages' keys are taken now (the node may be evicted
                            or split before the put returns)
    retired(job, clean)     the put returned on this rank: with every object stored
                            or present (`clean`) its pages are announced (STORE
                            stored) and remembered per object key; otherwise nothing
    looked_up(objs, found)  a lookup's answer: an object announced before and now
                            absent was evicted by the store (STORE removed)

The store is shared and evicts on its own, so this tier's view is what this
cache put and has not seen missing since. Under CP each rank announces the
puts it saw retire; the publishing rank cannot see another rank's object
vanish (only its own lookups answer for it).

Runs in: the cache's thread (Tier3's calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hicache_cp.events import EventLog, Key, Medium, Removal
from hicache_cp.l3.keys import L3Object
from hicache_cp.l3.ops import WriteJob
from hicache_cp.radix import Node


@dataclass(slots=True)
class _Pending:
    lo: int
    keys: list[Key]
    parent: Key | None
    tokens: np.ndarray


class StoreEvents:
    """See the module docstring."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self._jobs: dict[int, _Pending] = {}  # write job id -> its pages' keys
        self._announced: dict[str, list[Key]] = {}  # object key -> keys of the pages it holds

    def queued(self, job: WriteJob, node: Node, lo: int, hi: int) -> None:
        if self.log.wants(Medium.STORE):
            keys, parent, tokens = self.log.run_of(node, lo)
            self._jobs[job.id] = _Pending(lo, keys[: hi - lo], parent, tokens[: (hi - lo) * self.log.page_size])

    def retired(self, job: WriteJob, clean: bool) -> None:
        p = self._jobs.pop(job.id, None)
        if p is None or not clean:
            return
        self.log.stored_run(Medium.STORE, p.keys, p.parent, p.tokens, p.lo)
        for obj in job.objects:
            self._announced[obj.key] = [p.keys[int(i) - p.lo] for i in obj.positions]

    def looked_up(self, objects: Sequence[L3Object], found: Sequence[bool]) -> None:
        gone: list[Key] = []
        for obj, ok in zip(objects, found):
            if not ok:
                gone.extend(self._announced.pop(obj.key, ()))
        self.log.removed_keys(Medium.STORE, gone, Removal.MISSING)
