"""One batched, chunked prefill forward of the real model, layer by layer, over paged KV.

A forward computes a chunk of each of several sequences. Sequence b brings
positions [start_b, end_b) as queries and reads the KV of positions
[0, start_b) (its prefix) from a `KVStore`; the new tokens' KV is written
back to the store for positions [write_from_b, write_to_b). The model's
decoder layers are called one at a time (attention, indexer and MLP are
transformers' own code); between them the engine moves KV:

    for each target layer l:
        hooks.before_layer(TARGET, l)     # the server waits for loads of layer l here
        for each sequence b of the batch:
            cache layer l <- b's prefix KV gathered from the store (latent, rope key, indexer key)
            hidden_b = decoder_layer(hidden_b, mask_b, positions_b, cache)   # appends the chunk's KV
            store <- the chunk's KV of layer l (whole pages only)
        hooks.after_layer(TARGET, l)      # the layer hook: backup of layer l starts
    logits of the last token of every sequence that ends here; next token = argmax
    the MTP draft layer the same way, one position ahead (below); its last
    logits (the shared head over its output) propose the token after the next

The draft's entries are shifted by one, as transformers' own MTP decoding
has them: entry j (rotary position j) reads the embedding of token j and the
target's hidden state at j - 1, so it depends on tokens 0..j only and a
cached page's draft KV is a function of its prefix like the target's. A
chunk of target queries [start, end) computes draft entries [start + 1,
end + 1) over the draft prefix [0, start + 1); entry 0 has no hidden state
before it: it is stored as zeros and masked out. Entry `end` reads the token
after the chunk (`next_token`, or the sampled first token, or a final
chunk's `forced_token`) and gives the proposal; it is not stored, since the
next chunk starts at end - 1 (`scheduler`: a chunk recomputes the last
position before it, whose hidden state the draft needs) and computes it again.

The batch is ragged: each sequence goes through a layer as its own call, on
its own [1, chunk] queries and [prefix | chunk] keys, as a varlen attention
kernel would see it. Padding sequences to one [B, longest chunk] tensor with
the longest prefix costs B x longest chunk x (longest prefix + chunk) of
attention and indexer work: on an H200 a 512-token hit beside a 2,048-token
chunk took 0.43 s padded against 0.07 + 0.04 s apart (bench/experiments/hf_profile.py).
The hooks still fire once per layer for the whole batch.

On CUDA the attention runs on PyTorch's memory-efficient SDPA kernel, not
cuDNN's: cuDNN builds an execution plan for every (query, key) length it has
not seen, and a serving batch is made of such shapes. On an H200 a hit
forward of a new shape took 0.8-2.3 s with the default choice and 36-45 ms
with the memory-efficient kernel, against 20-33 ms for either once warm
(`bench/experiments/hf_profile.py --only-shapes`).

Each sequence's index arrays (`SeqPlan`) are built on the CPU once per
forward (numpy, vectorised) and moved to the device once; every layer and
part reuses them, because all parts share page ids. No host sync inside the
forward: logits and sampled tokens stay on the device until the caller
reads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from hicache_harness.engines.hf_model import HfModel
from hicache_cp.layout import Model, Part


@dataclass
class SeqChunk:
    """One sequence's share of a forward.

    `ids` are the model token ids of positions [start, start + len(ids)).
    `pages` maps page position -> this rank's physical L1 page of the
    sequence (enough pages for [0, write_to)); None for a sequence whose KV
    lives in a `ScratchKV` (no pages, nothing written to L1). `next_token` is the token at
    position `end` (the draft's input for its last entry); None means the
    prompt ends here: the forward samples it from the logits. Both models
    write positions [write_from, write_to) (the draft: its entries, module
    docstring), except the draft's entry `start` when start > 0: that one is
    the previous chunk's last, which a server recomputes by starting the next
    chunk one position early (`scheduler`), so write_from > start there.
    `forced_token` (final chunks only): the draft reads it instead of the
    sampled token; the logits and the sampled token are computed and
    returned as always (a teacher-forced comparison, `hf_spec`).
    """

    ids: np.ndarray
    start: int
    pages: np.ndarray | None
    write_from: int
    write_to: int
    next_token: int | None
    forced_token: int | None = None

    def __post_init__(self) -> None:
        if self.forced_token is not None and self.next_token is not None:
            raise ValueError(f"forced_token {self.forced_token} on a chunk that is not final (next_token {self.next_token})")

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
class SeqPlan:
    """CPU-side index arrays of one sequence's chunk in a forward: `Q` query
    positions [start, start + Q) over a prefix of `P` = start positions,
    padded with `Qp - Q` trailing filler queries (see `build`)."""

    seq: SeqChunk
    page_size: int
    P: int
    Q: int
    Qp: int
    ids: np.ndarray  # [1, Qp]
    positions: np.ndarray  # [1, Qp]
    gather_idx: np.ndarray  # [P] flat token slots of the prefix
    src: np.ndarray  # rows of the chunk [Qp] to store (real queries only)
    dst: np.ndarray  # their flat token slots
    #: The draft's: prefix entries [0, P + 1) (none when P == 0: entry 0 is zeros), the
    #: rows of its chunk entries [P + 1, P + 1 + Qp) to store and their slots, and
    #: whether this chunk stores entry 0 (as zeros).
    d_gather: np.ndarray
    d_src: np.ndarray
    d_dst: np.ndarray
    d_zero: bool

    @classmethod
    def build(cls, s: SeqChunk, page_size: int) -> SeqPlan:
        """The plan of `s`, its queries padded up to a multiple of the page size.

        The padding bounds the shapes the model's kernels see: cuBLAS picks a
        GEMM algorithm per new shape on the host, about 17 ms for one hit
        forward of the real widths on an H200 (`bench/experiments/hf_profile.py
        --only-shapes`), more than a hit's compute. Filler queries come after
        every real one, so under the causal mask no real query sees them;
        their KV is never stored and their logits never read."""
        q = len(s.ids)
        if q == 0:
            raise ValueError("a sequence brings no tokens to the forward")
        if s.write_to > s.write_from and not (s.start <= s.write_from and s.write_to <= s.end):
            raise ValueError(f"write range [{s.write_from}, {s.write_to}) outside [{s.start}, {s.end})")
        qp = -(-q // page_size) * page_size
        ids = np.zeros(qp, np.int64)
        ids[:q] = s.ids
        pos = np.arange(s.start, s.start + qp)
        empty = np.empty(0, np.int64)
        gather, src, dst, d_gather, d_src, d_dst = empty, empty, empty, empty, empty, empty
        d_zero = s.write_from == 0 and s.write_to > 0
        if s.pages is not None:
            gather = _slots(s.pages, np.arange(s.start), page_size)
            if s.start:
                d_gather = _slots(s.pages, np.arange(s.start + 1), page_size)
            if s.write_to > s.write_from:
                w = np.arange(s.write_from, s.write_to)
                src, dst = w - s.start, _slots(s.pages, w, page_size)
                j = w[w > s.start]
                d_src, d_dst = j - (s.start + 1), _slots(s.pages, j, page_size)
        return cls(s, page_size, s.start, q, qp, ids[None], pos[None], gather, src, dst, d_gather, d_src, d_dst, d_zero)

    @property
    def tokens(self) -> int:
        """Real query tokens (padding excluded)."""
        return self.Q

    def mask(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Additive causal mask [1, 1, Qp, P+Qp]: query i sees keys 0..P+i."""
        q = torch.arange(self.Qp, device=device)[:, None]
        k = torch.arange(self.P + self.Qp, device=device)[None, :]
        out = torch.zeros((self.Qp, self.P + self.Qp), dtype=dtype, device=device)
        out.masked_fill_(k > self.P + q, torch.finfo(dtype).min)
        return out[None, None]

    def draft_mask(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The draft's [1, 1, Qp, P+1+Qp]: entry P+1+i sees entries 1..P+1+i (entry 0 is no entry)."""
        q = torch.arange(self.Qp, device=device)[:, None]
        k = torch.arange(self.P + 1 + self.Qp, device=device)[None, :]
        out = torch.zeros((self.Qp, self.P + 1 + self.Qp), dtype=dtype, device=device)
        out.masked_fill_((k > self.P + 1 + q) | (k == 0), torch.finfo(dtype).min)
        return out[None, None]


def _slots(pages: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """Flat token slot (page * page_size + offset) of each position."""
    need = int(positions.max()) // page_size + 1 if len(positions) else 0
    if need > len(pages):
        raise ValueError(f"positions up to {int(positions.max())} need {need} pages, the sequence has {len(pages)}")
    return pages[positions // page_size] * page_size + positions % page_size


class KVStore(Protocol):
    """Where a forward reads one sequence's prefix KV from and writes its new KV to."""

    def gather(self, part: Part, slot: int) -> torch.Tensor:
        """Prefix KV of one layer of one part: [1, P, dim] (a draft part: [1, P + 1, dim]).
        Not called when P == 0 (the draft's prefix is then entry 0: zeros)."""

    def scatter(self, part: Part, slot: int, new: torch.Tensor) -> None:
        """Store the chunk's KV of one layer of one part; `new` is [Qp, dim] (module docstring)."""


class PagedKV:
    """The L1 pools as the KV store: one typed tensor [pages, page_size, dim] per layer."""

    def __init__(self, buffers: dict[Part, list[torch.Tensor]], plan: SeqPlan) -> None:
        self.buffers = buffers
        self.plan = plan
        device = next(iter(buffers.values()))[0].device
        put = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        self.idx = {
            Model.TARGET: (put(plan.gather_idx), put(plan.src), put(plan.dst)),
            Model.DRAFT: (put(plan.d_gather), put(plan.d_src), put(plan.d_dst)),
        }

    def _flat(self, part: Part, slot: int) -> torch.Tensor:
        t = self.buffers[part][slot]
        return t.view(-1, t.shape[-1])

    def gather(self, part: Part, slot: int) -> torch.Tensor:
        return self._flat(part, slot).index_select(0, self.idx[part.model][0])[None]

    def scatter(self, part: Part, slot: int, new: torch.Tensor) -> None:
        _, src, dst = self.idx[part.model]
        flat = self._flat(part, slot)
        if len(dst):
            flat.index_copy_(0, dst, new.index_select(0, src))
        if part.model is Model.DRAFT and self.plan.d_zero:
            flat[self.plan.seq.pages[0] * self.plan.page_size].zero_()  # type: ignore[index]


class ScratchKV:
    """A private contiguous KV store for one sequence computed without the cache
    (the recompute reference): its prefix is everything its earlier chunks wrote."""

    def __init__(self) -> None:
        self.kv: dict[tuple[Part, int], torch.Tensor] = {}
        self.plan: SeqPlan | None = None

    def bind(self, plan: SeqPlan) -> ScratchKV:
        self.plan = plan
        return self

    def gather(self, part: Part, slot: int) -> torch.Tensor:
        assert self.plan is not None
        return self.kv[(part, slot)][None, : self.plan.P + (part.model is Model.DRAFT)]

    def scatter(self, part: Part, slot: int, new: torch.Tensor) -> None:
        """Keep every position (draft: entry) the chunk computed, after the prefix it read."""
        assert self.plan is not None
        new = new[: self.plan.Q]  # the filler queries' KV is not the sequence's
        draft = part.model is Model.DRAFT
        old = self.kv.get((part, slot))
        if old is None:
            assert self.plan.P == 0, "a ScratchKV starts at position 0"
            old = new.new_zeros((1 if draft else 0, new.shape[-1]))  # the draft's entry 0
        self.kv[(part, slot)] = torch.cat([old[: self.plan.P + draft], new])


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [n_final, vocab] float32 on the device, in batch order of the final sequences
    final_rows: list[int]  # batch rows that ended their prompt in this forward
    next_tokens: torch.Tensor  # [n_final] sampled first tokens (device)
    #: [n_final, vocab] float32: the MTP draft's last-token logits (what it predicts after
    #: the sampled token, or the chunk's `forced_token`); their argmax is the draft's proposed token.
    draft_logits: torch.Tensor | None = None

    @property
    def draft_tokens(self) -> torch.Tensor | None:
        return None if self.draft_logits is None else self.draft_logits.argmax(dim=-1)


@dataclass
class _Row:
    """One sequence's tensors during a forward."""

    plan: SeqPlan
    kv: KVStore
    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    pos_emb: Any
    hidden: torch.Tensor
    next_token: torch.Tensor  # [1] the token after the chunk (sampled for a final row unless forced)
    cache: Any  # transformers cache objects of the target and of the draft layer
    draft_cache: Any
    draft_mask: torch.Tensor
    draft_pos_emb: Any  # rotary embeddings of the draft's entries (one position ahead)


class PagedForward:
    """Runs a batch of `SeqPlan`s through the target model and its draft layer."""

    def __init__(self, model: HfModel, attention: Sequence[Any] | None = None) -> None:
        """`attention`: the SDPA backends (`torch.nn.attention.SDPBackend`) the
        forward may use on CUDA; None: every one but cuDNN's (module docstring)."""
        from transformers import DynamicCache

        self.m = model
        self._cache_cls = DynamicCache
        parts = model.parts
        self.target_parts = (parts[Part.TARGET_KV], parts.get(Part.TARGET_STATE))
        self.draft_parts = (parts[Part.DRAFT_KV], parts.get(Part.DRAFT_STATE))
        self._attention = _attention_backends(model.device, attention)

    @torch.no_grad()
    def run(self, batch: Sequence[tuple[SeqPlan, KVStore]], hooks: LayerHooks | None = None) -> ForwardResult:
        with self._attention():
            return self._run(batch, hooks)

    def _run(self, batch: Sequence[tuple[SeqPlan, KVStore]], hooks: LayerHooks | None) -> ForwardResult:
        if not batch:
            raise ValueError("a forward needs at least one sequence")
        hooks = hooks or NoHooks()
        m = self.m
        base = m.target.model
        rows = [self._row(plan, kv) for plan, kv in batch]  # every host->device copy before the first kernel
        for layer, decoder in enumerate(base.layers):
            hooks.before_layer(Model.TARGET, layer)
            for r in rows:
                self._fill(r.cache, layer, layer, r, self.target_parts)
                r.hidden = decoder(
                    r.hidden, attention_mask=r.mask, position_embeddings=r.pos_emb, position_ids=r.positions,
                    past_key_values=r.cache, use_cache=True,
                )  # fmt: skip
                self._drain(r.cache, layer, layer, r, self.target_parts)
            hooks.after_layer(Model.TARGET, layer)
        final_rows = [b for b, (plan, _) in enumerate(batch) if plan.seq.final]
        logits = torch.empty((0, m.vocab_size), dtype=torch.float32, device=m.device)
        if final_rows:
            last = torch.cat([rows[b].hidden[:, rows[b].plan.Q - 1] for b in final_rows])
            logits = m.target.lm_head(base.norm(last)).float()
        sampled = logits.argmax(dim=-1)
        for i, b in enumerate(final_rows):
            if rows[b].plan.seq.forced_token is None:  # else the draft reads the forced token (`_row`)
                rows[b].next_token = sampled[i : i + 1]
        hooks.before_layer(Model.DRAFT, 0)
        draft_last: list[torch.Tensor] = []
        for r in rows:
            self._fill(r.draft_cache, 0, 0, r, self.draft_parts)
            q = r.plan.Q
            draft_ids = torch.cat([r.ids[:, 1:q], r.next_token[:, None], r.ids[:, q:]], dim=1)
            out = m.draft(
                inputs_embeds=base.embed_tokens(draft_ids), previous_hidden_state=r.hidden,
                position_embeddings=r.draft_pos_emb, attention_mask=r.draft_mask, position_ids=r.positions + 1,
                past_key_values=r.draft_cache, use_cache=True,
            )  # fmt: skip
            if r.plan.seq.final:
                draft_last.append(out[:, q - 1])
            self._drain(r.draft_cache, 0, 0, r, self.draft_parts)
        hooks.after_layer(Model.DRAFT, 0)
        draft_logits = torch.empty_like(logits)
        if draft_last:  # the MTP layer's output is post-normed; the head is the target's (shared)
            draft_logits = m.target.lm_head(torch.cat(draft_last)).float()
        return ForwardResult(logits, final_rows, sampled, draft_logits)

    def _row(self, plan: SeqPlan, kv: KVStore) -> _Row:
        m = self.m
        dev = m.device
        ids = torch.from_numpy(plan.ids).to(dev)
        positions = torch.from_numpy(plan.positions).to(dev)
        seq = plan.seq
        nxt = seq.next_token if seq.next_token is not None else seq.forced_token if seq.forced_token is not None else 0
        hidden = m.target.model.embed_tokens(ids)
        rope = m.target.model.rotary_emb
        return _Row(plan, kv, ids, positions, plan.mask(dev, m.dtype), rope(hidden, position_ids=positions), hidden,
                    torch.tensor([nxt], device=dev), self._cache_cls(config=m.target_config),
                    self._cache_cls(config=m.draft_config), plan.draft_mask(dev, m.dtype),
                    rope(hidden, position_ids=positions + 1))  # fmt: skip

    def _fill(self, cache: Any, idx: int, layer: int, row: _Row, parts: tuple[Any, Any]) -> None:
        """Put the prefix KV of `layer` into the transformers cache layer `idx`
        (the draft's: entries [0, P + 1), entry 0 zeros at P == 0)."""
        kv_part, state_part = parts
        draft = kv_part.part.model is Model.DRAFT
        if row.plan.P == 0 and not draft:
            return
        has_state = state_part is not None and layer in state_part.layers
        if row.plan.P == 0:  # the draft at position 0: entry 0 only, no entry at all (masked)
            prefix = row.hidden.new_zeros((1, 1, kv_part.dim))
            state = row.hidden.new_zeros((1, 1, state_part.dim)) if has_state else None
        else:
            prefix = row.kv.gather(kv_part.part, kv_part.layers.index(layer))
            state = row.kv.gather(state_part.part, state_part.layers.index(layer)) if has_state else None
        rank = self.m.kv_lora_rank
        cache.update(prefix[..., :rank].unsqueeze(1), prefix[..., rank:].unsqueeze(1), idx)
        if state is not None:
            cache.update_indexer(state, idx)

    def _drain(self, cache: Any, idx: int, layer: int, row: _Row, parts: tuple[Any, Any]) -> None:
        """Store the chunk's KV of `layer` from the cache layer, then free the layer."""
        kv_part, state_part = parts
        cl = cache.layers[idx]
        P, Qp = row.plan.P + (kv_part.part.model is Model.DRAFT), row.plan.Qp
        new = torch.cat([cl.keys[:, 0, P:], cl.values[:, 0, P:]], dim=-1).reshape(Qp, kv_part.dim)
        row.kv.scatter(kv_part.part, kv_part.layers.index(layer), new)
        if state_part is not None and layer in state_part.layers:
            row.kv.scatter(state_part.part, state_part.layers.index(layer), cl.indexer_keys[:, P:].reshape(Qp, state_part.dim))
        cl.reset()


def _attention_backends(
    device: torch.device, allowed: Sequence[Any] | None
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The SDPA kernels a forward may use (see the module docstring): on CUDA
    `allowed`, by default every backend but cuDNN's; elsewhere whatever PyTorch picks."""
    if device.type != "cuda":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = list(allowed or (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH))
    return lambda: sdpa_kernel(backends)
