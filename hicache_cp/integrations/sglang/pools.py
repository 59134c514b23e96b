"""SGLang's device KV pools as hicache-cp's L1: the layout and page-major byte views.

SGLang 0.5.23 keeps one tensor per layer in each pool, paged by its
`page_size` (token slot `s` is row `s` of the layer; page `p` is rows
`[p * page_size, (p + 1) * page_size)`, page 0 being the padded dummy page,
as hicache-cp's page 0 is). How each pool maps onto the parts of one
logical object:

    MLATokenToKVPool / DSATokenToKVPool    kv_buffer[layer]: [slots, 1, kv_cache_dim] (store dtype)
      -> Part.TARGET_KV                    viewed as uint8 [pages, page_size * kv_cache_dim * itemsize]
    DSATokenToKVPool (the DSA indexer)     index_k_with_scale_buffer[layer]: uint8 [pages, page_size * 132],
      -> Part.TARGET_STATE                 the page's key bytes then its scales; layers that reuse the
                                           previous layer's top-k (index skip) hold a 0-row placeholder:
                                           they are left out, so the part is compacted and keeps the
                                           logical ids of the layers that own index keys. The indexer
                                           reads these keys before its layer's attention fetches KV
                                           (`SGLangKV.read_ahead`).
    MHATokenToKVPool (MHA and GQA:         k_buffer[layer]: [slots, kv_heads, head_dim] -> Part.TARGET_KV
      Llama, Qwen)                         v_buffer[layer]: [slots, kv_heads, v_head_dim] -> Part.TARGET_STATE
                                           K and V of a layer are two parts of the same logical page:
                                           every layer of both is loaded before attention reads the
                                           layer, both are backed up, and a host copy is visible only
                                           with both (the all-parts rule). SGLang may allocate them as
                                           the halves of one tensor: each half is viewed on its own.
                                           Page-leading layouts (`hnd`, `vectorized_5d`) hold a page
                                           per row and are viewed as such.
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

from hicache_cp import ModelLayout
from hicache_cp import KVLayout, Model, Part


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
class _PoolParts:
    """What one pool contributes: its KV part, its second part (indexer keys or V), its kind."""

    kind: str  # "mla", "dsa" or "mha"
    kv: PoolPart
    second: PoolPart | None


@dataclass(frozen=True)
class SGLangKV:
    """The parts of SGLang's pools, their layout and the page count they share.

    `kinds` names each model's pool kind ("mla", "dsa", "mha"); `read_ahead`
    holds the parts read before their layer's hook fires (the DSA indexer's
    keys: the indexer of layer l runs before layer l's attention)."""

    page_size: int
    num_pages: int
    num_target_layers: int
    num_draft_layers: int
    parts: tuple[PoolPart, ...]
    kinds: tuple[tuple[Model, str], ...] = ()
    read_ahead: frozenset[Part] = frozenset()

    @classmethod
    def from_pools(cls, target: Any, drafts: Sequence[Any] = ()) -> SGLangKV:
        """Read `target` (SGLang's MLA, DSA or MHA KV pool) and the MTP draft pools.

        Raises `ValueError` for a pool this plug-in cannot view page-major
        (a quantized MHA pool with scale buffers, a pooled or DCP-sharded
        indexer, drafts of mixed kinds), naming the pool and what differs.
        """
        page_size = int(target.page_size)
        own = _pool_parts(target, Model.TARGET, page_size)
        parts = [own.kv, *([own.second] if own.second is not None else [])]
        kinds = [(Model.TARGET, own.kind)]
        read_ahead = {Part.TARGET_STATE} if own.kind == "dsa" else set()
        num_draft = 0
        draft_kv: list[torch.Tensor] = []
        draft_second: list[tuple[int, torch.Tensor]] = []
        draft_kinds: set[str] = set()
        for pool in drafts:
            if int(pool.page_size) != page_size:
                raise ValueError(f"draft pool {type(pool).__name__}: page_size {pool.page_size} != target's {page_size}")
            got = _pool_parts(pool, Model.DRAFT, page_size)
            draft_kinds.add(got.kind)
            draft_kv.extend(got.kv.views)
            if got.second is not None:
                draft_second.extend((num_draft + i, v) for i, v in zip(got.second.layer_ids, got.second.views))
            num_draft += len(got.kv.views)
        if len(draft_kinds) > 1:
            raise ValueError(f"draft pools of mixed kinds {sorted(draft_kinds)}: one draft KV layout is supported")
        if draft_kv:
            parts.append(PoolPart(Part.DRAFT_KV, tuple(range(num_draft)), tuple(draft_kv)))
            kinds.append((Model.DRAFT, draft_kinds.pop()))
            if kinds[-1][1] == "dsa":
                read_ahead.add(Part.DRAFT_STATE)
        if draft_second:
            ids, views = zip(*draft_second)
            parts.append(PoolPart(Part.DRAFT_STATE, tuple(ids), tuple(views)))
        num_pages = min(v.shape[0] for p in parts for v in p.views)
        trimmed = tuple(PoolPart(p.part, p.layer_ids, tuple(v[:num_pages] for v in p.views)) for p in parts)
        return cls(page_size, num_pages, len(parts[0].views), num_draft, trimmed, tuple(kinds), frozenset(read_ahead))

    def part(self, part: Part) -> PoolPart | None:
        return next((p for p in self.parts if p.part is part), None)

    def kind(self, model: Model) -> str | None:
        return dict(self.kinds).get(model)

    def model_layout(self) -> ModelLayout:
        """The hicache-cp model description of these pools (one byte budget for all parts)."""

        def per_token(part: Part) -> int:
            p = self.part(part)
            return p.bytes_per_token // self.page_size if p is not None else 0

        def ids(part: Part) -> tuple[int, ...] | None:
            p = self.part(part)
            return p.layer_ids if p is not None else None

        return ModelLayout(
            name=f"sglang-{self.kind(Model.TARGET)}",
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

    def describe(self) -> str:
        """The pools' kinds and what each part holds (the start-up log line)."""
        names = {"mla": ("latent", ""), "dsa": ("latent", "index keys"), "mha": ("K", "V")}
        rows = []
        for model, kind in self.kinds:
            kv, second = names[kind]
            first, other = (Part.TARGET_KV, Part.TARGET_STATE) if model is Model.TARGET else (Part.DRAFT_KV, Part.DRAFT_STATE)
            rows.append(f"{model.value} {kind}: {first.value}={kv}" + (f", {other.value}={second}" if second else ""))
        return "; ".join(rows)


def _pool_parts(pool: Any, model: Model, page_size: int) -> _PoolParts:
    """The parts of one pool (`model`'s numbering: TARGET_* or DRAFT_*)."""
    kv_part, second_part = (Part.TARGET_KV, Part.TARGET_STATE) if model is Model.TARGET else (Part.DRAFT_KV, Part.DRAFT_STATE)
    name = type(pool).__name__
    if isinstance(getattr(pool, "k_buffer", None), (list, tuple)) and isinstance(getattr(pool, "v_buffer", None), (list, tuple)):
        if any(getattr(pool, attr, None) is not None for attr in ("k_scale_buffer", "v_scale_buffer")):
            raise ValueError(f"{name}: a quantized MHA pool keeps per-token scales beside K and V; not supported")
        rows_are_pages = getattr(pool, "kv_cache_layout", "nhd") not in (None, "nhd")
        k = _layers(kv_part, pool.k_buffer, page_size, rows_are_pages, f"{name} K")
        v = _layers(second_part, pool.v_buffer, page_size, rows_are_pages, f"{name} V")
        return _PoolParts("mha", k, v)
    buffers = getattr(pool, "kv_buffer", None)
    if not isinstance(buffers, (list, tuple)) or not buffers or not hasattr(pool, "kv_lora_rank"):
        raise ValueError(
            f"{name}: hicache-cp's SGLang plug-in needs an MLA, DSA or MHA KV pool (kv_buffer per layer: "
            "MLATokenToKVPool, DSATokenToKVPool; k_buffer and v_buffer per layer: MHATokenToKVPool)"
        )
    kv = _layers(kv_part, buffers, page_size, False, f"{name} {kv_part.value}")
    state = _state_part(second_part, pool, page_size)
    return _PoolParts("mla" if state is None else "dsa", kv, state)


def _layers(part: Part, buffers: Sequence[torch.Tensor], page_size: int, rows_are_pages: bool, what: str) -> PoolPart:
    views = tuple(_page_major(b, page_size, rows_are_pages, f"{what} layer {i}") for i, b in enumerate(buffers))
    return PoolPart(part, tuple(range(len(views))), views)


def _page_major(t: torch.Tensor, page_size: int, rows_are_pages: bool, what: str) -> torch.Tensor:
    """A layer viewed as uint8 [pages, page bytes] (no copy). Rows are token slots, or
    whole pages in a page-leading layout."""
    if not t.is_contiguous():
        raise ValueError(f"{what}: the layer tensor is not contiguous")
    flat = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    if rows_are_pages:
        return flat.reshape(t.shape[0], -1)
    rows = t.shape[0]
    if rows % page_size:
        raise ValueError(f"{what}: {rows} rows are not whole pages of {page_size}")
    return flat.reshape(rows // page_size, -1)


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
