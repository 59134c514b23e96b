"""The page gather/scatter kernel, compiled at run time with NVRTC.

One kernel copies `n` pages of one layer from `src` to `dst`, page `k`
going from byte `src_pages[k] * page_bytes` to `dst_pages[k] * page_bytes`.
Either side may be device memory or pinned, mapped host memory (through its
device address), so the same kernel serves backups (device -> host: the SMs
write straight into pinned host pages over PCIe) and loads (host -> device).

Shape of the work: the `n * page_bytes / width` vector elements form one
flat index space walked by a grid-stride loop, so a warp's 32 lanes touch 32
consecutive vectors of one page (coalesced 512-byte bursts at 16-byte width)
and every CTA gets the same share however many pages there are. Each thread
issues `UNROLL` independent loads before its first store: PCIe reads are
slow (about a microsecond), and only many requests in flight fill the link.
The grid is capped (a fraction of the SMs, see `hicache_cp.io.cuda`), so
compute running beside a copy keeps most of the GPU.

Page lists reach the kernel one of two ways:
* up to `INLINE_PAGES` pages: by value, inside the kernel's parameters
  (`__grid_constant__`, read from the constant bank). No index copy at all,
  which matters for small per-layer copies where a separate index DMA would
  cost as much as the copy.
* more pages: a device int64 array `[src_pages..., dst_pages...]`.

Kernels are compiled once per process and device (`load_kernels`), for the
device's own architecture (`sm_XY`, CUBIN, so the driver never JIT-compiles
PTX). Every NVRTC/driver error goes through `_check` into `KernelError`.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Largest page count passed by value: 2 * 240 * 8 = 3840 bytes of page ids,
#: under the 4 KiB kernel-parameter limit every CUDA version accepts.
INLINE_PAGES = 240
#: Threads per CTA: 16 warps; enough resident loads per SM without
#: needing many CTAs (the grid is kept small on purpose).
THREADS = 512
#: Independent loads per thread before the first store.
UNROLL = 4
#: Vector widths in bytes, widest first; the widest dividing page_bytes wins.
WIDTHS = (16, 8, 4, 1)
_VTYPE = {16: "uint4", 8: "uint2", 4: "unsigned int", 1: "unsigned char"}

_SOURCE_HEAD = r"""
typedef unsigned long long u64;
#define INLINE_PAGES %(inline)d
#define UNROLL %(unroll)d

struct InlinePages { long long p[2 * INLINE_PAGES]; };

// Copy n pages; sp/dp are the source/destination page ids. Offsets are in
// units of V. The host guarantees total + UNROLL * stride < 2^32.
template <typename V>
__device__ __forceinline__ void copy_pages(const V* __restrict__ s, V* __restrict__ d,
                                           const long long* sp, const long long* dp,
                                           unsigned int n, unsigned int vpp) {
  const unsigned int total = n * vpp;
  const unsigned int stride = gridDim.x * blockDim.x;
  unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < total; i += UNROLL * stride) {
    V v[UNROLL];
    u64 o[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const unsigned int j = i + u * stride;
      const unsigned int p = j / vpp;
      const unsigned int r = j - p * vpp;
      v[u] = s[(u64)sp[p] * vpp + r];
      o[u] = (u64)dp[p] * vpp + r;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) d[o[u]] = v[u];
  }
  for (; i < total; i += stride) {
    const unsigned int p = i / vpp;
    const unsigned int r = i - p * vpp;
    d[(u64)dp[p] * vpp + r] = s[(u64)sp[p] * vpp + r];
  }
}
"""

_SOURCE_KERNELS = r"""
extern "C" __global__ void __launch_bounds__(%(threads)d)
page_copy_ptr_w%(w)d(const %(v)s* __restrict__ s, %(v)s* __restrict__ d,
                     const long long* __restrict__ pages, unsigned int n, unsigned int vpp) {
  copy_pages<%(v)s>(s, d, pages, pages + n, n, vpp);
}
extern "C" __global__ void __launch_bounds__(%(threads)d)
page_copy_inline_w%(w)d(const %(v)s* __restrict__ s, %(v)s* __restrict__ d,
                        const __grid_constant__ InlinePages pages, unsigned int n, unsigned int vpp) {
  copy_pages<%(v)s>(s, d, pages.p, pages.p + n, n, vpp);
}
"""


class KernelError(RuntimeError):
    """NVRTC compilation, module loading or a kernel launch failed."""


def source() -> str:
    """The CUDA C++ source of every kernel variant (pure function)."""
    parts = [_SOURCE_HEAD % {"inline": INLINE_PAGES, "unroll": UNROLL}]
    for w in WIDTHS:
        parts.append(_SOURCE_KERNELS % {"threads": THREADS, "w": w, "v": _VTYPE[w]})
    return "".join(parts)


def vector_width(page_bytes: int) -> int:
    """The widest access width (bytes) that divides `page_bytes`."""
    return next(w for w in WIDTHS if page_bytes % w == 0)


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
    """Loaded kernels of one device: `launch` them on any stream of it."""

    device_index: int
    context: Any
    module: Any
    functions: dict[tuple[str, int], Any]
    num_sms: int

    def launch(
        self, inline: bool, width: int, grid: int, stream_handle: int, src: int, dst: int,
        pages: np.ndarray | int, n: int, vpp: int,
    ) -> None:
        """Enqueue one copy on `stream_handle`; returns at once.

        `pages` is the int64 array `[src..., dst...]` (inline, length <= 2 *
        INLINE_PAGES) or the device address of such an array. Raises
        KernelError when the launch is refused; kernel faults surface later
        through the stream's event.
        """
        from cuda.bindings import driver

        fn = self.functions[("inline" if inline else "ptr", width)]
        if inline:
            page_arg = np.zeros(2 * INLINE_PAGES, dtype=np.int64)
            page_arg[: len(pages)] = pages
        else:
            page_arg = np.array([pages], dtype=np.uint64)
        args = [
            np.array([src], dtype=np.uint64),
            np.array([dst], dtype=np.uint64),
            page_arg,
            np.array([n], dtype=np.uint32),
            np.array([vpp], dtype=np.uint32),
        ]
        # The driver copies parameter values at launch, so these arrays may die after the call.
        ptrs = np.array([a.ctypes.data for a in args], dtype=np.uint64)
        _check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        _check(
            driver.cuLaunchKernel(
                fn, grid, 1, 1, THREADS, 1, 1, 0, driver.CUstream(stream_handle), ptrs.ctypes.data, 0
            ),
            "cuLaunchKernel(page copy)",
        )


_LOCK = threading.Lock()


@functools.cache
def _compile(arch: str) -> bytes:
    """NVRTC-compile every variant for `arch` (e.g. "sm_90") into a CUBIN."""
    from cuda.bindings import nvrtc

    src = source().encode()
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
    logger.debug("compiled page-copy kernels for %s (%d bytes of CUBIN)", arch, len(cubin))
    return cubin


_LOADED: dict[int, CopyKernels] = {}


def load_kernels(device_index: int) -> CopyKernels:
    """Compile (once per process and architecture) and load the kernels on a device.

    Loads into the device's primary context, the one torch uses. Cached per
    device; thread-safe. Raises KernelError (or ImportError without
    cuda-python) with the NVRTC log when compilation fails.
    """
    with _LOCK:
        cached = _LOADED.get(device_index)
        if cached is not None:
            return cached
        import torch
        from cuda.bindings import driver

        major, minor = torch.cuda.get_device_capability(device_index)
        cubin = _compile(f"sm_{major}{minor}")
        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        functions = {}
        for kind in ("ptr", "inline"):
            for w in WIDTHS:
                name = f"page_copy_{kind}_w{w}".encode()
                functions[(kind, w)] = _check(driver.cuModuleGetFunction(module, name), f"cuModuleGetFunction({name!r})")
        num_sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        kernels = CopyKernels(device_index, ctx, module, functions, num_sms)
        _LOADED[device_index] = kernels
        logger.debug("page-copy kernels loaded on cuda:%d (sm_%d%d, %d SMs)", device_index, major, minor, num_sms)
        return kernels
