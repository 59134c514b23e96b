"""One batched, chunked prefill forward of the real model, layer by layer, over paged KV.

A forward computes a chunk of each of several sequences. Sequence b brings
positions [start_b, end_b) as queries and reads the KV of positions
[0, start_b) (its prefix) from a `KVStore`; the new tokens' KV is written
back to the store for positions [write_from_b, write_to_b). The model's
decoder layers are called one at a time (attention, indexer and MLP are
transformers' own code); between them the engine moves KV:

    for each target layer l:
        hooks.before_layer(TARGET, l)     # the server waits for loads of layer l here
        cache layer l <- prefix KV gathered from the store (latent, rope key, indexer key)
        hidden = decoder_layer(hidden, mask, positions, cache)   # appends the chunk's KV
        store <- the chunk's KV of layer l (whole pages only)
        hooks.after_layer(TARGET, l)      # the layer hook: backup of layer l starts
    logits of the last token of every sequence that ends here; next token = argmax
    the MTP draft layer the same way (input: embedding of the next token, target hidden)

Batch layout: sequences are left-padded to the longest chunk Q and their
prefixes left-padded to the longest prefix P; the transformers cache layer
holds [prefix region P | chunk region Q]. The 4-D additive mask lets a query
see its own sequence's prefix and the causal part of its chunk (by absolute
position); a padded query sees only itself (no all-masked rows). The last
query slot is every sequence's last token.

The index arrays are built on the CPU once per forward (numpy, vectorised)
and moved to the device once; every layer and part reuses them, because all
parts share page ids. No host sync inside the forward: logits and sampled
tokens stay on the device until the caller reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from hicache_cp.harness.engines.hf_model import HfModel
from hicache_cp.layout import Model, Part


@dataclass
class SeqChunk:
    """One sequence's share of a forward.

    `ids` are the model token ids of positions [start, start + len(ids)).
    `pages` maps page position -> this rank's physical L1 page of the
    sequence (enough pages for [0, write_to)); None for a sequence whose KV
    lives in a `ScratchKV` (no pages, nothing written to L1). `next_token` is the token at
    position `end` (the draft's input for the last position); None means the
    prompt ends here: the forward samples it from the logits.
    """

    ids: np.ndarray
    start: int
    pages: np.ndarray | None
    write_from: int
    write_to: int
    next_token: int | None

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    @property
    def final(self) -> bool:
        return self.next_token is None


class LayerHooks(Protocol):
    def before_layer(self, model: Model, layer: int) -> None:
        """Layer `layer` of `model` is about to read the prefix (wait for its loads)."""

    def after_layer(self, model: Model, layer: int) -> None:
        """Layer `layer` of `model` wrote its KV into the store (fire the layer hook)."""


class NoHooks:
    def before_layer(self, model: Model, layer: int) -> None:
        pass

    def after_layer(self, model: Model, layer: int) -> None:
        pass


@dataclass
class BatchPlan:
    """CPU-side index arrays of one forward (see the module docstring)."""

    seqs: list[SeqChunk]
    page_size: int
    B: int = 0
    Q: int = 0
    P: int = 0
    ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # [B, Q]
    positions: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # [B, Q]
    q_valid: np.ndarray = field(default_factory=lambda: np.empty(0, bool))  # [B, Q]
    kv_pos: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # [B, P+Q], -1 where padded
    gather_idx: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # [B*P] flat token slots
    src: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # rows of [B*Q] to store
    dst: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # their flat token slots

    @classmethod
    def build(cls, seqs: list[SeqChunk], page_size: int) -> BatchPlan:
        if not seqs:
            raise ValueError("a forward needs at least one sequence")
        ps = page_size
        B = len(seqs)
        Q = max(len(s.ids) for s in seqs)
        P = max(s.start for s in seqs)
        ids = np.zeros((B, Q), np.int64)
        positions = np.zeros((B, Q), np.int64)
        q_valid = np.zeros((B, Q), bool)
        kv_pos = np.full((B, P + Q), -1, np.int64)
        gather = np.zeros((B, P), np.int64)
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        for b, s in enumerate(seqs):
            q = len(s.ids)
            if q == 0:
                raise ValueError(f"sequence {b} of the batch brings no tokens")
            if s.write_to > s.write_from and not (s.start <= s.write_from and s.write_to <= s.end):
                raise ValueError(f"sequence {b}: write range [{s.write_from}, {s.write_to}) outside [{s.start}, {s.end})")
            pos = np.arange(s.start, s.end)
            ids[b, Q - q :] = s.ids
            positions[b, Q - q :] = pos
            q_valid[b, Q - q :] = True
            kv_pos[b, P + Q - q :] = pos
            prefix = np.arange(s.start)
            kv_pos[b, P - s.start : P] = prefix
            if s.pages is None:
                continue
            gather[b, P - s.start :] = _slots(s.pages, prefix, ps)
            if s.write_to > s.write_from:
                w = np.arange(s.write_from, s.write_to)
                src.append(b * Q + (Q - q) + (w - s.start))
                dst.append(_slots(s.pages, w, ps))
        empty = np.empty(0, np.int64)
        return cls(
            seqs, ps, B, Q, P, ids, positions, q_valid, kv_pos, gather.reshape(-1),
            np.concatenate(src) if src else empty, np.concatenate(dst) if dst else empty,
        )  # fmt: skip

    @property
    def tokens(self) -> int:
        """Query tokens computed (padding excluded)."""
        return int(self.q_valid.sum())

    def mask(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, Q, P+Q]: 0 where a query may look, the dtype's minimum elsewhere."""
        kv_pos = torch.from_numpy(self.kv_pos).to(device)
        q_pos = torch.from_numpy(self.positions).to(device)
        q_valid = torch.from_numpy(self.q_valid).to(device)
        allowed = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
        own = torch.zeros_like(allowed)
        idx = torch.arange(self.Q, device=device)
        own[:, idx, self.P + idx] = True
        allowed |= own & ~q_valid[:, :, None]  # a padded query sees only itself
        out = torch.zeros(allowed.shape, dtype=dtype, device=device)
        out.masked_fill_(~allowed, torch.finfo(dtype).min)
        return out[:, None, :, :]


def _slots(pages: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """Flat token slot (page * page_size + offset) of each position."""
    need = int(positions.max()) // page_size + 1 if len(positions) else 0
    if need > len(pages):
        raise ValueError(f"positions up to {int(positions.max())} need {need} pages, the sequence has {len(pages)}")
    return pages[positions // page_size] * page_size + positions % page_size


class KVStore(Protocol):
    """Where a forward reads prefix KV from and writes new KV to."""

    def gather(self, part: Part, slot: int) -> torch.Tensor:
        """Prefix KV of one layer of one part: [B, P, dim], left-padded."""

    def scatter(self, part: Part, slot: int, new: torch.Tensor) -> None:
        """Store the chunk's KV of one layer of one part; `new` is [B*Q, dim]."""


class PagedKV:
    """The L1 pools as the KV store: one typed tensor [pages, page_size, dim] per layer."""

    def __init__(self, buffers: dict[Part, list[torch.Tensor]], plan: BatchPlan) -> None:
        self.buffers = buffers
        self.plan = plan
        device = next(iter(buffers.values()))[0].device
        self.gather_idx = torch.from_numpy(plan.gather_idx).to(device)
        self.src = torch.from_numpy(plan.src).to(device)
        self.dst = torch.from_numpy(plan.dst).to(device)

    def _flat(self, part: Part, slot: int) -> torch.Tensor:
        t = self.buffers[part][slot]
        return t.view(-1, t.shape[-1])

    def gather(self, part: Part, slot: int) -> torch.Tensor:
        flat = self._flat(part, slot)
        return flat.index_select(0, self.gather_idx).view(self.plan.B, self.plan.P, flat.shape[-1])

    def scatter(self, part: Part, slot: int, new: torch.Tensor) -> None:
        if len(self.dst):
            self._flat(part, slot).index_copy_(0, self.dst, new.index_select(0, self.src))


class ScratchKV:
    """A private contiguous KV store for one sequence computed without the cache
    (the recompute reference): its prefix is everything its earlier chunks wrote."""

    def __init__(self) -> None:
        self.kv: dict[tuple[Part, int], torch.Tensor] = {}
        self.plan: BatchPlan | None = None

    def bind(self, plan: BatchPlan) -> ScratchKV:
        if plan.B != 1:
            raise ValueError("ScratchKV holds one sequence")
        self.plan = plan
        return self

    def gather(self, part: Part, slot: int) -> torch.Tensor:
        assert self.plan is not None
        return self.kv[(part, slot)][None, : self.plan.P]

    def scatter(self, part: Part, slot: int, new: torch.Tensor) -> None:
        old = self.kv.get((part, slot))
        self.kv[(part, slot)] = new if old is None else torch.cat([old, new])


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [n_final, vocab] float32 on the device, in batch order of the final sequences
    final_rows: list[int]  # batch rows that ended their prompt in this forward
    next_tokens: torch.Tensor  # [n_final] sampled first tokens (device)


class PagedForward:
    """Runs `BatchPlan`s through the target model and its draft layer."""

    def __init__(self, model: HfModel) -> None:
        from transformers import DynamicCache

        self.m = model
        self._cache_cls = DynamicCache
        parts = model.parts
        self.target_parts = (parts[Part.TARGET_KV], parts.get(Part.TARGET_STATE))
        self.draft_parts = (parts[Part.DRAFT_KV], parts.get(Part.DRAFT_STATE))

    @torch.no_grad()
    def run(self, plan: BatchPlan, kv: KVStore, hooks: LayerHooks | None = None) -> ForwardResult:
        hooks = hooks or NoHooks()
        m = self.m
        dev = m.device
        base = m.target.model
        # Every host->device copy before the first kernel: none waits for compute later.
        ids = torch.from_numpy(plan.ids).to(dev)
        positions = torch.from_numpy(plan.positions).to(dev)
        final_rows = [b for b, s in enumerate(plan.seqs) if s.final]
        rows = torch.tensor(final_rows, dtype=torch.long, device=dev)
        nxt = torch.tensor([s.next_token if s.next_token is not None else 0 for s in plan.seqs], device=dev)
        mask = plan.mask(dev, m.dtype)
        hidden = base.embed_tokens(ids)
        pos_emb = base.rotary_emb(hidden, position_ids=positions)
        cache = self._cache_cls(config=m.target_config)
        for layer, decoder in enumerate(base.layers):
            hooks.before_layer(Model.TARGET, layer)
            self._fill(cache, layer, layer, kv, self.target_parts, plan)
            hidden = decoder(
                hidden, attention_mask=mask, position_embeddings=pos_emb, position_ids=positions,
                past_key_values=cache, use_cache=True,
            )  # fmt: skip
            self._drain(cache, layer, layer, kv, self.target_parts, plan)
            hooks.after_layer(Model.TARGET, layer)
        logits = m.target.lm_head(base.norm(hidden[rows, -1])).float()
        sampled = logits.argmax(dim=-1)
        nxt[rows] = sampled
        draft_ids = torch.cat([ids[:, 1:], nxt[:, None]], dim=1)
        dcache = self._cache_cls(config=m.draft_config)
        hooks.before_layer(Model.DRAFT, 0)
        self._fill(dcache, 0, 0, kv, self.draft_parts, plan)
        m.draft(
            inputs_embeds=base.embed_tokens(draft_ids), previous_hidden_state=hidden, position_embeddings=pos_emb,
            attention_mask=mask, position_ids=positions, past_key_values=dcache, use_cache=True,
        )  # fmt: skip
        self._drain(dcache, 0, 0, kv, self.draft_parts, plan)
        hooks.after_layer(Model.DRAFT, 0)
        return ForwardResult(logits, final_rows, sampled)

    def _fill(self, cache: Any, idx: int, layer: int, kv: KVStore, parts: tuple[Any, Any], plan: BatchPlan) -> None:
        """Put the prefix KV of `layer` into the transformers cache layer `idx`."""
        if plan.P == 0:
            return
        kv_part, state_part = parts
        rank = self.m.kv_lora_rank
        prefix = kv.gather(kv_part.part, kv_part.layers.index(layer))
        cache.update(prefix[..., :rank].unsqueeze(1), prefix[..., rank:].unsqueeze(1), idx)
        if state_part is not None and layer in state_part.layers:
            cache.update_indexer(kv.gather(state_part.part, state_part.layers.index(layer)), idx)

    def _drain(self, cache: Any, idx: int, layer: int, kv: KVStore, parts: tuple[Any, Any], plan: BatchPlan) -> None:
        """Store the chunk's KV of `layer` from the cache layer, then free the layer."""
        kv_part, state_part = parts
        cl = cache.layers[idx]
        P, BQ = plan.P, plan.B * plan.Q
        new = torch.cat([cl.keys[:, 0, P:], cl.values[:, 0, P:]], dim=-1).reshape(BQ, kv_part.dim)
        kv.scatter(kv_part.part, kv_part.layers.index(layer), new)
        if state_part is not None and layer in state_part.layers:
            kv.scatter(state_part.part, state_part.layers.index(layer), cl.indexer_keys[:, P:].reshape(BQ, state_part.dim))
        cl.reset()
