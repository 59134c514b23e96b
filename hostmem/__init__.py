"""hostmem: the host (L2) memory layer of hicache-cp.

* :mod:`hostmem.extents`: :class:`ExtentAllocator`, a best-fit page
  allocator over sorted free extents, and run/page conversions.
* :mod:`hostmem.arena`: :class:`HostArena`, one large host buffer touched in
  parallel and pinned for CUDA chunk by chunk.
* :mod:`hostmem.cuda`: the single adapter to cuda-python.

``HostArena`` is imported lazily (it pulls in torch), so importing the
allocator stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hostmem.cuda import CudaError, cuda_available
from hostmem.extents import ExtentAllocator, ExtentStats, Runs, pages_to_runs, runs_to_pages

if TYPE_CHECKING:
    from hostmem.arena import ArenaError, HostArena

__all__ = [
    "ArenaError",
    "CudaError",
    "ExtentAllocator",
    "ExtentStats",
    "HostArena",
    "Runs",
    "cuda_available",
    "pages_to_runs",
    "runs_to_pages",
]


def __getattr__(name: str) -> Any:
    if name in ("HostArena", "ArenaError"):
        from hostmem import arena

        return getattr(arena, name)
    raise AttributeError(f"module 'hostmem' has no attribute {name!r}")
