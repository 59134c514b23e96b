"""The page gather/scatter kernels, compiled at run time with NVRTC.

One launch copies `n` pages of one layer from `src` to `dst`, page `k`
going from byte `src_pages[k] * page_bytes` to `dst_pages[k] * page_bytes`.
Either side may be device memory or pinned, mapped host memory (through its
device address), so the same kernels serve backups (device -> host: the SMs
write straight into pinned host pages over PCIe) and loads (host -> device).

Three ways to move the bytes (`MODES`):

* `simt`: the `n * page_bytes / width` vector elements form one flat index
  space walked by a grid-stride loop, so a warp's 32 lanes touch 32
  consecutive vectors of one page (coalesced 512-byte bursts at 16-byte
  width) and every CTA gets the same share however many pages there are.
  Each thread issues `unroll` (`UNROLL` by default) independent loads
  before its first store: PCIe reads are slow (about a microsecond), and
  only many requests in flight fill the link. The tail (`TAILS`): "loop"
  finishes the last `< unroll` strides one load at a time; "pred" runs
  every pass unrolled with predicated loads, so the tail also keeps all of
  a thread's loads in flight (a small copy is mostly tail).
* `l2hint`: the same, with 16-byte loads that ask L2 to fetch 256-byte
  blocks (`ld.global.L2::256B`), so reads of host memory may go out as
  fewer, larger PCIe requests.
* `tma`: one thread per CTA drives the bulk-copy unit (`cp.async.bulk`):
  chunks of `TMA_CHUNK` bytes go global -> shared -> global through
  `TMA_STAGES` shared buffers, with mbarrier completion for the loads and
  bulk groups for the stores. No registers hold data; a CTA needs
  `TMA_STAGES * TMA_CHUNK` bytes of shared memory and one warp. Needs
  sm_90 and pages that are a multiple of 16 bytes.

The grid is capped (a fraction of the SMs, see `hicache_cp.io.cuda`), so
compute running beside a copy keeps most of the GPU.

Page ids (int32) reach the kernels without an allocation per copy: up to
`SMALL_PAGES` or `LARGE_PAGES` pages inside the launch parameters
(`__grid_constant__`, read from the constant bank; about 2 KB and 16 KB of
parameters, CUDA 12.1+ takes up to 32 KB), more through a persistent device
array of the launcher, filled by one DMA from a pinned ring on the same
stream (the copy stream's order protects the array from the next copy; the
ring slot is reused once its DMA's event completed). So the host cost of one
copy is a numpy copy of the ids plus one launch (plus a DMA and an event
record past `LARGE_PAGES`), whatever the page count (`PageCopyLauncher`).

Kernels are compiled once per process and device (`load_kernels`), for the
device's own architecture (`sm_XY`, CUBIN, so the driver never JIT-compiles
PTX). Every NVRTC/driver error goes through `_check` into `KernelError`.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Page ids per launch carried in the small and the large parameter block.
SMALL_PAGES = 240
LARGE_PAGES = 2000
#: Pinned ring carrying the ids of copies past LARGE_PAGES to the device (per copy stream).
ID_RING_BYTES = 4 << 20
#: How the bytes move; see the module docstring.
MODES = ("simt", "l2hint", "tma")
#: Threads per CTA of the simt kernels: 16 warps, enough resident loads per SM
#: without needing many CTAs (the grid is kept small on purpose).
THREADS = 512
#: Independent loads per thread before the first store (simt kernels), by default.
UNROLL = 4
#: Tail handling of the simt kernels (see the module docstring), and the default.
TAILS = ("loop", "pred")
TAIL = "loop"
#: TMA kernels: bytes per bulk copy, and shared buffers per CTA in flight.
TMA_CHUNK = 4096
TMA_STAGES = 4
TMA_THREADS = 32
#: Vector widths in bytes, widest first; the widest dividing page_bytes wins.
WIDTHS = (16, 8, 4, 1)
_VTYPE = {16: "uint4", 8: "uint2", 4: "unsigned int", 1: "unsigned char"}
#: Bytes before the page ids in a parameter block: src, dst (u64), n, vpp (u32).
_HEADER = 24
#: Parameter capacities: 0 stands for "ids in device memory" (a pointer follows the header).
_CAPS = (SMALL_PAGES, LARGE_PAGES, 0)

_SOURCE_HEAD = r"""
typedef unsigned long long u64;
#define UNROLL %(unroll)d
#define PRED_TAIL %(pred)d
#define TMA_CHUNK %(chunk)d
#define TMA_STAGES %(stages)d

template <typename V, bool HINT> __device__ __forceinline__ V load(const V* p) { return *p; }
template <> __device__ __forceinline__ uint4 load<uint4, true>(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.L2::256B.v4.u32 {%%0, %%1, %%2, %%3}, [%%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Copy n pages; sp/dp are the source/destination page ids. Offsets are in
// units of V. The host guarantees n * vpp + UNROLL * stride < 2^32.
template <typename V, bool HINT>
__device__ __forceinline__ void copy_pages(const V* __restrict__ s, V* __restrict__ d,
                                           const int* sp, const int* dp,
                                           unsigned int n, unsigned int vpp) {
  const unsigned int total = n * vpp;
  const unsigned int stride = gridDim.x * blockDim.x;
  unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
#if PRED_TAIL
  for (; i < total; i += UNROLL * stride) {
    V v[UNROLL];
    u64 o[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const unsigned int j = i + u * stride;
      if (j < total) {
        const unsigned int p = j / vpp;
        const unsigned int r = j - p * vpp;
        v[u] = load<V, HINT>(s + ((u64)(unsigned int)sp[p] * vpp + r));
        o[u] = (u64)(unsigned int)dp[p] * vpp + r;
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (i + u * stride < total) d[o[u]] = v[u];
  }
#else
  for (; i + (UNROLL - 1) * stride < total; i += UNROLL * stride) {
    V v[UNROLL];
    u64 o[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const unsigned int j = i + u * stride;
      const unsigned int p = j / vpp;
      const unsigned int r = j - p * vpp;
      v[u] = load<V, HINT>(s + ((u64)(unsigned int)sp[p] * vpp + r));
      o[u] = (u64)(unsigned int)dp[p] * vpp + r;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) d[o[u]] = v[u];
  }
  for (; i < total; i += stride) {
    const unsigned int p = i / vpp;
    const unsigned int r = i - p * vpp;
    d[(u64)(unsigned int)dp[p] * vpp + r] = load<V, HINT>(s + ((u64)(unsigned int)sp[p] * vpp + r));
  }
#endif
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ bool mbar_try_wait(unsigned bar, unsigned phase) {
  unsigned ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%%1], %%2;\n"
               " selp.u32 %%0, 1, 0, p;\n}\n" : "=r"(ok) : "r"(bar), "r"(phase) : "memory");
  return ok != 0;
}

// Bulk-copy pages in chunks of TMA_CHUNK bytes: item = (page, chunk), CTA c
// takes items c, c + grid, ...; one thread issues, TMA_STAGES buffers in flight.
// page_bytes is a multiple of 16 (bulk copies need 16-byte sizes and addresses).
__device__ __forceinline__ void tma_pages(const unsigned char* s, unsigned char* d,
                                          const int* sp, const int* dp,
                                          unsigned int n, unsigned int page_bytes) {
  __shared__ __align__(128) unsigned char buf[TMA_STAGES][TMA_CHUNK];
  __shared__ __align__(8) unsigned long long bar[TMA_STAGES];
  if (threadIdx.x != 0) return;
  const unsigned int chunks = (page_bytes + TMA_CHUNK - 1) / TMA_CHUNK;
  const unsigned int total = n * chunks;
  for (int b = 0; b < TMA_STAGES; ++b)
    asm volatile("mbarrier.init.shared::cta.b64 [%%0], 1;" :: "r"(smem_addr(&bar[b])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  unsigned int phase = 0;  // bit b: parity to wait for on bar[b]
  // Issue the load of `item` into stage b.
  auto issue = [&](unsigned int item, int b) {
    const unsigned int p = item / chunks, c = item - p * chunks;
    const unsigned int off = c * TMA_CHUNK;
    const unsigned int size = min((unsigned int)TMA_CHUNK, page_bytes - off);
    const unsigned char* src = s + (u64)(unsigned int)sp[p] * page_bytes + off;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;"
                 :: "r"(smem_addr(&bar[b])), "r"(size) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%%0], [%%1], %%2, [%%3];"
                 :: "r"(smem_addr(buf[b])), "l"(src), "r"(size), "r"(smem_addr(&bar[b])) : "memory");
  };
  for (int b = 0; b < TMA_STAGES; ++b) {
    const unsigned int item = blockIdx.x + b * gridDim.x;
    if (item < total) issue(item, b);
  }
  int b = 0;
  for (unsigned int item = blockIdx.x; item < total; item += gridDim.x) {
    while (!mbar_try_wait(smem_addr(&bar[b]), (phase >> b) & 1u)) {}
    phase ^= 1u << b;
    const unsigned int p = item / chunks, c = item - p * chunks;
    const unsigned int off = c * TMA_CHUNK;
    const unsigned int size = min((unsigned int)TMA_CHUNK, page_bytes - off);
    unsigned char* dst = d + (u64)(unsigned int)dp[p] * page_bytes + off;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%%0], [%%1], %%2;"
                 :: "l"(dst), "r"(smem_addr(buf[b])), "r"(size) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    const unsigned int next = item + TMA_STAGES * gridDim.x;
    if (next < total) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // stage b's store has read it
      issue(next, b);
    }
    b = (b + 1 == TMA_STAGES) ? 0 : b + 1;
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

_SOURCE_BLOCK = r"""
struct Pages%(cap)d { u64 src; u64 dst; unsigned int n; unsigned int vpp; int p[2 * %(cap)d]; };
"""

_SOURCE_PTR = r"""
struct PagesPtr { u64 src; u64 dst; unsigned int n; unsigned int vpp; const int* p; };
"""

_SOURCE_SIMT = r"""
extern "C" __global__ void __launch_bounds__(%(threads)d)
page_%(mode)s_%(cap)d_w%(w)d(const __grid_constant__ %(block)s a) {
  copy_pages<%(v)s, %(hint)s>(reinterpret_cast<const %(v)s*>(a.src), reinterpret_cast<%(v)s*>(a.dst),
                              a.p, a.p + %(dst)s, a.n, a.vpp);
}
"""

_SOURCE_TMA = r"""
extern "C" __global__ void __launch_bounds__(%(threads)d)
page_tma_%(cap)d(const __grid_constant__ %(block)s a) {
  tma_pages(reinterpret_cast<const unsigned char*>(a.src), reinterpret_cast<unsigned char*>(a.dst),
            a.p, a.p + %(dst)s, a.n, a.vpp);
}
"""


class KernelError(RuntimeError):
    """NVRTC compilation, module loading or a kernel launch failed."""


def _block(cap: int) -> tuple[str, str]:
    """(struct name, offset expression of the destination ids) of a parameter capacity."""
    return ("PagesPtr", "a.n") if cap == 0 else (f"Pages{cap}", str(cap))


def kernel_name(mode: str, cap: int, width: int) -> str:
    return f"page_tma_{cap}" if mode == "tma" else f"page_{mode}_{cap}_w{width}"


def check_shape(unroll: int, tail: str) -> None:
    """Raise ValueError unless (`unroll`, `tail`) shapes a simt kernel we compile."""
    if not 1 <= unroll <= 32:
        raise ValueError(f"unroll must be in [1, 32], got {unroll}")
    if tail not in TAILS:
        raise ValueError(f"unknown kernel tail {tail!r}; tails: {', '.join(TAILS)}")


def source(arch_major: int = 9, unroll: int = UNROLL, tail: str = TAIL) -> str:
    """The CUDA C++ source of every kernel variant (pure function); TMA kernels from sm_90.

    `unroll` and `tail` shape the simt/l2hint kernels (module docstring)."""
    check_shape(unroll, tail)
    head = {"unroll": unroll, "pred": int(tail == "pred"), "chunk": TMA_CHUNK, "stages": TMA_STAGES}
    parts = [_SOURCE_HEAD % head]
    if arch_major < 9:  # no bulk copies: drop the TMA helper
        parts = [parts[0][: parts[0].index("__device__ __forceinline__ unsigned smem_addr")]]
    parts.append(_SOURCE_PTR)
    for cap in _CAPS:
        block, dst = _block(cap)
        if cap:
            parts.append(_SOURCE_BLOCK % {"cap": cap})
        for mode in ("simt", "l2hint"):
            for w in WIDTHS if mode == "simt" else (16,):
                parts.append(_SOURCE_SIMT % {
                    "threads": THREADS, "mode": mode, "cap": cap, "w": w, "v": _VTYPE[w], "block": block, "dst": dst,
                    "hint": "true" if mode == "l2hint" else "false",
                })
        if arch_major >= 9:
            parts.append(_SOURCE_TMA % {"threads": TMA_THREADS, "cap": cap, "block": block, "dst": dst})
    return "".join(parts)


def vector_width(page_bytes: int) -> int:
    """The widest access width (bytes) that divides `page_bytes`."""
    return next(w for w in WIDTHS if page_bytes % w == 0)


def block_bytes(cap: int) -> int:
    """Size of the parameter block of the `cap`-page kernels (matches the C struct)."""
    return _HEADER + (8 if cap == 0 else 8 * cap)


def _check(result: Any, what: str) -> Any:
    """Convert an NVRTC or driver `(err, *values)` tuple; raise KernelError."""
    if not isinstance(result, tuple):
        result = (result,)
    err, *values = result
    if int(err) != 0:
        raise KernelError(f"{what} failed: {getattr(err, 'name', err)} ({int(err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass
class CopyKernels:
    """Loaded kernels of one device; `launch` them through a `PageCopyLauncher`."""

    device_index: int
    context: int
    module: Any
    functions: dict[str, int]  # kernel name -> CUfunction handle
    num_sms: int
    has_tma: bool
    unroll: int = UNROLL
    tail: str = TAIL

    def launch(self, launcher: PageCopyLauncher, stream: int, grid: int, src: int, dst: int,
               src_pages: np.ndarray, dst_pages: np.ndarray, page_bytes: int) -> None:
        """Enqueue the copy of `len(src_pages)` pages on `stream`; returns at once.

        Raises KernelError/DriverError when a launch is refused; kernel faults
        surface later through the stream's events.
        """
        launcher.launch(self, stream, grid, src, dst, src_pages, dst_pages, page_bytes)


class PageCopyLauncher:
    """Persistent parameter blocks and device id array of one copy stream.

    Not thread-safe: one launcher per stream, used from one thread at a time.
    The driver copies parameter values at launch, so a block is reused by the
    next launch at once; the device id array is reused in the stream's order.
    """

    def __init__(self, device: Any, mode: str = "simt") -> None:
        from hicache_cp.io.cudadrv import driver

        if mode not in MODES:
            raise ValueError(f"unknown kernel mode {mode!r}; modes: {', '.join(MODES)}")
        self.mode = mode
        self._device = device
        self._drv = driver()
        self._blocks: dict[int, tuple[np.ndarray, ...]] = {}
        for cap in _CAPS:
            raw = np.zeros(block_bytes(cap), dtype=np.uint8)
            head = raw[:_HEADER].view(np.uint64)  # src, dst, (n | unit << 32)
            ids = raw[_HEADER:].view(np.int64 if cap == 0 else np.int32)
            params = np.array([raw.ctypes.data], dtype=np.uint64)  # void* kernelParams[1]
            self._blocks[cap] = (raw, head, params, ids)
        self._param_ptr = {cap: int(block[2].ctypes.data) for cap, block in self._blocks.items()}
        self._plans: dict[tuple[int, int], tuple[int, int, int, dict[int, int]]] = {}
        self._dev_ids: Any = None  # torch int32 tensor on the device: the ids of the copy past LARGE_PAGES
        self._ring: Any = None  # pinned torch int32 tensor: ids on their way to _dev_ids
        self._ring_view = np.zeros(0, dtype=np.int32)
        self._head = 0
        self._pending: collections.deque[tuple[int, int, int]] = collections.deque()  # (lo, hi, event) of ring slots
        self._events: list[int] = []
        self._old: list[Any] = []  # outgrown buffers: kept (queued work may still use them)

    def mode_for(self, page_bytes: int, kernels: CopyKernels) -> str:
        """The mode that runs for a page size (tma and l2hint need 16-byte multiples)."""
        if page_bytes % 16:
            return "simt"
        if self.mode == "tma" and not kernels.has_tma:
            return "simt"
        return self.mode

    def _plan(self, kernels: CopyKernels, page_bytes: int) -> tuple[int, int, int, dict[int, int]]:
        """(threads, unit, elements per CTA pass, {capacity: function}) for a page size; cached."""
        key = (page_bytes, kernels.unroll)
        plan = self._plans.get(key)
        if plan is None:
            mode = self.mode_for(page_bytes, kernels)
            if mode == "tma":  # unit: the page size in bytes; one item per TMA_CHUNK of a page
                threads, unit, per_cta, width = TMA_THREADS, page_bytes, 1, 16
            else:  # unit: vectors per page
                width = 16 if mode == "l2hint" else vector_width(page_bytes)
                threads, unit, per_cta = THREADS, page_bytes // width, THREADS * kernels.unroll
            plan = (threads, unit, per_cta, {cap: kernels.functions[kernel_name(mode, cap, width)] for cap in _CAPS})
            self._plans[key] = plan
        return plan

    def launch(self, kernels: CopyKernels, stream: int, grid_cap: int, src: int, dst: int,
               src_pages: np.ndarray, dst_pages: np.ndarray, page_bytes: int) -> None:
        n = len(src_pages)
        threads, unit, per_cta, functions = self._plan(kernels, page_bytes)
        if threads == TMA_THREADS:
            items = n * -(-page_bytes // TMA_CHUNK)
        else:
            items = n * unit
            if items >= 1 << 31:  # 32-bit flat indices in the simt kernels
                raise ValueError(f"{n} pages of {page_bytes} B exceed one launch's 2^31 vectors")
        grid = min(grid_cap, -(-items // per_cta)) or 1
        if n <= LARGE_PAGES:
            cap = SMALL_PAGES if n <= SMALL_PAGES else LARGE_PAGES
            head, ids = self._blocks[cap][1], self._blocks[cap][3]
            ids[:n] = src_pages
            ids[cap : cap + n] = dst_pages
        else:
            cap = 0
            head, ids = self._blocks[0][1], self._blocks[0][3]
            ids[0] = self._stage_ids(src_pages, dst_pages, stream)
        head[:] = (src, dst, n | (unit << 32))  # src, dst, then the u32 pair (n, unit), little-endian
        self._drv.launch(functions[cap], grid, threads, 0, stream, self._param_ptr[cap])

    def _stage_ids(self, src_pages: np.ndarray, dst_pages: np.ndarray, stream: int) -> int:
        """Copy [src ids, dst ids] into the device array on `stream`; returns its address.

        The ids go through a pinned ring (`ID_RING_BYTES`): one DMA from a
        ring slot on the copy stream, then the slot waits for that DMA's event
        before the ring comes round to it again. The caller blocks only when
        more than a ring's worth of ids is queued behind unfinished copies.
        """
        import torch

        n = len(src_pages)
        need = 2 * n
        if self._dev_ids is None or self._dev_ids.numel() < need:
            if self._dev_ids is not None:
                self._old.append(self._dev_ids)  # a queued kernel may still read it
            self._dev_ids = torch.empty(need + need // 2, dtype=torch.int32, device=self._device)
        if self._ring is None or len(self._ring_view) < need:
            self._drain_ring()
            size = max(ID_RING_BYTES // 4, 2 * need)
            if self._ring is not None:
                self._old.append(self._ring)
            self._ring = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._ring_view = self._ring.numpy()
            self._head = 0
        if self._head + need > len(self._ring_view):  # wrap: slots past the head are the oldest
            while self._pending and self._pending[0][0] >= self._head:
                self._retire()
            self._head = 0
        lo, hi = self._head, self._head + need
        while self._pending and self._pending[0][0] < hi and self._pending[0][1] > lo:
            self._retire()
        view = self._ring_view
        view[lo : lo + n] = src_pages
        view[lo + n : hi] = dst_pages
        dev = int(self._dev_ids.data_ptr())
        self._drv.memcpy_async(dev, int(self._ring.data_ptr()) + 4 * lo, 4 * need, stream)
        event = self._events.pop() if self._events else self._drv.event_create()
        self._drv.event_record(event, stream)
        self._pending.append((lo, hi, event))
        self._head = hi
        return dev

    def _retire(self) -> None:
        """Free the oldest ring slot: its DMA is done (long ago, unless the ring is full of queued copies)."""
        _, _, event = self._pending.popleft()
        self._drv.event_synchronize(event)
        self._events.append(event)

    def _drain_ring(self) -> None:
        while self._pending:
            self._retire()


_LOCK = threading.Lock()


@functools.cache
def _compile(arch: str, unroll: int = UNROLL, tail: str = TAIL) -> bytes:
    """NVRTC-compile every variant for `arch` (e.g. "sm_90") into a CUBIN."""
    from cuda.bindings import nvrtc

    src = source(int(arch[3:-1]), unroll, tail).encode()
    prog = _check(nvrtc.nvrtcCreateProgram(src, b"hicache_page_copy.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    try:
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err[0]) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise KernelError(f"NVRTC compilation for {arch} failed:\n{log.decode(errors='replace')}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    logger.debug("compiled page-copy kernels for %s, unroll %d, tail %s (%d bytes of CUBIN)", arch, unroll, tail, len(cubin))
    return cubin


_LOADED: dict[tuple[int, int, str], CopyKernels] = {}


def load_kernels(device_index: int, unroll: int = UNROLL, tail: str = TAIL) -> CopyKernels:
    """Compile (once per process, architecture and shape) and load the kernels on a device.

    Loads into the device's primary context, the one torch uses. Cached per
    device and shape (`unroll`, `tail`); thread-safe. Raises ValueError for
    a bad shape, KernelError (or ImportError without cuda-python) with the
    NVRTC log when compilation fails.
    """
    check_shape(unroll, tail)
    with _LOCK:
        cached = _LOADED.get((device_index, unroll, tail))
        if cached is not None:
            return cached
        import torch
        from cuda.bindings import driver

        major, minor = torch.cuda.get_device_capability(device_index)
        cubin = _compile(f"sm_{major}{minor}", unroll, tail)
        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        previous = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        try:
            module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            functions = {}
            for cap in _CAPS:
                names = [kernel_name("simt", cap, w) for w in WIDTHS] + [kernel_name("l2hint", cap, 16)]
                if major >= 9:
                    names.append(kernel_name("tma", cap, 16))
                for name in names:
                    fn = _check(driver.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
                    functions[name] = int(fn)
        finally:
            if int(previous) and int(previous) != int(ctx):
                driver.cuCtxSetCurrent(previous)
        num_sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        kernels = CopyKernels(device_index, int(ctx), module, functions, num_sms, major >= 9, unroll, tail)
        _LOADED[(device_index, unroll, tail)] = kernels
        logger.debug("page-copy kernels loaded on cuda:%d (sm_%d%d, %d SMs)", device_index, major, minor, num_sms)
        return kernels
