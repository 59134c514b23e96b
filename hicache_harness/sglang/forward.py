"""The stand-in forward over SGLang's pools: writes each new token's KV, checks every prefix byte.

What stands in for SGLang's GPU model runner (which the harness does not
run) is `KVForward`: per layer of every pool (the target's, then the
draft's) it writes the deterministic bytes of the batch's new tokens where
attention writes KV (`kv_bytes`), fetches the layer through the pool's own
accessors (`get_key_buffer` / `get_value_buffer`, which run the pool's
`layer_transfer_counter` hook exactly as attention does), and compares every
byte of every prefix token the layer reads:

    DSA pool   the indexer's keys of each layer that owns them (read before the
               layer's attention fetches KV, as the DSA indexer does), then the
               MLA latent
    MLA pool   the latent
    MHA pool   K and V (GQA: as many heads as the pool keeps)

The comparisons run where the pool lives: on a CUDA pool the expected bytes
are copied to the GPU (pinned, non-blocking) and compared there, the counts
of differing bytes stay on the GPU, and the host reads them only when the
report is asked for (`KVForward.report`): checking does not synchronise the
forward, so the host can run ahead of the GPU as SGLang's does. With
`delay_cycles` each forward first keeps its stream busy that long
(`torch.cuda._sleep`), so copies ordered against the wrong stream read or
write before the forward did.

With `full_graph` the forward is a full prefill CUDA-graph replay as SGLang's
`PrefillCudaGraphRunner` runs one: before the replay, if the target pool's
counter has loads (`consumer_index >= 0`), one `wait_until(last layer)`
(`_wait_for_layer_loads`); inside it no pool accessor runs its hook (the
layers read the buffers directly).

A token's bytes are a function of its prefix, its request's extra key
(a LoRA adapter's KV differs from the base model's), the model, the layer
and the part; KV of one adapter served to another shows as mismatched bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache_harness.sglang.kv_bytes import prefix_hashes, token_bytes

INDEX_BYTES = 132  # the DSA indexer's key (128 fp8) and scale (4) bytes per token


@dataclass
class ForwardReport:
    """What the stand-in forwards read and checked."""

    checked_bytes: int = 0
    mismatched_bytes: int = 0
    mismatches: list[str] = field(default_factory=list)
    forwards: int = 0
    computed_tokens: int = 0


@dataclass
class _Pending:
    """A comparison whose counts are still on the device."""

    rid: str
    what: str
    bad_bytes: torch.Tensor
    bad_tokens: torch.Tensor


class KVForward:
    """The stand-in forward over SGLang's pools (see the module docstring)."""

    def __init__(
        self,
        target: Any,
        drafts: Sequence[Any],
        req_to_token: torch.Tensor,
        check: bool,
        delay_cycles: int = 0,
        full_graph: bool = False,
    ) -> None:
        self.pools = [("target", target), *(("draft", p) for p in drafts)]
        self.full_graph = full_graph
        self.req_to_token = req_to_token
        self.check = check
        self.device = req_to_token.device
        self.delay_cycles = delay_cycles if self.device.type == "cuda" else 0
        self._report = ForwardReport()
        self._pending: list[_Pending] = []

    @property
    def report(self) -> ForwardReport:
        """The counts so far (reads the device-side counts: one host sync on CUDA)."""
        pending, self._pending = self._pending, []
        if pending and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the counts were computed on the forward's stream
        for p in pending:
            bad = int(p.bad_bytes.item())
            if bad:
                self._report.mismatched_bytes += bad
                self._report.mismatches.append(f"{p.rid}: {p.what}: {int(p.bad_tokens.item())} prefix tokens differ")
        return self._report

    def run(self, reqs: Sequence[Any]) -> None:
        self._report.forwards += 1
        if self.delay_cycles:
            torch.cuda._sleep(self.delay_cycles)
        plans = [self._plan(r) for r in reqs]
        self._report.computed_tokens += sum(p[2].stop - p[2].start for p in plans)
        if self.full_graph:  # PrefillCudaGraphRunner._wait_for_layer_loads, then a replay without hooks
            counter = self.pools[0][1].layer_transfer_counter
            if counter is not None and counter.consumer_index >= 0:
                counter.wait_until(counter.num_layers - 1)
        for model, pool in self.pools:
            index = getattr(pool, "index_k_with_scale_buffer", None)
            mha = hasattr(pool, "k_buffer")
            for layer in range(pool.layer_num):
                salt = _salt(model, layer)
                if index is not None and index[layer].shape[0] > 0:
                    for req, slots, new, hashes in plans:
                        self._write_index(index[layer], slots[new], hashes[new], salt, pool.page_size)
                    for req, slots, new, hashes in plans:  # the indexer reads its keys before attention
                        self._check_index(req, model, layer, index[layer], slots, hashes, salt, pool.page_size)
                if mha:
                    parts = (("k", pool.k_buffer[layer], pool.get_key_buffer, salt),
                             ("v", pool.v_buffer[layer], pool.get_value_buffer, salt + 3))  # fmt: skip
                else:
                    parts = (("kv", pool.kv_buffer[layer], pool.get_key_buffer, salt),)
                for name, buf, fetch, part_salt in parts:
                    self._layer(plans, f"{model} {name} layer {layer}", buf, lambda f=fetch: f(layer), part_salt)

    def _layer(self, plans: list[Any], what: str, buf: torch.Tensor, fetch: Any, salt: int) -> None:
        """Write the new tokens' bytes into one layer buffer, fetch it through the pool
        (the hook), check every prefix token."""
        width = buf[0].numel() * buf.element_size()
        for req, slots, new, hashes in plans:
            buf.view(torch.uint8).view(buf.shape[0], width)[slots[new]] = self._bytes(hashes[new], salt, width)
        fetched = buf if self.full_graph else fetch()  # the accessor runs the hook, as attention's does
        got = fetched.view(torch.uint8).view(buf.shape[0], width)
        for req, slots, new, hashes in plans:
            self._compare(req, what, got[slots[: req.prefix_len]], hashes[: req.prefix_len], salt, width)

    def _plan(self, req: Any) -> tuple[Any, torch.Tensor, slice, np.ndarray]:
        slots = self.req_to_token[req.kv.req_pool_idx, : req.extend_end].to(torch.int64)
        tokens = np.frombuffer(req.full_untruncated_fill_ids[: req.extend_end], dtype=np.int64)
        hashes = prefix_hashes(tokens) ^ _key_salt(req.extra_key)
        return req, slots, slice(req.prefix_len, req.extend_end), hashes

    def _bytes(self, hashes: np.ndarray, salt: int, width: int) -> torch.Tensor:
        """The expected bytes of tokens with `hashes`, on the pools' device (non-blocking)."""
        host = torch.from_numpy(token_bytes(hashes, salt, width))
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _write_index(self, buf: torch.Tensor, slots: torch.Tensor, hashes: np.ndarray, salt: int, ps: int) -> None:
        data = self._bytes(hashes, salt + 7, INDEX_BYTES)
        page, off = slots // ps, slots % ps
        for col, (lo, width) in enumerate(((0, 128), (ps * 128, 4))):
            idx = page[:, None] * buf.shape[1] + lo + off[:, None] * width + torch.arange(width, device=buf.device)
            buf.view(-1)[idx] = data[:, :128] if col == 0 else data[:, 128:]

    def _check_index(self, req: Any, model: str, layer: int, buf: torch.Tensor, slots: torch.Tensor,
                     hashes: np.ndarray, salt: int, ps: int) -> None:  # fmt: skip
        n = req.prefix_len
        if not self.check or n == 0:
            return
        page, off = slots[:n] // ps, slots[:n] % ps
        span = torch.arange(128, device=buf.device)
        keys = buf.view(-1)[page[:, None] * buf.shape[1] + off[:, None] * 128 + span[None, :]]
        scales = buf.view(-1)[page[:, None] * buf.shape[1] + ps * 128 + off[:, None] * 4 + span[None, :4]]
        self._compare(req, f"{model} index layer {layer}", torch.cat([keys, scales], dim=1), hashes[:n], salt + 7,
                      INDEX_BYTES)  # fmt: skip

    def _compare(self, req: Any, what: str, got: torch.Tensor, hashes: np.ndarray, salt: int, width: int) -> None:
        if not self.check or len(hashes) == 0:
            return
        bad = got != self._bytes(hashes, salt, width)
        self._report.checked_bytes += len(hashes) * width
        self._pending.append(_Pending(req.rid, what, bad.sum(), bad.any(dim=1).sum()))


def _salt(model: str, layer: int) -> int:
    return (0 if model == "target" else 1000) + 17 * layer


def _key_salt(extra_key: str | None) -> np.uint64:
    """A request's extra key (LoRA adapter, cache salt) as a 64-bit mask of its KV bytes."""
    if not extra_key:
        return np.uint64(0)
    return np.uint64(int.from_bytes(hashlib.blake2b(extra_key.encode(), digest_size=8).digest(), "little") | 1)
