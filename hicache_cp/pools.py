"""The two page pools: L1 (device) and L2 (host).

Both pools hand out *logical* page ids through a `LanePageAllocator` and store
bytes by *physical* page id on this rank (identical when cp_size == 1). Every
part has its own buffer, laid out layer-first:

    buffer[part][slot, physical_page, 0:page_bytes]

so that one layer of consecutive pages is one contiguous byte range: the
shape per-layer copies and transfers coalesce on.

Page ids are shared by all parts: one reservation yields page ids valid in
every part's buffer, which makes "the same number of pages in every part,
atomically" true by construction and gives every part the same page
capacity (docs/invariants.md rule 2: one budget, draft capacity equal to target's).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from hicache_cp.allocator import LanePageAllocator
from hicache_cp.cp import mapping as cp_mapping
from hicache_cp.layout import KVLayout, Part, log_budget
from hostmem.arena import HostArena
from hostmem.mapping import pss_bytes, resident_bytes
from hostmem.segment import SegmentRegion

logger = logging.getLogger(__name__)

#: What a freed page holds under debug checks (`DevicePool.poison`, `HostPool.poison`).
POISON_BYTE = 0x5A


class DevicePool:
    """L1: per-part, per-layer device buffers of this rank plus the logical page allocator.

    Each layer of each part is one uint8 tensor [physical_pages, page_bytes]
    (`layer(part, slot)`). A real server hands in its own KV buffers through
    `buffers`: per part either one contiguous tensor [slots, physical_pages,
    page_bytes] or one tensor per compact slot (an engine such as vLLM
    allocates every layer separately), each viewable as [physical_pages,
    page_bytes] uint8 (page-major). Otherwise zeroed buffers are made on
    `device` (host tensors stand in for GPU memory on CPU machines).
    """

    def __init__(
        self,
        layout: KVLayout,
        physical_pages: int,
        *,
        cp_size: int = 1,
        rank: int = 0,
        device: str | torch.device = "cpu",
        buffers: Mapping[Part, torch.Tensor | Sequence[torch.Tensor]] | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.cp_size = cp_size
        self.allocator = LanePageAllocator(physical_pages, cp_size, name=f"L1 rank {rank}")
        if buffers is None:
            buffers = {
                p.part: torch.zeros((p.num_slots, physical_pages, p.page_bytes), dtype=torch.uint8, device=device)
                for p in layout.parts
            }
        self.buffers = dict(buffers)
        self._layers = _layer_tensors(layout, physical_pages, buffers)
        self.device = next(iter(self._layers.values()))[0].device
        self._views = {} if self.is_cuda else {p: [t.numpy() for t in ts] for p, ts in self._layers.items()}
        self._part_views = {} if self.is_cuda else {
            p: b.numpy() for p, b in self.buffers.items() if isinstance(b, torch.Tensor)}  # fmt: skip

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def physical_pages(self) -> int:
        return self.allocator.physical_pages

    def layer(self, part: Part, slot: int) -> torch.Tensor:
        """One layer of one part: uint8 [physical_pages, page_bytes]."""
        return self._layers[part][slot]

    def layer_ptr(self, part: Part, slot: int) -> int:
        """Device address of page 0 of one layer."""
        return int(self._layers[part][slot].data_ptr())

    def buffer(self, part: Part) -> torch.Tensor:
        """The whole part as one tensor [slots, physical_pages, page_bytes]
        (pools whose part was given, or made, as one tensor)."""
        buf = self.buffers[part]
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{part.value} was given as one tensor per layer; use layer(part, slot)")
        return buf

    def layer_view(self, part: Part, slot: int) -> np.ndarray:
        """numpy view [physical_pages, page_bytes] of one layer (CPU pools only)."""
        if self.is_cuda:
            raise TypeError("layer_view is for host-memory device pools; CUDA engines use layer()")
        return self._views[part][slot]

    def part_view(self, part: Part) -> np.ndarray | None:
        """numpy view [slots, physical_pages, page_bytes] of a part given (or made) as one
        tensor, on a host-memory pool; None otherwise (then `layer_view` per slot)."""
        return self._part_views.get(part)  # none on CUDA

    def poison(self, pages: np.ndarray) -> None:
        """Overwrite this rank's share of logical `pages` with `POISON_BYTE` in every part
        and layer (CPU pools only). With debug checks the cache poisons every page it
        frees: a later read of it then shows as wrong bytes, never as the KV it used to
        hold. O(pages x layers)."""
        if self.is_cuda:
            raise TypeError("poison is for host-memory device pools")
        physical = _owned_physical(pages, self.cp_size, self.rank)
        for views in self._views.values():
            for view in views:
                view[physical] = POISON_BYTE


class HostPool:
    """L2: one `HostArena` per part (pinned where CUDA is), plus the allocator.

    The arenas are sized from one byte budget (`KVLayout.split_budget`). Close
    the pool (or use it as a context manager) to unregister pinned memory.
    """

    def __init__(
        self,
        layout: KVLayout,
        budget_bytes: int,
        *,
        cp_size: int = 1,
        rank: int = 0,
        pin: bool | None = None,
        memory: bool = True,
        checksums: bool = False,
        regions: Mapping[Part, SegmentRegion] | None = None,
        sums_region: SegmentRegion | None = None,
    ) -> None:
        """`memory=False`: the allocator only, no arenas (views raise KeyError),
        for a process that decides but never copies, such as the scheduler
        process of vLLM (`hicache_cp.integrations.vllm`). `checksums`: an arena
        for the checksums of every stored page and layer (`hicache_cp.checksum`;
        `HiCache` asks for it unless `verify_restores = off`). `regions`: each
        part's arena over that region of a shared segment instead of private
        memory, and `sums_region` the checksum arena's (the node tier,
        `hicache_cp.node`: every rank of the node reads and writes one table;
        their contents are kept)."""
        self.layout = layout
        self.rank = rank
        self.cp_size = cp_size
        self.split = layout.split_budget(budget_bytes)
        physical_pages = self.split.pages
        if physical_pages < 2:
            raise ValueError(
                f"host budget {budget_bytes} B holds {physical_pages} page(s); need at least 2 "
                f"(page 0 is the dummy page); one page is {layout.bytes_per_page} B"
            )
        log_budget(layout, self.split, rank)
        self.allocator = LanePageAllocator(physical_pages, cp_size, name=f"L2 rank {rank}")
        self.arenas: dict[Part, HostArena] = {}
        self._views: dict[Part, np.ndarray] = {}
        #: The identity of each logical page's committed copy: its prefix hash
        #: (`hicache_cp.keys.prefix_hashes`), replicated on every rank; 0 = none.
        self.tags = np.zeros(self.allocator.capacity + 1, dtype=np.uint64)
        #: One arena of every part's checksums, [slots, physical_pages] uint64 per part
        #: (`sums`), pinned like the data so GPU kernels write it in place.
        self.sums_arena: HostArena | None = None
        self._sums: dict[Part, np.ndarray] = {}
        self._sums_table: np.ndarray | None = None
        self.shared = regions is not None  # the arenas are regions of a shared segment
        if not memory:
            return
        try:
            # Every arena first: they prepare (touch, pin) in parallel in the background.
            for p in layout.parts:
                name = f"L2 {p.part.value} rank {rank}"
                region = regions[p.part] if regions is not None else None
                self.arenas[p.part] = HostArena(p.bytes_per_page * physical_pages, pin=pin, name=name, memory=region)
            if checksums or sums_region is not None:
                rows = sum(p.num_slots for p in layout.parts)
                self.sums_arena = HostArena(8 * rows * physical_pages, pin=pin, background=False, memory=sums_region,
                                            name=f"L2 checksums rank {rank}")  # fmt: skip
                self._sums_table = table = self.sums_arena.numpy().view(np.uint64).reshape(rows, physical_pages)
                first = 0
                for p in layout.parts:  # each part's rows, a block of the table
                    self._sums[p.part] = table[first : first + p.num_slots]
                    first += p.num_slots
            for p in layout.parts:  # numpy views wait for their arena to be whole
                self._views[p.part] = self.arenas[p.part].numpy().reshape(p.num_slots, physical_pages, p.page_bytes)
        except BaseException:
            self.close()
            raise

    @property
    def physical_pages(self) -> int:
        return self.allocator.physical_pages

    @property
    def pinned(self) -> bool:
        return all(a.pinned for a in self.arenas.values())

    def layer_view(self, part: Part, slot: int) -> np.ndarray:
        """numpy view [physical_pages, page_bytes] of one layer of one part."""
        return self._views[part][slot]

    def part_view(self, part: Part) -> np.ndarray:
        return self._views[part]

    def poison(self, pages: np.ndarray) -> None:
        """`DevicePool.poison` for L2 (nothing without memory). O(pages x layers)."""
        physical = _owned_physical(pages, self.cp_size, self.rank)
        for view in self._views.values():
            view[:, physical] = POISON_BYTE

    # ---- checksums and identity tags (`hicache_cp.checksum`) -----------------------------

    @property
    def has_checksums(self) -> bool:
        return bool(self._sums)

    def sums(self, part: Part) -> np.ndarray:
        """The stored checksums of one part: uint64 [slots, physical_pages], in place
        (KeyError without a checksum arena)."""
        return self._sums[part]

    def sums_table(self) -> np.ndarray:
        """Every part's stored checksums as one table, in place: uint64 [rows,
        physical_pages], the parts' slots in layout order (row `offsets[part] + slot` of
        `checksum.layout_salts`; `sums(part)` is a block of its rows). KeyError without a
        checksum arena."""
        if self._sums_table is None:
            raise KeyError("no checksum arena")
        return self._sums_table

    def sums_address(self, part: Part) -> int:
        """Address (host = device under UVA) of `sums(part)`'s first entry."""
        return int(self._sums[part].ctypes.data)

    def set_tags(self, pages: np.ndarray, tags: np.ndarray) -> None:
        """Record the identity (prefix hash) of the copies now held by logical `pages`."""
        self.tags[pages] = tags

    def stale_tags(self, pages: np.ndarray, expected: np.ndarray) -> np.ndarray:
        """Indices of the logical `pages` whose recorded identity is not `expected`
        (a page freed and reused by another copy, or dropped). O(n)."""
        return np.flatnonzero(self.tags[pages] != np.asarray(expected, dtype=np.uint64))

    def torch_view(self, part: Part) -> torch.Tensor:
        """Zero-copy torch view [slots, physical_pages, page_bytes] of one part."""
        return torch.from_numpy(self._views[part])

    def page_address(self, part: Part, slot: int, physical_page: int) -> int:
        p = self.layout.part(part)
        return self.arenas[part].ptr + (slot * self.physical_pages + physical_page) * p.page_bytes

    def pss_bytes(self) -> int:
        """This process's proportional share of the memory under the arenas: their resident
        bytes, those of a shared segment divided by the processes mapping it (its whole
        mapping, `hostmem.mapping.pss_bytes`). For reports (reads /proc)."""
        if self.shared:
            return pss_bytes([(a.ptr, a.nbytes) for a in self.arenas.values()])
        return sum(resident_bytes(a.ptr, a.nbytes) for a in self.arenas.values())

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every arena is fully pinned (no-op on plain memory)."""
        for arena in self.arenas.values():
            arena.wait_ready(arena.nbytes, timeout=timeout)

    def close(self) -> None:
        self._views.clear()
        self._sums.clear()
        self._sums_table = None
        for arena in self.arenas.values():
            arena.close()
        if self.sums_arena is not None:
            self.sums_arena.close()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _owned_physical(pages: np.ndarray, cp_size: int, rank: int) -> np.ndarray:
    """Physical ids of the logical `pages` that `rank` owns."""
    pages = np.asarray(pages, dtype=np.int64)
    return cp_mapping.to_physical(pages[cp_mapping.owner(pages, cp_size) == rank], cp_size)


def _layer_tensors(
    layout: KVLayout, physical_pages: int, buffers: Mapping[Part, torch.Tensor | Sequence[torch.Tensor]]
) -> dict[Part, list[torch.Tensor]]:
    """Validate the given buffers and cut them into per-layer uint8 [pages, page_bytes] tensors."""
    expected = {p.part for p in layout.parts}
    if set(buffers) != expected:
        raise ValueError(
            f"device buffers for parts {sorted(x.value for x in buffers)} but the layout has "
            f"{sorted(x.value for x in expected)}"
        )
    out: dict[Part, list[torch.Tensor]] = {}
    for p in layout.parts:
        given = buffers[p.part]
        if isinstance(given, torch.Tensor):
            shape = (p.num_slots, physical_pages, p.page_bytes)
            if tuple(given.shape) != shape or given.dtype != torch.uint8 or not given.is_contiguous():
                raise ValueError(
                    f"{p.part.value} device buffer must be a contiguous uint8 tensor of shape {shape}, "
                    f"got {tuple(given.shape)} {given.dtype}"
                )
            layers = list(given.unbind(0))
        else:
            layers = [_as_pages(p.part.value, slot, t, physical_pages, p.page_bytes) for slot, t in enumerate(given)]
            if len(layers) != p.num_slots:
                raise ValueError(f"{p.part.value}: {len(layers)} layer buffers given, the layout has {p.num_slots}")
        out[p.part] = layers
    devices = {t.device for layers in out.values() for t in layers}
    if len(devices) != 1:
        raise ValueError(f"device buffers live on several devices: {devices}")
    return out


def _as_pages(part: str, slot: int, t: torch.Tensor, physical_pages: int, page_bytes: int) -> torch.Tensor:
    """View one layer's tensor (any dtype, page-major, contiguous) as uint8 [pages, page_bytes]."""
    if not t.is_contiguous():
        raise ValueError(f"{part} layer slot {slot}: the buffer must be contiguous")
    flat = t.view(torch.uint8).reshape(-1)
    if flat.numel() != physical_pages * page_bytes:
        raise ValueError(
            f"{part} layer slot {slot}: {flat.numel()} bytes, expected {physical_pages} pages x {page_bytes} B"
        )
    return flat.view(physical_pages, page_bytes)
