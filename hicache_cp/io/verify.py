"""The io side of the restore checks (`hicache_cp.checksum`), shared by the backends.

    backup (D2H)  the checksum of every copied page and layer is computed from the
                  device pages the copy read and stored beside the host copy
                  (`HostPool.sums`): `store`
    load (H2D)    the checksum of what landed in the device pages is compared with
                  the stored one: `compare`, which counts, warns once per failed
                  submission (tier, request, part, layer, rank, pages) and returns
                  the IntegrityError that fails the copy's ticket

A failed ticket fails its op like any failed copy: the load aborts on every rank
at the next agreed poll and its request recomputes (`hicache_cp.cache.lifecycle`).
The cpu backend calls these on its copy workers; the CUDA backends compute the
checksums with `hicache_cp.io.checksum_gpu` and compare when a layer's ticket
completes (`hicache_cp.io.checked`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache_cp import checksum
from hicache_cp.checksum import Verify
from hicache_cp.errors import INTEGRITY_MARK, IntegrityError
from hicache_cp.io.base import CopyFailed
from hicache_cp.layout import Part

if TYPE_CHECKING:
    from hicache_cp.io.base import CopyEngine

logger = logging.getLogger(__name__)

#: Failing pages named in a warning (the count is always exact).
MAX_NAMED = 16


def active(engine: CopyEngine) -> bool:
    """Whether the engine computes and checks checksums at all."""
    return engine.verify is not Verify.OFF and engine.host_pool.has_checksums


def checked_rows(check: np.ndarray | None, n: int) -> np.ndarray | slice:
    """The rows of a load's page lists to compare (`CopyPlan.check`): all of them, or a sample."""
    return slice(0, n) if check is None else check


def store(engine: CopyEngine, part: Part, layer: int, host_pages: np.ndarray, sums: np.ndarray) -> None:
    """Keep a backup's checksums of `part`'s `layer` beside the host copy (physical `host_pages`)."""
    slot = engine.layout.part(part).slot(layer)
    engine.host_pool.sums(part)[slot, host_pages] = sums


def compare(
    engine: CopyEngine, part: Part, layer: int, got: np.ndarray, host_pages: np.ndarray,
    device_pages: np.ndarray, request: Any = None, counted: bool = False,
) -> IntegrityError | None:
    """Compare the checksums of landed pages (`got`, uint64 per page) with the stored
    ones of their physical `host_pages`; count them (unless `counted`), and on a
    mismatch warn and return the error (None when every page matches). O(pages)."""
    slot = engine.layout.part(part).slot(layer)
    expected = engine.host_pool.sums(part)[slot, host_pages]
    if not counted:
        engine.integrity.count_checked("l2", len(got))
    bad = np.flatnonzero(got != expected)
    if not len(bad):
        return None
    engine.integrity.count_failed("l2", part.value, len(bad))
    err = IntegrityError(
        "L2 load: landed bytes differ from the checksum stored at backup; the load fails and is recomputed",
        tier="l2", part=part.value, layer=layer, rank=engine.host_pool.rank, pages=host_pages[bad],
        units=len(bad), request=request,
    )  # fmt: skip
    logger.warning("%s; L1 pages %s", err, device_pages[bad][:MAX_NAMED].tolist())
    return err


def failure_from_report(text: str) -> BaseException:
    """A copy failure reported as text by another process (vLLM's workers): an
    IntegrityError when a restore check failed (then the agreed abort drops the
    copy), else CopyFailed."""
    if INTEGRITY_MARK in text:
        return IntegrityError(text, tier="l2")
    return CopyFailed(text)


class HostChecks:
    """The checks of one op's copies on a host-memory device pool (the cpu backend),
    run in batches: whenever one of its tickets asks, every copy of the op that is done
    and not checked yet is checked, one gather and one checksum pass per part for all
    of their layers. A backup stores the checksums of the device pages it copied (they
    stay as they were until it is decided), a load compares what landed now with the
    stored ones (`compare`: each failed layer's ticket gets its IntegrityError).

    `done(ticket)` says whether a ticket's copy finished without error; tickets have
    `part`, `layer` and a `checked(error)` callback. Runs on the asking thread."""

    def __init__(
        self, engine: CopyEngine, direction: Any, device_pages: np.ndarray, host_pages: np.ndarray,
        check: np.ndarray | None, request: Any, done: Callable[[Any], bool | None],
    ) -> None:
        self.engine = engine
        self.d2h = direction.value == "d2h"
        rows = slice(None) if self.d2h else checked_rows(check, len(device_pages))
        self.device_pages, self.host_pages = device_pages[rows], host_pages[rows]
        self.request = request
        self._done = done  # True: landed, False: failed, None: in flight
        self.pending: list[Any] = []

    def run(self) -> None:
        states = [self._done(t) for t in self.pending]
        ready = [t for t, st in zip(self.pending, states) if st is not None]
        self.pending = [t for t, st in zip(self.pending, states) if st is None]
        by_part: dict[Part, list[Any]] = {}
        for t, st in zip(ready, [st for st in states if st is not None]):
            if st:
                by_part.setdefault(t.part, []).append(t)
            else:
                t.checked(None)  # its copy failed: that is its error
        dp, hp, n = self.device_pages, self.host_pages, len(self.device_pages)
        if not n or not by_part:
            for group in by_part.values():
                for t in group:
                    t.checked(None)
            return
        # Every part's multilinear sums, then one salt-and-finalise pass over all of them.
        blocks, raws, salted = [], [], []
        for part, group in by_part.items():
            layout = self.engine.layout.part(part)
            layers = [t.layer for t in group]
            slots = [layout.slot(layer) for layer in layers]
            blocks.append((part, group, np.asarray(slots, dtype=np.int64)))
            raws.append(checksum.raw_sums(self._rows(part, slots)))
            salted.append(np.repeat(checksum.salts(part, layers, layout.page_bytes), n))
        flat = np.concatenate(raws) if len(raws) > 1 else raws[0]
        flat ^= np.concatenate(salted) if len(salted) > 1 else salted[0]
        sums_all = checksum.fmix64(flat).reshape(-1, n)
        row = 0
        if not self.d2h:
            self.engine.integrity.count_checked("l2", sums_all.size)
        for part, group, rows in blocks:
            sums = sums_all[row : row + len(group)]
            row += len(group)
            stored = self.engine.host_pool.sums(part)
            if self.d2h:
                stored[rows[:, None], hp[None, :]] = sums
                for t in group:
                    t.checked(None)
                continue
            bad = sums != stored[rows[:, None], hp[None, :]]
            for t, wrong, got in zip(group, bad, sums):
                t.checked(compare(self.engine, part, t.layer, got, hp, dp, self.request, counted=True)
                          if wrong.any() else None)  # fmt: skip

    def _rows(self, part: Part, slots: list[int]) -> np.ndarray:
        """The op's device pages of `slots` of `part`: uint8 [len(slots) * pages, page_bytes]
        (one gather when the part is one buffer and the slots are consecutive)."""
        pool, dp = self.engine.device_pool, self.device_pages
        buf = pool.buffers.get(part)
        if hasattr(buf, "numpy") and slots == list(range(slots[0], slots[0] + len(slots))):
            block = buf.numpy()[slots[0] : slots[0] + len(slots), dp]  # type: ignore[union-attr]
            return block.reshape(-1, block.shape[-1])
        views = [pool.layer_view(part, slot)[dp] for slot in slots]
        return views[0] if len(views) == 1 else np.concatenate(views)
