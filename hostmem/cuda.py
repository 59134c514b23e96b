"""The one adapter between hostmem and cuda-python's runtime bindings.

Every CUDA runtime call made by this package goes through this module, so
cuda-python's ``(err, *values)`` return tuples are converted to values or a
:class:`CudaError` in exactly one place (:func:`check`).

Behaviour without CUDA (facts from docs/platform.md): ``import`` of
``cuda.bindings`` may fail outright, and when it succeeds on a machine without
a driver every runtime call returns ``cudaErrorInsufficientDriver`` (35)
instead of raising. :func:`cuda_available` folds both cases into ``False`` and
never raises; callers choose their backend from it.

Pointers are plain ``int`` host addresses throughout; sizes are bytes.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

try:  # pragma: no branch - depends on the installation
    from cuda.bindings import runtime as cudart
except Exception as exc:  # noqa: BLE001 - any import failure means "no CUDA"
    cudart = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

__all__ = [
    "CudaError",
    "HOST_REGISTER_FLAGS",
    "check",
    "cuda_available",
    "driver_version",
    "free_host",
    "get_device",
    "host_alloc",
    "host_get_device_pointer",
    "host_get_flags",
    "host_register",
    "host_unregister",
    "set_device",
]

#: Flags used for ``cudaHostRegister``: Portable (pinned for every context,
#: not only the current device's) | Mapped (a device pointer exists, so a GPU
#: kernel can read and write the host pages directly).
HOST_REGISTER_FLAGS: int = 0x01 | 0x02
#: Flags used for ``cudaHostAlloc``: Portable | Mapped, matching the above.
HOST_ALLOC_FLAGS: int = 0x01 | 0x02


class CudaError(RuntimeError):
    """A CUDA runtime call returned an error code.

    Attributes:
        what: the operation that failed, as the caller described it.
        code: the integer ``cudaError_t`` value.
        name: the enum name, e.g. ``"cudaErrorInvalidValue"``.
    """

    def __init__(self, what: str, err: Any) -> None:
        self.what = what
        self.code = int(err)
        self.name = getattr(err, "name", str(err))
        super().__init__(f"{what} failed: {self.name} ({self.code}): {_error_string(err)}")


def _error_string(err: Any) -> str:
    """Return CUDA's description of ``err``; never raises."""
    if cudart is None:
        return "cuda-python is not importable"
    try:
        status, text = cudart.cudaGetErrorString(err)
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # noqa: BLE001 - only used to decorate an error message
        return "no description"


def check(result: tuple[Any, ...], what: str) -> Any:
    """Convert a cuda-python ``(err, *values)`` tuple into its values.

    Returns ``None`` when the call returns no values, the single value when it
    returns one, and a tuple otherwise. Raises :class:`CudaError` (naming
    ``what``) when ``err`` is not ``cudaSuccess``. O(1).

    >>> check((cudart.cudaError_t.cudaSuccess, 7), "demo")  # doctest: +SKIP
    7
    """
    err, *values = result
    if int(err) != 0:
        raise CudaError(what, err)
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return tuple(values)


@functools.cache
def cuda_available() -> bool:
    """Whether a CUDA runtime with at least one device is usable here.

    Never raises: a failed import, a missing driver (error 35) or any
    exception while probing all answer ``False``. The answer is cached for
    the life of the process. O(1) after the first call.
    """
    if cudart is None:
        logger.debug("cuda-python unavailable: %s", _IMPORT_ERROR)
        return False
    try:
        err, count = cudart.cudaGetDeviceCount()
    except Exception as exc:  # noqa: BLE001 - the probe must never raise
        logger.debug("cudaGetDeviceCount raised: %s", exc)
        return False
    if int(err) != 0:
        logger.debug("cudaGetDeviceCount: %s", getattr(err, "name", err))
        return False
    return bool(count) and int(count) > 0


def _runtime() -> Any:
    """Return the runtime module; raise ``RuntimeError`` if cuda-python is absent."""
    if cudart is None:
        raise RuntimeError(f"cuda-python is not importable: {_IMPORT_ERROR}")
    return cudart


def host_register(ptr: int, nbytes: int, flags: int = HOST_REGISTER_FLAGS) -> None:
    """Page-lock ``[ptr, ptr + nbytes)`` with ``cudaHostRegister``.

    Cost is about 0.03 s per GiB of already-touched memory on an H200. The
    range must not overlap another registration. Raises :class:`CudaError`.
    """
    check(_runtime().cudaHostRegister(ptr, nbytes, flags), f"cudaHostRegister(0x{ptr:x}, {nbytes})")


def host_unregister(ptr: int) -> None:
    """Undo :func:`host_register` for the registration starting at ``ptr``.

    ``ptr`` must be the exact base address that was registered. Raises
    :class:`CudaError` (for example when ``ptr`` is not registered).
    """
    check(_runtime().cudaHostUnregister(ptr), f"cudaHostUnregister(0x{ptr:x})")


def host_get_flags(ptr: int) -> int:
    """Return the ``cudaHostRegister``/``cudaHostAlloc`` flags of ``ptr``.

    Succeeds only for addresses inside pinned memory, so it doubles as the
    "is this pinned?" probe. Raises :class:`CudaError` otherwise.
    """
    return int(check(_runtime().cudaHostGetFlags(ptr), f"cudaHostGetFlags(0x{ptr:x})"))


def host_get_device_pointer(ptr: int) -> int:
    """Return the device address of mapped pinned host address ``ptr``.

    On UVA systems (every Hopper host) this equals ``ptr``, but callers must
    ask rather than assume. Raises :class:`CudaError` when ``ptr`` is not in
    mapped pinned memory.
    """
    return int(check(_runtime().cudaHostGetDevicePointer(ptr, 0), f"cudaHostGetDevicePointer(0x{ptr:x})"))


def host_alloc(nbytes: int, flags: int = HOST_ALLOC_FLAGS) -> int:
    """Allocate ``nbytes`` of pinned host memory with ``cudaHostAlloc``.

    Cost is about 0.54-0.64 s per GiB on an H200 (the driver touches and pins
    serially). Release with :func:`free_host`. Raises :class:`CudaError`.
    """
    return int(check(_runtime().cudaHostAlloc(nbytes, flags), f"cudaHostAlloc({nbytes})"))


def free_host(ptr: int) -> None:
    """Release memory from :func:`host_alloc`. Raises :class:`CudaError`."""
    check(_runtime().cudaFreeHost(ptr), f"cudaFreeHost(0x{ptr:x})")


def get_device() -> int:
    """The calling thread's current CUDA device (``cudaGetDevice``). Raises :class:`CudaError`."""
    return int(check(_runtime().cudaGetDevice(), "cudaGetDevice"))


def set_device(device: int) -> None:
    """Make ``device`` current for the calling thread (``cudaSetDevice``).

    A new thread starts on device 0: a worker that registers memory for a
    process using another device must call this first, or it creates (and
    pins through) a context on device 0. Raises :class:`CudaError`.
    """
    check(_runtime().cudaSetDevice(device), f"cudaSetDevice({device})")


def driver_version() -> int:
    """The driver's CUDA version as ``1000 * major + 10 * minor`` (``cudaDriverGetVersion``).

    Raises :class:`CudaError`."""
    return int(check(_runtime().cudaDriverGetVersion(), "cudaDriverGetVersion"))
