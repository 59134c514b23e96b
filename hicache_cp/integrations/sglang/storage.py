"""An SGLang L3 storage backend over hicache-cp's Mooncake Store adapter.

SGLang (0.5.23) loads it as a `dynamic` storage backend::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "hicache_cp",
            "module_path": "hicache_cp.integrations.sglang.storage",
            "class_name": "HiCacheCpStorage", "master": "127.0.0.1:50051"}'

The extra config takes the `[l3]` settings of `hicache_cp.l3.config.L3Config`
(`master`, `namespace`, `local_hostname`, `protocol`, `device_name`,
`segment_bytes`, `local_buffer_bytes`, `kv_dtype`).

What it is: SGLang's `HiCacheStorage` interface (exists / get / set in
batch, zero-copy into the registered host KV pool) over the same store
client, the same return-code conversion (`MooncakeStore`, `L3Error`) and the
same key discipline as hicache-cp's own L3 tier:

    {namespace}/{fingerprint}/{SGLang's page hash}/kv/{rank}

The fingerprint covers the model name, page size, host layout, dtype, MLA or
not and `FORMAT_VERSION`, so pools of another layout never read these bytes;
`rank` is `mla` (one writer per page for MLA, as SGLang's `is_storage_writer`
says) or the TP rank, plus the attention-CP rank when attention CP is on.
Failures never raise into SGLang's cache controller threads: a failed key
reads as absent / not stored, logged as a WARNING.

Runs in: each SGLang scheduler process (one backend per rank).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from hicache_cp import L3_FORMAT_VERSION as FORMAT_VERSION, L3Config
from hicache_cp import L3Error, MooncakeStore

logger = logging.getLogger(__name__)

_L3_FIELDS = ("master", "namespace", "local_hostname", "protocol", "device_name", "segment_bytes",
              "local_buffer_bytes", "kv_dtype")  # fmt: skip


class HiCacheCpStorage(HiCacheStorage):
    """See the module docstring. `kwargs` (from SGLang's factory) may carry a
    ready `store` (any `KVStore`), e.g. one shared by several backends."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        settings = {k: extra[k] for k in _L3_FIELDS if k in extra}
        self.config = L3Config(backend="mooncake", **settings)
        self.storage_config = storage_config
        given = (kwargs or {}).get("store")
        self.store = given if given is not None else MooncakeStore.open(self.config, name="sglang l3")
        self._owns_store = given is None
        self.prefix: str | None = None
        self._registered: int | None = None
        rank = "mla" if storage_config.is_mla_model else f"tp{storage_config.tp_rank}"
        if storage_config.attn_cp_size > 1:
            rank += f"-cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}"
        self.rank = rank

    # ---- host pool -----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host KV buffer with the store (zero-copy) and derive the key prefix."""
        super().register_mem_pool_host(mem_pool_host)
        buf: torch.Tensor = mem_pool_host.kv_buffer
        self.store.register(buf.data_ptr(), buf.numel() * buf.element_size())
        self._registered = buf.data_ptr()
        desc = {
            "format": FORMAT_VERSION,
            "engine": "sglang",
            "model": self.storage_config.model_name,
            "page_size": mem_pool_host.page_size,
            "layout": getattr(mem_pool_host, "layout", None),
            "dtype": str(getattr(mem_pool_host, "dtype", buf.dtype)),
            "mla": self.storage_config.is_mla_model,
            "kv_dtype": self.config.kv_dtype,
        }
        fingerprint = hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=8).hexdigest()
        self.prefix = f"{self.config.namespace}/{fingerprint}"

    def _key(self, key: str) -> str:
        if self.prefix is None:
            raise RuntimeError("HiCacheCpStorage: register_mem_pool_host must come before any I/O")
        return f"{self.prefix}/{key}/kv/{self.rank}"

    def _buffers(self, keys: list[str], host_indices: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
        """Per key, the host pool's buffers of that page (one or, layer-first, several)."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) % len(keys):
            raise ValueError(f"host pool gave {len(ptrs)} buffers for {len(keys)} pages")
        k = len(ptrs) // len(keys)
        return [list(ptrs[i : i + k]) for i in range(0, len(ptrs), k)], [
            list(sizes[i : i + k]) for i in range(0, len(sizes), k)
        ]

    # ---- zero-copy batch I/O (what SGLang's cache controller calls) ---------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many keys from the start are stored."""
        if not keys:
            return 0
        try:
            found = self.store.exists([self._key(k) for k in keys])
        except L3Error as exc:
            logger.warning("sglang l3: lookup failed, treating %d pages as absent: %s", len(keys), exc)
            return 0
        return found.index(False) if False in found else len(found)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read each page into its host pages; per key, whether it was read whole."""
        if not keys:
            return []
        ptrs, sizes = self._buffers(keys, host_indices)
        try:
            errors = self.store.get_each([self._key(k) for k in keys], ptrs, sizes)
        except L3Error as exc:
            logger.warning("sglang l3: get of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        bad = [e for e in errors if e is not None]
        if bad:
            logger.warning("sglang l3: %d of %d pages not read, e.g. %s", len(bad), len(keys), bad[0])
        return [e is None for e in errors]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store each page from its host pages (keys already stored are skipped)."""
        if not keys:
            return []
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # MLA: another rank writes the shared page
        ptrs, sizes = self._buffers(keys, host_indices)
        full = [self._key(k) for k in keys]
        try:
            present = self.store.exists(full)
            todo = [i for i, p in enumerate(present) if not p]
            errors = self.store.put([full[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo])
        except L3Error as exc:
            logger.warning("sglang l3: set of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        ok = [True] * len(keys)
        for i, err in zip(todo, errors):
            if err is not None:
                ok[i] = False
                logger.warning("sglang l3: page not stored: %s", err)
        return ok

    # ---- the single-key and deprecated batch calls: zero-copy only ---------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read one page into `target_location` (address or list of addresses,
        `target_sizes` bytes); returns None if absent or failed. Copying
        reads (no target) are not offered: use the zero-copy path."""
        if target_location is None:
            raise NotImplementedError("HiCacheCpStorage reads zero-copy only: pass target_location")
        ok = self._get_into([key], [target_location], [target_sizes])[0]
        return torch.empty(0) if ok else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        if target_locations is None:
            raise NotImplementedError("HiCacheCpStorage reads zero-copy only: pass target_locations")
        return [torch.empty(0) if ok else None for ok in self._get_into(keys, target_locations, target_sizes)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if target_location is None:
            raise NotImplementedError("HiCacheCpStorage writes zero-copy only: pass target_location")
        return self._put_from([key], [target_location], [target_sizes])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        if target_locations is None:
            raise NotImplementedError("HiCacheCpStorage writes zero-copy only: pass target_locations")
        return all(self._put_from(keys, target_locations, target_sizes))

    def _get_into(self, keys: list[str], locs: list[Any], sizes: list[Any]) -> list[bool]:
        try:
            errors = self.store.get_each([self._key(k) for k in keys], [_as_list(x) for x in locs],
                                         [_as_list(x) for x in sizes])  # fmt: skip
        except L3Error as exc:
            logger.warning("sglang l3: get failed: %s", exc)
            return [False] * len(keys)
        return [e is None for e in errors]

    def _put_from(self, keys: list[str], locs: list[Any], sizes: list[Any]) -> list[bool]:
        try:
            errors = self.store.put([self._key(k) for k in keys], [_as_list(x) for x in locs],
                                    [_as_list(x) for x in sizes])  # fmt: skip
        except L3Error as exc:
            logger.warning("sglang l3: put failed: %s", exc)
            return [False] * len(keys)
        return [e is None for e in errors]

    # ---- lifecycle ---------------------------------------------------------------------------

    def clear(self) -> None:
        """A shared store holds other instances' pages too: nothing is removed."""

    def close(self) -> None:
        if self._registered is not None:
            try:
                self.store.unregister(self._registered)
            except L3Error as exc:
                logger.warning("sglang l3: %s", exc)
            self._registered = None
        if self._owns_store:
            self.store.close()


def _as_list(x: Any) -> list[int]:
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]
