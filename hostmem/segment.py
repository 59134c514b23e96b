"""Named shared memory that outlives the processes using it.

A segment is a file in a RAM-backed file system, mapped ``MAP_SHARED`` by
every process that opens it by name: ``/dev/shm`` (tmpfs), or a hugetlbfs
mount where the host reserved huge pages. Its bytes live as long as the
file: a process that exits, or is killed, leaves them to the next one;
:meth:`Segment.close` with ``unlink_if_last`` (or :func:`drop_segment`)
frees them once no process maps them any more.

Who uses a segment is told by two open-file-description locks on the file
(``F_OFD_SETLK``), which the kernel drops when the holder closes the file or
dies, SIGKILL included, so a crashed process never leaves one behind::

    byte 0  the opening mutex: held exclusively (:meth:`Segment.opening`)
            while a process decides what the segment holds (reads, resizes,
            writes its owner's header); short, with a deadline
    byte 1  users: held shared (:meth:`Segment.share`) for as long as a
            process maps the segment; exclusively (:meth:`Segment.sole_user`)
            only by a process that may change its shape because nobody else
            maps it

Being OFD locks, they work between two opens in one process as between two
processes (tests open several "engines" in one process).

The segment knows bytes, not what they mean: its owner
(:mod:`hicache_cp.node`) keeps a header and a journal in them. Regions of it
(:meth:`Segment.region`) become :class:`hostmem.arena.HostArena` memory, so
they are prefaulted and registered with CUDA by the arena's own pipeline.

Huge pages: on hugetlbfs every page is huge (sizes round up to its page
size); on tmpfs ``madvise(MADV_HUGEPAGE)`` is applied where
``transparent_hugepage/shmem_enabled`` allows it, else base pages. NUMA
placement is set before the first touch (:mod:`hostmem.numa`).

Lifecycle::

    seg = Segment("hicache-cp-node")             # opens or creates the file (empty)
    with seg.opening(timeout_s=30):              # exclusive while deciding
        head = seg.read(0, 4096)                 # what a previous user left
        if must_reshape and seg.sole_user():     # nobody else maps it
            seg.resize(nbytes)                   # zeroed
        seg.map()                                # MAP_SHARED, huge pages, NUMA policy
        seg.share()                              # a user until close
    region = seg.region(offset, nbytes)          # memory for a HostArena
    seg.close(unlink_if_last=False)              # unmap; the bytes stay for the next process
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hostmem import numa
from hostmem.mapping import (
    BASE_PAGE, MADV_DONTFORK, MADV_HUGEPAGE, MADV_POPULATE_WRITE, HugePages, _address, _round_up, madvise, read_smaps, thp_mode,
)

logger = logging.getLogger(__name__)

__all__ = ["SHM_DIR", "Segment", "SegmentBusy", "SegmentInfo", "SegmentRegion", "check_name", "drop_segment",
           "find_segment", "list_segments", "mapping_pids", "segment_dirs"]  # fmt: skip

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_MUTEX, _USERS = 0, 1  # lock bytes
_POLL_S = 0.01


class SegmentBusy(RuntimeError):
    """Another process maps the segment, so it may not be reshaped or dropped."""

    def __init__(self, path: Path, pids: list[int], what: str) -> None:
        self.path, self.pids = path, pids
        shown = ", ".join(map(str, pids)) if pids else "unknown (not visible from here)"
        super().__init__(f"{path}: cannot {what}: the segment is in use by other processes (pids {shown})")


def segment_dirs(mounts: Path = Path("/proc/mounts")) -> list[Path]:
    """Where segments may live: ``/dev/shm``, then every hugetlbfs mount."""
    out = [SHM_DIR]
    try:
        for line in mounts.read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[2] == "hugetlbfs" and Path(fields[1]) not in out:
                out.append(Path(fields[1]))
    except OSError:
        pass
    return out


def check_name(name: str) -> str:
    """`name` when it is a valid segment name; ValueError saying what is allowed otherwise."""
    if not _NAME.match(name):
        raise ValueError(f"segment name {name!r}: use letters, digits, '.', '_' and '-' (no '/'), at most 200")
    return name


def find_segment(name: str, directory: Path | None = None) -> Path | None:
    """The path of an existing segment called ``name`` (in ``directory``, else the first
    segment directory that has it), or None."""
    for d in [directory] if directory is not None else segment_dirs():
        path = d / check_name(name)
        if path.exists():
            return path
    return None


def _hugetlb_page_size(directory: Path) -> int:
    """The page size of a hugetlbfs mount (its block size), or 0 for tmpfs."""
    if directory == SHM_DIR:
        return 0
    try:
        return os.statvfs(directory).f_bsize
    except OSError:
        return 0


def _choose_dir(nbytes: int, huge_pages: HugePages) -> Path:
    """``/dev/shm``, or a hugetlbfs mount with room for ``nbytes`` when huge pages are wanted."""
    if huge_pages in (HugePages.AUTO, HugePages.HUGETLB):
        for d in segment_dirs()[1:]:
            try:
                st = os.statvfs(d)
            except OSError:
                continue
            if st.f_bsize and st.f_bavail * st.f_bsize >= nbytes:
                return d
        if huge_pages is HugePages.HUGETLB:
            logger.warning("segment: no hugetlbfs mount with %d free bytes; using %s", nbytes, SHM_DIR)
    return SHM_DIR


@dataclass(frozen=True)
class SegmentRegion:
    """``[offset, offset + nbytes)`` of a mapped segment, as :class:`hostmem.arena.HostArena` memory.

    It offers what the arena reads of its own anonymous mapping
    (:class:`hostmem.mapping.Mapping`): the ``mmap`` object and the offset of
    the range in it, its address, what pages it got, prefaulting and the
    smaps readers. The segment owns the mapping: :meth:`release` leaves it.
    """

    mm: mmap.mmap
    lead: int
    addr: int
    nbytes: int
    obtained: HugePages
    page_size: int
    granule: int
    dontfork: bool
    map_s: float = 0.0
    advise_s: float = 0.0

    def populate(self, offset: int, length: int) -> None:
        """Fault ``[offset, offset + length)`` in for writing, keeping what it holds."""
        madvise(self.addr + offset, length, MADV_POPULATE_WRITE)

    def huge_bytes(self, smaps: Path = Path("/proc/self/smaps")) -> int:
        """Bytes of the region on huge pages now (shmem THP or hugetlbfs), capped at its size."""
        keys = ("ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb", "Private_Hugetlb", "AnonHugePages")
        total = 0
        for e in read_smaps(smaps, self.addr, self.addr + self.nbytes):
            total += sum(e.fields.get(k, 0) for k in keys)
        return min(total, self.nbytes)

    def vm_flags(self, smaps: Path = Path("/proc/self/smaps")) -> frozenset[str]:
        entries = read_smaps(smaps, self.addr, self.addr + 1)
        return entries[0].flags if entries else frozenset()

    def release(self) -> None:
        """Nothing: the segment unmaps (:meth:`Segment.close`)."""


class Segment:
    """One named segment, opened or created (empty) by the constructor; see the module docstring.

    Args:
        name: the file name (letters, digits, ``.``, ``_``, ``-``).
        directory: where it is (or is created); default: an existing
            segment of that name where it is, else a hugetlbfs mount with
            room for ``size_hint`` bytes when ``huge_pages`` allows, else
            ``/dev/shm``. Any RAM-backed directory works (a tmpfs mounted
            where a container's ``/dev/shm`` is too small).
        size_hint: the size the caller will give it (chooses the directory).
        huge_pages: ``AUTO``/``THP``/``HUGETLB``/``NONE`` (see the module docstring).

    Not thread-safe: one thread opens, maps and closes.
    """

    def __init__(self, name: str, *, directory: Path | None = None, size_hint: int = 0,
                 huge_pages: HugePages | str = HugePages.AUTO) -> None:  # fmt: skip
        self.name = check_name(name)
        self.huge_pages = HugePages(huge_pages)
        existing = find_segment(name, directory)
        self.path = existing or (directory or _choose_dir(size_hint, self.huge_pages)) / name
        self.created = existing is None
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.fs_page_size = _hugetlb_page_size(self.path.parent)  # 0: tmpfs
        self.mm: mmap.mmap | None = None
        self.addr = 0
        self.obtained = HugePages.NONE
        self.numa = numa.NumaPolicy.LOCAL
        self.map_s = self.advise_s = 0.0
        self.dontfork = False

    # -- locks ------------------------------------------------------------------

    def _lock(self, kind: int, byte: int, wait: bool) -> bool:
        """Set an OFD lock on one byte; False when another holder conflicts (``wait=False``)."""
        cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
        try:
            fcntl.fcntl(self.fd, cmd, struct.pack("hhqqi4x", kind, os.SEEK_SET, byte, 1, 0))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    @contextlib.contextmanager
    def opening(self, timeout_s: float = 30.0) -> Iterator[None]:
        """Hold the opening mutex (byte 0) exclusively; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self._lock(fcntl.F_WRLCK, _MUTEX, wait=False):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path}: another process held the opening lock for {timeout_s:.0f} s")
            time.sleep(_POLL_S)
        try:
            yield
        finally:
            self._lock(fcntl.F_UNLCK, _MUTEX, wait=False)

    def sole_user(self) -> bool:
        """Take the users lock exclusively if no other open maps the segment; True when taken.

        Held until :meth:`share` (which turns it shared) or :meth:`close`.
        """
        return self._lock(fcntl.F_WRLCK, _USERS, wait=False)

    def share(self) -> None:
        """Hold the users lock shared (a user until :meth:`close`). Never blocks for long:
        only a holder of the opening mutex holds it exclusively."""
        self._lock(fcntl.F_RDLCK, _USERS, wait=True)

    def users(self) -> list[int]:
        """Pids of processes (this one included) that map the segment, from ``/proc/*/maps``.

        For messages: it reads every visible process's maps (tens of ms)."""
        return mapping_pids(self.path)

    # -- contents ---------------------------------------------------------------

    @property
    def size(self) -> int:
        """The file's size in bytes now."""
        return os.fstat(self.fd).st_size

    def read(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` from ``offset`` (zeros past the end of the file), without mapping."""
        data = os.pread(self.fd, nbytes, offset)
        return data + bytes(nbytes - len(data))

    def resize(self, nbytes: int) -> None:
        """Empty the file and give it ``nbytes`` (rounded up to the hugetlbfs page): every
        byte reads zero afterwards. Needs :meth:`sole_user`; not while mapped."""
        if self.mm is not None:
            raise RuntimeError(f"{self.path}: resize while mapped")
        if not self.sole_user():
            raise SegmentBusy(self.path, [p for p in self.users() if p != os.getpid()], "resize it")
        os.ftruncate(self.fd, 0)
        os.ftruncate(self.fd, _round_up(nbytes, self.fs_page_size or BASE_PAGE))

    def map(self, *, numa_policy: numa.NumaPolicy | str = numa.NumaPolicy.AUTO, dontfork: bool = True) -> None:
        """Map the whole file shared; advise huge pages (tmpfs), set the NUMA policy, MADV_DONTFORK.

        The NUMA policy is the file's shared policy: it places the pages any
        process faults in afterwards (see :mod:`hostmem.numa`)."""
        if self.mm is not None:
            return
        size = self.size
        if size <= 0:
            raise ValueError(f"{self.path}: empty segment; resize it first")
        t0 = time.perf_counter()
        self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.addr = _address(self.mm)
        self.map_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.fs_page_size:
            self.obtained = HugePages.HUGETLB
        elif self.huge_pages in (HugePages.AUTO, HugePages.THP) and thp_mode(setting="shmem_enabled") in ("always", "within_size", "advise", "force"):
            try:
                madvise(self.addr, size, MADV_HUGEPAGE)
                self.obtained = HugePages.THP
            except OSError as exc:
                logger.debug("%s: MADV_HUGEPAGE refused (%s); base pages", self.path, exc)
        self.numa = numa.resolve(numa_policy)
        if not numa.place(self.addr, size, self.numa):
            self.numa = numa.NumaPolicy.LOCAL
        self.dontfork = False
        if dontfork:
            try:
                madvise(self.addr, size, MADV_DONTFORK)
                self.dontfork = True
            except OSError as exc:
                logger.warning("%s: MADV_DONTFORK refused (%s)", self.path, exc)
        self.advise_s = time.perf_counter() - t0

    @property
    def page_size(self) -> int:
        """Bytes one fault maps for sure: the hugetlbfs page, else the base page."""
        return self.fs_page_size or BASE_PAGE

    @property
    def granule(self) -> int:
        """Alignment worth keeping for regions: the huge page size where huge pages are used."""
        return self.fs_page_size or (2 << 20 if self.obtained is HugePages.THP else BASE_PAGE)

    def region(self, offset: int, nbytes: int) -> SegmentRegion:
        """``[offset, offset + nbytes)`` as arena memory (``offset`` a multiple of the page size)."""
        if self.mm is None:
            raise RuntimeError(f"{self.path}: region of an unmapped segment")
        if offset % self.page_size or not 0 <= offset < offset + nbytes <= len(self.mm):
            raise ValueError(f"{self.path}: region [{offset}, {offset + nbytes}) is not page-aligned "
                             f"inside [0, {len(self.mm)})")  # fmt: skip
        return SegmentRegion(self.mm, offset, self.addr + offset, nbytes, self.obtained, self.page_size,
                             self.granule, self.dontfork, self.map_s, self.advise_s)  # fmt: skip

    @classmethod
    def open_mapped(cls, name: str, nbytes: int, **kwargs: object) -> Segment:
        """Open or create segment `name`, give it `nbytes` (zeroed) when it has another
        size and nobody else maps it, map it and become a user: the whole opening for a
        caller that keeps no header (tests, benchmarks)."""
        seg = cls(name, size_hint=nbytes, **kwargs)  # type: ignore[arg-type]
        try:
            with seg.opening():
                if seg.size != _round_up(nbytes, seg.page_size):
                    seg.resize(nbytes)
                seg.map()
                seg.share()
        except BaseException:
            seg.close()
            raise
        return seg

    # -- teardown ---------------------------------------------------------------

    def close(self, *, unlink_if_last: bool = False) -> bool:
        """Unmap, stop being a user, close the file. Idempotent.

        ``unlink_if_last``: remove the name when no other open maps the
        segment any more (the memory is freed with the last mapping); the
        last of several closing users always finds itself last. Returns
        whether this call removed it. Views still referencing the mapping keep
        it mapped until they are dropped (logged at DEBUG).
        """
        if self.fd < 0:
            return False
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                logger.debug("%s: views still alive; unmapped when they are dropped", self.path)
            self.mm = None
        removed = False
        try:
            self._lock(fcntl.F_UNLCK, _USERS, wait=False)
            if unlink_if_last and self.sole_user():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                    removed = True
        finally:
            os.close(self.fd)
            self.fd = -1
        return removed

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment({str(self.path)!r}, size={self.size if self.fd >= 0 else 'closed'})"


@dataclass(frozen=True)
class SegmentInfo:
    """An existing segment, for listings: where it is, its size, who maps it."""

    name: str
    path: Path
    nbytes: int
    users: tuple[int, ...]


def list_segments(prefix: str = "", directory: Path | None = None) -> list[SegmentInfo]:
    """Every segment whose name starts with ``prefix``, in ``directory`` or every segment directory."""
    out: list[SegmentInfo] = []
    for d in [directory] if directory is not None else segment_dirs():
        try:
            paths = sorted(p for p in d.iterdir() if p.name.startswith(prefix) and p.is_file())
        except OSError:
            continue
        for p in paths:
            with contextlib.suppress(OSError):
                out.append(SegmentInfo(p.name, p, p.stat().st_size, tuple(mapping_pids(p))))
    return out


def drop_segment(name: str, directory: Path | None = None) -> bool:
    """Remove segment ``name``; False when there is none. Raises :class:`SegmentBusy`
    (naming the processes) while any process maps it: its memory would stay
    theirs, and its next opener would not find it."""
    path = find_segment(name, directory)
    if path is None:
        return False
    seg = Segment(name, directory=path.parent)
    try:
        if not seg.sole_user():
            raise SegmentBusy(path, [p for p in seg.users() if p != os.getpid()], "drop it")
        os.unlink(path)
        return True
    finally:
        seg.close()


def mapping_pids(path: Path) -> list[int]:
    """Processes whose ``/proc/<pid>/maps`` name ``path`` (those this user may read)."""
    needle = str(path)
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "maps").read_text():
                pids.append(int(entry.name))
    return pids
