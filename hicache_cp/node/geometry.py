"""Where everything lives in the node segment, and what makes two engines' segments compatible.

One segment holds, in this order (offsets fixed by the geometry alone)::

    header      HEADER_BYTES: magic, format, state, session, generation, the
                fingerprint and its description (`header`)
    directory   one entry per logical host page, `ENTRY` (`journal`)
    tokens      the token ids of each logical page, int64 [pages, page_size]
    sums        for each copy, its checksum table: what a private `HostPool`
                keeps in its checksum arena (`hicache_cp.checksum`), part by part
                in layout order, each uint64 [slots, physical_pages]; present
                when `verify` is on, each copy's starting on `align`
    data        for each copy, for each part, the part's layer-first pool
                [slots, physical_pages, page_bytes], each starting on `align`

A *copy* is one full host pool. Replicated parts (every TP rank holds the
same KV: the MLA latent, the DSA indexer keys, the draft) keep one copy for
the node (`Sharing.REPLICATED`); sharded ones (CP ranks, TP-sharded heads)
keep one copy per rank (`Sharing.PER_RANK`), as each rank's private pool did.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache_cp.layout import KVLayout, Part

#: Bumped whenever the bytes of the segment change meaning: an older segment is then not adopted.
#: 2: the checksum table is `HostPool`'s (`hicache_cp.checksum`, [part][slot, page] per copy).
FORMAT_VERSION = 2
HEADER_BYTES = 4096
#: Data regions start on this boundary: a 2 MiB huge page (and a multiple of every
#: smaller page), so no region shares a huge page with another.
DEFAULT_ALIGN = 2 << 20

#: One directory entry per logical page (64 bytes). `state` is written last at a
#: commit and first at a release (`journal`); `key` is the 128-bit prefix chain hash
#: through this page and `parent` the one before it (zeros at position 0).
ENTRY = np.dtype([
    ("state", "<u4"), ("flags", "<u4"), ("position", "<i8"), ("seq", "<u8"),
    ("key", "<u8", (2,)), ("parent", "<u8", (2,)), ("pad", "<u8"),
])  # fmt: skip
assert ENTRY.itemsize == 64


class Sharing(str, enum.Enum):
    """How many copies of the pool the node keeps (see the module docstring)."""

    #: `REPLICATED` with one CP rank (TP replicas), `PER_RANK` under CP.
    AUTO = "auto"
    REPLICATED = "replicated"
    PER_RANK = "per_rank"


@dataclass(frozen=True)
class NodeGeometry:
    """The byte map of one node segment.

    Args:
        layout: the KV layout (parts, layers, page size).
        model: the model's identity (preset name, or the engine's model id).
        physical_pages: pages of one copy's pool, the dummy page 0 included
            (`HostPool.physical_pages`).
        cp_size: CP ranks (logical pages = (physical_pages - 1) x cp_size).
        copies: 1 (replicated) or the number of ranks (per rank).
        sharing: what the copies are.
        kv_dtype: what the engine calls its KV dtype (part of the fingerprint).
        verify: whether checksums are kept (`verify_restores` is not off; a
            segment written without them is never adopted: nothing in it could
            be checked before its first use).
        align: alignment of the data regions (bytes; a multiple of 4 KiB).
    """

    layout: KVLayout
    model: str
    physical_pages: int
    cp_size: int
    copies: int
    sharing: Sharing
    kv_dtype: str = "opaque"
    verify: bool = True
    align: int = DEFAULT_ALIGN
    _sums: list[int] = field(init=False, repr=False, compare=False)
    _offsets: dict[tuple[int, Part], int] = field(init=False, repr=False, compare=False)
    _data: int = field(init=False, repr=False, compare=False)
    _total: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.copies < 1 or self.physical_pages < 2 or self.cp_size < 1:
            raise ValueError(f"node geometry: copies {self.copies}, pages {self.physical_pages}, cp {self.cp_size}")
        if self.sharing is Sharing.REPLICATED and (self.copies != 1 or self.cp_size != 1):
            raise ValueError("node geometry: a replicated pool is one copy of one CP rank's pages")
        off = _round_up(self.tokens_offset + self.logical_pages * self.layout.page_size * 8, self.align)
        sums: list[int] = []
        for _ in range(self.copies if self.verify else 0):
            sums.append(off)
            off = _round_up(off + self.sums_bytes, self.align)
        offsets: dict[tuple[int, Part], int] = {}
        for copy in range(self.copies):
            for p in self.layout.parts:
                offsets[(copy, p.part)] = off
                off = _round_up(off + self.part_bytes(p.part), self.align)
        object.__setattr__(self, "_sums", sums)
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_data", offsets[(0, self.layout.parts[0].part)])
        object.__setattr__(self, "_total", off)

    # -- sizes and offsets ------------------------------------------------------

    @property
    def logical_pages(self) -> int:
        """Directory entries: logical page ids 0 (the dummy) .. capacity."""
        return (self.physical_pages - 1) * self.cp_size + 1

    @property
    def units(self) -> int:
        """Checksums of a page: one per layer of every part."""
        return sum(p.num_slots for p in self.layout.parts)

    @property
    def directory_offset(self) -> int:
        return HEADER_BYTES

    @property
    def tokens_offset(self) -> int:
        return self.directory_offset + self.logical_pages * ENTRY.itemsize

    @property
    def sums_bytes(self) -> int:
        """One copy's checksum table (`HostPool.sums` of every part): 8 bytes a unit."""
        return self.units * self.physical_pages * 8

    def sums_offset(self, copy: int) -> int:
        """Offset of one copy's checksum table (ValueError when checksums are off)."""
        if not self.verify:
            raise ValueError("node geometry: a segment without checksums (verify off) has no checksum table")
        return self._sums[copy]

    @property
    def data_offset(self) -> int:
        """Where the first copy's first part starts."""
        return self._data

    @property
    def total_bytes(self) -> int:
        """The segment's size."""
        return self._total

    @property
    def copy_bytes(self) -> int:
        """Bytes of one copy's pool (every part), as a private pool would take."""
        return sum(self.part_bytes(p.part) for p in self.layout.parts)

    def part_bytes(self, part: Part) -> int:
        return self.physical_pages * self.layout.part(part).bytes_per_page

    def part_offset(self, copy: int, part: Part) -> int:
        """Offset of one copy's pool of one part [slots, physical_pages, page_bytes]."""
        return self._offsets[(copy, part)]

    # -- compatibility ----------------------------------------------------------

    def description(self) -> dict[str, Any]:
        """Everything that decides what the segment's bytes mean (JSON-ready)."""
        return {
            "format": FORMAT_VERSION,
            "model": self.model,
            **self.layout.description(),
            "kv_dtype": self.kv_dtype,
            "physical_pages": self.physical_pages,
            "cp_size": self.cp_size,
            "copies": self.copies,
            "sharing": self.sharing.value,
            "verify": self.verify,
            "align": self.align,
            "total_bytes": self.total_bytes,
        }

    def fingerprint(self) -> bytes:
        """16 bytes that differ whenever `description` does."""
        return hashlib.blake2b(json.dumps(self.description(), sort_keys=True).encode(), digest_size=16).digest()


def differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """What differs between two descriptions, one phrase per key (for the INFO line)."""
    out = []
    for key in sorted(set(stored) | set(wanted)):
        if stored.get(key) != wanted.get(key):
            out.append(f"{key} {_short(stored.get(key))} in the segment, {_short(wanted.get(key))} here")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
