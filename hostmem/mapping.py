"""Anonymous memory for the arena: huge pages, fork safety, prefaulting, and what the kernel gave.

:class:`Mapping` owns one private anonymous mapping and applies, once, at
creation:

* **huge pages** (:class:`HugePages`): ``madvise(MADV_HUGEPAGE)`` where
  transparent huge pages (THP) are enabled (``always`` or ``madvise`` in
  ``/sys/kernel/mm/transparent_hugepage/enabled``), or ``MAP_HUGETLB`` from
  the reserved hugetlbfs pool (``vm.nr_hugepages``). A THP mapping is
  over-allocated by one huge page and its usable range starts on a huge page
  boundary, so every 2 MiB of it can be one huge page. Without either, base
  pages; nothing fails for lack of huge pages.
* **fork safety**: ``madvise(MADV_DONTFORK)``. A forked child does not inherit
  the range at all: fork does not copy its page tables, and the parent's
  pages never become copy-on-write (a copy-on-write break would move the
  parent's data to a new physical page behind the back of a CUDA
  registration that still points at the old one).

What the kernel really gave is read back from ``/proc/self/smaps``
(:meth:`Mapping.huge_bytes`): ``AnonHugePages`` for THP, ``*_Hugetlb`` for
hugetlbfs. THP is best effort: under memory fragmentation a fault may get
base pages, so coverage can be below 1.

Prefaulting: :meth:`Mapping.populate` asks the kernel to fault a range in
for writing (``MADV_POPULATE_WRITE``, Linux 5.14+) with no user-space writes,
through ctypes, which releases the GIL, so several threads populate disjoint
ranges in parallel. :func:`populate_supported` says whether the kernel has it.

Everything here is Linux-specific and degrades (logs, reports "none") on
other systems.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import mmap
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "BASE_PAGE",
    "HugePages",
    "Mapping",
    "SmapsEntry",
    "hugetlb_pool",
    "populate_supported",
    "pss_bytes",
    "resident_bytes",
    "read_smaps",
    "thp_mode",
    "thp_size",
]

#: The OS base page (4 KiB on x86-64 and most arm64 kernels).
BASE_PAGE = mmap.PAGESIZE
#: Linux flag values, for Pythons whose mmap module lacks them (x86-64 and arm64).
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)
_DEFAULT_THP_SIZE = 2 << 20


class HugePages(str, enum.Enum):
    """Which huge pages the arena asks for (``requested``) or got (``obtained``)."""

    #: THP where enabled; else hugetlbfs when its free pool covers the size; else none.
    AUTO = "auto"
    #: ``madvise(MADV_HUGEPAGE)``; best effort per fault (see ``Mapping.huge_bytes``).
    THP = "thp"
    #: ``MAP_HUGETLB`` from the reserved pool: all or nothing at ``mmap`` time.
    HUGETLB = "hugetlb"
    #: base pages only.
    NONE = "none"


def thp_mode(sys_root: Path = Path("/sys"), setting: str = "enabled") -> str | None:
    """The bracketed THP mode (``always``, ``madvise``, ``never``), or None without THP.
    ``setting="shmem_enabled"``: the mode for shared memory (tmpfs) instead."""
    try:
        text = (sys_root / "kernel/mm/transparent_hugepage" / setting).read_text()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


def thp_size(sys_root: Path = Path("/sys")) -> int:
    """Bytes of one transparent huge page (``hpage_pmd_size``; 2 MiB if unreadable)."""
    try:
        return int((sys_root / "kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return _DEFAULT_THP_SIZE


def hugetlb_pool(proc_root: Path = Path("/proc")) -> tuple[int, int]:
    """``(free pages, bytes per page)`` of the default hugetlbfs pool; ``(0, 0)`` if unreadable."""
    free = size = 0
    try:
        for line in (proc_root / "meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "HugePages_Free":
                free = int(value.split()[0])
            elif key == "Hugepagesize":
                size = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return free, size


@dataclass(frozen=True)
class SmapsEntry:
    """One VMA of ``/proc/<pid>/smaps``: ``[start, end)``, its ``kB`` fields in bytes, its VmFlags."""

    start: int
    end: int
    fields: dict[str, int]
    flags: frozenset[str]


_VMA_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+)\s")


def read_smaps(path: Path = Path("/proc/self/smaps"), lo: int = 0, hi: int = 1 << 64) -> list[SmapsEntry]:
    """Parse the VMAs of ``path`` that overlap ``[lo, hi)``.

    The kernel walks the page tables of every mapping to produce this file
    (tens of ms for a large 4 KiB-page process): call it for reports, never
    on a hot path. Raises ``OSError`` when the file cannot be read.
    """
    out: list[SmapsEntry] = []
    current: tuple[int, int, dict[str, int], set[str]] | None = None
    for line in path.read_text().splitlines():
        m = _VMA_HEADER.match(line)
        if m:
            if current is not None and current[0] < hi and current[1] > lo:
                out.append(SmapsEntry(current[0], current[1], current[2], frozenset(current[3])))
            current = (int(m.group(1), 16), int(m.group(2), 16), {}, set())
            continue
        if current is None:
            continue
        key, _, value = line.partition(":")
        if key == "VmFlags":
            current[3].update(value.split())
            continue
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            current[2][key] = int(parts[0]) * 1024
    if current is not None and current[0] < hi and current[1] > lo:
        out.append(SmapsEntry(current[0], current[1], current[2], frozenset(current[3])))
    return out


def resident_bytes(addr: int, length: int) -> int:
    """Bytes of ``[addr, addr + length)`` resident in RAM now (``mincore(2)``, base-page
    granularity; ``addr`` page-aligned). O(length / 4 KiB): for reports."""
    pages = -(-length // BASE_PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mincore(0x{addr:x}, {length}): {os.strerror(code)}")
    return int((np.frombuffer(vec, np.uint8) & 1).sum()) * BASE_PAGE


def pss_bytes(ranges: list[tuple[int, int]], smaps: Path = Path("/proc/self/smaps")) -> int:
    """The proportional set size of the shared mappings overlapping any ``(addr, nbytes)``
    range: resident bytes, each page divided by the number of processes mapping it.
    Each mapping counts once however many ranges fall in it. Meant for file mappings
    (a shared segment): the kernel merges neighbouring private anonymous mappings, so
    there it would count memory outside the ranges (use :func:`resident_bytes`).
    Reads smaps (see :func:`read_smaps`): for reports."""
    if not ranges:
        return 0
    lo = min(a for a, _ in ranges)
    hi = max(a + n for a, n in ranges)
    entries = read_smaps(smaps, lo, hi)
    return sum(e.fields.get("Pss", 0) for e in entries if any(e.start < a + n and a < e.end for a, n in ranges))


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


_LIBC = _libc()


def madvise(addr: int, length: int, advice: int) -> None:
    """``madvise(2)`` through ctypes (releases the GIL). Raises ``OSError`` with errno."""
    if _LIBC.madvise(addr, length, advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"madvise(0x{addr:x}, {length}, {advice}): {os.strerror(code)}")


@functools.cache
def populate_supported() -> bool:
    """Whether this kernel has ``MADV_POPULATE_WRITE`` (Linux 5.14+). Cached; never raises."""
    try:
        mm = mmap.mmap(-1, BASE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return False
    try:
        buf = (ctypes.c_char * BASE_PAGE).from_buffer(mm)
        try:
            madvise(ctypes.addressof(buf), BASE_PAGE, MADV_POPULATE_WRITE)
        finally:
            del buf
    except OSError as exc:
        logger.debug("MADV_POPULATE_WRITE unsupported: %s", exc)
        return False
    finally:
        mm.close()
    return True


class Mapping:
    """One private anonymous mapping of at least ``nbytes``, huge-page and fork advised.

    Args:
        nbytes: usable bytes (> 0).
        huge_pages: what to ask for (see :class:`HugePages`); an explicit
            request that cannot be met falls back with a WARNING, ``AUTO`` at DEBUG.
        dontfork: apply ``MADV_DONTFORK``.
        align: ``HUGETLB`` is used only when its page size divides ``align``
            (the arena's registration chunk), so chunks never split a huge page.
        name: for log lines.
        sys_root, proc_root: where ``/sys`` and ``/proc`` are (tests pass fakes).

    Attributes (fixed after construction): ``mm`` (the ``mmap`` object,
    ``lead + nbytes`` bytes or more), ``lead`` (offset of the usable range in
    ``mm``), ``addr`` (address of the usable range), ``requested``,
    ``obtained``, ``page_size`` (the unit one fault maps for sure: the
    hugetlb page size or the base page), ``granule`` (the alignment worth
    keeping for parallel work: the huge page size with THP or hugetlb),
    ``dontfork`` (whether ``MADV_DONTFORK`` took), ``map_s`` and
    ``advise_s`` (seconds spent in ``mmap`` and ``madvise``), ``thp_mode``.
    """

    def __init__(
        self,
        nbytes: int,
        huge_pages: HugePages = HugePages.AUTO,
        *,
        dontfork: bool = True,
        align: int = BASE_PAGE,
        name: str = "mapping",
        sys_root: Path = Path("/sys"),
        proc_root: Path = Path("/proc"),
    ) -> None:
        if nbytes <= 0:
            raise ValueError(f"{name}: nbytes must be positive, got {nbytes}")
        self.name = name
        self.nbytes = int(nbytes)
        self.requested = HugePages(huge_pages)
        self.thp_mode = thp_mode(sys_root)
        thp_on = self.thp_mode in ("always", "madvise")
        free, hp_size = hugetlb_pool(proc_root)
        hugetlb_fits = hp_size > 0 and align % hp_size == 0 and free * hp_size >= _round_up(nbytes, hp_size)
        explicit = self.requested is not HugePages.AUTO
        want = self.requested
        if want is HugePages.AUTO:
            want = HugePages.THP if thp_on else HugePages.HUGETLB if hugetlb_fits else HugePages.NONE
        t0 = time.perf_counter()
        mm: mmap.mmap | None = None
        if want is HugePages.HUGETLB:
            if hugetlb_fits:
                try:
                    mm = mmap.mmap(
                        -1, _round_up(nbytes, hp_size),
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB,
                    )
                except OSError as exc:
                    self._fallback(explicit, f"MAP_HUGETLB failed ({exc})")
            else:
                self._fallback(
                    explicit,
                    f"hugetlbfs pool has {free} free pages of {hp_size} B, need "
                    f"{_round_up(nbytes, hp_size) // max(hp_size, 1)} (and page size dividing {align})",
                )
            if mm is None:
                want = HugePages.THP if thp_on else HugePages.NONE
        if mm is not None:
            self.obtained, self.page_size, self.granule, self.lead = HugePages.HUGETLB, hp_size, hp_size, 0
        else:
            if want is HugePages.THP and not thp_on:
                self._fallback(explicit, f"transparent huge pages are {self.thp_mode or 'absent'}")
                want = HugePages.NONE
            size = thp_size(sys_root) if want is HugePages.THP else 0
            mm = mmap.mmap(-1, self.nbytes + size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            base = _address(mm)
            self.obtained, self.page_size = want, BASE_PAGE
            self.granule = size or BASE_PAGE
            self.lead = (-base) % size if size else 0
        self.mm: mmap.mmap = mm
        self.map_s = time.perf_counter() - t0
        self.addr = _address(mm) + self.lead
        t0 = time.perf_counter()
        if self.obtained is HugePages.THP:
            try:
                mm.madvise(MADV_HUGEPAGE)
            except OSError as exc:
                self._fallback(explicit, f"MADV_HUGEPAGE refused ({exc})")
                self.obtained, self.granule = HugePages.NONE, BASE_PAGE
        self.dontfork = False
        if dontfork:
            try:
                mm.madvise(MADV_DONTFORK)
                self.dontfork = True
            except OSError as exc:
                logger.warning("%s: MADV_DONTFORK refused (%s); a forked child would share its pages", name, exc)
        self.advise_s = time.perf_counter() - t0

    def _fallback(self, explicit: bool, why: str) -> None:
        level = logging.WARNING if explicit else logging.DEBUG
        logger.log(level, "%s: %s huge pages not used: %s", self.name, self.requested.value, why)

    def release(self) -> None:
        """Unmap (``mm.close()``); raises ``BufferError`` while views still reference it."""
        self.mm.close()

    def populate(self, offset: int, length: int) -> None:
        """Fault ``[offset, offset + length)`` in for writing (``MADV_POPULATE_WRITE``).

        Existing contents are kept (present pages are skipped), so it never
        races with writers. Releases the GIL. ``offset`` must be a multiple of
        ``page_size``. Raises ``OSError`` (``EINVAL`` on kernels before 5.14,
        ``ENOMEM``/``EFAULT`` when memory runs out).
        """
        madvise(self.addr + offset, length, MADV_POPULATE_WRITE)

    def huge_bytes(self, smaps: Path = Path("/proc/self/smaps")) -> int:
        """Bytes of the usable range backed by huge pages now (THP or hugetlbfs).

        Sums ``AnonHugePages``, ``Private_Hugetlb`` and ``Shared_Hugetlb`` of
        the VMAs overlapping the range (the untouched alignment slack holds
        none), capped at ``nbytes``. Reads smaps: see :func:`read_smaps`.
        """
        total = 0
        for e in read_smaps(smaps, self.addr, self.addr + self.nbytes):
            total += sum(e.fields.get(k, 0) for k in ("AnonHugePages", "Private_Hugetlb", "Shared_Hugetlb"))
        return min(total, self.nbytes)

    def vm_flags(self, smaps: Path = Path("/proc/self/smaps")) -> frozenset[str]:
        """VmFlags of the VMA holding the usable range's first byte (``dc``: not copied on fork; ``hg``: huge advised)."""
        entries = read_smaps(smaps, self.addr, self.addr + 1)
        return entries[0].flags if entries else frozenset()


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit if unit > 0 else n


def _address(mm: mmap.mmap) -> int:
    """Base address of ``mm`` (the temporary buffer export is released before returning)."""
    buf = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf
