"""Deterministic KV content, so every reader can check what it got.

The reference server "computes" KV by writing bytes that are a function of
the page's prefix (`hicache_cp.keys.prefix_hashes`: a hash of every page up
to and including it), the part and the layer. A later request that hits the cache, or the decode peer
that receives a transfer, recomputes the same bytes and compares.

`contents(prefix_hashes, part, layers, page_bytes)` is vectorised over
[layers, pages, words]: a whole part of a request in a few passes, no
Python loop per page or layer. page_bytes must be a multiple of 8.
`contents_torch` computes the same bytes with torch on any device, so a GPU
server writes and checks KV without host round trips.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import torch

from hicache_cp.layout import PART_ORDER, Part

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint64)
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _salts(part: Part, layers: Sequence[int]) -> np.ndarray:
    """One salt per (part, layer): uint64 [len(layers)]."""
    with np.errstate(over="ignore"):
        layer_ids = np.asarray(layers, dtype=np.uint64) + np.uint64(1)
        return np.uint64((PART_ORDER.index(part) + 1) << 56) ^ (layer_ids * _GOLDEN)


def _words(page_bytes: int) -> np.ndarray:
    if page_bytes % 8:
        raise ValueError(f"page_bytes must be a multiple of 8, got {page_bytes}")
    with np.errstate(over="ignore"):
        return np.arange(page_bytes // 8, dtype=np.uint64) * _GOLDEN


def contents(prefix_hashes: np.ndarray, part: Part, layers: Sequence[int], page_bytes: int) -> np.ndarray:
    """The bytes of `part` for every layer in `layers` and every page: uint8 [layers, n, page_bytes].

    Word j of a page is seed ^ (j * golden), with one well-mixed seed per
    (prefix hash, part, layer): a page of another prefix, part or layer, or
    a page shifted or partly written, differs. One XOR per word, so a whole
    part of a request is generated in a few vectorised passes."""
    with np.errstate(over="ignore"):
        hashes = np.asarray(prefix_hashes, dtype=np.uint64)
        seeds = _splitmix(hashes[None, :] ^ _salts(part, layers)[:, None])
        block = seeds[:, :, None] ^ _words(page_bytes)[None, None, :]
    return block.view(np.uint8).reshape(len(layers), len(hashes), page_bytes)


def content(prefix_hashes: np.ndarray, part: Part, layer: int, page_bytes: int) -> np.ndarray:
    """The bytes of `part`, `layer` for pages with these prefix hashes: uint8 [n, page_bytes]."""
    return contents(prefix_hashes, part, [layer], page_bytes)[0]


def _as_int64(x: np.ndarray) -> np.ndarray:
    """The int64 with the same 64 bits (torch has no full uint64 arithmetic)."""
    return np.asarray(x, dtype=np.uint64).view(np.int64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * int(_as_int64(_M1))  # int64 products wrap mod 2^64, like uint64
    x = x ^ _shr(x, 27)
    x = x * int(_as_int64(_M2))
    return x ^ _shr(x, 31)


def contents_torch(
    prefix_hashes: np.ndarray, part: Part, layers: Sequence[int], page_bytes: int, device: torch.device | str
) -> torch.Tensor:
    """`contents` computed by torch on `device`: the same bytes, uint8 [layers, n, page_bytes]."""
    hashes = torch.from_numpy(_as_int64(prefix_hashes)).to(device, non_blocking=True)
    salts = torch.from_numpy(_as_int64(_salts(part, layers))).to(device, non_blocking=True)
    words = torch.from_numpy(_as_int64(_words(page_bytes))).to(device, non_blocking=True)
    seeds = _splitmix_torch(hashes[None, :] ^ salts[:, None])
    block = seeds[:, :, None] ^ words[None, None, :]
    return block.view(torch.uint8).reshape(len(layers), len(prefix_hashes), page_bytes)


def content_torch(prefix_hashes: np.ndarray, part: Part, layer: int, page_bytes: int, device: torch.device | str) -> torch.Tensor:
    """`content` computed by torch on `device`: the same bytes, uint8 [n, page_bytes]."""
    return contents_torch(prefix_hashes, part, [layer], page_bytes, device)[0]


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
