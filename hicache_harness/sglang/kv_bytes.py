"""Deterministic KV bytes for the SGLang harness: what a token's KV is, checkable anywhere.

The KV of a token is a function of its prefix (every token up to and
including it), the layer and the part. `prefix_hashes` gives each
position's prefix hash in one vectorised pass (a polynomial hash mod 2**64:
h[i] = sum_j t[j] P**(i - j), computed as P**i * cumsum(t[j] * P**-j));
`token_bytes` expands hashes into `width` bytes per token for a salt naming
(model, part, layer). A stand-in forward writes these bytes where SGLang's
attention would write KV, and checks them wherever a forward reads a prefix.
"""

from __future__ import annotations

import numpy as np

_P = np.uint64(0x100000001B3)
_P_INV = np.uint64(pow(0x100000001B3, -1, 1 << 64))
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """uint64 hash of tokens[: i + 1] for every i. O(n), no Python loop over tokens."""
    t = np.asarray(tokens, dtype=np.uint64) + np.uint64(1)
    n = len(t)
    with np.errstate(over="ignore"):
        up = np.concatenate([[np.uint64(1)], np.cumprod(np.full(max(n - 1, 0), _P, dtype=np.uint64))])[:n]
        down = np.concatenate([[np.uint64(1)], np.cumprod(np.full(max(n - 1, 0), _P_INV, dtype=np.uint64))])[:n]
        return up * np.cumsum(t * down, dtype=np.uint64)


def token_bytes(hashes: np.ndarray, salt: int, width: int) -> np.ndarray:
    """uint8 [len(hashes), width]: the KV bytes of those tokens for one (model, part, layer)."""
    with np.errstate(over="ignore"):
        x = hashes[:, None] ^ (np.uint64(salt + 1) * _GOLDEN)
        x = x + np.arange(width, dtype=np.uint64)[None, :] * _M1
        x ^= x >> np.uint64(31)
        x *= _M2
        x ^= x >> np.uint64(29)
    return (x & np.uint64(0xFF)).astype(np.uint8)
