"""The CUDA driver calls of the copy engines' hot path, through ctypes.

Why not cuda-python here: its wrappers convert every argument into a Python
object, and `cuMemcpyBatchAsync` takes Python lists that it converts element
by element (milliseconds for thousands of copies). These bindings take plain
integers and the addresses of numpy arrays, cost about a microsecond a call,
and release the GIL while the driver works (ctypes `CFUNCTYPE`).

Every entry point is looked up once with `cuGetProcAddress` for the ABI of
the running driver (CUDA 13 changed `cuMemcpyBatchAsync`; several calls have
`_v2` variants), and every `CUresult` is converted here, once, into
`DriverError` naming the call (docs/contributing.md, conventions).

Handles (streams, events, contexts, functions) and device pointers are plain
`int`s; torch's `Stream.cuda_stream` is a valid `CUstream`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p
from typing import Any

import numpy as np

#: cuEventCreate flag: no timing data (cheaper record and query).
EVENT_DISABLE_TIMING = 0x2
#: CUmemcpySrcAccessOrder: the source is read in stream order.
SRC_ACCESS_ORDER_STREAM = 0x1
#: CUmemcpyFlags: a hint to overlap the copy with compute on the SMs.
MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1
#: sizeof(CUmemcpyAttributes): srcAccessOrder, two CUmemLocation, flags.
MEMCPY_ATTRIBUTES_BYTES = 24

_SUCCESS = 0
_NOT_READY = 600  # CUDA_ERROR_NOT_READY


class DriverError(RuntimeError):
    """A CUDA driver call failed; `code` is the CUresult, `call` its name."""

    def __init__(self, call: str, code: int, name: str) -> None:
        self.call = call
        self.code = code
        super().__init__(f"{call} failed: {name} ({code})")


_CUresult = c_int
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuCtxGetCurrent": (POINTER(c_void_p),),
    "cuCtxSetCurrent": (c_void_p,),
    "cuDeviceGet": (POINTER(c_int), c_int),
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),
    "cuEventCreate": (POINTER(c_void_p), c_uint),
    "cuEventDestroy": (c_void_p,),
    "cuEventRecord": (c_void_p, c_void_p),
    "cuEventQuery": (c_void_p,),
    "cuEventSynchronize": (c_void_p,),
    "cuStreamWaitEvent": (c_void_p, c_void_p, c_uint),
    "cuMemcpyAsync": (c_uint64, c_uint64, c_size_t, c_void_p),
    "cuLaunchKernel": (c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, c_void_p, c_void_p),
    "cuFuncSetAttribute": (c_void_p, c_int, c_int),
}
#: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, [failIdx,] stream): CUDA 13 dropped failIdx.
_BATCH_13 = (c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_size_t, c_void_p)
_BATCH_12 = (c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p)


class Driver:
    """The driver entry points the copy engines use; one per process (`driver()`).

    Methods raise `DriverError`; none blocks except `event_synchronize`.
    """

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        get_proc = lib.cuGetProcAddress_v2
        get_proc.restype = _CUresult
        get_proc.argtypes = (c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int))
        version = c_int(0)
        lib.cuDriverGetVersion.restype = _CUresult
        lib.cuDriverGetVersion.argtypes = (POINTER(c_int),)
        _check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.version = int(version.value)
        err_name = lib.cuGetErrorName
        err_name.restype = _CUresult
        err_name.argtypes = (c_int, POINTER(c_char_p))
        self._err_name = err_name

        def proc(name: str, argtypes: tuple[Any, ...], cuda_version: int) -> Any:
            pfn, status = c_void_p(), c_int(0)
            code = get_proc(name.encode(), ctypes.byref(pfn), cuda_version, 0, ctypes.byref(status))
            if code != _SUCCESS or not pfn.value:
                return None
            return ctypes.CFUNCTYPE(_CUresult, *argtypes)(pfn.value)  # CFUNCTYPE releases the GIL

        api = min(self.version, 13000)
        self._fn: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            fn = proc(name, argtypes, api)
            if fn is None:
                raise DriverError(f"cuGetProcAddress({name})", -1, "symbol not found")
            self._fn[name] = fn
        # Batched copies: CUDA 12.8+; the CUDA 13 ABI has no failIdx argument.
        self.batch_abi = 0
        self._batch = None
        if self.version >= 13000:
            self._batch, self.batch_abi = proc("cuMemcpyBatchAsync", _BATCH_13, 13000), 13
        elif self.version >= 12080:
            self._batch, self.batch_abi = proc("cuMemcpyBatchAsync", _BATCH_12, 12080), 12
        if self._batch is None:
            self.batch_abi = 0
        self._fail_idx = np.zeros(1, dtype=np.uint64)
        # The hot path calls these directly (one Python call less each).
        fn = self._fn
        self._record, self._wait, self._launch = fn["cuEventRecord"], fn["cuStreamWaitEvent"], fn["cuLaunchKernel"]
        self._memcpy = fn["cuMemcpyAsync"]

    # -- errors -----------------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> int:
        code = self._fn[name](*args)
        if code != _SUCCESS:
            raise self.error(name, code)
        return code

    def error(self, call: str, code: int) -> DriverError:
        text = c_char_p()
        self._err_name(code, ctypes.byref(text))
        return DriverError(call, int(code), (text.value or b"unknown").decode())

    # -- contexts -----------------------------------------------------------------------

    def primary_context(self, device_index: int) -> int:
        """The device's primary context (the one torch uses), retained."""
        dev, ctx = c_int(0), c_void_p()
        self._call("cuDeviceGet", ctypes.byref(dev), device_index)
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        return int(ctx.value or 0)

    def current_context(self) -> int:
        ctx = c_void_p()
        self._call("cuCtxGetCurrent", ctypes.byref(ctx))
        return int(ctx.value or 0)

    def set_context(self, ctx: int) -> None:
        self._call("cuCtxSetCurrent", ctx)

    # -- events and stream ordering ---------------------------------------------------------

    def event_create(self) -> int:
        ev = c_void_p()
        self._call("cuEventCreate", ctypes.byref(ev), EVENT_DISABLE_TIMING)
        return int(ev.value or 0)

    def event_destroy(self, event: int) -> None:
        self._call("cuEventDestroy", event)

    def event_record(self, event: int, stream: int) -> None:
        code = self._record(event, stream)
        if code:
            raise self.error("cuEventRecord", code)

    def event_query(self, event: int) -> bool:
        """True once the work before the last record completed; raises on a fault."""
        code = self._fn["cuEventQuery"](event)
        if code == _SUCCESS:
            return True
        if code == _NOT_READY:
            return False
        raise self.error("cuEventQuery", code)

    def event_synchronize(self, event: int) -> None:
        self._call("cuEventSynchronize", event)

    def stream_wait_event(self, stream: int, event: int) -> None:
        code = self._wait(stream, event, 0)
        if code:
            raise self.error("cuStreamWaitEvent", code)

    # -- copies and launches ------------------------------------------------------------------

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        code = self._memcpy(dst, src, nbytes, stream)
        if code:
            raise self.error("cuMemcpyAsync", code)

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def memcpy_batch_async(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, attrs: np.ndarray, attr_idx: np.ndarray, stream: int
    ) -> None:
        """One cuMemcpyBatchAsync over uint64 arrays `dsts`, `srcs`, `sizes` (C-contiguous).

        `attrs` is one CUmemcpyAttributes (`memcpy_attributes()`), applied to
        every copy (`attr_idx` = [0]). The driver reads the arrays during the
        call only.
        """
        assert self._batch is not None, "cuMemcpyBatchAsync is unavailable (driver before CUDA 12.8)"
        n = len(sizes)
        args: list[Any] = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, attrs.ctypes.data, attr_idx.ctypes.data, 1]
        if self.batch_abi == 12:
            args.append(self._fail_idx.ctypes.data)
        code = self._batch(*args, stream)
        if code != _SUCCESS:
            raise self.error(f"cuMemcpyBatchAsync({n} copies)", code)

    def memcpy_batch_ptrs(self, dsts: int, srcs: int, sizes: int, count: int, attrs: int, attr_idx: int, stream: int) -> None:
        """`memcpy_batch_async` over the addresses of the three uint64 arrays (the hot path)."""
        assert self._batch is not None, "cuMemcpyBatchAsync is unavailable (driver before CUDA 12.8)"
        if self.batch_abi == 12:
            code = self._batch(dsts, srcs, sizes, count, attrs, attr_idx, 1, self._fail_idx.ctypes.data, stream)
        else:
            code = self._batch(dsts, srcs, sizes, count, attrs, attr_idx, 1, stream)
        if code != _SUCCESS:
            raise self.error(f"cuMemcpyBatchAsync({count} copies)", code)

    def launch(self, function: int, grid: int, block: int, smem: int, stream: int, params: int) -> None:
        """cuLaunchKernel with a 1-D grid; `params` is the address of the void* array."""
        code = self._launch(function, grid, 1, 1, block, 1, 1, smem, stream, params, None)
        if code:
            raise self.error("cuLaunchKernel", code)

    def func_set_attribute(self, function: int, attribute: int, value: int) -> None:
        self._call("cuFuncSetAttribute", function, attribute, value)


class DmaIssuer:
    """Enqueues DMAs on a stream: one cuMemcpyBatchAsync per `MAX_BATCH`
    descriptors, or one cuMemcpyAsync each where the driver lacks the batch
    call (or refused it once: then for good, with a WARNING).

    Host cost: driver time linear in the descriptors, on the calling thread, so
    callers keep descriptor counts small or issue them off the hot thread (`io.issue`).
    """

    #: Descriptors per cuMemcpyBatchAsync call (bounds one call's argument arrays).
    MAX_BATCH = 16384

    def __init__(self, drv: Driver, batch: bool = True, flags: int = 0) -> None:
        self.drv = drv
        self.batch = batch and drv.has_batch
        self.flags = flags
        self._attrs = memcpy_attributes(flags)
        self._attr_idx = np.zeros(1, dtype=np.uint64)
        self._attrs_ptr, self._attr_idx_ptr = self._attrs.ctypes.data, self._attr_idx.ctypes.data

    @property
    def attrs_ptr(self) -> int:
        """Address of the one CUmemcpyAttributes every batch uses (alive as long as the issuer)."""
        return self._attrs_ptr

    @property
    def attr_idx_ptr(self) -> int:
        return self._attr_idx_ptr

    def issue_table_row(self, desc: Any, stream: int) -> None:
        """One layer of a descriptor table (`io.plans.LayerDescriptors`): one cuMemcpyAsync
        or one batch over the row's precomputed addresses. Raises DriverError."""
        n = desc.count
        if n == 1:
            self.drv.memcpy_async(int(desc.dst[0]), int(desc.src[0]), int(desc.sizes[0]), stream)
        elif self.batch and n <= self.MAX_BATCH:
            try:
                self.drv.memcpy_batch_ptrs(desc.dst_ptr, desc.src_ptr, desc.sizes_ptr, n, self._attrs_ptr, self._attr_idx_ptr, stream)
            except DriverError as exc:
                logging.getLogger(__name__).warning("cuMemcpyBatchAsync unusable (%s); using one cuMemcpyAsync per run", exc)
                self.batch = False
                self.issue_pairs(desc.dst, desc.src, desc.sizes, stream)
        else:
            self.issue_pairs(desc.dst, desc.src, desc.sizes, stream)

    def issue(self, device_to_host: bool, device: np.ndarray, host: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """`device`, `host`, `sizes`: C-contiguous uint64 arrays of equal length. Raises DriverError."""
        srcs, dsts = (device, host) if device_to_host else (host, device)
        self.issue_pairs(dsts, srcs, sizes, stream)

    def issue_pairs(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Copies `srcs[i]` -> `dsts[i]` of `sizes[i]` bytes: C-contiguous uint64 arrays. Raises DriverError."""
        n = len(sizes)
        if self.batch and n > 1:
            lo = 0
            try:
                for lo in range(0, n, self.MAX_BATCH):
                    hi = min(n, lo + self.MAX_BATCH)
                    self.drv.memcpy_batch_async(dsts[lo:hi], srcs[lo:hi], sizes[lo:hi], self._attrs, self._attr_idx, stream)
                return
            except DriverError as exc:
                if lo:  # part of the copy is enqueued: report it rather than repeat it
                    raise
                logging.getLogger(__name__).warning("cuMemcpyBatchAsync unusable (%s); using one cuMemcpyAsync per run", exc)
                self.batch = False
        for d, s, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            self.drv.memcpy_async(d, s, size, stream)


def memcpy_attributes(flags: int = 0) -> np.ndarray:
    """One CUmemcpyAttributes: sources read in stream order, no location hints,
    `flags` (`MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE` or 0)."""
    attrs = np.zeros(MEMCPY_ATTRIBUTES_BYTES, dtype=np.uint8)
    words = attrs.view(np.uint32)
    words[0] = SRC_ACCESS_ORDER_STREAM
    words[5] = flags  # after srcAccessOrder (4 B) and two CUmemLocation (8 B each)
    return attrs


def _check(code: int, what: str) -> None:
    if code != _SUCCESS:
        raise DriverError(what, int(code), "see cuda.h")


_LOCK = threading.Lock()


@functools.cache
def _load() -> Driver:
    return Driver()


def driver() -> Driver:
    """The process-wide driver bindings (loaded on first use; thread-safe)."""
    with _LOCK:
        return _load()
