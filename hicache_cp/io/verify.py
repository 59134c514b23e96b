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
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache_cp import checksum
from hicache_cp.checksum import Verify
from hicache_cp.errors import INTEGRITY_MARK, IntegrityError
from hicache_cp.io.base import CopyFailed, Direction
from hicache_cp.layout import Part

if TYPE_CHECKING:
    from hicache_cp.io.base import CopyEngine
    from hicache_cp.pools import DevicePool

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
    on the asking thread (`run`: one pass per block of consecutive slots of a part,
    straight from the device pages, a view when they are one run). `run` then salts
    and finalises every done copy's sums at once: a backup stores them (the device
    pages it copied stay as they were until it is decided), a load compares them with
    the stored ones (`compare`: each failed layer's ticket gets its IntegrityError).

    Tickets, appended to `pending` in submission order, have `part`, `layer` and a
    `checked(error)` callback. The op's copies run in that order on one worker (one
    direction), which reports each one's end with `finished` after its copy and its
    hash there: a copy's raw sums are read only once it is reported. `run` runs on
    the asking thread."""

    def __init__(
        self, engine: CopyEngine, direction: Direction, device_pages: np.ndarray, host_pages: np.ndarray,
        check: np.ndarray | None, request: Any, salts: checksum.LayoutSalts,
    ) -> None:
        self.engine = engine
        self.d2h = direction is Direction.D2H
        rows = slice(None) if self.d2h else checked_rows(check, len(device_pages))
        self.device_pages, self.host_pages = device_pages[rows], host_pages[rows]
        n = len(self.device_pages)
        # the checked device pages as a slice when they are one run (a view, no gather)
        first = _run_start(self.device_pages)
        self._device_rows: np.ndarray | slice = self.device_pages if first is None else slice(first, first + n)
        self.request = request
        self.pending: list[Any] = []
        self._salts = salts
        self._raw = np.empty((salts.rows, n), dtype=np.uint64)  # row: (part, slot)
        self._hashed: set[int] = set()  # rows hashed on the copy's worker
        self._finished = 0  # copies the worker reported, landed or failed
        self._failed: set[int] = set()  # their submission indices, of those that failed
        self._taken = 0  # copies that left `pending`

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
            _hash_pages(layer_view, self._device_rows, self._raw[row])
        self._hashed.add(row)

    def finished(self, landed: bool) -> None:
        """On the copy worker, once per copy in submission order, after the copy and its
        hash there: whether it landed (False: it failed)."""
        if not landed:
            self._failed.add(self._finished)
        self._finished += 1  # last: `run` reads a copy's outcome once this counts it

    def copied(self) -> bool:
        """Whether every copy of `pending` is done."""
        return self._finished - self._taken >= len(self.pending)

    def run(self) -> None:
        """Check every copy of `pending` that is done, finalising all their sums in one
        pass. O(done copies + their pages): the copies of an op finish in the order they
        were submitted, which is `pending`'s."""
        done = min(self._finished - self._taken, len(self.pending))
        if not done:
            return
        tickets = self.pending[:done]
        del self.pending[:done]
        first, self._taken = self._taken, self._taken + done
        if self._failed:
            landed = []
            for i, t in enumerate(tickets, first):
                if i in self._failed:
                    t.checked(None)  # its copy failed: that is its error
                else:
                    landed.append(t)
            tickets = landed
        if tickets:
            self._check(tickets)

    def _check(self, tickets: list[Any]) -> None:
        """Check landed copies: hash what their worker did not, finalise, then store (a
        backup) or compare (a load) and give each ticket its verdict."""
        if not len(self.device_pages):
            for t in tickets:
                t.checked(None)
            return
        row_of = self._salts.row_of
        rows = [row_of[t.part, t.layer] for t in tickets]
        distinct = set(rows)
        todo = sorted(distinct - self._hashed)
        if todo:
            self._hash_device(todo)
        self._hashed -= distinct
        index: np.ndarray | None
        whole = not self.pending and len(rows) == len(distinct) == self._salts.rows
        if whole:  # every row once, none in flight: the table in place, sums row r is table row r
            index, sums = None, checksum.finalise(self._raw, self._salts.salts)
        else:  # sums row i is tickets[i]'s
            index = np.asarray(rows, dtype=np.int64)
            sums = checksum.finalise(self._raw[index], self._salts.salts[index])
        table, hp = self.engine.host_pool.sums_table(), self.host_pages
        errors: dict[int, IntegrityError | None] = {}
        if self.d2h:
            checksum.store(table, index, hp, sums)
        else:
            self.engine.integrity.count_checked("l2", len(self.device_pages) * len(tickets))
            if checksum.mismatched(table, index, hp, sums):
                stored = table[:, hp] if index is None else table[index[:, None], hp]
                errors = self._mismatches(tickets, rows if whole else range(len(tickets)), sums, sums != stored)
        for k, t in enumerate(tickets):
            t.checked(errors.get(k))

    def _mismatches(
        self, tickets: list[Any], sums_row: Sequence[int], sums: np.ndarray, bad: np.ndarray,
    ) -> dict[int, IntegrityError | None]:
        """A load's failed tickets (by index) and their errors (`compare`): ticket k's
        checksums are row `sums_row[k]` of `sums`, `bad` is sums != stored."""
        bad_rows = bad.any(axis=1)
        return {k: compare(self.engine, t.part, t.layer, sums[i], self.host_pages, self.device_pages, self.request,
                           counted=True)
                for k, (t, i) in enumerate(zip(tickets, sums_row)) if bad_rows[i]}  # fmt: skip

    def _hash_device(self, rows: list[int]) -> None:
        """The raw sums of the op's device pages of table `rows` (ascending, distinct), in
        one `checksum.raw_sums_blocks` (no gather when the pages are one run)."""
        pool = self.engine.device_pool
        by_rows = _BLOCKS.setdefault(pool, {})
        key = tuple(rows)
        blocks = by_rows.get(key)
        if blocks is None:
            if len(by_rows) > 256:  # a few row sets per layout; keep it bounded
                by_rows.clear()
            blocks = by_rows[key] = _blocks(pool, self._salts, rows)
        checksum.raw_sums_blocks(blocks, self._raw, self._device_rows)


#: Per device pool, its `_blocks` by table rows (the pool's buffers do not move).
_BLOCKS: weakref.WeakKeyDictionary[DevicePool, dict[tuple[int, ...], tuple[checksum.Block, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _blocks(pool: DevicePool, salts: checksum.LayoutSalts, rows: list[int]) -> tuple[checksum.Block, ...]:
    """Table `rows` (ascending, distinct) of a host-memory device pool as blocks of
    `checksum.raw_sums_blocks`: a [slots, pages, page_bytes] view per run of consecutive
    slots of a part that is one buffer, else one per slot."""
    out: list[checksum.Block] = []
    i = 0
    while i < len(rows):
        lo, part = rows[i], salts.part_at[rows[i]]
        j = i + 1
        while j < len(rows) and rows[j] == lo + j - i and salts.part_at[rows[j]] is part:
            j += 1
        slot, buf = lo - salts.offsets[part], pool.part_view(part)
        if buf is not None:
            views = [buf[slot : slot + j - i]]
        else:
            views = [pool.layer_view(part, slot + k)[None] for k in range(j - i)]
        row = lo
        for view in views:
            out.append((view, checksum.word_multipliers(view.shape[-1] // 8), row))
            row += len(view)
        i = j
    return tuple(out)


def _hash_pages(view: np.ndarray, pages: np.ndarray | slice, out: np.ndarray) -> None:
    """The raw sums of `pages` (a slice, or page ids) of `view` ([..., pages, page_bytes])
    into `out`: a view of them for a slice, else gathered by the hash itself."""
    if isinstance(pages, slice):
        checksum.raw_sums(view[..., pages, :], out=out)
    else:
        checksum.raw_sums(view, out=out, index=pages)


def _run_start(pages: np.ndarray) -> int | None:
    """The first of `pages` when they are one ascending run of consecutive ids, else None.
    O(n): a few pages compare as Python ints (cheaper than numpy's fixed cost)."""
    n = len(pages)
    if not n or int(pages[-1]) - int(pages[0]) != n - 1:
        return None
    first = int(pages[0])
    if n <= 64:
        return first if pages.tolist() == list(range(first, first + n)) else None
    return first if bool((pages[1:] - pages[:-1] == 1).all()) else None
