"""hostmem: the host (L2) memory layer of hicache-cp.

* :mod:`hostmem.extents`: :class:`ExtentAllocator`, a best-fit page
  allocator over sorted free extents, and run/page conversions.
* :mod:`hostmem.arena`: :class:`HostArena`, one large host buffer on huge
  pages, prefaulted and pinned for CUDA chunk by chunk, in parallel and
  overlapped, usable while it grows.
* :mod:`hostmem.mapping`: the anonymous mapping under an arena (huge pages,
  ``MADV_DONTFORK``, prefault, what ``/proc/self/smaps`` says it got).
* :mod:`hostmem.sizing`: how much host memory a pool may really take (cgroup
  v2/v1 limit or ``MemAvailable``, minus a reserve).
* :mod:`hostmem.cuda`: the single adapter to cuda-python.

``HostArena`` and its enums are imported lazily (the arena pulls in torch),
so importing the allocator or the sizing stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hostmem.cuda import CudaError, cuda_available
from hostmem.extents import ExtentAllocator, ExtentStats, Runs, pages_to_runs, runs_to_pages
from hostmem.sizing import HostMemory, MemorySource, host_memory, pool_budget_bytes

if TYPE_CHECKING:
    from hostmem.arena import ArenaError, ArenaTimings, HostArena, TouchMode
    from hostmem.mapping import HugePages

__all__ = [
    "ArenaError",
    "ArenaTimings",
    "CudaError",
    "ExtentAllocator",
    "ExtentStats",
    "HostArena",
    "HostMemory",
    "HugePages",
    "MemorySource",
    "Runs",
    "TouchMode",
    "cuda_available",
    "host_memory",
    "pages_to_runs",
    "pool_budget_bytes",
    "runs_to_pages",
]

_LAZY = {
    "HostArena": "hostmem.arena",
    "ArenaError": "hostmem.arena",
    "ArenaTimings": "hostmem.arena",
    "TouchMode": "hostmem.arena",
    "HugePages": "hostmem.mapping",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hostmem' has no attribute {name!r}")
