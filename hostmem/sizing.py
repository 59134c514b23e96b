"""How much host memory a pool may really take here: container limit or machine, minus a reserve.

A prefill server runs in a container far more often than on a bare machine,
and the container's memory limit, not ``MemTotal``, is what the kernel's OOM
killer enforces. Pinned memory cannot be swapped or reclaimed, so a pool
sized past the limit kills the rank at start-up. :func:`host_memory` reads,
in order:

1. **cgroup v2**: ``memory.max`` of the process's cgroup and every ancestor
   (the smallest limit wins; ``max`` means none), with ``memory.current`` and
   ``inactive_file`` from ``memory.stat`` of the process's own cgroup;
2. **cgroup v1**: ``memory.limit_in_bytes`` (and ``hierarchical_memory_limit``
   from ``memory.stat``, which already folds in the ancestors), with
   ``memory.usage_in_bytes`` and ``total_inactive_file``;
3. always, ``/proc/meminfo``: ``MemTotal`` and ``MemAvailable``.

Available memory under a cgroup limit is ``limit - (usage - inactive_file)``:
the usage counts the page cache, and its inactive part is what the kernel
reclaims first when the pool grows (the "working set" that container runtimes
report). The answer is the smaller of that and ``MemAvailable``, because a
container without a tight limit still shares the machine. Absurd limits
(``9223372036854771712``, v1's "unlimited") count as none.

The reserve is what the pool must leave to everything else in the process
and container (CUDA context, torch, Python, the server's other buffers):
``max(reserve_bytes, reserve_fraction * total)``. :meth:`HostMemory.pool_bytes`
is what is left for the pool, never negative.

Where the cgroup of this process lives: ``/proc/self/cgroup`` names it
(``0::/path`` for v2; ``N:memory:/path`` for v1), under the mount at
``<sys_root>/fs/cgroup`` (v2, or ``.../unified`` in hybrid mode) or
``<sys_root>/fs/cgroup/memory`` (v1). Inside a cgroup namespace the path is
``/`` and the mount root is the container's own cgroup; when the named path
does not exist under the mount (a namespace whose mount shows the host's
tree), the mount root is read instead.

Every path is relative to ``proc_root`` and ``sys_root``, so tests pass fake
trees. Nothing here raises for a missing or unreadable file: the reading
falls back to the next source and says which one it used (``source``).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RESERVE_BYTES", "HostMemory", "MemorySource", "host_memory", "pool_budget_bytes"]

GIB = 1 << 30
#: Left to the process and container by default: a CUDA context, torch and
#: Python take a few GiB per rank; the rest is headroom for the server.
DEFAULT_RESERVE_BYTES = 8 * GIB
#: Limits at or above this are "no limit" (cgroup v1 writes 2**63 - 4096).
_UNLIMITED = 1 << 62


class MemorySource(str, enum.Enum):
    """Where the limit came from."""

    CGROUP_V2 = "cgroup2"
    CGROUP_V1 = "cgroup1"
    MEMINFO = "meminfo"


@dataclass(frozen=True)
class HostMemory:
    """One reading of the memory a pool may take.

    Attributes:
        source: what bounded ``total_bytes``.
        total_bytes: the cgroup limit, or ``MemTotal`` without one.
        available_bytes: what could be allocated now, before the reserve:
            ``min(limit - working set, MemAvailable)`` under a limit, else
            ``MemAvailable``.
        reserve_bytes: left to everything else.
        meminfo_total_bytes, meminfo_available_bytes: ``/proc/meminfo``.
        cgroup_limit_bytes, cgroup_usage_bytes, cgroup_inactive_file_bytes:
            the cgroup's numbers (None without a limit).
        cgroup_path: the cgroup directory read (None without one).
    """

    source: MemorySource
    total_bytes: int
    available_bytes: int
    reserve_bytes: int
    meminfo_total_bytes: int
    meminfo_available_bytes: int
    cgroup_limit_bytes: int | None = None
    cgroup_usage_bytes: int | None = None
    cgroup_inactive_file_bytes: int | None = None
    cgroup_path: str | None = None

    @property
    def pool_bytes(self) -> int:
        """Bytes a pool may take now: ``available - reserve``, at least 0."""
        return max(0, self.available_bytes - self.reserve_bytes)

    def describe(self) -> str:
        """One line for logs and error messages, in GiB."""
        limit = f"limit {self.total_bytes / GIB:.1f} GiB ({self.source.value})"
        return (
            f"{limit}, available {self.available_bytes / GIB:.1f} GiB, reserve "
            f"{self.reserve_bytes / GIB:.1f} GiB -> pool {self.pool_bytes / GIB:.1f} GiB"
        )


def host_memory(
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    *,
    reserve_fraction: float = 0.0,
    proc_root: Path | str = Path("/proc"),
    sys_root: Path | str = Path("/sys"),
) -> HostMemory:
    """Read the memory available to this process's pool (see the module doc).

    Args:
        reserve_bytes: bytes always left to the rest of the process/container.
        reserve_fraction: also leave at least this fraction of ``total_bytes``
            (in ``[0, 1)``); the larger of the two reserves applies.
        proc_root, sys_root: ``/proc`` and ``/sys`` (tests pass fake trees).

    Raises ``ValueError`` for a negative reserve or a fraction outside
    ``[0, 1)``, and ``OSError`` only when ``<proc_root>/meminfo`` cannot be
    read (there is nothing to fall back to). O(depth of the cgroup tree).
    """
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
    if not 0.0 <= reserve_fraction < 1.0:
        raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction}")
    proc, sys_ = Path(proc_root), Path(sys_root)
    meminfo = _read_meminfo(proc / "meminfo")
    mem_total, mem_avail = meminfo["MemTotal"], meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    cgroups = _read_proc_cgroup(proc / "self/cgroup")
    reading = _cgroup_v2(sys_, cgroups.get("")) or _cgroup_v1(sys_, cgroups.get("memory"))

    def reserve(total: int) -> int:
        return max(int(reserve_bytes), int(reserve_fraction * total))

    if reading is None:
        return HostMemory(
            MemorySource.MEMINFO, mem_total, mem_avail, reserve(mem_total), mem_total, mem_avail
        )
    source, path, limit, usage, inactive = reading
    working = max(0, usage - inactive)
    available = max(0, min(limit - working, mem_avail))
    total = min(limit, mem_total)
    logger.debug("host memory: %s limit %d usage %d inactive_file %d at %s", source.value, limit, usage, inactive, path)
    return HostMemory(
        source, total, available, reserve(total), mem_total, mem_avail,
        cgroup_limit_bytes=limit, cgroup_usage_bytes=usage, cgroup_inactive_file_bytes=inactive,
        cgroup_path=str(path),
    )


def pool_budget_bytes(
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    *,
    reserve_fraction: float = 0.0,
    proc_root: Path | str = Path("/proc"),
    sys_root: Path | str = Path("/sys"),
) -> int:
    """``host_memory(...).pool_bytes``: the bytes a host pool may take now.

    This is one process's view: ranks sharing a machine must divide it (and
    agree on the result across CP ranks with a MIN) themselves.
    """
    return host_memory(reserve_bytes, reserve_fraction=reserve_fraction, proc_root=proc_root, sys_root=sys_root).pool_bytes


# -- readers (each returns None or {} when its source is absent) -------------------------------------


def _read_meminfo(path: Path) -> dict[str, int]:
    """``/proc/meminfo`` as bytes by key. Raises OSError/ValueError when unusable."""
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    if "MemTotal" not in out:
        raise ValueError(f"{path}: no MemTotal line")
    return out


def _read_proc_cgroup(path: Path) -> dict[str, str]:
    """Controller -> cgroup path from ``/proc/self/cgroup`` (v2's line has controller "")."""
    out: dict[str, str] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(","):
            out.setdefault(controller, parts[2])
    return out


def _read_int(path: Path) -> int | None:
    """An integer file (``max`` and absurd values mean None); None when absent or unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _read_stat(path: Path) -> dict[str, int]:
    """A ``memory.stat`` file as ints by key; {} when unreadable."""
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _cgroup_dir(mount: Path, rel: str | None, probe: str) -> Path | None:
    """The directory of this process's cgroup under ``mount`` that holds ``probe``, or None."""
    if rel is None or not mount.is_dir():
        return None
    leaf = mount / rel.lstrip("/")
    for d in (leaf, mount):
        if (d / probe).exists():
            return d
    return None


_Reading = tuple[MemorySource, Path, int, int, int]


def _cgroup_v2(sys_root: Path, rel: str | None) -> _Reading | None:
    """Limit (smallest over the cgroup and its ancestors), usage and inactive file of cgroup v2."""
    for mount in (sys_root / "fs/cgroup", sys_root / "fs/cgroup/unified"):
        leaf = _cgroup_dir(mount, rel, "memory.current")
        if leaf is None:
            continue
        limits = []
        d = leaf
        while True:
            value = _read_int(d / "memory.max")
            if value is not None:
                limits.append(value)
            if d == mount or mount not in d.parents:
                break
            d = d.parent
        usage = _read_int(leaf / "memory.current")
        if not limits or usage is None:
            return None
        inactive = _read_stat(leaf / "memory.stat").get("inactive_file", 0)
        return MemorySource.CGROUP_V2, leaf, min(limits), usage, inactive
    return None


def _cgroup_v1(sys_root: Path, rel: str | None) -> _Reading | None:
    """Limit (own or hierarchical), usage and inactive file of the v1 memory controller."""
    mount = sys_root / "fs/cgroup/memory"
    leaf = _cgroup_dir(mount, rel, "memory.limit_in_bytes")
    if leaf is None:
        return None
    stat = _read_stat(leaf / "memory.stat")
    candidates = [_read_int(leaf / "memory.limit_in_bytes"), stat.get("hierarchical_memory_limit")]
    limits = [v for v in candidates if v is not None and v < _UNLIMITED]
    usage = _read_int(leaf / "memory.usage_in_bytes")
    if not limits or usage is None:
        return None
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return MemorySource.CGROUP_V1, leaf, min(limits), usage, inactive
