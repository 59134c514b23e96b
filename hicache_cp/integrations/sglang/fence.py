"""Copies the scheduler thread submits, ordered behind the forward in flight.

hicache-cp's CUDA copy engines order every copy after the work enqueued so
far on the caller's current stream (`hicache_cp.io.cuda`). Inside SGLang's
forward that stream is the forward's own, so the layer hooks need nothing
more. The scheduler thread runs on SGLang's schedule stream instead, and
under overlap scheduling the forward of the previous batch is still running
on the model runner's `forward_stream` while the scheduler works: a copy
ordered only behind the schedule stream could read KV that forward has not
written yet (a backup of its last layers, submitted at a checkpoint), or
write slots it still reads (a load). SGLang's own HiCache fences the same
way (`HiCacheController.load_fence_stream` / `write_fence_stream`, set to
the forward stream by its scheduler).

`ForwardFence.behind_forward()` makes the copies submitted inside it wait
for both: the forward stream first waits for the caller's stream (SGLang's
forward does so before each launch anyway, so this orders nothing new for
the forward), then the copies are submitted with the forward stream
current, so the copy engine orders them after every forward enqueued so
far. No host synchronisation. A no-op without CUDA, without a forward
stream, or when the caller already runs on it (inside the forward).

Which submissions go through it (`radix_cache`): the backup layers a
checkpoint or the after-batch flush submits for a finished forward. Loads
and write-through reservations are submitted at the forward's start, on the
forward's stream (`layer_hooks.ForwardCopies.begin`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class ForwardFence:
    """The forward stream that scheduler-thread copies are ordered behind."""

    def __init__(self, forward_stream: Any = None) -> None:
        self.stream = forward_stream if isinstance(forward_stream, torch.cuda.Stream) else None
        self.fenced = 0  # submissions ordered behind another stream (tests, logs)

    @contextmanager
    def behind_forward(self) -> Iterator[None]:
        """Copies submitted inside are ordered after the forward stream's work so far."""
        stream = self.stream
        if stream is None:
            yield
            return
        current = torch.cuda.current_stream(stream.device)
        if current.cuda_stream == stream.cuda_stream:
            yield
            return
        stream.wait_stream(current)
        self.fenced += 1
        with torch.cuda.stream(stream):
            yield
