"""Deterministic KV content, so every reader can check what it got.

The reference server "computes" KV by writing bytes that are a function of
the page's prefix (`hicache_cp.keys.prefix_hashes`: a hash of every page up
to and including it), the part and the layer. A later request that hits the cache, or the decode peer
that receives a transfer, recomputes the same bytes and compares.

`content(prefix_hashes, part, layer, page_bytes)` is vectorised: one numpy
expression over [pages, words], no Python loop per page. page_bytes must be
a multiple of 8. `content_torch` computes the same bytes with torch on any
device, so a GPU server writes and checks KV without host round trips.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import torch

from hicache_cp.layout import PART_ORDER, Part

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def content(prefix_hashes: np.ndarray, part: Part, layer: int, page_bytes: int) -> np.ndarray:
    """The bytes of `part`, `layer` for pages with these prefix hashes: uint8 [n, page_bytes]."""
    if page_bytes % 8:
        raise ValueError(f"page_bytes must be a multiple of 8, got {page_bytes}")
    with np.errstate(over="ignore"):
        salt = np.uint64((PART_ORDER.index(part) + 1) << 56) ^ (np.uint64(layer + 1) * _GOLDEN)
        seeds = _splitmix(np.asarray(prefix_hashes, dtype=np.uint64) ^ salt)
        words = np.arange(page_bytes // 8, dtype=np.uint64) * _GOLDEN
        block = _splitmix(seeds[:, None] + words[None, :])
    return block.view(np.uint8).reshape(len(seeds), page_bytes)


def _as_int64(x: np.uint64 | int) -> int:
    """The int64 with the same 64 bits (torch has no full uint64 arithmetic)."""
    v = int(x)
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _as_int64(_M1)  # int64 products wrap mod 2^64, like uint64
    x = x ^ _shr(x, 27)
    x = x * _as_int64(_M2)
    return x ^ _shr(x, 31)


def content_torch(prefix_hashes: np.ndarray, part: Part, layer: int, page_bytes: int, device: torch.device | str) -> torch.Tensor:
    """`content` computed by torch on `device`: the same bytes, uint8 [n, page_bytes]."""
    if page_bytes % 8:
        raise ValueError(f"page_bytes must be a multiple of 8, got {page_bytes}")
    with np.errstate(over="ignore"):
        salt = np.uint64((PART_ORDER.index(part) + 1) << 56) ^ (np.uint64(layer + 1) * _GOLDEN)
    hashes = np.asarray(prefix_hashes, dtype=np.uint64).view(np.int64)
    seeds = _splitmix_torch(torch.from_numpy(hashes).to(device, non_blocking=True) ^ _as_int64(salt))
    words = torch.arange(page_bytes // 8, dtype=torch.int64, device=device) * _as_int64(_GOLDEN)
    block = _splitmix_torch(seeds[:, None] + words[None, :])
    return block.view(torch.uint8).reshape(len(hashes), page_bytes)


@dataclass(frozen=True)
class Mismatch:
    """One page whose bytes differ from what computing it gives."""

    request: int
    position: int  # request-absolute page position
    part: str
    layer: int
    rank: int = 0

    def __str__(self) -> str:
        return f"request {self.request} page {self.position} {self.part} layer {self.layer} rank {self.rank}"


def compare(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Indices of the rows (pages) of `actual` that differ from `expected`."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch {actual.shape} vs {expected.shape}")
    return np.flatnonzero((actual != expected).any(axis=1))
