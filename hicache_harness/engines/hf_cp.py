"""The real model under CP shared KV: each rank holds its own pages, a forward reads all of them.

Under CP (docs/invariants.md, CP shared KV) rank r's L1 and L2 hold only the pages it
owns (page position i of a request lives on lane i mod cp_size); it computes,
backs up, loads back and byte-checks those alone. The forward is replicated:
every rank runs the whole model over the whole batch, so each needs the full
prefix KV before attention reads it. That is the fork's "full-view
compatibility path": per layer, once the layer's loads have landed, the ranks
all-gather their owned prefix pages and each rebuilds the full logical
prefix from what it holds and what it received:

    before_layer(model, l)           (`SharedHooks`)
        wait for layer l of every load of the batch      (this rank's share)
        send  <- this rank's owned prefix pages of layer l, every part of `model`,
                 of every sequence of the batch, read from its own L1
        all_gather(send)                                  (one collective a layer)
        prefix[b] <- pages of sequence b in position order, each from its owner
    forward of layer l reads prefix[b]  (`SharedKV.gather`)
    the chunk's new KV: only the pages this rank owns go to its L1 (`SharedKV.scatter`)

The draft layer's exchange carries one entry more than the target's (its
entries run one position ahead, `hf_forward`).

No rank reads a page it neither holds (computed or restored into its own L1)
nor received in that layer's all-gather: the physical ids of another rank's
pages are never used to index this rank's buffers. Every rank issues the
same collectives in the same order because every input to the decision (the
batch, each sequence's prefix length and page table) is replicated; a layer
whose batch has no prefix issues none, on every rank. The cache's agreement
(one MIN all-reduce per poll) shares the process group and comes between
forwards, in the same order everywhere.

`LocalView` is the same contract at CP 1: the L1 pools are the store, every
page is this rank's, no collective. The scheduler talks to either through
`KVView`.

On CUDA the exchange runs on the compute stream (NCCL orders a collective
after the work queued before it), so it follows the loads' waits. Pages move
as bytes (any dtype, gloo or NCCL); the send buffer is padded to the largest
rank's share, so a collective's size is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hicache_cp.cp import mapping as cp_mapping
from hicache_harness.engines.hf_forward import KVStore, LayerHooks, PagedKV, SeqPlan
from hicache_harness.engines.hf_model import HfModel
from hicache_cp.layout import Model, Part

Buffers = dict[Part, list[torch.Tensor]]


class KVView(Protocol):
    """How the scheduler's forwards see KV on this rank."""

    rank: int
    cp_size: int

    def stores(self, rows: Sequence[tuple[np.ndarray, SeqPlan]]) -> list[KVStore]:
        """The KV store of each sequence of a forward, from its logical page table and plan."""

    def hooks(self, inner: LayerHooks, stores: Sequence[KVStore]) -> LayerHooks:
        """The forward's layer hooks: `inner` (waits, backups) plus what the view needs."""


class LocalView:
    """CP 1: every page is this rank's; the L1 pools are the store."""

    rank = 0
    cp_size = 1

    def __init__(self, buffers: Buffers) -> None:
        self.buffers = buffers

    def stores(self, rows: Sequence[tuple[np.ndarray, SeqPlan]]) -> list[KVStore]:
        return [PagedKV(self.buffers, plan) for _, plan in rows]

    def hooks(self, inner: LayerHooks, stores: Sequence[KVStore]) -> LayerHooks:
        return inner


@dataclass
class PrefixSource:
    """Where one sequence's owned prefix pages lie on this rank, for an exchange.

    `owners[i]` is the rank owning page position i (i < ceil(tokens / page
    size)); `physical[i]` is its page in `buffers` where this rank owns it
    (ignored elsewhere). `buffers` is the L1 pool, or a snapshot laid out
    like it."""

    buffers: Buffers
    physical: np.ndarray
    owners: np.ndarray
    tokens: int


class PrefixExchange:
    """The all-gather of owned prefix pages (module docstring) over the default process group."""

    def __init__(self, model: HfModel, rank: int, cp_size: int) -> None:
        import torch.distributed as dist

        if cp_size > 1 and not dist.is_initialized():
            raise RuntimeError("a CP prefix exchange needs torch.distributed initialised (one process per rank)")
        self.m = model
        self.rank = rank
        self.cp_size = cp_size
        self.ps = model.preset.page_size
        self.collectives = 0
        self.bytes_sent = 0

    def parts_of(self, model: Model, layer: int) -> list[tuple[Part, int, int]]:
        """(part, compact slot, dim) of every part of `model` that owns `layer`."""
        out = []
        for part in (Part.TARGET_KV, Part.TARGET_STATE) if model is Model.TARGET else (Part.DRAFT_KV, Part.DRAFT_STATE):
            dims = self.m.parts.get(part)
            if dims is not None and layer in dims.layers:
                out.append((part, dims.layers.index(layer), dims.dim))
        return out

    def gather(self, parts: list[tuple[Part, int, int]], rows: Sequence[PrefixSource]) -> list[dict[tuple[Part, int], torch.Tensor]]:
        """Per row, the full prefix of each part: {(part, slot): [1, tokens, dim]}.

        One all-gather (none when no row has a prefix: a replicated decision).
        Allocates the send buffer (the largest rank's share of pages, every
        part side by side) and cp_size receive buffers of its size."""
        out: list[dict[tuple[Part, int], torch.Tensor]] = [{} for _ in rows]
        if not parts or not any(r.tokens for r in rows):
            return out
        cp, ps, dev, dtype = self.cp_size, self.ps, self.m.device, self.m.dtype
        width = sum(d for _, _, d in parts)
        counts = np.zeros(cp, np.int64)
        for r in rows:
            if len(r.owners) and (r.owners.min() < 0 or r.owners.max() >= cp):
                raise ValueError(f"prefix owners outside ranks 0..{cp - 1}: {r.owners}")
            counts += np.bincount(r.owners, minlength=cp)
        most = int(counts.max())
        send = torch.zeros((most, ps, width), dtype=dtype, device=dev)
        mine = [np.flatnonzero(r.owners == self.rank) for r in rows]
        i = 0
        for r, sel in zip(rows, mine):
            if not len(sel):
                continue
            idx = torch.from_numpy(np.ascontiguousarray(r.physical[sel], np.int64)).to(dev)
            block = torch.cat([r.buffers[p][slot].index_select(0, idx) for p, slot, _ in parts], dim=-1)
            send[i : i + len(sel)] = block
            i += len(sel)
        received = self._all_gather(send)  # [cp * most, ps, width]
        offsets = np.arange(cp, dtype=np.int64) * most
        for b, r in enumerate(rows):
            if not r.tokens:
                continue
            rows_at = np.empty(len(r.owners), np.int64)
            for s in range(cp):
                sel = np.flatnonzero(r.owners == s)
                rows_at[sel] = offsets[s] + np.arange(len(sel))
                offsets[s] += len(sel)
            idx = torch.from_numpy(rows_at).to(dev)
            full = received.index_select(0, idx).reshape(-1, width)[: r.tokens]
            lo = 0
            for p, slot, d in parts:
                out[b][(p, slot)] = full[None, :, lo : lo + d]
                lo += d
        return out

    def _all_gather(self, send: torch.Tensor) -> torch.Tensor:
        """Every rank's `send`, stacked by rank along dim 0 (as bytes on the wire)."""
        if self.cp_size == 1:
            return send
        import torch.distributed as dist

        raw = send.contiguous().view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(self.cp_size)]
        dist.all_gather(parts, raw)
        self.collectives += 1
        self.bytes_sent += raw.numel()
        return torch.cat(parts).view(send.dtype)


class SharedKV:
    """One sequence's KV store under CP: the prefix from the layer's exchange,
    new pages into this rank's L1 only where it owns them (`hf_forward.PagedKV`'s
    index rules, restricted to this rank's pages)."""

    def __init__(self, buffers: Buffers, plan: SeqPlan, table: np.ndarray, rank: int, cp_size: int) -> None:
        s, ps = plan.seq, plan.page_size
        assert s.pages is not None, "a CP sequence lives in L1 pages"
        self.buffers = buffers
        self.plan = plan
        device = next(iter(buffers.values()))[0].device
        # The draft reads one entry more (`hf_forward`); at P == 0 the forward supplies it.
        tokens = {Model.TARGET: plan.P, Model.DRAFT: plan.P + 1 if plan.P else 0}
        self.sources: dict[Model, PrefixSource] = {}
        for model, n in tokens.items():
            pages = -(-n // ps)
            self.sources[model] = PrefixSource(buffers, s.pages[:pages], cp_mapping.owner(table[:pages], cp_size), n)
        self.prefix: dict[tuple[Part, int], torch.Tensor] = {}

        def owned(src: np.ndarray, dst_positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            keep = cp_mapping.owned_mask(table[dst_positions // ps], rank, cp_size)
            p = dst_positions[keep]
            return torch.from_numpy(src[keep]).to(device), torch.from_numpy(s.pages[p // ps] * ps + p % ps).to(device)

        w = np.arange(s.write_from, s.write_to)
        j = w[w > s.start]
        self.idx = {Model.TARGET: owned(w - s.start, w), Model.DRAFT: owned(j - (s.start + 1), j)}
        self.zero_slot = int(s.pages[0]) * ps if plan.d_zero and cp_mapping.owner(table[:1], cp_size)[0] == rank else None

    def gather(self, part: Part, slot: int) -> torch.Tensor:
        try:
            return self.prefix[(part, slot)]
        except KeyError:
            raise AssertionError(f"{part.value} slot {slot}: the prefix was read before its exchange") from None

    def scatter(self, part: Part, slot: int, new: torch.Tensor) -> None:
        src, dst = self.idx[part.model]
        t = self.buffers[part][slot]
        flat = t.view(-1, t.shape[-1])
        if len(dst):
            flat.index_copy_(0, dst, new.index_select(0, src))
        if part.model is Model.DRAFT and self.zero_slot is not None:
            flat[self.zero_slot].zero_()


class SharedHooks:
    """`inner`'s hooks, with the layer's prefix exchange after its waits."""

    def __init__(self, inner: LayerHooks, exchange: PrefixExchange, stores: Sequence[SharedKV]) -> None:
        self.inner = inner
        self.exchange = exchange
        self.stores = stores

    def before_layer(self, model: Model, layer: int) -> None:
        self.inner.before_layer(model, layer)
        full = self.exchange.gather(self.exchange.parts_of(model, layer), [s.sources[model] for s in self.stores])
        for store, prefix in zip(self.stores, full):
            store.prefix = prefix

    def after_layer(self, model: Model, layer: int) -> None:
        self.inner.after_layer(model, layer)


class SharedView:
    """CP > 1: see the module docstring."""

    def __init__(self, buffers: Buffers, exchange: PrefixExchange) -> None:
        self.buffers = buffers
        self.exchange = exchange
        self.rank = exchange.rank
        self.cp_size = exchange.cp_size

    def stores(self, rows: Sequence[tuple[np.ndarray, SeqPlan]]) -> list[KVStore]:
        return [SharedKV(self.buffers, plan, table, self.rank, self.cp_size) for table, plan in rows]

    def hooks(self, inner: LayerHooks, stores: Sequence[KVStore]) -> LayerHooks:
        shared = [s for s in stores if isinstance(s, SharedKV)]
        assert len(shared) == len(stores), "every store of a CP forward is a SharedKV"
        return SharedHooks(inner, self.exchange, shared)


def make_view(model: HfModel, buffers: Buffers, rank: int, cp_size: int, exchange: PrefixExchange | None = None) -> KVView:
    """The view of a rank: `LocalView` at CP 1, else `SharedView` over `exchange`
    (default: a new one over the default process group)."""
    if cp_size == 1:
        return LocalView(buffers)
    return SharedView(buffers, exchange or PrefixExchange(model, rank, cp_size))
