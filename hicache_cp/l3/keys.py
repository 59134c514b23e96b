"""L3 object keys and the byte layout of one object.

A key names what the bytes are, so that no reader can get bytes of another
content or another layout:

    {namespace}/{fingerprint}/{chain hash}/{parts}/{rank}

- `chain hash`: h_i = blake2b-128(h_{i-1} || tokens of page i), the prefix
  chain of the *last* page the object holds; it commits to the whole prefix.
- `fingerprint`: the layout the bytes were written in (model and its part
  geometry with the logical layer ids, page size, KV dtype, CP size, the
  grouping knobs and `FORMAT_VERSION`). Two caches whose layouts differ in
  any of these never compute the same key, so they never read each other.
- `parts`: `all` when every part of the pages is one object (`group_parts`),
  else the part's name (then a page is present only with all its part keys).
- `rank`: the CP rank whose pages the object holds. Pages are sharded by
  request position (position p lives on rank p mod cp_size), so every rank
  writes and reads only its own objects.

Grouping (`pages_per_object` = G): positions [kG, (k+1)G) form group k; rank
r's object of group k holds r's pages of the group. Only whole groups are
written (the chain hash of the group's last page must be known), and a group
is read whole (Mooncake reads whole objects). G = 1 gives one object per
page per rank; a larger G divides the keys the master sees by G. Keys per
request: ceil(pages / G) x (1 or parts) per rank.

Object bytes: for each part (layout order), for each compact slot (layer),
the object's pages in position order, `page_bytes` each. Consecutive
physical L2 pages of one layer are contiguous in the arena as in the object,
so a chunk list coalesces them into one run. With restore checks on
(`checksums`, part of the fingerprint) a trailer follows: the same order
again with one 8-byte checksum per page (`hicache_cp.checksum`), read from
and written to the host pool's checksum arena in place (`checksum_chunks`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.keys import chain_hashes
from hicache_cp.l3.config import FORMAT_VERSION, L3Config
from hicache_cp.layout import KVLayout, PartLayout

def layout_fingerprint(layout: KVLayout, model: str, config: L3Config, cp_size: int, checksums: bool = False) -> str:
    """A short digest of everything that decides what an object's bytes mean."""
    desc = {
        "checksums": checksums,
        "format": FORMAT_VERSION,
        "model": model,
        **layout.description(),
        "kv_dtype": config.kv_dtype,
        "cp_size": cp_size,
        "pages_per_object": config.object_pages(layout.page_size),
        "group_parts": config.group_parts,
    }
    return hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=8).hexdigest()


class PositionHashes:
    """Chain hashes of request positions [base, base + len(hashes)), indexed by position."""

    def __init__(self, base: int, hashes: list[bytes]) -> None:
        self.base = base
        self.hashes = hashes

    @classmethod
    def of(cls, tokens: np.ndarray, page_size: int) -> PositionHashes:
        """Every whole page of a request, from position 0."""
        return cls(0, chain_hashes(tokens, page_size))

    def __getitem__(self, position: int) -> bytes:
        i = position - self.base
        if not 0 <= i < len(self.hashes):
            raise IndexError(f"chain hash of position {position} not computed (have {self.base}+{len(self.hashes)})")
        return self.hashes[i]


@dataclass(frozen=True)
class L3Object:
    """One object of this rank: its key, the parts it carries and the
    request positions of its pages (ascending)."""

    key: str
    group: int
    parts: tuple[PartLayout, ...]
    positions: np.ndarray

    @property
    def nbytes(self) -> int:
        return len(self.positions) * sum(p.bytes_per_page for p in self.parts)


class KeyScheme:
    """Keys and chunk lists of one rank's objects; see the module docstring."""

    def __init__(
        self, layout: KVLayout, model: str, config: L3Config, cp_size: int, rank: int, checksums: bool = False
    ) -> None:
        self.layout = layout
        self.group = config.object_pages(layout.page_size)
        self.cp_size = cp_size
        self.rank = rank
        self.checksums = checksums
        self.fingerprint = layout_fingerprint(layout, model, config, cp_size, checksums)
        self.prefix = f"{config.namespace}/{self.fingerprint}"
        if config.group_parts:
            self.part_groups: list[tuple[str, tuple[PartLayout, ...]]] = [("all", tuple(layout.parts))]
        else:
            self.part_groups = [(p.part.value, (p,)) for p in layout.parts]

    def whole_groups(self, lo: int, hi: int) -> range:
        """Groups that lie wholly inside positions [lo', hi) where lo' = lo
        rounded down to a group start: the groups a read from `lo` needs."""
        return range(lo // self.group, hi // self.group)

    def objects(self, hashes: PositionHashes | Sequence[bytes], groups: range) -> list[L3Object]:
        """This rank's objects of `groups`; `hashes[p]` is position p's chain
        hash (at least up to the last group's end). Groups where this rank
        owns no page have no object of this rank."""
        out: list[L3Object] = []
        g = self.group
        for k in groups:
            pos = np.arange(k * g, (k + 1) * g, dtype=np.int64)
            if self.cp_size > 1:
                pos = pos[pos % self.cp_size == self.rank]
                if not len(pos):
                    continue
            tail = hashes[(k + 1) * g - 1].hex()
            for name, parts in self.part_groups:
                out.append(L3Object(f"{self.prefix}/{tail}/{name}/{self.rank}", k, parts, pos))
        return out

    def rank_positions(self, lo: int, hi: int) -> np.ndarray:
        """This rank's positions in [lo, hi)."""
        pos = np.arange(lo, hi, dtype=np.int64)
        return pos if self.cp_size == 1 else pos[pos % self.cp_size == self.rank]

    def physical(self, host: np.ndarray, first: int, obj: L3Object) -> np.ndarray:
        """This rank's physical L2 pages holding `obj`, given the logical L2 pages
        `host` of a run of positions that starts at `first`."""
        return cp_mapping.to_physical(host[obj.positions - first], self.cp_size)


def chunk_list(
    parts: Sequence[PartLayout], physical: np.ndarray, bases: dict, physical_pages: int
) -> tuple[list[int], list[int]]:
    """Addresses and lengths of one object's bytes in a layer-first host pool.

    `physical`: the object's physical L2 pages in position order; `bases`:
    arena address of each part. Runs of consecutive physical pages coalesce
    into one chunk per layer. O(parts x layers x runs), no per-page loop.
    """
    physical = np.asarray(physical, dtype=np.int64)
    if len(physical) == 0:
        return [], []
    brk = np.flatnonzero(np.diff(physical) != 1) + 1
    starts = physical[np.concatenate(([0], brk))]
    lengths = np.diff(np.concatenate(([0], brk, [len(physical)])))
    ptrs: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    for p in parts:
        slots = np.arange(p.num_slots, dtype=np.int64)[:, None]
        ptrs.append((bases[p.part] + (slots * physical_pages + starts[None, :]) * p.page_bytes).ravel())
        sizes.append(np.broadcast_to(lengths[None, :] * p.page_bytes, (p.num_slots, len(starts))).ravel())
    return np.concatenate(ptrs).tolist(), np.concatenate(sizes).tolist()


def checksum_chunks(
    parts: Sequence[PartLayout], physical: np.ndarray, sums_bases: dict, physical_pages: int
) -> tuple[list[int], list[int]]:
    """`chunk_list` of an object's checksum trailer: per part and slot, 8 bytes a
    page in the host pool's checksum arena ([slots, physical_pages] uint64 per part,
    based at `sums_bases[part]`)."""
    words = [PartLayout(p.part, p.layer_ids, 8, 1) for p in parts]  # one 8-byte "page" each
    return chunk_list(words, physical, sums_bases, physical_pages)
