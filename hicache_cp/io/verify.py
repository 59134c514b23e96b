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
The cpu backend's checks are an op's `HostChecks` (hashed on its copy workers or
in batches, finalised on the asking thread); the CUDA backends compute the
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
    """The checks of one op's copies on a host-memory device pool (the cpu backend).

    Each copy's raw sums (`checksum.raw_sums`, uint64 per page) land in the op's
    table of them, one row per (part, slot) (`checksum.layout_salts`), either on the
    copy's worker right after the copy (`hash_copied`, `hash_landed`: large copies,
    from the bytes the copy has at hand) or, for the copies that were not, in batches
    on the asking thread (`run`: one pass per part over every such layer, straight
    from the device pages, a view when they are one run). `run` then salts and
    finalises every done copy's sums at once: a backup stores them (the device pages
    it copied stay as they were until it is decided), a load compares them with the
    stored ones (`compare`: each failed layer's ticket gets its IntegrityError).

    `done(ticket)` says whether a ticket's copy finished without error (None: not yet);
    tickets, appended to `pending` in submission order, have `part`, `layer` and a
    `checked(error)` callback. `run` runs on the asking thread,
    the `hash_*` calls on the op's copy worker (one direction, so one worker): a
    copy's raw sums are read only once its copy is done."""

    def __init__(
        self, engine: CopyEngine, direction: Any, device_pages: np.ndarray, host_pages: np.ndarray,
        check: np.ndarray | None, request: Any, done: Callable[[Any], bool | None],
    ) -> None:
        self.engine = engine
        self.d2h = direction.value == "d2h"
        rows = slice(None) if self.d2h else checked_rows(check, len(device_pages))
        self.device_pages, self.host_pages = device_pages[rows], host_pages[rows]
        n = len(self.device_pages)
        # the checked device pages as a slice when they are one run (a view, no gather)
        first = int(self.device_pages[0]) if n else 0
        one_run = n > 0 and int(self.device_pages[-1]) - first == n - 1 and bool(
            (np.diff(self.device_pages) == 1).all())  # fmt: skip
        self._device_rows: np.ndarray | slice = slice(first, first + n) if one_run else self.device_pages
        self.request = request
        self._done = done  # True: landed, False: failed, None: in flight
        self.pending: list[Any] = []
        self._salts = checksum.layout_salts(engine.layout)
        self._raw = np.empty((self._salts.rows, n), dtype=np.uint64)  # row: (part, slot)
        self._hashed: set[int] = set()  # rows hashed on the copy's worker

    def hash_copied(self, part: Part, slot: int, rows: np.ndarray) -> None:
        """On the copy worker, after a backup's copy: the raw sums of the device pages'
        bytes it gathered (`rows`, uint8 [n, page_bytes]), without reading them again."""
        row = self._salts.offsets[part] + slot
        checksum.raw_sums(rows, out=self._raw[row])
        self._hashed.add(row)

    def hash_landed(self, part: Part, slot: int, layer_view: np.ndarray) -> None:
        """On the copy worker, after a load's copy: the raw sums of what landed in the
        checked device pages of `layer_view` (the layer, uint8 [pages, page_bytes])."""
        row = self._salts.offsets[part] + slot
        if len(self.device_pages):
            checksum.raw_sums(layer_view[self._device_rows], out=self._raw[row])
        self._hashed.add(row)

    def copied(self) -> bool:
        """Whether every copy of `pending` is done (they finish in submission order)."""
        return not self.pending or self._done(self.pending[-1]) is not None

    def run(self) -> None:
        """Check every copy of `pending` that is done, finalising all their sums in one
        pass. O(done copies): the copies of an op (one direction) finish in the order
        they were submitted, which is `pending`'s."""
        by_part: dict[Part, list[Any]] = {}
        done = 0
        for t in self.pending:
            state = self._done(t)
            if state is None:
                break
            done += 1
            if state:
                by_part.setdefault(t.part, []).append(t)
            else:
                t.checked(None)  # its copy failed: that is its error
        del self.pending[:done]
        if not len(self.device_pages):
            for group in by_part.values():
                for t in group:
                    t.checked(None)
            return
        groups: list[tuple[Part, list[Any], list[int]]] = []
        rows: list[int] = []
        for part, group in by_part.items():
            layout, offset = self.engine.layout.part(part), self._salts.offsets[part]
            slots = [layout.slot(t.layer) for t in group]
            todo = [s for s in slots if offset + s not in self._hashed]
            if todo:
                self._hash_device(part, todo, offset)
            groups.append((part, group, slots))
            rows += [offset + s for s in slots]
        if not rows:
            return
        index = np.asarray(rows, dtype=np.int64)
        sums = checksum.finalise(self._raw[index], self._salts.salts[index])
        if not self.d2h:
            self.engine.integrity.count_checked("l2", len(self.device_pages) * len(rows))
        hp, at = self.host_pages, 0
        for part, group, slots in groups:
            part_sums, at = sums[at : at + len(slots)], at + len(slots)
            block = _run_of(slots)
            table_rows = block if block is not None else np.asarray(slots, dtype=np.int64)[:, None]
            stored = self.engine.host_pool.sums(part)
            if self.d2h:
                stored[table_rows, hp] = part_sums
                for t in group:
                    t.checked(None)
                continue
            bad = part_sums != stored[table_rows, hp]
            for t, wrong, got in zip(group, bad, part_sums):
                t.checked(compare(self.engine, part, t.layer, got, hp, self.device_pages, self.request, counted=True)
                          if wrong.any() else None)  # fmt: skip

    def _hash_device(self, part: Part, slots: list[int], offset: int) -> None:
        """The raw sums of the op's device pages of `slots` of `part` (table rows `offset`
        + slot): one pass over a [slots, n, page_bytes] view when the part is one buffer
        and the slots are consecutive (no gather when the pages are one run), else per slot."""
        pool, pages = self.engine.device_pool, self._device_rows
        buf = pool.buffers.get(part)
        block = _run_of(slots)
        if hasattr(buf, "numpy") and block is not None:
            out = self._raw[offset + block.start : offset + block.stop]
            checksum.raw_sums(buf.numpy()[block, pages], out=out)  # type: ignore[union-attr]
            return
        for slot in slots:
            checksum.raw_sums(pool.layer_view(part, slot)[pages], out=self._raw[offset + slot])


def _run_of(slots: list[int]) -> slice | None:
    """`slots` as a slice when they are consecutive and ascending, else None."""
    lo = slots[0]
    return slice(lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else None
