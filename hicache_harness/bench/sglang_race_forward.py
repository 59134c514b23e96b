"""The race's forward: SGLang's KV pools written and read as a model's forward would, on any device.

`RaceForward.run(reqs)` stands in for SGLang's model runner on one batch (the
same calls as `hicache_harness.sglang.server.KVForward`, with the bytes made and
checked by torch on the pools' own device, so the race runs on CUDA):

    for each layer l of the target pool:
        write the batch's new tokens' KV where attention writes it: the bytes are
        `kv_bytes.token_bytes` of the token's prefix hash for (part, layer): the MLA
        latent, or an MHA pool's K and V; for DSA pools also the indexer's
        key-with-scale bytes, for the layers that own them
        pool.get_key_buffer(l)      the pool runs the tree cache's layer_transfer_counter
                                    (its per-layer waits for loads; hicache-cp's backups)
        `matmuls` products of two [dim, dim] matrices on the compute stream: the
                                    layer's compute (compute-bound, independent of the batch)

`calibrate` times the same forward alone on the empty pool (no hook, no
check) for a few numbers of new tokens: the baseline the race's exposure is
measured against. A CUDA event pair (or the wall clock on CPU) times the
forward from its start to its last layer's compute; the layer hooks inside are timed by the server's
clock, not here. After the end event, every prefix token each layer reads is
compared with what computing it gives, on the device: the count of differing
bytes accumulates in a device tensor per request, read once at the end of
the run (`mismatches`), so checking adds no host synchronisation. The host
then waits for the forward's end, as SGLang's scheduler waits for a batch's
sampled tokens before it processes the results (`event_loop_normal`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache_harness.sglang.kv_bytes import prefix_hashes

INDEX_KEY_BYTES, INDEX_SCALE_BYTES = 128, 4  # the DSA indexer's fp8 key and its scale, per token

_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _i64(x: int) -> int:
    """The int64 with the same 64 bits as `x` (torch has no uint64 arithmetic)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def token_bytes_torch(hashes: torch.Tensor, salt: int, width: int) -> torch.Tensor:
    """`kv_bytes.token_bytes` on `hashes`' device: uint8 [len(hashes), width], the same bytes."""
    x = hashes[:, None] ^ _i64((salt + 1) * _GOLDEN)
    x = x + torch.arange(width, device=hashes.device, dtype=torch.int64)[None, :] * _i64(_M1)
    x = x ^ _shr(x, 31)
    x = x * _i64(_M2)
    x = x ^ _shr(x, 29)
    return (x & 0xFF).to(torch.uint8)


@dataclass
class ForwardRecord:
    """One forward: which requests, whether it waited on a load, and its time (read at the end)."""

    rids: tuple[str, ...]
    new_tokens: int
    had_load: bool
    timer: Any  # (start, end) CUDA events, or the wall seconds on CPU


@dataclass
class ForwardStats:
    """What the forwards computed and checked."""

    forwards: list[ForwardRecord] = field(default_factory=list)
    computed_tokens: int = 0
    checked_bytes: int = 0
    bad: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # rid -> device counts of differing bytes


class RaceForward:
    """The stand-in model forward over one target pool (see the module docstring)."""

    def __init__(self, pool: Any, req_to_token: torch.Tensor, *, matmuls: int, dim: int, check: bool) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self._mha = hasattr(pool, "k_buffer") and not hasattr(pool, "kv_buffer")
        self.device = (pool.k_buffer if self._mha else pool.kv_buffer)[0].device
        self.check = check
        self.matmuls = matmuls
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        gen = torch.Generator(device="cpu").manual_seed(0)
        self._a = torch.randn(dim, dim, generator=gen).to(self.device, dtype)
        self._b = torch.randn(dim, dim, generator=gen).to(self.device, dtype)
        self._c = torch.empty_like(self._a)
        index = getattr(pool, "index_k_with_scale_buffer", None)
        self._index = [index[layer] if index is not None and index[layer].shape[0] > 0 else None
                       for layer in range(pool.layer_num)]  # fmt: skip
        self.stats = ForwardStats()

    # ---- the forward ----------------------------------------------------------------------

    def run(self, reqs: Sequence[Any]) -> None:
        plans = [self._plan(r) for r in reqs]
        counter = self.pool.layer_transfer_counter
        had_load = counter is not None and getattr(counter, "consumer_index", -1) >= 0
        new_tokens = sum(new.stop - new.start for _, _, new, _ in plans)
        timer = self._start()
        self._layers([(slots[new], hashes[new]) for _, slots, new, hashes in plans if new.stop > new.start])
        timer = self._stop(timer)
        self.stats.forwards.append(ForwardRecord(tuple(r.rid for r in reqs), new_tokens, had_load, timer))
        self.stats.computed_tokens += new_tokens
        if self.check:
            for req, slots, _, hashes in plans:
                self._check(req, slots[: req.prefix_len], hashes[: req.prefix_len])
        if self.device.type == "cuda":  # the scheduler reads the batch's sampled tokens: it waits for the forward
            timer[1].synchronize()

    def calibrate(self, sizes: Sequence[int], repeats: int = 3) -> list[tuple[int, float]]:
        """(new tokens, median ms) of the forward alone, writing that many tokens: KV writes and
        compute, the layer counter detached, nothing checked. Call it on an empty pool, before
        serving (it writes into the first slots)."""
        counter, self.pool.layer_transfer_counter = self.pool.layer_transfer_counter, None
        out = []
        try:
            for n in sizes:
                slots = torch.arange(self.pool.page_size, self.pool.page_size + n, device=self.device)
                hashes = torch.arange(n, device=self.device, dtype=torch.int64)
                times = []
                for _ in range(repeats + 1):  # the first warms up
                    timer = self._start()
                    self._layers([(slots, hashes)] if n else [])
                    times.append(self._elapsed_ms(self._stop(timer)))
                out.append((n, float(np.median(times[1:]))))
        finally:
            self.pool.layer_transfer_counter = counter
        return out

    def _layers(self, writes: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every layer: the new tokens' KV written, the layer hook, the layer's compute."""
        for layer in range(self.pool.layer_num):
            salt = _salt(layer)
            for j, rows in enumerate(self._rows(layer)):
                for slots, hashes in writes:
                    rows[slots] = token_bytes_torch(hashes, salt + 31 * j, rows.shape[1])
            for slots, hashes in writes:
                if self._index[layer] is not None:
                    self._write_index(self._index[layer], slots, hashes, salt)
            self.pool.get_key_buffer(layer)  # the layer hook, as attention's KV fetch runs it
            self._compute()

    def _compute(self) -> None:
        for _ in range(self.matmuls):
            torch.matmul(self._a, self._b, out=self._c)

    def _start(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _stop(self, start: Any) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter() - start
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return (start, end)

    # ---- bytes ----------------------------------------------------------------------------

    def _plan(self, req: Any) -> tuple[Any, torch.Tensor, slice, torch.Tensor]:
        slots = self.req_to_token[req.kv.req_pool_idx, : req.extend_end].to(self.device, torch.int64)
        ids = np.frombuffer(req.full_untruncated_fill_ids[: req.extend_end], dtype=np.int64)
        hashes = torch.from_numpy(prefix_hashes(ids).view(np.int64)).to(self.device, non_blocking=True)
        return req, slots, slice(req.prefix_len, req.extend_end), hashes

    def _rows(self, layer: int) -> list[torch.Tensor]:
        """The layer's KV tensors as uint8 rows, one per token slot (views of SGLang's tensors):
        the MLA latent, or an MHA pool's K and V."""
        bufs = [self.pool.k_buffer[layer], self.pool.v_buffer[layer]] if self._mha else [self.pool.kv_buffer[layer]]
        return [b.view(torch.uint8).view(b.shape[0], -1) for b in bufs]

    def _index_cols(self, slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat byte offsets of each token's index key and scale in its page (see `pools`)."""
        ps = self.pool.page_size
        page, off = slots // ps, slots % ps
        keys = (page * width + off * INDEX_KEY_BYTES)[:, None] + torch.arange(INDEX_KEY_BYTES, device=self.device)
        scales = (page * width + ps * INDEX_KEY_BYTES + off * INDEX_SCALE_BYTES)[:, None] + torch.arange(
            INDEX_SCALE_BYTES, device=self.device
        )
        return keys, scales

    def _write_index(self, buf: torch.Tensor, slots: torch.Tensor, hashes: torch.Tensor, salt: int) -> None:
        data = token_bytes_torch(hashes, salt + 7, INDEX_KEY_BYTES + INDEX_SCALE_BYTES)
        keys, scales = self._index_cols(slots, buf.shape[1])
        flat = buf.view(-1)
        flat[keys] = data[:, :INDEX_KEY_BYTES]
        flat[scales] = data[:, INDEX_KEY_BYTES:]

    def _check(self, req: Any, slots: torch.Tensor, hashes: torch.Tensor) -> None:
        n = len(slots)
        if n == 0:
            return
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        for layer in range(self.pool.layer_num):
            salt = _salt(layer)
            for j, rows in enumerate(self._rows(layer)):
                bad += (rows[slots] != token_bytes_torch(hashes, salt + 31 * j, rows.shape[1])).sum()
                self.stats.checked_bytes += n * rows.shape[1]
            buf = self._index[layer]
            if buf is not None:
                keys, scales = self._index_cols(slots, buf.shape[1])
                got = torch.cat([buf.view(-1)[keys], buf.view(-1)[scales]], dim=1)
                bad += (got != token_bytes_torch(hashes, salt + 7, got.shape[1])).sum()
                self.stats.checked_bytes += got.numel()
        self.stats.bad.setdefault(req.rid, []).append(bad)

    # ---- results (one host synchronisation) ------------------------------------------------

    def mismatches(self) -> dict[str, int]:
        """Differing bytes per request that had any (synchronises once)."""
        out = {rid: int(torch.stack(counts).sum().item()) for rid, counts in self.stats.bad.items()}
        return {rid: n for rid, n in out.items() if n}

    def forward_ms(self) -> list[float]:
        """Each forward's time in ms (synchronises once on CUDA)."""
        return [self._elapsed_ms(r.timer) for r in self.stats.forwards]

    def _elapsed_ms(self, timer: Any) -> float:
        if self.device.type != "cuda":
            return timer * 1e3
        timer[1].synchronize()
        return timer[0].elapsed_time(timer[1])


def _salt(layer: int) -> int:
    """The target model's salt of `layer`, as `hicache_harness.sglang.server` names it."""
    return 17 * layer
