"""The page checksum (`hicache_cp.checksum`) on the GPU: one Triton kernel.

    launch(tables, part, slot0, slots, pages, out_base, out_row, out_index, stream)

computes the checksum of `pages` (device page ids, an int64 device tensor) of
`slots` consecutive compact slots of one part, starting at `slot0`, and
stores each at `out_base + 8 * (slot * out_row + out_index[i])`: a uint64
array anywhere the GPU can write, pinned host memory included (UVA). A
backup writes them straight into the host pool's checksum arena at the host
pages (`HostPool.sums`); a load into the engine's landed array at the device
pages, which the host then compares (`hicache_cp.io.checked`).

A program per slot and page (or, with `DeviceTables.max_programs`, about that
many programs a launch, each taking every k-th page of its slot): for a page it
streams the page's 64-bit words in blocks of `BLOCK`, accumulates
A_j * x_j + B_j * (x_j >> 32) in uint64 lanes (wrapping mod 2**64 like numpy),
sums the lanes, XORs the (part, layer) salt and applies fmix64. Fewer programs
leave the SMs' other slots to the forward's kernels beside them. One pass over
the pages' bytes; the multipliers (16 bytes per word of a page, shared by every
page) stay in the GPU's L2 cache. The result is
bit-identical to `checksum.checksums` (tests/test_checksum_gpu.py).

Triton is imported when the first kernel is built, so CPU installs never need it.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache_cp import checksum
from hicache_cp.layout import KVLayout, Part

#: Words (8 bytes) a program reads per step.
BLOCK = 1024
#: Programs a checksum launch of the engines uses per SM of its device (None: a program
#: a page and slot): fewer leave the SMs' other slots to the forward beside the checks, and
#: below a few per SM the kernel falls short of the link's rate (docs/integrity.md, Cost).
PROGRAMS_PER_SM: int | None = 8


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Only `words` (the loop bound) and the tensors' alignment select a compiled variant:
    # the first slot, the page count, the output's address and its row length change from
    # launch to launch (an op's first landed layer, its pages, a direction's output), and
    # each variant would be compiled in whichever step first launched it.
    @triton.jit(do_not_specialize=["slot0", "n", "out_base", "out_row"])
    def checksum_pages(layer_ptrs, slot0, pages, n, out_base, out_row, out_index, mult_a, mult_b, salts, words,
                       BLOCK: tl.constexpr):  # fmt: skip
        s = slot0 + tl.program_id(1)
        base = tl.load(layer_ptrs + s).to(tl.pointer_type(tl.uint64))
        salt = tl.load(salts + s).to(tl.uint64, bitcast=True)
        for p in range(tl.program_id(0), n, tl.num_programs(0)):
            src = base + tl.load(pages + p) * words
            acc = tl.zeros([BLOCK], dtype=tl.uint64)
            for start in range(0, words, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < words
                x = tl.load(src + offs, mask=mask, other=0)
                a = tl.load(mult_a + offs, mask=mask, other=0).to(tl.uint64, bitcast=True)
                b = tl.load(mult_b + offs, mask=mask, other=0).to(tl.uint64, bitcast=True)
                acc += x * a + (x >> 32) * b
            h = tl.sum(acc, axis=0) ^ salt
            h = h ^ (h >> 30)
            h = h * 0xBF58476D1CE4E5B9
            h = h ^ (h >> 27)
            h = h * 0x94D049BB133111EB
            h = h ^ (h >> 31)
            out = (out_base + (s * out_row + tl.load(out_index + p)) * 8).to(tl.pointer_type(tl.uint64))
            tl.store(out, h)

    return checksum_pages


def _int64(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.uint64).view(np.int64))


@dataclass
class PartTables:
    """What every launch of one part shares, on the device: each slot's layer address
    (int64 [slots]) and salt (as int64 bits), and the page's word count."""

    layer_ptrs: torch.Tensor
    salts: torch.Tensor
    words: int


class DeviceTables:
    """The device-side tables of one pool: per part `PartTables`, and the multipliers
    (as int64 bits) for the largest page. Made once (small H2D copies at start-up).

    `max_programs`: at most this many programs a launch, and at least one a slot
    (None: one a page and slot)."""

    def __init__(
        self, layout: KVLayout, layer_ptr: Any, device: torch.device, max_programs: int | None = None
    ) -> None:
        if max_programs is not None and max_programs < 1:
            raise ValueError(f"max_programs must be >= 1 or None, got {max_programs}")
        self.device = device
        self.max_programs = max_programs
        words = max(p.page_bytes for p in layout.parts) // 8
        a, b = checksum.multipliers(words)
        self.mult_a = _int64(a).to(device)
        self.mult_b = _int64(b).to(device)
        self.parts: dict[Part, PartTables] = {}
        for p in layout.parts:
            ptrs = np.array([layer_ptr(p.part, slot) for slot in range(p.num_slots)], dtype=np.int64)
            salts = checksum.salts(p.part, p.layer_ids, p.page_bytes)
            self.parts[p.part] = PartTables(torch.from_numpy(ptrs).to(device), _int64(salts).to(device), p.page_bytes // 8)


def max_programs(device: torch.device) -> int | None:
    """The engines' `DeviceTables.max_programs` on `device` (`PROGRAMS_PER_SM`)."""
    if PROGRAMS_PER_SM is None:
        return None
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def launch(
    tables: DeviceTables, part: Part, slot0: int, slots: int, pages: torch.Tensor, out_base: int, out_row: int,
    out_index: torch.Tensor, stream: torch.cuda.Stream,
) -> None:
    """Enqueue the checksums of `pages` x slots [slot0, slot0 + slots) of `part` on `stream`
    (see the module docstring). No host sync; `pages` and `out_index` must stay alive
    until the kernel ran (the caller keeps them)."""
    n = int(pages.shape[0])
    if not n or not slots:
        return
    t = tables.parts[part]
    programs = n if tables.max_programs is None else min(n, max(1, tables.max_programs // slots))
    with torch.cuda.stream(stream):
        _kernel()[(programs, slots)](t.layer_ptrs, slot0, pages, n, out_base, out_row, out_index, tables.mult_a,
                                     tables.mult_b, t.salts, t.words, BLOCK=BLOCK)  # fmt: skip


def device_checksums(pool: Any, part: Part, layer: int, physical: np.ndarray) -> np.ndarray:
    """The checksums of one layer of physical pages of a device pool (`DevicePool`):
    numpy on a host-memory pool, the kernel on CUDA (then it synchronises: a
    control path, such as a PD send's "done"). uint64 [len(physical)]."""
    slot = pool.layout.part(part).slot(layer)
    physical = np.asarray(physical, dtype=np.int64)
    if not pool.is_cuda:
        return checksum.checksums(pool.layer_view(part, slot)[physical], part, layer)
    tables = _tables(pool)
    out = torch.empty(len(physical), dtype=torch.int64, device=pool.device)
    stream = torch.cuda.current_stream(pool.device)
    index = torch.arange(len(physical), dtype=torch.int64, device=pool.device)
    pages = torch.from_numpy(physical).to(pool.device)
    launch(tables, part, slot, 1, pages, out.data_ptr(), 0, index, stream)
    return out.cpu().numpy().view(np.uint64)


_TABLES: weakref.WeakKeyDictionary[Any, DeviceTables] = weakref.WeakKeyDictionary()


def _tables(pool: Any) -> DeviceTables:
    """The pool's `DeviceTables`, made on first use and dropped with the pool."""
    t = _TABLES.get(pool)
    if t is None:
        t = _TABLES[pool] = DeviceTables(pool.layout, pool.layer_ptr, pool.device)
    return t
