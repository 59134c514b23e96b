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
from typing import TYPE_CHECKING, Any

import numpy as np

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
    device_pages: np.ndarray, request: Any = None,
) -> IntegrityError | None:
    """Compare the checksums of landed pages (`got`, uint64 per page) with the stored
    ones of their physical `host_pages`; count, and on a mismatch warn and return
    the error (None when every page matches). O(pages)."""
    slot = engine.layout.part(part).slot(layer)
    expected = engine.host_pool.sums(part)[slot, host_pages]
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
