"""How vLLM's KV cache maps onto hicache-cp's logical object (both processes).

vLLM describes its KV cache in a `KVCacheConfig`: groups of layer names that
share one block table, each layer with a spec (`page_size_bytes`, the MLA
indexer's `cache_role`, `is_draft`). Both connector roles build the same
`KVPlan` from it, so the scheduler's page accounting and the worker's copies
agree byte for byte:

    vLLM                                   hicache-cp
    block id (one block table)             device page id (block 0: vLLM's null block = our dummy page)
    block_size tokens                      page_size tokens
    attention / MLA layer i of the target  Part.TARGET_KV, layer i (dense order of the KV layers)
    MLA indexer cache (cache_role INDEXER) Part.TARGET_STATE, the layer of its attention
    draft (MTP) layers                     Part.DRAFT_KV / DRAFT_STATE, dense draft order
    per-layer tensor, page-major           `DevicePool` buffer [num_blocks, page_bytes] (a view, no copy)

Layer indices come from the names (`...layers.<i>...`).

Layouts. vLLM 0.33 views every attention layer's cache as [B, H, N, C]
(blocks, heads, tokens, content bytes; a dense layer's C holds K then V of
one head and token) over one backing allocation, placed by the resolved
`KVCacheLayout`. The layer-compact ones keep each layer's block one dense
page: LBNHC (NHD, the default of FlashAttention, Triton and MLA) and LBHNC
(HND, FlashInfer's and vLLM's OffloadingConnector's). They are page-major and
supported, dense and MLA alike; the connector asks vLLM for LBNHC
(`PREFERRED_LAYOUT`), and VLLM_KV_CACHE_LAYOUT may pick LBHNC. The others
interleave the layers inside a block (BLHNC, BLNHC, BHLNC: block-outermost,
the only ones the DeepSeek-V3.2 indexer backend takes) or the heads across
blocks (LHBNC): a layer's page is then strided by other layers' or blocks'
bytes, which the copy engines do not address; they are refused at
`register_kv_caches` with the reason.

One KV cache group (one block table). The connector keeps vLLM's hybrid KV
cache manager on; a model it splits into several groups (sliding-window and
full attention, Mamba) is refused at start: a host hit would have to restore
each group's own blocks, the sliding-window ones only inside the window,
under block tables the jobs do not carry. `--disable-hybrid-kv-cache-manager`
gives such a model one group (full-attention KV for every layer).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hicache_cp import KVLayout, Model, Part

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """The model layer index in a vLLM layer name (`model.layers.3.self_attn.attn` -> 3)."""
    found = _LAYER_INDEX.findall(name)
    if len(found) != 1:
        raise ValueError(f"vLLM layer name {name!r}: expected exactly one '.layers.<i>.' in it")
    return int(found[0])


@dataclass(frozen=True)
class LayerSlot:
    """Where one vLLM layer's cache lives in the logical object."""

    part: Part
    layer: int  # logical layer id of `part.model` (dense order)

    @property
    def model(self) -> Model:
        return self.part.model


@dataclass(frozen=True)
class KVPlan:
    """The layout, the layer map and the page geometry, from vLLM's KV cache config."""

    layout: KVLayout
    block_size: int
    num_blocks: int
    slots: dict[str, LayerSlot]  # vLLM layer name -> (part, layer)
    replicated: bool = False  # MLA: vLLM keeps the same KV on every TP rank

    #: The `KVCacheLayout` the connector asks vLLM for (layer-compact, token-major).
    PREFERRED_LAYOUT = "LBNHC"

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, num_hidden_layers: int) -> KVPlan:
        """Build the plan; ValueError naming the layer for anything it cannot map."""
        groups = [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
        if len(groups) != 1:
            raise ValueError(
                f"hicache-cp's vLLM connector needs exactly one KV cache group (one block table); "
                f"vLLM's hybrid KV cache manager split this model into {len(groups)} "
                f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}): run with "
                f"--disable-hybrid-kv-cache-manager (one group, full-attention KV for every layer)"
            )
        group = groups[0]
        block_size = int(group.kv_cache_spec.block_size)
        roles = _layer_roles(kv_cache_config, group)
        # (model, is_state) -> [(index, name, bytes_per_token)]
        found: dict[tuple[Model, bool], list[tuple[int, str, int]]] = {}
        for name in group.layer_names:
            page, state, is_draft = roles[name]
            if page % block_size:
                raise ValueError(f"layer {name}: page of {page} B is not a whole number of bytes per token")
            index = layer_index(name)
            draft = is_draft or index >= num_hidden_layers
            model = Model.DRAFT if draft else Model.TARGET
            found.setdefault((model, state), []).append((index, name, page // block_size))
        if not found.get((Model.TARGET, False)):
            raise ValueError(f"no target attention layer among {list(group.layer_names)}")
        slots: dict[str, LayerSlot] = {}
        dense: dict[Model, dict[int, int]] = {}
        per_token: dict[Part, int] = {}
        state_ids: dict[Model, tuple[int, ...]] = {}
        for model in (Model.TARGET, Model.DRAFT):
            kv = sorted(found.get((model, False), []))
            dense[model] = {index: i for i, (index, _, _) in enumerate(kv)}
            for is_state in (False, True):
                part = _part(model, is_state)
                rows = sorted(found.get((model, is_state), []))
                if not rows:
                    continue
                sizes = {b for _, _, b in rows}
                if len(sizes) != 1:
                    raise ValueError(f"{part.value}: layers differ in bytes per token {sorted(sizes)}")
                per_token[part] = sizes.pop()
                ids = []
                for index, name, _ in rows:
                    if index not in dense[model]:
                        raise ValueError(f"layer {name}: indexer cache of layer {index}, which has no attention cache")
                    ids.append(dense[model][index])
                    slots[name] = LayerSlot(part, dense[model][index])
                if is_state:
                    state_ids[model] = tuple(ids)
        layout = KVLayout.build(
            page_size=block_size,
            num_layers=len(dense[Model.TARGET]),
            kv_bytes_per_token=per_token[Part.TARGET_KV],
            state_bytes_per_token=per_token.get(Part.TARGET_STATE, 0),
            state_layers=state_ids.get(Model.TARGET),
            draft_layers=len(dense[Model.DRAFT]),
            draft_kv_bytes_per_token=per_token.get(Part.DRAFT_KV, 0),
            draft_state_bytes_per_token=per_token.get(Part.DRAFT_STATE, 0),
            draft_state_layers=state_ids.get(Model.DRAFT),
        )
        replicated = _is_mla(group.kv_cache_spec)
        return cls(layout, block_size, int(kv_cache_config.num_blocks), slots, replicated)

    def slot(self, layer_name: str) -> LayerSlot:
        try:
            return self.slots[layer_name]
        except KeyError:
            raise ValueError(
                f"vLLM layer {layer_name!r} is not in the KV cache config the connector was built for"
            ) from None

    def device_buffers(self, kv_caches: Mapping[str, torch.Tensor]) -> dict[Part, list[torch.Tensor]]:
        """vLLM's per-layer tensors as `DevicePool` buffers: per part, one uint8
        [num_blocks, page_bytes] view per layer in slot order. No copy."""
        missing = sorted(set(self.slots) - set(kv_caches))
        if missing:
            raise ValueError(f"register_kv_caches: no tensor for layers {missing}")
        out: dict[Part, list[torch.Tensor | None]] = {
            p.part: [None] * p.num_slots for p in self.layout.parts
        }
        for name, where in self.slots.items():
            p = self.layout.part(where.part)
            out[where.part][p.slot(where.layer)] = page_major(kv_caches[name], self.num_blocks, p.page_bytes, name)
        return {part: [t for t in ts if t is not None] for part, ts in out.items()}


def page_major(t: torch.Tensor, num_blocks: int, page_bytes: int, name: str = "layer") -> torch.Tensor:
    """View one layer's KV tensor as uint8 [num_blocks, page_bytes] without copying.

    Accepts any dtype and any stride order in which dimension 0 (blocks, or
    kernel blocks, a whole number per block) is outermost in memory and the
    tensor is dense. ValueError otherwise, with the shape and strides.
    """
    why = None
    if t.dim() == 0 or t.shape[0] % num_blocks:
        why = f"dimension 0 ({t.shape[0] if t.dim() else '-'}) is not a multiple of the {num_blocks} blocks"
    else:
        order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
        physical = t.permute(*order)
        if order[0] != 0 and t.shape[order[0]] > 1:
            why = "the block dimension is not outermost in memory"
        elif not physical.is_contiguous():
            why = "it is not dense (a block-outermost or padded layout?)"
        elif physical.numel() * physical.element_size() != num_blocks * page_bytes:
            why = f"{physical.numel() * physical.element_size()} B, expected {num_blocks} x {page_bytes} B"
        else:
            return physical.view(torch.uint8).reshape(num_blocks, page_bytes)
    raise ValueError(
        f"vLLM KV cache of {name} (shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype}) is not page-major: {why}"
    )


def _layer_roles(kv_cache_config: Any, group: Any) -> dict[str, tuple[int, bool, bool]]:
    """Per layer: (page bytes, is an indexer cache, is a draft layer).

    The workers' config carries every layer's spec (`UniformTypeKVCacheSpecs`
    for DeepSeek-V3.2's MLA + indexer group). The scheduler's copy does not:
    vLLM's `generate_scheduler_kv_cache_config` keeps one arbitrary layer's
    spec per group. There the page bytes come from the config's
    `kv_cache_tensors` (the workers' placement, kept in the copy), and an
    indexer cache is known by vLLM's layer name (`...indexer.k_cache`).
    Either way the worker checks that both processes built the same layout
    (`HiCacheMetadata.layout`)."""
    spec = group.kv_cache_spec
    specs = getattr(spec, "kv_cache_specs", None)
    if specs:
        return {
            n: (int(s.page_size_bytes), _is_indexer(s), bool(getattr(s, "is_draft", False))) for n, s in specs.items()
        }
    names = list(group.layer_names)
    if not any(_INDEXER_NAME.search(n) for n in names):  # one spec truly describes every layer
        return {n: (int(spec.page_size_bytes), _is_indexer(spec), bool(getattr(spec, "is_draft", False))) for n in names}
    pages = _tensor_pages(kv_cache_config, names)
    missing = sorted(set(names) - set(pages))
    if missing:
        raise ValueError(
            f"the KV cache group mixes attention and indexer caches but names one spec, and its kv_cache_tensors "
            f"give no page size for {missing[:3]}: cannot tell each layer's bytes"
        )
    return {n: (pages[n], bool(_INDEXER_NAME.search(n)), False) for n in names}


_INDEXER_NAME = re.compile(r"\.indexer\.k_cache$")


def _is_indexer(spec: Any) -> bool:
    return str(getattr(getattr(spec, "cache_role", None), "value", "")) == "indexer"


def _tensor_pages(kv_cache_config: Any, names: list[str]) -> dict[str, int]:
    """Page bytes per layer from vLLM's `KVCacheTensor`s (layer-outermost or block-outermost placement)."""
    blocks = int(kv_cache_config.num_blocks)
    out: dict[str, int] = {}
    for t in getattr(kv_cache_config, "kv_cache_tensors", None) or []:
        layers = list(getattr(t, "layers", None) or getattr(t, "shared_by", None) or [])
        block_stride = int(getattr(t, "block_stride", 0) or 0)
        layer_stride = int(getattr(t, "layer_stride", 0) or 0)
        if not layers or not blocks:
            continue
        if len(layers) == 1 or layer_stride >= block_stride * blocks:
            page = block_stride or int(t.size) // blocks // len(layers)  # layer-outermost: a block is one page
        else:
            page = layer_stride  # block-outermost: layers are consecutive pages inside a block
        for n in layers:
            if n in names:
                out[n] = page
    return out


def _is_mla(spec: Any) -> bool:
    """MLA caches (vLLM replicates them on every TP rank), by vLLM's spec class name."""
    specs = getattr(spec, "kv_cache_specs", None)
    return any("MLA" in type(s).__name__ for s in (specs.values() if specs else [spec]))


def _part(model: Model, state: bool) -> Part:
    if model is Model.TARGET:
        return Part.TARGET_STATE if state else Part.TARGET_KV
    return Part.DRAFT_STATE if state else Part.DRAFT_KV
