"""SM-kernel copy engines `kernel` and `hybrid`: benchmark variants, not product settings.

The SMs (or their bulk-copy units) read and write pinned host pages through
their mapped device address: one launch per layer and part whatever the page
pattern, at the price of SMs taken from the forward while the copy runs.
`hybrid` sends copies of few runs to the DMA engines instead. They follow the
contract of `hicache_cp.io.cuda` but are not in the built-in registry: the
benchmarks register them (`hicache_harness.bench.io_variants`) to measure
them beside the `direct` default (docs/design/copy-engines.md has why they lost).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache_cp.io import kernels
from hicache_cp.io.base import CopyPlan, Direction
from hicache_cp.io.cuda import CudaCopyEngine, PartInfo
from hicache_cp.io.runs import plan_runs, run_starts
from hicache_cp.pools import DevicePool, HostPool

#: Default share of the SMs the copy kernel may occupy (compute keeps the rest).
DEFAULT_SM_FRACTION = 0.25
#: Runs at most of a copy the hybrid backend sends to the DMA engines (each costs
#: driver time on the caller's thread, so the bound keeps the submit cost bounded).
HYBRID_DMA_RUNS = 16
_D2H = Direction.D2H


class KernelCopyEngine(CudaCopyEngine):
    """Gather/scatter kernel writing/reading pinned host pages through their device address.

    Options: `sm_fraction` caps the grid at that share of the SMs (at least
    one CTA); `mode` picks how the kernel moves bytes (`kernels.MODES`:
    "simt", "l2hint", "tma"); `unroll` and `tail` shape the simt kernels
    (loads in flight per thread, `kernels.TAILS`); `dma_runs` sends a
    copy that coalesces into at most that many runs (consecutive on both
    sides, in the given order) to the DMA engines instead (0: never). Page
    ids go inside the launch parameters (`kernels.PageCopyLauncher`).
    """

    name = "kernel"

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        sm_fraction: float = DEFAULT_SM_FRACTION,
        mode: str = "simt",
        dma_runs: int = 0,
        unroll: int = kernels.UNROLL,
        tail: str = kernels.TAIL,
    ) -> None:
        kernels.check_shape(unroll, tail)
        super().__init__(device_pool, host_pool)
        if not 0.0 < sm_fraction <= 1.0:
            raise ValueError(f"sm_fraction must be in (0, 1], got {sm_fraction}")
        if dma_runs < 0:
            raise ValueError(f"dma_runs must be >= 0, got {dma_runs}")
        self.unroll, self.tail = unroll, tail
        self.kernels = kernels.load_kernels(self.device_index, unroll, tail)
        self.max_ctas = max(1, int(self.kernels.num_sms * sm_fraction))
        self.mode = mode
        self.dma_runs = dma_runs
        self._launchers = (kernels.PageCopyLauncher(self.device, mode), kernels.PageCopyLauncher(self.device, mode))
        #: Copies sent to the kernel / to the DMA engines (dma_runs), for benchmarks.
        self.counts = {"kernel": 0, "dma": 0}

    def _enqueue(self, d2h, info, slot, device_pages, host_pages, stream, keep) -> None:  # type: ignore[no-untyped-def]
        if self.dma_runs:
            starts = run_starts(device_pages, host_pages, self.dma_runs)
            if starts is not None:
                self.counts["dma"] += 1
                self._dma_few(d2h, info, slot, device_pages, host_pages, starts, stream)
                return
        self._launch_kernel(d2h, info, slot, device_pages, host_pages, stream)

    def _launch_kernel(
        self, d2h: bool, info: PartInfo, slot: int, device_pages: np.ndarray, host_pages: np.ndarray, stream: int
    ) -> None:
        self.counts["kernel"] += 1
        dev_ptr, host_ptr = info.device_layers[slot], info.host_base + info.host_layer(slot)
        if d2h:
            src, dst, src_pages, dst_pages = dev_ptr, host_ptr, device_pages, host_pages
        else:
            src, dst, src_pages, dst_pages = host_ptr, dev_ptr, host_pages, device_pages
        self.kernels.launch(self._launchers[0 if d2h else 1], stream, self.max_ctas, src, dst, src_pages, dst_pages, info.page_bytes)

    def _prepare_backend(self, plan: CopyPlan) -> None:
        """A copy of at most `dma_runs` runs goes to the DMA engines: tabulate its descriptors."""
        if self.dma_runs and run_starts(plan.device_pages, plan.host_pages, self.dma_runs) is not None:
            plan.prepared = self.descriptor_table(plan)

    def _enqueue_layer(self, plan, parts, infos, layer, stream, keep) -> None:  # type: ignore[no-untyped-def]
        table = plan.prepared
        if table is None:  # not few runs (decided once, in the plan): the kernel
            d2h = plan.direction is _D2H
            for info in infos:
                self._launch_kernel(d2h, info, info.slots[layer], plan.device_pages, plan.host_pages, stream)
            return
        self.counts["dma"] += len(parts)
        self._issuer.issue_table_row(table.get(parts, layer), stream)

    def _dma_few(
        self, d2h: bool, info: PartInfo, slot: int, device_pages: np.ndarray, host_pages: np.ndarray, starts: list[int], stream: int
    ) -> None:
        """The DMAs of a copy of few runs (`runs.plan_runs`): one cuMemcpyAsync, or one batch."""
        devs, hosts, sizes = plan_runs(
            device_pages, host_pages, starts, info.page_bytes, info.device_layers[slot], info.host_base,
            info.host_layer(slot), info.arena.register_chunk_bytes,
        )
        if len(sizes) == 1:
            src, dst = (devs[0], hosts[0]) if d2h else (hosts[0], devs[0])
            self._drv.memcpy_async(dst, src, sizes[0], stream)
            return
        u64 = np.uint64
        self._issuer.issue(d2h, np.array(devs, dtype=u64), np.array(hosts, dtype=u64), np.array(sizes, dtype=u64), stream)


class HybridCopyEngine(KernelCopyEngine):
    """The kernel backend that sends copies of few runs to the DMA engines.

    A copy that coalesces into at most `dma_runs` runs (consecutive on both
    sides) is one DMA per run: no SMs taken from the forward, O(runs) driver
    time on the caller's thread. Any other copy is one
    kernel launch (two past `kernels.LARGE_PAGES` pages), whatever the
    pattern: the caller's host time stays bounded by the run threshold.
    """

    name = "hybrid"

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        dma_runs: int = HYBRID_DMA_RUNS,
        **options: Any,
    ) -> None:
        """`options`: the kernel backend's (grid cap, mode, kernel shape)."""
        super().__init__(device_pool, host_pool, dma_runs=dma_runs, **options)
