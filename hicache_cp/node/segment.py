"""The node segment: who opens it how, and when a restarted engine adopts what it holds.

Every process of an engine that uses the node tier opens the segment by name
(`NodeSegment`). Under the segment's opening mutex
(`hostmem.segment.Segment.opening`) it reads the header and decides:

    JOIN    the header is READY and carries this engine's session (another rank
            of the same engine opened it first): map it, check the fingerprint
            is this rank's too (else ConsistencyError: the ranks disagree)
    ADOPT   a previous engine left it READY with the same fingerprint and no
            process maps it any more: start a new session (generation + 1) and
            keep the journal, so the tree is rebuilt from it (`adopt`)
    CLEAN   nothing there, another layout, model, page size, format or size,
            a segment left INITIALIZING, or adoption switched off: empty it
            (every byte zero), one INFO line saying why

ADOPT and CLEAN need every other user gone (`Segment.sole_user`): a segment
another live engine maps is never reshaped; that is a `SegmentBusy` error
naming its processes. The session is a number every process of one engine
knows (the cache agrees it over its ranks with a MIN; the vLLM plug-in
derives it from vLLM's instance id), so a rank can tell its own engine's
segment from a previous engine's.

The header is written READY last: a crash while initialising leaves it
INITIALIZING, which the next opener cleans.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hicache_cp.errors import ConsistencyError
from hicache_cp.layout import Part
from hicache_cp.node.geometry import ENTRY, HEADER_BYTES, NodeGeometry, differences
from hostmem import numa
from hostmem.segment import Segment, SegmentBusy, SegmentRegion

logger = logging.getLogger(__name__)

MAGIC = b"HICACHE-CP-NODE1"
HEADER = np.dtype([
    ("magic", "S16"), ("format", "<u4"), ("state", "<u4"), ("session", "<u8"), ("generation", "<u8"),
    ("fingerprint", "V16"), ("created_ns", "<u8"), ("desc_len", "<u4"), ("adopted", "<u4"),
])  # fmt: skip
_DESC = 128  # the description's JSON starts here


class HeaderState(enum.IntEnum):
    EMPTY = 0
    INITIALIZING = 1
    READY = 2


class Decision(str, enum.Enum):
    JOIN = "join"
    ADOPT = "adopt"
    CLEAN = "clean"


@dataclass(frozen=True)
class Header:
    """What the first HEADER_BYTES of a segment say."""

    state: HeaderState
    session: int
    generation: int
    fingerprint: bytes
    description: dict[str, object]
    adopted: bool = False  # the session's first opener adopted the journal (else it started clean)

    @classmethod
    def parse(cls, raw: bytes) -> Header:
        h = np.frombuffer(raw, HEADER, 1)[0]
        if bytes(h["magic"]) != MAGIC:
            return cls(HeaderState.EMPTY, 0, 0, b"", {})
        try:
            desc = json.loads(raw[_DESC : _DESC + int(h["desc_len"])].decode())
        except (UnicodeDecodeError, ValueError):
            desc = {}
        state = int(h["state"])
        return cls(HeaderState(state) if state in HeaderState._value2member_map_ else HeaderState.EMPTY,
                   int(h["session"]), int(h["generation"]), h["fingerprint"].tobytes(), desc,
                   bool(h["adopted"]))  # fmt: skip


def _write_header(buf: np.ndarray, geometry: NodeGeometry, session: int, generation: int, adopted: bool) -> None:
    """Write the header into `buf` (the segment's first HEADER_BYTES, uint8), READY last."""
    desc = json.dumps(geometry.description(), sort_keys=True).encode()
    if _DESC + len(desc) > HEADER_BYTES:
        raise ValueError(f"node segment: description of {len(desc)} bytes does not fit the header")
    h = buf[: HEADER.itemsize].view(HEADER)
    h["state"] = HeaderState.INITIALIZING
    buf[_DESC : _DESC + len(desc)] = np.frombuffer(desc, np.uint8)
    buf[_DESC + len(desc) : HEADER_BYTES] = 0
    h["magic"], h["format"], h["session"], h["generation"] = MAGIC, geometry.description()["format"], session, generation
    h["fingerprint"], h["created_ns"], h["desc_len"] = np.void(geometry.fingerprint()), time.time_ns(), len(desc)
    h["adopted"] = adopted
    h["state"] = HeaderState.READY


class NodeSegment:
    """One process's view of the node segment; see the module docstring.

    Args:
        name: the segment's name (a file in /dev/shm or a hugetlbfs mount).
        geometry: what this engine expects it to hold.
        session: this engine's session number (the same in every process of it).
        adopt: keep what a previous engine committed (False: always CLEAN).
        numa_policy: NUMA placement of pages faulted in from now on.
        directory: where the segment lives (default: see `hostmem.segment.Segment`).
        timeout_s: longest wait for another process's opening.

    Attributes: `decision` and `reason` (why CLEAN, for the INFO line), `adopted`
    (whether this engine's session kept a previous engine's journal, whoever opened first),
    `generation`, and numpy views of the directory and the tokens.
    """

    def __init__(self, name: str, geometry: NodeGeometry, *, session: int, adopt: bool = True,
                 numa_policy: numa.NumaPolicy | str = numa.NumaPolicy.AUTO, timeout_s: float = 60.0,
                 directory: Path | None = None) -> None:  # fmt: skip
        self.geometry = geometry
        self.session = session & ((1 << 63) - 1)
        self.segment = Segment(name, size_hint=geometry.total_bytes, directory=directory)
        try:
            with self.segment.opening(timeout_s):
                self.decision, self.reason, self.generation = self._open(adopt, numa_policy)
                self.segment.share()
        except BaseException:
            self.segment.close()
            raise
        if self.decision is Decision.CLEAN and self.reason:
            logger.info("node segment %s: not adopted (%s); starting clean", self.segment.path, self.reason)
        elif self.decision is Decision.ADOPT:
            logger.info("node segment %s: adopting generation %d's journal", self.segment.path, self.generation - 1)
        self.t_open = time.perf_counter()
        mm = self.segment.mm
        assert mm is not None
        g = geometry
        self.directory = np.frombuffer(mm, ENTRY, g.logical_pages, g.directory_offset)
        self.tokens = np.frombuffer(mm, np.int64, g.logical_pages * g.layout.page_size, g.tokens_offset).reshape(
            g.logical_pages, g.layout.page_size
        )

    def _open(self, adopt: bool, numa_policy: numa.NumaPolicy | str) -> tuple[Decision, str, int]:
        """The decision, under the opening mutex; leaves the segment mapped."""
        seg, g = self.segment, self.geometry
        head = Header.parse(seg.read(0, HEADER_BYTES))
        same = head.fingerprint == g.fingerprint() and seg.size == g.total_bytes
        if head.state is HeaderState.READY and head.session == self.session:
            if not same:
                raise ConsistencyError(
                    f"node segment {seg.path}: another rank of this engine opened it for another layout",
                    details={"differences": differences(head.description, g.description())},
                )
            seg.map(numa_policy=numa_policy)
            self.adopted = head.adopted
            return Decision.JOIN, "", head.generation
        if not seg.sole_user():
            raise SegmentBusy(seg.path, seg.users(), "reshape or adopt it for a new engine")
        if head.state is HeaderState.READY and same and adopt:
            decision, reason = Decision.ADOPT, ""
        else:
            decision, reason = Decision.CLEAN, _why_clean(head, g, adopt, seg.size)
            seg.resize(g.total_bytes)
        seg.map(numa_policy=numa_policy)
        self.adopted = decision is Decision.ADOPT
        assert seg.mm is not None
        _write_header(np.frombuffer(seg.mm, np.uint8, HEADER_BYTES), g, self.session, head.generation + 1,
                      decision is Decision.ADOPT)  # fmt: skip
        return decision, reason, head.generation + 1

    @property
    def path(self) -> str:
        return str(self.segment.path)

    def region(self, copy: int, part: Part) -> SegmentRegion:
        """One copy's pool of one part, as arena memory."""
        g = self.geometry
        return self.segment.region(g.part_offset(copy, part), g.part_bytes(part))

    def sums_region(self, copy: int) -> SegmentRegion:
        """One copy's checksum table (`HostPool`'s checksum arena), as arena memory."""
        g = self.geometry
        return self.segment.region(g.sums_offset(copy), g.sums_bytes)

    def close(self, *, drop: bool = False) -> bool:
        """Unmap. `drop`: remove the segment once no other process maps it (the last
        user to close removes it). Returns whether this call removed it."""
        for name in ("directory", "tokens"):
            setattr(self, name, None)
        return self.segment.close(unlink_if_last=drop)


def _why_clean(head: Header, g: NodeGeometry, adopt: bool, size: int) -> str:
    """The INFO line's reason; empty for a new (empty) segment."""
    if head.state is HeaderState.EMPTY:
        return "" if size == 0 else "it holds no hicache-cp header"
    if head.state is HeaderState.INITIALIZING:
        return "its last opener died while initialising it"
    if not adopt:
        return "adoption is off (node_adopt is false, or verify_restores is off: nothing could be checked)"
    diff = differences(head.description, g.description())
    return "; ".join(diff) if diff else f"its size is {size} B, {g.total_bytes} B expected"
