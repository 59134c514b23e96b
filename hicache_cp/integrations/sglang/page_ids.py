"""Device page ids read on the host once per forward, never once per request.

SGLang keeps a request's token slots on the device (its allocator's free
list, the request-to-token table), while hicache-cp's copy engines take
CPU page lists. Reading a device index tensor on the host (`.cpu()`,
`.tolist()`) synchronises the scheduler thread with the GPU: one such read
per admitted request stalls scheduling behind every forward in flight.
`HostIndices` batches them:

    add(slots, step) scheduling (init_load_back, maybe_hand_to_session): a
                    non-blocking copy into pinned host memory on the caller's
                    current stream (SGLang's schedule stream) and an event
                    after it; no host wait. Returns a handle. The pinned memory
                    is one buffer reused from forward to forward (no pinned
                    allocation per request); it grows when a forward's ids
                    outgrow it (the old one is kept until `resolve`). The
                    slots are copied whole (one contiguous D2H copy, no
                    gather kernel on the device) and every `step`-th is kept
                    at `resolve` (a page's first slot: `step` = page size).
    resolve()       once per forward, where the staged copies are submitted
                    (the forward's start): one host wait on the last event
                    (the schedule stream's work up to the last `add`, i.e.
                    the allocation kernels of this step), then every handle's
                    values as int64 numpy arrays.

On a CPU device the tensors are cloned (no synchronisation exists). The
counters say how often the host waited (`waits`), how many tensors it
read (`reads`) and how many batched reads there were (`resolves`), for the
tests and the logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


#: The pinned buffer's first size in bytes (it doubles as a forward's ids need).
INITIAL_BYTES = 1 << 16


@dataclass
class HostIndices:
    """Index tensors staged for one host read per forward (see the module docstring)."""

    _staged: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (host copy, step)
    _event: Any = None  # torch.cuda.Event after the last staged copy
    _pinned: torch.Tensor | None = None  # the reused buffer (uint8; CUDA only)
    _used: int = 0  # its bytes this forward's copies write
    _retired: list[torch.Tensor] = field(default_factory=list)  # outgrown, still written until resolve
    waits: int = 0  # host waits on the GPU (CUDA only)
    reads: int = 0  # tensors read
    resolves: int = 0  # batched reads (at most one a forward)

    def add(self, values: torch.Tensor, step: int = 1) -> int:
        """Stage a 1-D index tensor for the next `resolve` (which keeps every `step`-th
        value, from the first); returns its handle. No host sync."""
        if step < 1:
            raise ValueError(f"HostIndices.add: step {step} < 1")
        if not values.is_contiguous():
            values = values.contiguous()
        if values.device.type == "cuda":
            n = values.numel()
            host = self._slot(n * values.element_size()).view(values.dtype)[:n].view(values.shape)
            host.copy_(values, non_blocking=True)
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))
        else:
            host = values.clone()
        self._staged.append((host, step))
        return len(self._staged) - 1

    def _slot(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the pinned buffer that no copy of this forward writes yet (8-aligned)."""
        nbytes = -(-nbytes // 8) * 8
        if self._pinned is None or self._used + nbytes > len(self._pinned):
            if self._pinned is not None and self._used:
                self._retired.append(self._pinned)
            size = max(INITIAL_BYTES, 2 * nbytes, 2 * len(self._pinned) if self._pinned is not None else 0)
            self._pinned, self._used = torch.empty(size, dtype=torch.uint8, pin_memory=True), 0
        out = self._pinned[self._used : self._used + nbytes]
        self._used += nbytes
        return out

    def __len__(self) -> int:
        return len(self._staged)

    def resolve(self) -> list[np.ndarray]:
        """Every staged tensor's values (int64 arrays of their own), after at most one host
        wait; clears the stage (the next forward's copies reuse the pinned buffer)."""
        staged, self._staged = self._staged, []
        self._used, self._retired = 0, []
        if not staged:
            return []
        if self._event is not None:
            self._event.synchronize()
            self.waits += 1
        self.resolves += 1
        self.reads += len(staged)
        return [t.numpy()[::step].astype(np.int64) for t, step in staged]
