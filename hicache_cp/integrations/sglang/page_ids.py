"""Device page ids read on the host once per forward, never once per request.

SGLang keeps a request's token slots on the device (its allocator's free
list, the request-to-token table), while hicache-cp's copy engines take
CPU page lists. Reading a device index tensor on the host (`.cpu()`,
`.tolist()`) synchronises the scheduler thread with the GPU: one such read
per admitted request stalls scheduling behind every forward in flight.
`HostIndices` batches them:

    add(slots, step) scheduling (init_load_back, maybe_hand_to_session): one
                    small kernel on the caller's current stream (SGLang's
                    schedule stream) stores every `step`-th slot, from the
                    first, as int64 into pinned host memory through its
                    device address, and an event follows it; no host wait.
                    Returns a handle. The pinned memory is one buffer reused
                    from forward to forward (no pinned allocation per request);
                    it grows when a forward's ids outgrow it (the old one is
                    kept until `resolve`).
    resolve()       once per forward, where the staged copies are submitted
                    (the forward's start): one host wait on the last event
                    (the schedule stream's work up to the last `add`, i.e.
                    the allocation kernels of this step), then every handle's
                    values as int64 numpy arrays of their own.

Why a kernel and not a device-to-host `copy_`: a D2H copy goes to the GPU's
copy engines, where it queues behind the D2H backups still in flight from
the previous forward (megabytes per layer group), so `resolve` would wait
for the backups; the kernel's stores cross PCIe from the SMs and wait for
nothing but the schedule stream.

On a CPU device the values are cloned at `add` and read at `resolve` (no
synchronisation exists). The counters say how often the host waited
(`waits`), how many tensors it read (`reads`) and how many batched reads
there were (`resolves`), for the tests and the logs. Triton is imported when
the first CUDA tensor is staged, so CPU installs never need it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: The pinned buffer's first size in int64 values (it doubles as a forward's ids need).
INITIAL_VALUES = 1 << 13
#: Values one program of the kernel stores.
BLOCK = 1024


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Every integer changes from call to call: none selects a compiled variant (only the
    # source's dtype does), so no request's step compiles one.
    @triton.jit(do_not_specialize=["n", "stride", "out_base"])
    def ids_to_host(src, n, stride, out_base, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        values = tl.load(src + offs.to(tl.int64) * stride, mask=mask, other=0).to(tl.int64)
        tl.store(out_base.to(tl.pointer_type(tl.int64)) + offs, values, mask=mask)

    return ids_to_host


def warm_up_page_ids(device: torch.device) -> None:
    """Compile the kernel for SGLang's index dtypes (int32 table rows, int64 slots) now,
    not in a request's step: each from a 16-byte aligned start and from one that is not
    (Triton compiles a variant per pointer alignment, and a table row or a slice of
    slots starts wherever the request's row or slots do). Synchronises (start-up only)."""
    out = torch.empty(1, dtype=torch.int64, pin_memory=True)
    for dtype in (torch.int32, torch.int64):
        src = torch.zeros(4, dtype=dtype, device=device)
        for start in (0, 1):
            _kernel()[(1,)](src[start:], 1, 1, out.data_ptr(), BLOCK=BLOCK)
    torch.cuda.synchronize(device)


@dataclass
class HostIndices:
    """Index tensors staged for one host read per forward (see the module docstring)."""

    _staged: list[torch.Tensor] = field(default_factory=list)  # slices of the pinned buffer, or clones (CPU)
    _event: Any = None  # torch.cuda.Event after the last staged kernel
    _pinned: torch.Tensor | None = None  # the reused buffer (int64; CUDA only)
    _used: int = 0  # its values this forward's kernels write
    _retired: list[torch.Tensor] = field(default_factory=list)  # outgrown, still written until resolve
    waits: int = 0  # host waits on the GPU (CUDA only)
    reads: int = 0  # tensors read
    resolves: int = 0  # batched reads (at most one a forward)

    def add(self, values: torch.Tensor, step: int = 1) -> int:
        """Stage every `step`-th value of a 1-D index tensor, from the first, for the next
        `resolve`; returns its handle. No host sync."""
        if step < 1:
            raise ValueError(f"HostIndices.add: step {step} < 1")
        if values.dim() != 1:
            raise ValueError(f"HostIndices.add: a 1-D index tensor, got shape {tuple(values.shape)}")
        n = -(-values.numel() // step)
        if values.device.type == "cuda":
            host = self._slot(n)
            if n:
                _kernel()[(-(-n // BLOCK),)](values, n, step * values.stride(0), host.data_ptr(), BLOCK=BLOCK)
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))
            self._staged.append(host)
        else:
            self._staged.append(values[::step].clone())
        return len(self._staged) - 1

    def _slot(self, n: int) -> torch.Tensor:
        """`n` int64 values of the pinned buffer that no kernel of this forward writes yet."""
        if self._pinned is None or self._used + n > len(self._pinned):
            if self._pinned is not None and self._used:
                self._retired.append(self._pinned)
            size = max(INITIAL_VALUES, 2 * n, 2 * len(self._pinned) if self._pinned is not None else 0)
            self._pinned, self._used = torch.empty(size, dtype=torch.int64, pin_memory=True), 0
        out = self._pinned[self._used : self._used + n]
        self._used += n
        return out

    def __len__(self) -> int:
        return len(self._staged)

    def resolve(self) -> list[np.ndarray]:
        """Every staged tensor's values (int64 arrays of their own), after at most one host
        wait; clears the stage (the next forward's kernels reuse the pinned buffer)."""
        staged, self._staged = self._staged, []
        self._used, self._retired = 0, []
        if not staged:
            return []
        if self._event is not None:
            self._event.synchronize()
            self.waits += 1
        self.resolves += 1
        self.reads += len(staged)
        return [t.numpy().astype(np.int64) for t in staged]
