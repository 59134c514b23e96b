"""SGLang's device KV pools as hicache-cp's L1: the layout and page-major byte views.

SGLang 0.5.23 keeps one tensor per layer in each pool, paged by its
`page_size` (token slot `s` is row `s` of the layer; page `p` is rows
`[p * page_size, (p + 1) * page_size)`, page 0 being the padded dummy page,
as hicache-cp's page 0 is):

    MLATokenToKVPool / DSATokenToKVPool    kv_buffer[layer]: [slots, 1, kv_cache_dim] (store dtype)
      -> Part.TARGET_KV                    viewed as uint8 [pages, page_size * kv_cache_dim * itemsize]
    DSATokenToKVPool (the DSA indexer)     index_k_with_scale_buffer[layer]: uint8 [pages, page_size * 132],
      -> Part.TARGET_STATE                 the page's key bytes then its scales; layers that reuse the
                                           previous layer's top-k (index skip) hold a 0-row placeholder:
                                           they are left out, so the part is compacted and keeps the
                                           logical ids of the layers that own index keys
    the MTP draft's pools                  the same shapes, draft numbering
      (CacheInitParams.mtp_draft_device_pools) -> Part.DRAFT_KV / Part.DRAFT_STATE

Target and draft pools share SGLang's token slots, so one page id names the
same tokens in every part: hicache-cp's "one logical object" holds by
construction. Nothing is copied: the views alias SGLang's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache_cp.config import ModelLayout
from hicache_cp.layout import KVLayout, Part


@dataclass(frozen=True)
class PoolPart:
    """One part as SGLang holds it: its logical layer ids and one uint8 view per layer."""

    part: Part
    layer_ids: tuple[int, ...]
    views: tuple[torch.Tensor, ...]  # uint8 [pages, page_bytes], one per layer id

    @property
    def bytes_per_token(self) -> int:
        return self.views[0].shape[1]


@dataclass(frozen=True)
class SGLangKV:
    """The parts of SGLang's pools, their layout and the page count they share."""

    page_size: int
    num_pages: int
    num_target_layers: int
    num_draft_layers: int
    parts: tuple[PoolPart, ...]

    @classmethod
    def from_pools(cls, target: Any, drafts: Sequence[Any] = ()) -> SGLangKV:
        """Read `target` (SGLang's MLA or DSA KV pool) and the MTP draft pools.

        Raises `ValueError` for a pool this plug-in cannot view page-major
        (MHA's separate K and V buffers, a pooled or DCP-sharded indexer),
        naming the pool and what differs.
        """
        page_size = int(target.page_size)
        parts = [_kv_part(Part.TARGET_KV, target, page_size)]
        state = _state_part(Part.TARGET_STATE, target, page_size)
        if state is not None:
            parts.append(state)
        num_draft = 0
        draft_kv: list[torch.Tensor] = []
        draft_state: list[tuple[int, torch.Tensor]] = []
        for pool in drafts:
            if int(pool.page_size) != page_size:
                raise ValueError(f"draft pool {type(pool).__name__}: page_size {pool.page_size} != target's {page_size}")
            kv = _kv_part(Part.DRAFT_KV, pool, page_size)
            draft_kv.extend(kv.views)
            st = _state_part(Part.DRAFT_STATE, pool, page_size)
            if st is not None:
                draft_state.extend((num_draft + i, v) for i, v in zip(st.layer_ids, st.views))
            num_draft += len(kv.views)
        if draft_kv:
            parts.append(PoolPart(Part.DRAFT_KV, tuple(range(num_draft)), tuple(draft_kv)))
        if draft_state:
            ids, views = zip(*draft_state)
            parts.append(PoolPart(Part.DRAFT_STATE, tuple(ids), tuple(views)))
        num_pages = min(v.shape[0] for p in parts for v in p.views)
        trimmed = tuple(PoolPart(p.part, p.layer_ids, tuple(v[:num_pages] for v in p.views)) for p in parts)
        return cls(page_size, num_pages, len(parts[0].views), num_draft, trimmed)

    def part(self, part: Part) -> PoolPart | None:
        return next((p for p in self.parts if p.part is part), None)

    def model_layout(self) -> ModelLayout:
        """The hicache-cp model description of these pools (one byte budget for all parts)."""

        def per_token(part: Part) -> int:
            p = self.part(part)
            return p.bytes_per_token // self.page_size if p is not None else 0

        def ids(part: Part) -> tuple[int, ...] | None:
            p = self.part(part)
            return p.layer_ids if p is not None else None

        return ModelLayout(
            name="sglang",
            num_layers=self.num_target_layers,
            kv_bytes_per_token=per_token(Part.TARGET_KV),
            state_bytes_per_token=per_token(Part.TARGET_STATE),
            state_layers=ids(Part.TARGET_STATE),
            draft_layers=self.num_draft_layers,
            draft_kv_bytes_per_token=per_token(Part.DRAFT_KV),
            draft_state_bytes_per_token=per_token(Part.DRAFT_STATE),
            draft_state_layers=ids(Part.DRAFT_STATE),
        )

    def layout(self) -> KVLayout:
        return self.model_layout().layout(self.page_size)

    def buffers(self) -> dict[Part, list[torch.Tensor]]:
        """`DevicePool(buffers=...)`: per part, one page-major view per compact slot."""
        return {p.part: list(p.views) for p in self.parts}


def _page_major(t: torch.Tensor, page_size: int, what: str) -> torch.Tensor:
    """A layer's rows viewed as uint8 [pages, page_size * row_bytes] (no copy)."""
    if not t.is_contiguous():
        raise ValueError(f"{what}: the layer tensor is not contiguous")
    rows = t.shape[0]
    if rows % page_size:
        raise ValueError(f"{what}: {rows} rows are not whole pages of {page_size}")
    flat = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return flat.reshape(rows // page_size, -1)


def _kv_part(part: Part, pool: Any, page_size: int) -> PoolPart:
    name = type(pool).__name__
    buffers = getattr(pool, "kv_buffer", None)
    if not isinstance(buffers, (list, tuple)) or not buffers or not hasattr(pool, "kv_lora_rank"):
        raise ValueError(
            f"{name}: hicache-cp's SGLang plug-in needs an MLA KV pool (kv_buffer per layer, "
            "MLATokenToKVPool or DSATokenToKVPool); MHA pools keep K and V apart"
        )
    views = tuple(_page_major(b, page_size, f"{name} {part.value} layer {i}") for i, b in enumerate(buffers))
    return PoolPart(part, tuple(range(len(views))), views)


def _state_part(part: Part, pool: Any, page_size: int) -> PoolPart | None:
    """The DSA indexer's key-with-scale buffer, compacted to the layers that own one."""
    if not hasattr(pool, "index_k_with_scale_buffer"):
        return None
    name = type(pool).__name__
    if getattr(pool, "index_kpool", 1) != 1 or getattr(pool, "index_page_size", page_size) != page_size:
        raise ValueError(f"{name}: a pooled or DCP-sharded indexer cache is not page-aligned with the KV pages")
    ids, views = [], []
    for layer, buf in enumerate(pool.index_k_with_scale_buffer):
        if buf.shape[0] == 0:  # index skip: this layer reuses the previous layer's top-k
            continue
        if buf.dtype != torch.uint8 or buf.dim() != 2:
            raise ValueError(f"{name} {part.value} layer {layer}: expected uint8 [pages, bytes], got {buf.dtype} "
                             f"{tuple(buf.shape)}")
        ids.append(layer)
        views.append(buf)
    if not ids:
        return None
    return PoolPart(part, tuple(ids), tuple(views))
