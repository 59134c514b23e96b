"""A real DeepSeek-V3.2 model for the prefill engine: presets, building, layout, KV pools.

The model is transformers' `DeepseekV32ForCausalLM` built from a config with
seeded random weights (nothing is downloaded), plus a one-layer draft: the
MTP module transformers provides (`transformers.modeling_layers.MtpLayer`: a
DeepSeek decoder layer over `eh_proj(enorm(embed(next token)), hnorm(target
hidden))`), run over the same tokens as the target.

What the cache stores comes from the model (transformers >= 5.20 keeps the
MLA latent in its cache, see docs/platform.md):

    part          per token, per layer                 from the cache layer's
    target_kv     kv_lora_rank latent + rope key       `keys` [b,1,T,rank] + `values` [b,1,T,rope]
    target_state  index_head_dim indexer key           `indexer_keys` [b,T,index_head_dim]
    draft_kv      the MTP layer's latent + rope key    (its own cache)
    draft_state   the MTP layer's indexer key

in the model's dtype. Target state is compacted to the layers whose attention
has an indexer (every layer of V3.2). `HfModel.model_layout()` turns that into
the cache's `ModelLayout`, and `HfModel.kv_buffers()` allocates the L1 pools
as the engine's own typed tensors, one per layer, page-major
[pages, page_size, dim], which `DevicePool` views as bytes.

Presets:

    tiny         3 layers, small dims, fp32, eager attention: CI on a CPU
    dsv32-width  the real hidden size (7168), 128 heads, q_lora 1536, kv_lora 512,
                 rope 64, indexer 64 heads x 128, real vocab, 4 layers, dense MLP,
                 bf16, SDPA attention: the H200

`index_topk` is set above any prompt length in both presets, so the indexer's
selection keeps every token and a recompute is comparable with a restored
prefix (with a small top-k the selection itself changes, docs/platform.md).
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_cp.presets import ModelLayout
from hicache_harness.errors import InputError, require
from hicache_cp.layout import Part

logger = logging.getLogger(__name__)

#: Above any prompt the harness builds: the indexer then selects every token.
DENSE_INDEX_TOPK = 1 << 20


@dataclass(frozen=True)
class HfPreset:
    """Model dimensions and the engine defaults that go with them."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_head_dim: int
    index_heads: int
    index_head_dim: int
    vocab_size: int
    dtype: str  # "float32" | "bfloat16"
    attn: str  # transformers attention implementation: "eager" | "sdpa"
    page_size: int
    chunk_tokens: int  # default --chunk-tokens
    max_batch_tokens: int  # default --max-batch-tokens
    #: Output oracle: |restored - recompute| <= atol + rtol * max|recompute| on the last-token logits.
    logits_atol: float
    logits_rtol: float
    #: torch intra-op threads while serving on a CPU (None: leave torch's setting). The tiny
    #: model's tensors are too small to gain from threads, and on a shared 2-core runner
    #: OpenMP threads spinning against each other made a forward 8x slower.
    cpu_threads: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]


PRESETS: dict[str, HfPreset] = {
    # Dims small enough that 40 embedded requests replay in seconds on 2 cores (with
    # 8-token pages a request of the embedded workload is ~160 tokens); fp32, so a
    # restored prefix matches a recompute to ~1e-6.
    "tiny": HfPreset(
        name="tiny", num_layers=3, hidden_size=64, intermediate_size=128, num_heads=4, q_lora_rank=32,
        kv_lora_rank=32, rope_dim=16, nope_dim=16, v_head_dim=16, index_heads=4, index_head_dim=32,
        vocab_size=512, dtype="float32", attn="eager", page_size=8, chunk_tokens=64, max_batch_tokens=256,
        logits_atol=1e-4, logits_rtol=1e-4, cpu_threads=1,
    ),
    # DeepSeek-V3.2's attention and indexer at full width, a few dense layers, bf16.
    # bf16 logits of a batched, chunked forward differ from one unbatched forward
    # by rounding: measured on a CPU (2 layers, 384 tokens, a restored prefix in
    # a batch) 0.7-0.8% of the largest logit, about 1.5 bf16 steps at its size;
    # the tolerance is 3%. A wrong prefix moves logits by about their size.
    # Chunks of 1,024 and forwards of at most 2,048 tokens: a request arriving
    # mid-prefill waits for at most that much compute (about 0.1 s on an H200).
    "dsv32-width": HfPreset(
        name="dsv32-width", num_layers=4, hidden_size=7168, intermediate_size=18432, num_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_head_dim=128, index_heads=64,
        index_head_dim=128, vocab_size=129280, dtype="bfloat16", attn="sdpa", page_size=64,
        chunk_tokens=1024, max_batch_tokens=2048, logits_atol=0.0, logits_rtol=3e-2,
    ),
}  # fmt: skip


def preset(name: str) -> HfPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hf preset {name!r}; presets: {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class PartDims:
    """Typed width of one part: elements per token, per layer."""

    part: Part
    dim: int
    layers: tuple[int, ...]  # logical layer ids of the part (compact slots in order)


@dataclass
class HfModel:
    """The target model, its MTP draft layer, and what their caches hold."""

    preset: HfPreset
    target: Any  # DeepseekV32ForCausalLM
    draft: Any  # transformers.modeling_layers.MtpLayer
    target_config: Any
    draft_config: Any
    device: torch.device
    parts: dict[Part, PartDims] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.preset.torch_dtype

    @property
    def num_layers(self) -> int:
        return int(self.target_config.num_hidden_layers)

    @property
    def kv_lora_rank(self) -> int:
        return int(self.target_config.kv_lora_rank)

    @property
    def rope_dim(self) -> int:
        return int(self.target_config.qk_rope_head_dim)

    @property
    def index_dim(self) -> int:
        return int(self.target_config.index_head_dim)

    @property
    def vocab_size(self) -> int:
        return int(self.target_config.vocab_size)

    @property
    def elem_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def model_layout(self) -> ModelLayout:
        """The cache's view of this model: bytes per token per layer of each part."""
        b = self.elem_bytes
        state = self.parts.get(Part.TARGET_STATE)
        draft_state = self.parts.get(Part.DRAFT_STATE)
        return ModelLayout(
            name=f"hf-{self.preset.name}",
            num_layers=self.num_layers,
            kv_bytes_per_token=self.parts[Part.TARGET_KV].dim * b,
            state_bytes_per_token=state.dim * b if state else 0,
            state_layers=state.layers if state else None,
            draft_layers=1,
            draft_kv_bytes_per_token=self.parts[Part.DRAFT_KV].dim * b,
            draft_state_bytes_per_token=draft_state.dim * b if draft_state else 0,
        )

    def kv_buffers(self, physical_pages: int) -> dict[Part, list[torch.Tensor]]:
        """The L1 pools: per part, one zeroed tensor [pages, page_size, dim] per layer.

        Page 0 is the allocator's dummy page; it stays zero."""
        ps = self.preset.page_size
        return {
            p: [torch.zeros((physical_pages, ps, d.dim), dtype=self.dtype, device=self.device) for _ in d.layers]
            for p, d in self.parts.items()
        }


#: The first transformers whose DeepSeek-V3.2 cache holds the MLA latent (5.17 held
#: expanded per-head keys and values, 70x the bytes: not what a server stores).
MIN_TRANSFORMERS = (5, 20)


def _transformers() -> Any:
    tf = require("transformers", "hf", "the hf engine")
    version = tuple(int(x) for x in tf.__version__.split(".")[:2] if x.isdigit())
    if version < MIN_TRANSFORMERS:
        raise InputError(
            f"the hf engine needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} (pip install 'hicache-cp[hf]'); "
            f"found {tf.__version__}, whose DeepSeek-V3.2 cache holds expanded keys, not the MLA latent"
        )
    return tf


def target_config(p: HfPreset) -> Any:
    """The `DeepseekV32Config` of a preset: dense MLP everywhere, dense index top-k."""
    tf = _transformers()
    cfg = tf.DeepseekV32Config(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads, num_key_value_heads=p.num_heads,
        q_lora_rank=p.q_lora_rank, kv_lora_rank=p.kv_lora_rank, qk_rope_head_dim=p.rope_dim,
        qk_nope_head_dim=p.nope_dim, v_head_dim=p.v_head_dim, index_n_heads=p.index_heads,
        index_head_dim=p.index_head_dim, index_topk=DENSE_INDEX_TOPK, mlp_layer_types=["dense"] * p.num_layers,
        first_k_dense_replace=p.num_layers, max_position_embeddings=DENSE_INDEX_TOPK, n_routed_experts=8,
        n_group=1, topk_group=1, num_experts_per_tok=2, pad_token_id=None,
    )  # fmt: skip
    cfg._attn_implementation = p.attn
    return cfg


def draft_config(target_cfg: Any) -> Any:
    """One MTP layer: the target's config with a single dense, indexed layer."""
    cfg = copy.deepcopy(target_cfg)
    cfg.num_hidden_layers = 1
    cfg.mlp_layer_types = ["dense"]
    cfg.layer_types = [target_cfg.layer_types[-1]]
    cfg.first_k_dense_replace = 1
    cfg._attn_implementation = target_cfg._attn_implementation
    return cfg


def build(preset_name: str, device: str | torch.device = "cpu", seed: int = 0) -> HfModel:
    """Build the target and draft with seeded random weights on `device` (no download)."""
    model = _construct(preset(preset_name), torch.device(device), seed)
    logger.info("hf model %s on %s: %s", preset_name, device,
                {k.value: (v.dim, len(v.layers)) for k, v in model.parts.items()})  # fmt: skip
    return model


@functools.lru_cache(maxsize=None)
def _meta(preset_name: str) -> HfModel:
    """A preset's modules built without memory (meta device): shapes only."""
    return _construct(preset(preset_name), torch.device("meta"), 0)


def layout_of(preset_name: str) -> ModelLayout:
    """The cache layout of a preset, read off its modules built on the meta device."""
    return _meta(preset_name).model_layout()


def build_bytes(preset_name: str) -> int:
    """Memory `build` may take where it builds a preset (per process), an upper
    bound: every parameter of the target and the draft in fp32 (the initialiser
    runs in fp32) and its cast to the preset's dtype side by side, plus the buffers."""
    m = _meta(preset_name)
    modules = (m.target, m.draft)
    params = sum(p.numel() for mod in modules for p in mod.parameters())
    buffers = sum(b.numel() * b.element_size() for mod in modules for b in mod.buffers())
    return params * (4 + m.preset.torch_dtype.itemsize) + buffers


def _construct(p: HfPreset, device: torch.device, seed: int) -> HfModel:
    tf = _transformers()
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32

    tcfg = target_config(p)
    dcfg = draft_config(tcfg)
    torch.manual_seed(seed)
    with torch.device(device):
        target = tf.DeepseekV32ForCausalLM(tcfg)
        draft = MtpLayer(dcfg, dsv32.DeepseekV32DecoderLayer, dsv32.DeepseekV32RMSNorm, layer_idx=0)
        draft.apply(target._init_weights)  # the target's initialiser, for like-scaled weights
    for module in (target, draft):
        module.requires_grad_(False).eval()
        for param in module.parameters():  # parameters only: rope frequencies and the router bias stay fp32
            param.data = param.data.to(p.torch_dtype)
    model = HfModel(p, target, draft, tcfg, dcfg, device)
    model.parts = _part_dims(model)
    return model


def _part_dims(m: HfModel) -> dict[Part, PartDims]:
    """Read the parts off the built modules: every layer stores its latent and
    rope key; the layers whose attention has an indexer also store its key."""
    kv = m.kv_lora_rank + m.rope_dim
    indexed = tuple(i for i, layer in enumerate(m.target.model.layers) if _has_indexer(layer))
    parts = {Part.TARGET_KV: PartDims(Part.TARGET_KV, kv, tuple(range(m.num_layers)))}
    if indexed:
        parts[Part.TARGET_STATE] = PartDims(Part.TARGET_STATE, m.index_dim, indexed)
    parts[Part.DRAFT_KV] = PartDims(Part.DRAFT_KV, kv, (0,))
    if _has_indexer(m.draft.mtp_block):
        parts[Part.DRAFT_STATE] = PartDims(Part.DRAFT_STATE, m.index_dim, (0,))
    return parts


def _has_indexer(decoder_layer: Any) -> bool:
    return getattr(decoder_layer.self_attn, "indexer", None) is not None
