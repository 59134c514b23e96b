"""Clocks of the real engine: wall time, load time, and the copy peak it is held to.

`Clock.now()` is wall time; `Clock.sync()` waits for the device first (the
engine syncs where a server does: when it reads the sampled tokens).

`LoadTimer` measures one load-back from the moment its copies may start to
the moment the last layer of the last part landed, without adding a host
sync to the forward. On CUDA: an event on the compute stream right before
`load_back` (the copy stream waits on the compute stream at submission, so
the copies cannot start earlier) and an event on a side stream that waits
for every copy's event; read after the step's sync. On the CPU backend: a
waiter thread blocks on the tickets and takes the time when they are done.

`copy_peak_gbps()` is the bound a load is compared with: on CUDA the best of
a few contiguous pinned host-to-device copies of 256 MiB (the PCIe peak, as
in bench-io); on a CPU machine a contiguous host memcpy of 64 MiB, which is
what the CPU io backend's copies are made of.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any

import numpy as np
import torch

from hicache_cp.ops import LoadOp

_WAITER: cf.ThreadPoolExecutor | None = None
_SIDE: Any = None


def _side_stream() -> Any:
    """One CUDA stream that only waits on load copies and records their end."""
    global _SIDE
    if _SIDE is None:
        _SIDE = torch.cuda.Stream()
    return _SIDE


def _waiter() -> cf.ThreadPoolExecutor:
    global _WAITER
    if _WAITER is None:
        _WAITER = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-load-timer")
    return _WAITER


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        return time.perf_counter()

    def sync(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class LoadTimer:
    """Time of one load-back (see the module docstring)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._start_event: Any = None
        self._end_event: Any = None
        self._t0 = 0.0
        self._future: cf.Future[float | None] | None = None

    @classmethod
    def before_load(cls, clock: Clock) -> LoadTimer:
        """Call right before `load_back`."""
        timer = cls(clock.cuda)
        if timer.cuda:
            timer._start_event = torch.cuda.Event(enable_timing=True)
            timer._start_event.record()
        timer._t0 = time.perf_counter()
        return timer

    def started(self, load: LoadOp) -> float:
        """Call right after `load_back` returned `load`; returns the host
        seconds `load_back` took."""
        submit_s = time.perf_counter() - self._t0
        tickets = [t for ts in load.by_layer.values() for t in ts]
        if self.cuda:
            side = _side_stream()
            try:
                with torch.cuda.stream(side):
                    for t in tickets:
                        t.make_compute_wait()  # the side stream waits; compute does not
                    self._end_event = torch.cuda.Event(enable_timing=True)
                    self._end_event.record(side)
            except Exception:  # noqa: BLE001 - a copy already failed: no time (the load aborts)
                self._end_event = None
            return submit_s

        def wait() -> float | None:
            try:
                for t in tickets:
                    t.wait()
            except Exception:  # noqa: BLE001 - a failed copy: no time (the load aborts)
                return None
            return time.perf_counter()

        self._future = _waiter().submit(wait)
        return submit_s

    def elapsed_s(self) -> float | None:
        """Seconds the load took; None if it failed. Blocks until it landed."""
        if self.cuda:
            if self._end_event is None:
                return None
            self._end_event.synchronize()
            return float(self._start_event.elapsed_time(self._end_event)) / 1e3
        assert self._future is not None
        done = self._future.result()
        return None if done is None else done - self._t0


def copy_peak_gbps(device: torch.device) -> tuple[float, str]:
    """(GB/s, what was measured): the bound a load's bytes are divided by."""
    if device.type == "cuda":
        n = 256 << 20
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        best = float("inf")
        for _ in range(4):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return n / best / 1e9, "pinned H2D copy of 256 MiB (PCIe)"
    n = 64 << 20
    src = np.ones(n, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(4):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return n / best / 1e9, "host memcpy of 64 MiB (no GPU: CPU io backend)"
