"""The allocators bench-alloc compares, behind one small adapter each.

Every adapter serves the same pool of ``N`` pages and the same calls:
``reserve(n)`` returns a handle (or ``None`` on a shortfall), ``piece(handle,
lo, hi)`` cuts the part of a reservation at page positions ``[lo, hi)`` (not
timed: the caller's bookkeeping), ``free(piece)`` returns it, and
``pages(handle)`` lists the page ids of a reservation in position order (not
timed: for the checks and the run counts).

* ``ours``: :class:`hostmem.extents.ExtentAllocator` (runs in, runs out).
* ``ours_lane``: :class:`hicache_cp.pools.LanePageAllocator`, the path the
  cache calls (logical page arrays in and out, with their conversions).
* ``slot_list_lazy``: SGLang's ``HostKVCache.alloc/free`` as shipped in
  sglang 0.5.23 (``mem_cache/pool_host/base.py``): token slots, 64 a page,
  freed slots set aside and merged lazily, a per-slot used flag. The real
  code when sglang is installed (``scripts/install_sglang.sh``), else
  :class:`LazySlotList`, a re-implementation of the same algorithm,
  labelled as such.
* ``page_free_list``: the same lazy list over page ids, in numpy: the
  simplest fast design.
* ``slot_list_eager``: history: the older free path, a token-slot list
  concatenated (``torch.cat``) on every free.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import numpy as np
import torch

from hicache_cp.allocator import LanePageAllocator
from hostmem.extents import ExtentAllocator, Runs, runs_to_pages

__all__ = [
    "EagerSlotList",
    "LazySlotList",
    "PageFreeList",
    "load_sglang_host_kv_cache",
    "make_peers",
    "position_runs",
]

SGLANG_VERSION = "0.5.23"
_SGLANG_BASE = "sglang.srt.mem_cache.pool_host.base"


class OursBare:
    """``ExtentAllocator`` through ``reserve_pairs``/``free_pairs``: runs as ``(start, length)``
    tuples in and out, no page arrays (``LanePageAllocator`` calls these)."""

    label = "ExtentAllocator (hostmem/extents.py) reserve_pairs/free_pairs: best fit over free extents, runs in and out"

    def __init__(self, num_pages: int) -> None:
        self.impl = ExtentAllocator(num_pages)
        self.reserve = self.impl.reserve_pairs
        self.free = self.impl.free_pairs

    @staticmethod
    def piece(pairs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
        out, offset = [], 0
        for start, length in pairs:
            a, b = max(lo, offset), min(hi, offset + length)
            if a < b:
                out.append((start + a - offset, b - a))
            offset += length
        return out

    @staticmethod
    def pages(pairs: list[tuple[int, int]]) -> np.ndarray:
        return runs_to_pages(np.array(pairs, dtype=np.int64).reshape(-1, 2))

    @staticmethod
    def runs(pairs: list[tuple[int, int]]) -> Runs:
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def check(self) -> None:
        self.impl.check_invariants()


class OursLane:
    """``LanePageAllocator`` (cp_size lanes, logical pages); handles are page arrays."""

    def __init__(self, num_pages: int, cp_size: int) -> None:
        if num_pages % cp_size:
            raise ValueError(f"a {num_pages}-page pool does not split into {cp_size} lanes")
        self.impl = LanePageAllocator(num_pages // cp_size + 1, cp_size, name="bench")
        self.label = f"LanePageAllocator (hicache_cp/pools.py), cp_size {cp_size}: logical page arrays in and out"
        self.cp_size = cp_size
        self.free = self.impl.free

    def reserve(self, n: int) -> np.ndarray | None:
        return self.impl.alloc(n)

    @staticmethod
    def piece(pages: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return pages[lo:hi]

    @staticmethod
    def pages(pages: np.ndarray) -> np.ndarray:
        return pages - 1  # logical pages 1..N on the bench's axis 0..N-1

    def runs(self, pages: np.ndarray) -> Runs:
        """Runs of physical pages, lane by lane (each rank copies its own lane)."""
        cp = self.cp_size
        if cp == 1:
            return position_runs(pages)
        lanes = (pages - 1) % cp
        physical = (pages - 1) // cp + 1
        return np.concatenate([position_runs(physical[lanes == r]) for r in range(cp)])

    def check(self) -> None:
        self.impl.check_invariants()


def position_runs(pages: np.ndarray) -> Runs:
    """``(start, length)`` rows of consecutive ascending page ids, in the order given
    (what one copy descriptor per run would cover); not sorted or merged."""
    n = pages.shape[0]
    if n == 0:
        return np.empty((0, 2), dtype=np.int64)
    first = np.concatenate(([0], np.flatnonzero(np.diff(pages) != 1) + 1))
    return np.stack((pages[first], np.diff(np.append(first, n))), axis=1).astype(np.int64)


class PageFreeList:
    """The lazy free list over page ids, in numpy (SGLang's algorithm at page granularity).

    Reserve slices the front of the free array, merging the set-aside frees
    into it only when the front is short; a used flag per page catches double
    reserves and double frees. Reserve O(n) (the flags), free O(n), a merge
    O(free pages).
    """

    label = "lazy page free list (numpy): free array + frees set aside, merged when short; used flags"

    def __init__(self, num_pages: int) -> None:
        self.free_array = np.arange(num_pages, dtype=np.int64)
        self.released: list[np.ndarray] = []
        self.num_released = 0
        self.used = np.zeros(num_pages, dtype=bool)

    def reserve(self, n: int) -> np.ndarray | None:
        if n > self.free_array.shape[0] + self.num_released:
            return None
        if n > self.free_array.shape[0]:
            self.free_array = np.concatenate([self.free_array, *self.released])
            self.released = []
            self.num_released = 0
        selected = self.free_array[:n]
        self.free_array = self.free_array[n:]
        if self.used[selected].any():
            raise AssertionError(f"page_free_list: double reserve of {selected[self.used[selected]][:8]}")
        self.used[selected] = True
        return selected

    def free(self, pages: np.ndarray) -> None:
        if not self.used[pages].all():
            raise ValueError(f"page_free_list: double free of {pages[~self.used[pages]][:8]}")
        self.used[pages] = False
        self.released.append(pages)
        self.num_released += pages.shape[0]

    piece = staticmethod(OursLane.piece)

    @staticmethod
    def pages(pages: np.ndarray) -> np.ndarray:
        return pages

    @staticmethod
    def runs(pages: np.ndarray) -> Runs:
        return position_runs(pages)

    def check(self) -> None:
        free = np.concatenate([self.free_array, *self.released])
        assert np.unique(free).size == free.size == np.count_nonzero(~self.used), "page_free_list state"


class _TokenSlots:
    """Shared adapter code for allocators that hand out token slots, ``page_tokens`` a page."""

    page_tokens: int

    def piece(self, slots: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return slots[lo * self.page_tokens : hi * self.page_tokens]

    def pages(self, slots: torch.Tensor) -> np.ndarray:
        s = slots.numpy().reshape(-1, self.page_tokens)
        first = s[:, 0]
        if (first % self.page_tokens).any() or (s - first[:, None] != np.arange(self.page_tokens)).any():
            raise AssertionError(f"{type(self).__name__}: a reservation's token slots do not form whole pages")
        return first // self.page_tokens

    def runs(self, slots: torch.Tensor) -> Runs:
        return position_runs(self.pages(slots))


class LazySlotList(_TokenSlots):
    """Fallback re-implementation of SGLang 0.5.23 ``HostKVCache.alloc/free/clear``
    (``mem_cache/pool_host/base.py``), for when sglang cannot be imported.

    Token slots in a torch tensor; frees are set aside and concatenated only
    when an allocation needs them; a per-slot ``slot_used`` flag catches
    double allocations and frees; every call holds an ``RLock``.
    """

    label = f"re-implementation of sglang {SGLANG_VERSION} HostKVCache.alloc/free (sglang not importable)"

    def __init__(self, num_pages: int, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        self.size = num_pages * page_tokens
        self.lock = threading.RLock()
        self.free_slots = torch.arange(self.size, dtype=torch.int64)
        self.release_slots: list[torch.Tensor] = []
        self.num_release_slots = 0
        self.slot_used = torch.zeros(self.size, dtype=torch.bool)

    def available_size(self) -> int:
        return len(self.free_slots) + self.num_release_slots

    def _merge_release_slots(self) -> None:
        if self.num_release_slots == 0:
            return
        if len(self.free_slots) == 0 and len(self.release_slots) == 1:
            self.free_slots = self.release_slots[0]
        else:
            self.free_slots = torch.cat([self.free_slots, *self.release_slots])
        self.release_slots = []
        self.num_release_slots = 0

    def alloc(self, need_size: int) -> torch.Tensor | None:
        with self.lock:
            assert need_size % self.page_tokens == 0
            if need_size > self.available_size():
                return None
            if need_size > len(self.free_slots):
                self._merge_release_slots()
            select_index = self.free_slots[:need_size]
            self.free_slots = self.free_slots[need_size:]
            assert not self.slot_used[select_index].any(), "double alloc"
            self.slot_used[select_index] = True
            return select_index

    def free(self, indices: torch.Tensor) -> int:
        with self.lock:
            indices_cpu = indices.cpu()
            if indices_cpu.numel() == 0:
                return 0
            assert self.slot_used[indices_cpu].all(), "double free"
            self.slot_used[indices_cpu] = False
            self.release_slots.append(indices_cpu)
            self.num_release_slots += len(indices_cpu)
            return len(indices)


class SlotListLazy(_TokenSlots):
    """SGLang's host allocator (``HostKVCache.alloc/free``): the real one, or :class:`LazySlotList`."""

    def __init__(self, num_pages: int, page_tokens: int, host_kv_cache: type | None, label: str) -> None:
        self.label = label
        self.page_tokens = page_tokens
        if host_kv_cache is None:
            self.impl: Any = LazySlotList(num_pages, page_tokens)
        else:
            self.impl = _make_host_kv_cache(host_kv_cache, num_pages, self.page_tokens)
        self.free = self.impl.free

    def reserve(self, n: int) -> torch.Tensor | None:
        return self.impl.alloc(n * self.page_tokens)

    def check(self) -> None:
        impl = self.impl
        free = torch.cat([impl.free_slots, *impl.release_slots]) if impl.release_slots else impl.free_slots
        assert int(torch.unique(free).numel()) == int(free.numel()) == int((~impl.slot_used).sum()), "slot list state"


class EagerSlotList(_TokenSlots):
    """History: a token-slot free list concatenated on every free (SGLang's older free path)."""

    label = "history: token-slot free list, torch.cat on every free (SGLang's older HostKVCache free path)"

    def __init__(self, num_pages: int, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        self.free_slots = torch.arange(num_pages * page_tokens, dtype=torch.int64)

    def reserve(self, n: int) -> torch.Tensor | None:
        need = n * self.page_tokens
        if need > self.free_slots.numel():
            return None
        selected = self.free_slots[:need]
        self.free_slots = self.free_slots[need:]
        return selected

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots = torch.cat((self.free_slots, slots))

    def check(self) -> None:
        assert int(torch.unique(self.free_slots).numel()) == int(self.free_slots.numel()), "eager list state"


# -- SGLang as shipped ---------------------------------------------------------


def load_sglang_host_kv_cache() -> tuple[type | None, dict[str, str]]:
    """SGLang's ``HostKVCache`` class from the installed sglang, and how it was loaded.

    Returns ``(None, info)`` with the reason when sglang is missing, is not
    version 0.5.23, or its module does not import. SGLang is imported as
    installed (`hicache_harness.sglang.env.import_sglang`: where torchvision
    does not import, as beside a CPU torch, it is a stand-in while
    `sglang.srt.configs` imports).
    """
    try:
        from importlib.metadata import PackageNotFoundError, version

        installed = version("sglang")
    except PackageNotFoundError:
        return None, {"impl": "reimplementation", "reason": "sglang is not installed (scripts/install_sglang.sh)"}
    if installed != SGLANG_VERSION:
        return None, {"impl": "reimplementation", "reason": f"sglang {installed} installed, the bench pins {SGLANG_VERSION}"}
    try:
        from hicache_harness.sglang.env import import_sglang

        import_sglang()
        module = importlib.import_module(_SGLANG_BASE)
        cls = module.HostKVCache
    except Exception as exc:  # noqa: BLE001 - any import failure means: use the labelled fallback
        return None, {"impl": "reimplementation", "reason": f"importing {_SGLANG_BASE} failed: {type(exc).__name__}: {exc}"}
    return cls, {
        "impl": "sglang",
        "version": installed,
        "code": f"{_SGLANG_BASE}.HostKVCache.alloc/free as installed ({module.__file__})",
        "import_route": "sglang imported as installed; torchvision, where it does not import, is a stand-in "
        "during the import of sglang.srt.configs only (hicache_harness.sglang.env)",
    }


def _make_host_kv_cache(cls: type, num_pages: int, page_tokens: int) -> Any:
    """An instance of SGLang's ``HostKVCache`` with no KV buffer (``is_dummy``): its allocator only."""

    def not_benchmarked(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("bench-alloc uses the allocator only")

    abstract = getattr(cls, "__abstractmethods__", frozenset())
    bench_cls = type("BenchHostKVCache", (cls,), {name: not_benchmarked for name in abstract})
    return bench_cls(
        dtype=torch.uint8,
        device_capacity_tokens=page_tokens,
        size_per_token=1,
        start_layer=0,
        end_layer=1,
        host_to_device_ratio=1.0,
        host_size=0,
        page_size=page_tokens,
        layout="layer_first",
        pin_memory=False,
        device="cpu",
        is_dummy=True,
        host_token_capacity=num_pages * page_tokens,
    )


def make_peers(
    num_pages: int,
    *,
    cp_size: int,
    max_slots: int,
    page_tokens: int,
    sglang: tuple[type | None, dict[str, str]],
) -> tuple[dict[str, Any], dict[str, str]]:
    """The adapters for a pool of ``num_pages`` pages, and the reason for each one left out.

    Token-slot allocators hold ``page_tokens x num_pages`` int64 slots (and copies of
    them when they merge); they are left out above ``max_slots`` slots.
    """
    peers: dict[str, Any] = {"ours": OursBare(num_pages)}
    skipped: dict[str, str] = {}
    if num_pages % cp_size:
        skipped["ours_lane"] = f"{num_pages} pages do not split into {cp_size} lanes"
    else:
        peers["ours_lane"] = OursLane(num_pages, cp_size)
    slots = num_pages * page_tokens
    cls, info = sglang
    if slots > max_slots:
        why = f"{slots} token slots (8 B each) exceed --max-slots {max_slots}"
        skipped["slot_list_lazy"] = skipped["slot_list_eager"] = why
    else:
        label = (
            f"sglang {info['version']} HostKVCache.alloc/free as shipped"
            if cls is not None
            else LazySlotList.label + f": {info['reason']}"
        )
        peers["slot_list_lazy"] = SlotListLazy(num_pages, page_tokens, cls, label)
    peers["page_free_list"] = PageFreeList(num_pages)
    if slots <= max_slots:
        peers["slot_list_eager"] = EagerSlotList(num_pages, page_tokens)
    return peers, skipped
