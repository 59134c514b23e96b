"""The page checksum: one 64-bit value per (page, part, layer) the cache stores.

Every page of every part and layer that a backup copies to L2 gets a
checksum computed from the bytes it was copied from; a restore (an L2 load,
an L3 get, a PD receive) recomputes it over the bytes that landed and
compares before the page counts (docs/integrity.md). The function is exact
integer arithmetic mod 2**64, so numpy here and the GPU kernel
(`hicache_cp.io.checksum_gpu`) give the same bits.

Definition, for a page of `page_bytes` bytes (a multiple of 8) of `part`
and logical `layer`:

    x_j      the page's little-endian 64-bit words, j = 0 .. page_bytes/8 - 1
    raw      = sum_j (A_j * x_j + B_j * (x_j >> 32))  mod 2**64
    checksum = fmix64(raw ^ salt(part, layer, page_bytes))

`A_j`, `B_j` are fixed odd 64-bit multipliers (splitmix64 of the word index
and a seed, `multipliers`); `fmix64` is splitmix64's finaliser, a bijection.
Written over the page's 32-bit words w_i (w_2j = low half of x_j, w_2j+1 =
high half), raw is the multilinear form sum_i M_i * w_i mod 2**64 with
M_2j = A_j and M_2j+1 = A_j * 2**32 + B_j, all odd.

Strength, per page (two byte strings of the same length, P = false match):
- a change confined to one 32-bit word is always detected (M_i is odd and a
  word changes by less than 2**32, so M_i * d is never 0 mod 2**64);
- bit flips whose lowest flipped bit position differs from every other
  flipped word's lowest bit are always detected (the sum's lowest set bit
  cannot cancel);
- for any other corruption chosen without knowledge of the multipliers,
  P <= 2**-(64 - v) <= 2**-33, where v (<= 31) is the lowest position of a
  changed bit in its 32-bit word (Lemire and Kaser's multilinear bound); for
  random differences (a torn, stale or swapped page: v = 0 almost always)
  P is about 2**-64;
- the same bytes under another part or layer give another checksum with
  certainty (the salts differ and fmix64 is a bijection), so a page and its
  checksum moved together to the wrong place fail.

Cost: two 64-bit multiply-adds per 8 bytes. numpy (`checksums`) runs as
integer sums of products over cache-sized steps; the GPU kernel is a single
pass over the pages (docs/integrity.md has the measurements).
"""

from __future__ import annotations

import enum

import numpy as np

from hicache_cp.layout import PART_ORDER, Part
from hicache_cp.tables import GrowingTables

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SHIFT32 = np.uint64(32)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)
#: Seeds of the multipliers and of the (part, layer) salts: part of the definition.
MULTIPLIER_SEED = 0x48_49_43_41_43_48_45_31  # "HICACHE1"
SALT_SEED = 0x49_4E_54_45_47_52_49_54  # "INTEGRIT"
#: Bytes of pages `raw_sums` hashes per step: the step's rows and the scratch of their
#: high halves (as many bytes again) stay in one core's L2 cache.
_STEP_BYTES = 1 << 19
#: At most this many 64-bit words in all: one matrix-vector product each (the lowest fixed
#: cost); above it einsum's sums of products (about twice matmul's speed on integers).
_SMALL_WORDS = 4096


class Verify(enum.Enum):
    """`Config.verify_restores`: which restored pages are checked before they count."""

    ALL = "all"  # every page of every L2 load, L3 get and PD receive
    SAMPLE = "sample"  # every page of L3 gets and PD receives; one L2-loaded page in SAMPLE_EVERY
    OFF = "off"  # no checksum is computed, stored or checked

    __hash__ = object.__hash__


#: Under `Verify.SAMPLE`, an L2 load checks the pages whose index in the load is
#: congruent to the load's id modulo this (so every page is checked by some loads).
SAMPLE_EVERY = 8


def fmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection of uint64), element-wise on a uint64 array
    (a new array; array products wrap silently)."""
    x = np.array(x, dtype=np.uint64)
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


_SALTS: dict[tuple[Part, int, int], np.uint64] = {}


def salt(part: Part, layer: int, page_bytes: int) -> np.uint64:
    """The salt of one (part, logical layer) at this page size (memoised)."""
    key = (part, layer, page_bytes)
    value = _SALTS.get(key)
    if value is None:
        raw = ((PART_ORDER.index(part) + 1) << 56) | (page_bytes << 24) | layer
        value = np.uint64(fmix64(np.array([raw ^ SALT_SEED], dtype=np.uint64))[0])
        _SALTS[key] = value
    return value


_SALT_ROWS: dict[tuple[Part, tuple[int, ...], int], np.ndarray] = {}


def salts(part: Part, layers: list[int] | tuple[int, ...], page_bytes: int) -> np.ndarray:
    """`salt` of each layer: uint64 [len(layers)], read-only (memoised)."""
    key = (part, tuple(layers), page_bytes)
    out = _SALT_ROWS.get(key)
    if out is None:
        if len(_SALT_ROWS) > 4096:  # a handful of layouts per process; keep it bounded
            _SALT_ROWS.clear()
        out = np.array([salt(part, layer, page_bytes) for layer in layers], dtype=np.uint64)
        out.flags.writeable = False
        _SALT_ROWS[key] = out
    return out


def _build_multipliers(size: int) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(over="ignore"):
        idx = np.arange(2 * size, dtype=np.uint64) * _GOLDEN + np.uint64(MULTIPLIER_SEED)
    both = fmix64(idx) | np.uint64(1)
    return np.ascontiguousarray(both[0::2]), np.ascontiguousarray(both[1::2])


_MULTS = GrowingTables(_build_multipliers)


def multipliers(words: int) -> tuple[np.ndarray, np.ndarray]:
    """(A, B): the first `words` odd multipliers of the 64-bit words, read-only.

    A_j = fmix64(SEED + 2j * golden) | 1 and B_j = fmix64(SEED + (2j + 1) * golden) | 1.
    Cached and grown by doubling (`tables.GrowingTables`, thread-safe)."""
    return _MULTS.first(words)


def raw_sums(pages: np.ndarray) -> np.ndarray:
    """The multilinear sums (before the salt) of each row of `pages` (uint8 [n, page_bytes]).

    O(bytes), no per-page Python work: per step of about `_STEP_BYTES` of rows,
    one pass for the high halves and two integer sums of products (uint64
    products and sums wrap mod 2**64), so a step's rows and its scratch stay in
    a core's L2 cache. Allocates O(min(n * page_bytes, _STEP_BYTES)) scratch;
    numpy releases the GIL inside each pass."""
    n, page_bytes = pages.shape
    if page_bytes % 8:
        raise ValueError(f"page_bytes must be a multiple of 8, got {page_bytes}")
    words = page_bytes // 8
    x = (pages if pages.flags.c_contiguous else np.ascontiguousarray(pages)).view(np.uint64)
    a, b = multipliers(words)
    if x.size <= _SMALL_WORDS:  # a few small pages: matmul's fixed cost is the lowest
        out = x @ a
        out += (x >> _SHIFT32) @ b
        return out
    rows = max(1, _STEP_BYTES // page_bytes)
    out = np.empty(n, dtype=np.uint64)
    high = np.empty((min(rows, n), words), dtype=np.uint64)
    for lo in range(0, n, rows):
        step = x[lo : lo + rows]
        hi = high[: len(step)]
        np.right_shift(step, _SHIFT32, out=hi)
        part = out[lo : lo + rows]
        np.einsum("ij,j->i", step, a, out=part)
        part += np.einsum("ij,j->i", hi, b)
    return out


def checksums(pages: np.ndarray, part: Part, layer: int) -> np.ndarray:
    """The checksum of each page (uint8 [n, page_bytes]) as `part`'s `layer`: uint64 [n]."""
    x = raw_sums(pages)
    x ^= salt(part, layer, pages.shape[1])
    return fmix64(x)


def checksums_by_layer(pages: np.ndarray, part: Part, layers: list[int], n: int) -> np.ndarray:
    """The checksums of `len(layers)` blocks of `n` pages each, block i as `layers[i]`
    (uint8 [len(layers) * n, page_bytes] -> uint64 [len(layers), n]): one pass for
    every layer of a part."""
    x = raw_sums(pages).reshape(len(layers), n)
    x ^= salts(part, layers, pages.shape[1])[:, None]
    return fmix64(x)


def sample_positions(n: int, op_id: int, verify: Verify) -> np.ndarray | None:
    """Indices (into an op's page list of `n`) that a load checks: None for all of them
    (`Verify.ALL`), every `SAMPLE_EVERY`-th from `op_id % SAMPLE_EVERY` under `SAMPLE`,
    none under `OFF`."""
    if verify is Verify.ALL:
        return None
    if verify is Verify.OFF:
        return np.empty(0, dtype=np.int64)
    return np.arange(op_id % SAMPLE_EVERY, n, SAMPLE_EVERY, dtype=np.int64)
