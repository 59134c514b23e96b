"""One op's DMA descriptors, planned once and reused layer after layer (pure numpy).

A backup or a load copies the same pages for every layer of every part it
covers. Both pools are layer-first: page p of compact slot s of a part lies
at `base(s) + p * page_bytes`, on the device and in the host arena alike. So
the runs of an op (pages consecutive on both sides) are found once, and one
layer's descriptors are the op's run offsets plus that layer's two base
addresses. `DescriptorTable` does that arithmetic for every layer up front:
for each layer of a model it holds the final `(dst, src, size)` uint64
arrays of all the parts that own the layer, side by side, so the layer hook
hands three array views to one `cuMemcpyBatchAsync`: no numpy work and no
allocation per layer, one driver call for both parts.

Registration chunks: the host arena registers its memory in chunks and a DMA
must not cross one (`runs.split_at_chunks`). Whether a run crosses depends on
the layer's offset in the arena, so the table checks every (layer, run) once
and cuts the few that cross; those layers keep their own ragged arrays.

Size: the table holds `layers x runs x parts` descriptors (24 bytes each). Past
`MAX_TABLE_DESCRIPTORS` (scattered pages: one run per page) it is not built
and each layer is computed when it is asked for (`layer_descriptors`); then
the driver's own cost, about a microsecond per descriptor, dominates anyway.

Everything here runs on CPU and is tested there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hicache_cp.io.runs import coalesce_in_order, split_at_chunks
from hicache_cp.layout import Part

#: Descriptors a table may hold (24 B each: 6 MiB); larger ops are planned per layer.
MAX_TABLE_DESCRIPTORS = 1 << 18

_U64 = np.uint64


@dataclass(frozen=True, slots=True)
class PartGeometry:
    """Where one part's layers lie: what a descriptor needs besides the runs."""

    part: Part
    page_bytes: int
    slots: dict[int, int]  # logical layer -> compact slot
    device_layers: tuple[int, ...]  # device address of page 0 of each slot
    host_base: int  # address of the arena (device = host address, UVA)
    host_layer_bytes: int  # arena bytes of one slot
    chunk: int  # the arena's registration chunk

    def host_offset(self, slot: int) -> int:
        """Arena byte offset of page 0 of a slot."""
        return slot * self.host_layer_bytes


class LayerDescriptors(NamedTuple):
    """The DMAs of one layer of some parts: C-contiguous uint64 arrays of equal
    length, and their addresses (what the driver call takes: computed once,
    since `ndarray.ctypes` costs a microsecond a call)."""

    dst: np.ndarray
    src: np.ndarray
    sizes: np.ndarray
    count: int
    dst_ptr: int
    src_ptr: int
    sizes_ptr: int

    @classmethod
    def of(cls, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> LayerDescriptors:
        assert len(dst) == len(src) == len(sizes), (len(dst), len(src), len(sizes))
        return cls(dst, src, sizes, len(sizes), dst.ctypes.data, src.ctypes.data, sizes.ctypes.data)


@dataclass(frozen=True, slots=True)
class Runs:
    """An op's runs of pages consecutive on both sides (int64 arrays, one row per run)."""

    device_starts: np.ndarray
    host_starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, device_pages: np.ndarray, host_pages: np.ndarray) -> Runs:
        """O(n): runs in the given order (`runs.coalesce_in_order`)."""
        return cls(*coalesce_in_order(device_pages, host_pages))

    def __len__(self) -> int:
        return len(self.lengths)


def layer_descriptors(d2h: bool, geoms: Sequence[PartGeometry], runs: Runs, layer: int) -> LayerDescriptors:
    """The DMAs of `layer` of every part in `geoms`, cut at registration chunks.

    O(runs x parts) numpy work; allocates the result. Raises KeyError for a
    part that lacks `layer` (callers pass only the parts that own it).
    """
    devs, hosts, sizes = [], [], []
    for g in geoms:
        slot = g.slots[layer]
        size = runs.lengths * g.page_bytes
        off, dev, size = split_at_chunks(
            g.host_offset(slot) + runs.host_starts * g.page_bytes,
            g.device_layers[slot] + runs.device_starts * g.page_bytes,
            size,
            g.chunk,
        )
        devs.append(dev)
        hosts.append(off + g.host_base)
        sizes.append(size)
    dev_a, host_a = _cat(devs), _cat(hosts)
    dst, src = (host_a, dev_a) if d2h else (dev_a, host_a)
    return LayerDescriptors.of(dst, src, _cat(sizes))


class _GroupArrays(NamedTuple):
    """The geometry of a group's rows, one (parts, layer) each, all with the same number
    of parts, as int64 arrays that broadcast over (rows, parts, runs)."""

    page_bytes: np.ndarray  # (rows, parts, 1)
    host_base: np.ndarray  # (rows, parts, 1): arena address
    chunk: int | np.ndarray  # the arenas' registration chunk: one int when the parts share it, else (rows, parts, 1)
    device_base: np.ndarray  # (rows, parts, 1): device address of page 0 of the slot
    host_offset: np.ndarray  # (rows, parts, 1): arena offset of page 0 of the slot

    @classmethod
    def of(cls, rows: Sequence[tuple[Sequence[PartGeometry], int]]) -> _GroupArrays:
        """The arrays of `rows`: (the geometries of the parts, a layer every one of them owns)."""
        a = np.array(
            [[(g.page_bytes, g.host_base, g.chunk, g.device_layers[g.slots[layer]], g.host_offset(g.slots[layer]))
              for g in geoms] for geoms, layer in rows],
            dtype=np.int64,
        )  # fmt: skip
        page_bytes, host_base, chunks, device_base, host_offset = (a[:, :, k : k + 1] for k in range(5))
        # numpy divides by one integer much faster than by an array of them (libdivide):
        # at 1024 scattered pages the whole table built 1.25x slower with the array.
        chunk = int(chunks.flat[0]) if (chunks == chunks.flat[0]).all() else chunks
        return cls(page_bytes, host_base, chunk, device_base, host_offset)


class TableShape:
    """What every op's table shares, from the layout alone (built once per engine):
    the (parts, layer) rows grouped by their number of parts (every group is built
    with one handful of numpy operations, so a layout of two models costs one
    build, not two), and where each row lives. `layers` lists the (logical layer,
    parts) pairs: per model, the parts of that model that own the layer, in layout
    order (target and draft layer ids overlap, so one layer id may come with two
    part sets)."""

    def __init__(self, geoms: Sequence[PartGeometry], layers: Sequence[tuple[int, tuple[Part, ...]]]) -> None:
        self.geoms = {g.part: g for g in geoms}
        grouped: dict[int, list[tuple[tuple[Part, ...], int]]] = {}
        for layer, parts in layers:
            if parts:
                grouped.setdefault(len(parts), []).append((parts, layer))
        #: Per group: its rows and their geometry.
        self.groups: list[tuple[list[tuple[tuple[Part, ...], int]], _GroupArrays]] = []
        self.index: dict[int, list[tuple[tuple[Part, ...], int, int]]] = {}
        for g_idx, rows in enumerate(grouped.values()):
            self.groups.append((rows, _GroupArrays.of([([self.geoms[p] for p in parts], layer) for parts, layer in rows])))
            for row, (parts, layer) in enumerate(rows):
                self.index.setdefault(layer, []).append((parts, g_idx, row))
        self.descriptors_per_run = sum(len(parts) for rows, _ in self.groups for parts, _ in rows)


class DescriptorTable:
    """Every layer's DMAs of one op, for the part sets of its `TableShape`.

    Built once per op: per group of rows, three 2-D uint64 arrays (rows x runs
    of all its parts) from a few vectorised operations, O(layers x runs x
    parts). `get(parts, layer)` then costs a dict lookup and three row views;
    another set of parts is computed afresh (`layer_descriptors`), and so are
    the rare layers where a run crosses a registration chunk.
    """

    def __init__(
        self, d2h: bool, shape: TableShape, runs: Runs, max_descriptors: int = MAX_TABLE_DESCRIPTORS
    ) -> None:
        self.d2h = d2h
        self.runs = runs
        self._shape = shape
        self._index = shape.index
        self.tabulated = len(runs) * shape.descriptors_per_run <= max_descriptors
        #: Per group: (dst 2-D, src 2-D, sizes 2-D, crossing rows, row bytes, dst/src/sizes addresses).
        self._groups: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int, int, int]] = []
        if self.tabulated and len(runs):
            for _, arrays in shape.groups:
                self._groups.append(self._build_group(arrays))

    def get(self, parts: tuple[Part, ...], layer: int) -> LayerDescriptors:
        """The DMAs of `layer` of `parts`: table rows, or computed now when not tabulated."""
        if self._groups:
            for built, g, row in self._index.get(layer, ()):
                if built == parts:
                    dst2d, src2d, sizes2d, crossing, row_bytes, dst0, src0, sizes0 = self._groups[g]
                    if crossing[row]:
                        break
                    off = row * row_bytes
                    return LayerDescriptors(dst2d[row], src2d[row], sizes2d[row], sizes2d.shape[1], dst0 + off, src0 + off,
                                            sizes0 + off)  # fmt: skip
        return layer_descriptors(self.d2h, [self._shape.geoms[p] for p in parts], self.runs, layer)

    def span(self, jobs: Sequence[tuple[tuple[Part, ...], int]]) -> LayerDescriptors | None:
        """The DMAs of several layers as one block of table rows: `jobs` (parts, layer),
        each the next row of one group after the one before (a run of consecutive layers
        of one model, the same parts), none crossing a registration chunk. None when
        they are not (then ask `get` per layer). O(len(jobs)), no allocation but the views."""
        if not self._groups or not jobs:
            return None
        first = None
        for k, (parts, layer) in enumerate(jobs):
            found = next(((g, row) for built, g, row in self._index.get(layer, ()) if built == parts), None)
            if found is None:
                return None
            if first is None:
                first = found
            elif found != (first[0], first[1] + k):
                return None
        g, row0 = first  # type: ignore[misc]
        dst2d, src2d, sizes2d, crossing, row_bytes, dst0, src0, sizes0 = self._groups[g]
        rows = slice(row0, row0 + len(jobs))
        if crossing[rows].any():
            return None
        off = row0 * row_bytes
        return LayerDescriptors(dst2d[rows].reshape(-1), src2d[rows].reshape(-1), sizes2d[rows].reshape(-1),
                                len(jobs) * sizes2d.shape[1], dst0 + off, src0 + off, sizes0 + off)  # fmt: skip

    def _build_group(self, g: _GroupArrays) -> tuple[Any, ...]:
        """One group's rows: every part's runs side by side, in part order, computed for all
        rows and parts at once (a handful of numpy operations whatever the layout)."""
        runs = self.runs
        size = runs.lengths * g.page_bytes  # (rows, parts, runs)
        off = g.host_offset + runs.host_starts * g.page_bytes
        crossing = (off // g.chunk != (off + size - 1) // g.chunk).any(axis=(1, 2))
        rows, width = off.shape[0], off.shape[1] * off.shape[2]
        dev2d = (g.device_base + runs.device_starts * g.page_bytes).reshape(rows, width).view(_U64)
        host2d = (off + g.host_base).reshape(rows, width).view(_U64)
        sizes2d = size.reshape(rows, width).view(_U64)
        dst2d, src2d = (host2d, dev2d) if self.d2h else (dev2d, host2d)
        row_bytes = width * dst2d.itemsize  # C-contiguous rows: row i starts at base + i * row_bytes
        return dst2d, src2d, sizes2d, crossing, row_bytes, dst2d.ctypes.data, src2d.ctypes.data, sizes2d.ctypes.data


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    out = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return np.ascontiguousarray(out, dtype=_U64)
