"""The SGLang storage backend (`hicache_cp.integrations.sglang.storage`), created
through SGLang 0.5.23's own backend factory as a `dynamic` backend, against a
real Mooncake master on loopback.

SGLang's host KV pools cannot be built here (its pool_host package imports
torchvision, which scripts/install_sglang.sh deliberately does not install),
so the host pool is a small double with the two things the storage interface
uses: `kv_buffer` and `get_page_buffer_meta(indices)`, in SGLang's
page-first (one buffer per page) and layer-first (one per layer) shapes.
Skipped without sglang (bash scripts/install_sglang.sh).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory", reason="sglang not installed")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from test_l3_support import l3env  # noqa: E402,F401 - fixture

pytestmark = pytest.mark.slow  # importing sglang costs ~10-20 s on a loaded CI core

PAGE = 16


class HostPoolDouble:
    """What HiCacheStorage reads of SGLang's HostKVCache: pages of `page_bytes`,
    page-first (one buffer per page) or layer-first (`layers` buffers per page)."""

    def __init__(self, pages: int, page_bytes: int, layout: str = "page_first", layers: int = 4) -> None:
        self.page_size = PAGE
        self.layout = layout
        self.dtype = torch.uint8
        self.layers = layers if layout == "layer_first" else 1
        self.page_bytes = page_bytes
        self.kv_buffer = torch.zeros(pages * page_bytes, dtype=torch.uint8)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        base = self.kv_buffer.data_ptr()
        per = self.page_bytes // self.layers
        pages = indices.reshape(-1, PAGE)[:, 0] // PAGE
        ptrs, sizes = [], []
        for p in pages.tolist():
            for layer in range(self.layers):  # layer-first: the page's slice of each layer
                ptrs.append(base + layer * (len(self.kv_buffer) // self.layers) + p * per)
                sizes.append(per)
        return ptrs, sizes

    def page(self, p: int) -> np.ndarray:
        per = self.page_bytes // self.layers
        stride = len(self.kv_buffer) // self.layers
        return np.concatenate([self.kv_buffer[layer * stride + p * per : layer * stride + (p + 1) * per].numpy()
                               for layer in range(self.layers)])  # fmt: skip

    def fill(self, p: int, data: np.ndarray) -> None:
        per = self.page_bytes // self.layers
        stride = len(self.kv_buffer) // self.layers
        for layer in range(self.layers):
            self.kv_buffer[layer * stride + p * per : layer * stride + (p + 1) * per] = torch.from_numpy(
                data[layer * per : (layer + 1) * per].copy()
            )


def _indices(*pages: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def _backend(env, model: str = "m", **extra) -> HiCacheStorage:  # type: ignore[no-untyped-def]
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        extra_config={"backend_name": "hicache_cp", "module_path": "hicache_cp.integrations.sglang.storage",
                      "class_name": "HiCacheCpStorage", "master": env.master.address, "namespace": env.ns,
                      "local_buffer_bytes": 0, **extra},
    )  # fmt: skip
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_sglang_loads_it_and_pages_round_trip(l3env, layout: str) -> None:  # noqa: F811
    l3env.ns = f"sg{layout}{id(l3env)}"
    a, b, other = _backend(l3env), _backend(l3env), _backend(l3env, model="another-model")
    try:
        from hicache_cp.integrations.sglang.storage import HiCacheCpStorage

        assert isinstance(getattr(a, "_backend", a), HiCacheCpStorage) or isinstance(a, HiCacheCpStorage)
        pa, pb, po = (HostPoolDouble(16, 4096, layout) for _ in range(3))
        a.register_mem_pool_host(pa)
        b.register_mem_pool_host(pb)
        other.register_mem_pool_host(po)
        rng = np.random.default_rng(0)
        data = {p: rng.integers(0, 256, 4096, dtype=np.uint8) for p in (1, 2, 3, 4)}
        for p, d in data.items():
            pa.fill(p, d)
        keys = ["h1", "h2", "h3", "h4"]
        assert a.batch_set_v1(keys, _indices(1, 2, 3, 4)) == [True] * 4
        assert a.batch_set_v1(keys[:2], _indices(1, 2)) == [True, True]  # stored already: skipped
        # b (another host pool) sees the chain up to the first missing page
        assert b.batch_exists([*keys, "h5"]) == 4 and b.exists("h1") and not b.exists("h5")
        assert b.batch_get_v1(keys, _indices(9, 10, 11, 12)) == [True] * 4
        for i, p in enumerate((1, 2, 3, 4)):
            assert np.array_equal(pb.page(9 + i), data[p])
        assert b.batch_get_v1(["h1", "nope"], _indices(5, 6)) == [True, False]  # a missing page is a miss
        # another model's pool never reads these bytes
        assert other.batch_exists(keys) == 0
    finally:
        for be in (a, b, other):
            be.close()
