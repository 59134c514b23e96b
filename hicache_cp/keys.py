"""Vectorised 64-bit hashes of token pages, for keys that leave the process.

    page_hashes(tokens, page_size)    one hash per whole page of its tokens alone
    prefix_hashes(tokens, page_size)  one hash per page of the page and everything before it
    PrefixHashMemo                    prefix_hashes of the last sequence asked for, reused
                                      and extended for the next one that shares its pages
    chain_hashes(tokens, page_size)   the same chain, 128-bit (blake2b): keys that must
                                      never collide (L3 objects, the node journal)

The radix tree does not need these (it compares tokens exactly); they name
pages where a hash is the key: the L3 store, the PD and integrity oracles.
Both are numpy over [pages, page_size], no Python object per page:
O(tokens) arithmetic plus O(pages) for the chain (`prefix_hashes` in one
compiled call where `checksum.NATIVE`, the same bits).

The prefix hash is a polynomial chain x_i = x_{i-1} * P + g_i (mod 2**64)
over the page hashes g_i, computed without a loop as
x_i = P**(i+1) * cumsum(g_j * P**-(j+1)) (P is odd, so invertible mod
2**64). The g_i are already mixed, so x_i needs no mixing of its own, and a
chain continues exactly from any of its hashes (`parent`).
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from hicache_cp import checksum
from hicache_cp.tables import GrowingTables

HASH_BYTES = 16  # chain_hashes' digest size

_P = np.uint64(0x9E3779B97F4A7C15)  # odd: invertible mod 2**64
_P_INV = np.uint64(pow(int(_P), -1, 1 << 64))
_POSITION_SEED = 0x5EED_CAFE


@functools.lru_cache(maxsize=16)
def _position_multipliers(page_size: int) -> np.ndarray:
    """A fixed odd 64-bit multiplier per token position of a page."""
    rng = np.random.Generator(np.random.PCG64(_POSITION_SEED + page_size))
    return rng.integers(0, 2**63, size=page_size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def _pages(tokens: np.ndarray, page_size: int) -> np.ndarray:
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    tokens = np.asarray(tokens)
    n = len(tokens) // page_size
    return tokens[: n * page_size].astype(np.int64, copy=False).view(np.uint64).reshape(n, page_size)


def page_hashes(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """uint64 hash of each whole page of `tokens` (a partial last page is dropped)."""
    pages = _pages(tokens, page_size)
    # A random odd multiplier per position, summed (mod 2**64), then mixed: two pages
    # collide only if their token differences cancel under the multipliers, which has
    # probability about 2**-64 for unrelated pages.
    summed = pages @ _position_multipliers(page_size)  # the sum of products, mod 2**64
    summed ^= np.uint64(page_size)
    return checksum.fmix64_in_place(summed)  # splitmix64's finaliser


def prefix_hashes(tokens: np.ndarray, page_size: int, parent: int = 0) -> np.ndarray:
    """uint64 hash of each page together with every page before it.

    `parent` continues a chain (the prefix hash of the page before `tokens`).
    Equal prefixes give equal hashes; a different page anywhere before
    position i changes hash i. Compiled where `checksum.NATIVE` (one call), else numpy."""
    if checksum.native is not None:
        pages = _pages(tokens, page_size)
        out = np.empty(len(pages), dtype=np.uint64)
        checksum.native.prefix_hashes(np.ascontiguousarray(pages), _position_multipliers(page_size), int(parent), out)
        return out
    g = page_hashes(tokens, page_size)
    n = len(g)
    if n == 0:
        return g
    p_pow, p_inv_pow = _powers(n)
    # x_i = P**(i+1) * (parent + sum_{j<=i} g_j * P**-(j+1)); array products wrap silently
    g *= p_inv_pow
    np.cumsum(g, out=g)
    if parent:
        g += np.uint64(parent)
    g *= p_pow
    return g


class PrefixHashMemo:
    """`prefix_hashes` of the last token sequence asked for, kept for the next ask:
    the pages it shares with the last one are not hashed again, and the chain
    continues from the last shared page (`parent`). A server asks for the same
    prompt's hashes several times (each match of a request, then its
    reservation): it hashes the prompt once. Pages are compared token by token
    (no hash decides a reuse). Not thread-safe: one per cache, on its caller's
    thread. O(shared tokens) to compare plus O(new tokens) to hash."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._tokens = np.empty(0, np.int64)  # the pages hashed last, whole pages
        self._hashes = np.empty(0, np.uint64)  # read-only: callers keep slices of it
        self._hashes.flags.writeable = False

    def first(self, tokens: np.ndarray, n: int) -> np.ndarray:
        """`prefix_hashes(tokens[: n * page_size], page_size)`, read-only."""
        ps = self.page_size
        if n * ps > len(tokens):
            raise ValueError(f"{n} pages asked of {len(tokens)} tokens (page size {ps})")
        known = self._shared_pages(tokens, n)
        if known < n:
            tail = np.asarray(tokens[known * ps : n * ps], dtype=np.int64)
            if known:
                fresh = prefix_hashes(tail, ps, int(self._hashes[known - 1]))
                hashes = np.concatenate([self._hashes[:known], fresh])
                self._tokens = np.concatenate([self._tokens[: known * ps], tail])
            else:  # nothing shared: the new pages alone (a copy: the caller's tokens may change)
                hashes, self._tokens = prefix_hashes(tail, ps), tail.copy()
            hashes.flags.writeable = False
            self._hashes = hashes
        return self._hashes[:n]

    def _shared_pages(self, tokens: np.ndarray, n: int) -> int:
        """How many of the first `n` pages of `tokens` are the memo's first pages."""
        m = min(n, len(self._hashes)) * self.page_size
        if not m or tokens[0] != self._tokens[0]:  # another prompt: no page to compare
            return 0
        differ = np.flatnonzero(np.asarray(tokens[:m]) != self._tokens[:m])
        return (m if not len(differ) else int(differ[0])) // self.page_size


def _build_powers(size: int) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(over="ignore"):
        fwd = np.cumprod(np.full(size, _P, dtype=np.uint64), dtype=np.uint64)
        inv = np.cumprod(np.full(size, _P_INV, dtype=np.uint64), dtype=np.uint64)
    return fwd, inv


#: (P**1 .. P**n, P**-1 .. P**-n) mod 2**64 for the largest n asked so far.
_POWERS = GrowingTables(_build_powers)


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(P**1 .. P**n, P**-1 .. P**-n) mod 2**64 (read-only, thread-safe)."""
    return _POWERS.first(n)


def chain_hashes(tokens: np.ndarray, page_size: int, parent: bytes = b"") -> list[bytes]:
    """Prefix chain hash of each whole page of `tokens` (int64):
    h_i = H(h_{i-1} || the page's token bytes), h_{-1} = `parent`. O(tokens)."""
    data = np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
    step = page_size * 8
    out: list[bytes] = []
    h = parent
    for lo in range(0, len(data) // step * step, step):
        h = hashlib.blake2b(h + data[lo : lo + step], digest_size=HASH_BYTES).digest()
        out.append(h)
    return out
