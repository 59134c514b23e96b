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

Cost: two 64-bit multiply-adds per 8 bytes. On CPU, `raw_sums`,
`raw_sums_blocks`, `finalise`, `store` and `mismatched` run compiled
(`hicache_cp._hashes`, built by setup.py where a C compiler is found:
`NATIVE`), one call for a part's gather and sums; else in numpy, as integer
sums of products over cache-sized steps (up to a MiB of pages: one sum of
products over their 32-bit words). Both take pages given as rows or as a
[layers, pages, page_bytes] view of a pool, optionally gathered by page
index; the GPU kernel is a single pass over the pages (docs/integrity.md has
the measurements).
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hicache_cp.layout import PART_ORDER, KVLayout, Part
from hicache_cp.tables import GrowingTables

try:  # the compiled passes (setup.py); without them numpy below computes the same bits
    from hicache_cp import _hashes as native
except ImportError:
    native = None  # type: ignore[assignment]

#: Whether this process hashes with the compiled passes (`hicache_cp._hashes`).
NATIVE = native is not None


@contextlib.contextmanager
def numpy_hashes() -> Iterator[None]:
    """Inside the block this process hashes with numpy, the definitions, built or not
    (`checksum` and `keys` consult `native` on every call): to compare the two paths.
    Not for a running cache: it switches every thread."""
    global native
    built, native = native, None
    try:
        yield
    finally:
        native = built

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
#: At most this many 64-bit words in all: one matrix-vector product over the 32-bit words
#: (the lowest fixed cost). Up to `_MID_WORDS`: one einsum over the 32-bit words (numpy
#: casts them to 64 bits in buffered chunks; faster than matmul once past its fixed cost).
#: Above it, steps of einsum over the 64-bit words and their high halves (`_STEP_BYTES`).
_SMALL_WORDS = 2048
_MID_WORDS = 1 << 17


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
    return fmix64_in_place(np.array(x, dtype=np.uint64))


def fmix64_in_place(x: np.ndarray) -> np.ndarray:
    """`fmix64` of the uint64 array `x` in place; returns `x`."""
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


_WORD_MULTS: dict[int, np.ndarray] = {}


def word_multipliers(words: int) -> np.ndarray:
    """The multilinear form's M_i over the 32-bit words of a page of `words` 64-bit words
    (M_2j = A_j, M_2j+1 = A_j * 2**32 + B_j): uint64 [2 * words], read-only (memoised
    per page size)."""
    m = _WORD_MULTS.get(words)
    if m is None:
        a, b = multipliers(words)
        m = np.empty(2 * words, dtype=np.uint64)
        m[0::2] = a
        m[1::2] = a * np.uint64(1 << 32) + b  # wraps mod 2**64
        m.flags.writeable = False
        m = _WORD_MULTS.setdefault(words, m)
    return m


def raw_sums(pages: np.ndarray, out: np.ndarray | None = None, index: np.ndarray | None = None) -> np.ndarray:
    """The multilinear sums (before the salt) of each page of `pages`: uint8
    [..., n, page_bytes] (a [layers, n, page_bytes] view of a pool's buffer needs no
    gather) -> uint64 [..., n], or of the pages `index` (int page ids along the pages
    axis) -> uint64 [..., len(index)]; written into `out` when given (then returned).

    O(bytes), no per-page Python work. Compiled (`NATIVE`, `out` C-contiguous): one
    pass that gathers and sums, the GIL released for large inputs. numpy: the gather
    first, then up to `_MID_WORDS` words one integer sum of products over the 32-bit
    words; above, per step of about `_STEP_BYTES` of pages, one pass for the high
    halves and two integer sums of products (uint64 products and sums wrap mod
    2**64), so a step's pages and its scratch stay in a core's L2 cache. Allocates
    O(min(bytes, _STEP_BYTES)) scratch; numpy releases the GIL inside each pass."""
    page_bytes = pages.shape[-1]
    if pages.ndim not in (2, 3):
        raise ValueError(f"pages must be [n, page_bytes] or [layers, n, page_bytes], got shape {pages.shape}")
    if page_bytes % 8:
        raise ValueError(f"page_bytes must be a multiple of 8, got {page_bytes}")
    if pages.dtype != np.uint8:
        raise ValueError(f"pages must be uint8, got {pages.dtype}")
    if index is not None:
        index = np.ascontiguousarray(index, dtype=np.int64)
    if out is None:
        out = np.empty(pages.shape[:-1] if index is None else (*pages.shape[:-2], len(index)), dtype=np.uint64)
    if native is not None and pages.strides[-1] == 1 and out.flags.c_contiguous:
        native.raw_sums(pages, word_multipliers(page_bytes // 8), out, index)
        return out
    if index is not None:
        pages = pages.take(index, axis=-2)  # `take` gathers with less overhead than fancy indexing
    if pages.strides[-1] != 1 or pages.strides[0] % 8 or pages.strides[-2] % 8:  # ndim is 2 or 3
        pages = np.ascontiguousarray(pages)
    words = page_bytes // 8
    total = words * out.size
    if total <= _MID_WORDS:  # one pass over the 32-bit words
        halves, m = pages.view(np.uint32), word_multipliers(words)
        if total <= _SMALL_WORDS:
            np.matmul(halves, m, out=out)
        else:
            np.einsum("...j,j->...", halves, m, out=out)
        return out
    x = pages.view(np.uint64)
    a, b = multipliers(words)
    if x.ndim == 3 and 8 * x[0].size >= _STEP_BYTES:  # a layer's pages per step
        for i in range(len(x)):
            _einsum_steps(x[i], a, b, out[i])
    else:  # pages, or whole layers, per step
        _einsum_steps(x, a, b, out)
    return out


#: One block of rows for `raw_sums_blocks`: a [k, N, page_bytes] view of a buffer, the
#: multipliers of its page size (`word_multipliers`) and the first row of `out` it fills.
Block = tuple[np.ndarray, np.ndarray, int]


def raw_sums_blocks(blocks: tuple[Block, ...], out: np.ndarray, pages: np.ndarray | slice) -> None:
    """`raw_sums` of the same `pages` (page ids, or a slice: the pages of one run) of each
    block's k rows, into rows [row, row + k) of `out` (uint64 [rows, len(pages)]).
    Compiled (`NATIVE`, `out` C-contiguous): one call for every block; else a
    `raw_sums` per block."""
    if native is not None and out.flags.c_contiguous:
        if isinstance(pages, slice):
            native.raw_sums_blocks(blocks, out, None, pages.start)
        else:
            native.raw_sums_blocks(blocks, out, np.ascontiguousarray(pages, dtype=np.int64), 0)
        return
    for view, _, row in blocks:
        rows = out[row : row + len(view)]
        if isinstance(pages, slice):
            raw_sums(view[:, pages], out=rows)
        else:
            raw_sums(view, out=rows, index=pages)


def _einsum_steps(x: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """`raw_sums` of the uint64 words `x` ([pages, words] or [layers, n, words]) into
    `out`, in steps of about `_STEP_BYTES` along the first axis."""
    row_bytes = 8 * x[0].size
    rows = max(1, _STEP_BYTES // row_bytes)
    if len(x) <= rows:  # one step
        hi = x >> _SHIFT32
        np.einsum("...j,j->...", x, a, out=out)
        out += np.einsum("...j,j->...", hi, b)
        return
    high = np.empty((rows, *x.shape[1:]), dtype=np.uint64)
    for lo in range(0, len(x), rows):
        step = x[lo : lo + rows]
        hi = high[: len(step)]
        np.right_shift(step, _SHIFT32, out=hi)
        part = out[lo : lo + rows]
        np.einsum("...j,j->...", step, a, out=part)
        part += np.einsum("...j,j->...", hi, b)


def salted(raw: np.ndarray, part: Part, layers: list[int] | tuple[int, ...], page_bytes: int) -> np.ndarray:
    """The checksums of pages whose `raw_sums` are `raw` (uint64 [len(layers), n], row i
    as `part`'s `layers[i]`, pages of `page_bytes`), computed in place; returns `raw`."""
    return finalise(raw, salts(part, layers, page_bytes))


def finalise(raw: np.ndarray, row_salts: np.ndarray) -> np.ndarray:
    """The checksums of pages whose `raw_sums` are `raw` (uint64 [rows, n]), row i salted
    with `row_salts[i]` (`LayoutSalts.salts` rows), computed in place; returns `raw`."""
    if native is not None and raw.ndim == 2 and len(row_salts) == len(raw) and raw.flags.c_contiguous:
        native.finalise(raw, np.ascontiguousarray(row_salts))
        return raw
    raw ^= row_salts[:, None]
    return fmix64_in_place(raw)


def store(table: np.ndarray, rows: np.ndarray | None, cols: np.ndarray, sums: np.ndarray) -> None:
    """Keep checksums in a table of stored ones: table[rows[i], cols[j]] = sums[i, j]
    (`rows` None: every row of the table, in order). Compiled where `NATIVE` (table,
    rows, cols and sums C-contiguous), else numpy."""
    if native is not None and _contiguous(table, rows, cols, sums):
        native.store(table, rows, cols, sums)
    else:
        table[(slice(None) if rows is None else rows[:, None]), cols] = sums


def mismatched(table: np.ndarray, rows: np.ndarray | None, cols: np.ndarray, sums: np.ndarray) -> bool:
    """Whether any sums[i, j] differs from table[rows[i], cols[j]] (`rows` as in `store`)."""
    if native is not None and _contiguous(table, rows, cols, sums):
        return bool(native.mismatched(table, rows, cols, sums))
    return bool((table[(slice(None) if rows is None else rows[:, None]), cols] != sums).any())


def _contiguous(table: np.ndarray, rows: np.ndarray | None, cols: np.ndarray, sums: np.ndarray) -> bool:
    """Whether the compiled `store` and `mismatched` take these as they are (their dtypes
    and C order; they check sizes and bounds themselves)."""
    return (table.dtype == sums.dtype == np.uint64 and cols.dtype == np.int64 and table.flags.c_contiguous
            and sums.flags.c_contiguous and cols.flags.c_contiguous
            and (rows is None or (rows.dtype == np.int64 and rows.flags.c_contiguous)))  # fmt: skip


@dataclass(frozen=True)
class LayoutSalts:
    """Every (part, slot) of a layout as one row of a table: part p's slot s is row
    `offsets[p] + s`, and `salts[row]` is that row's `salt`; `row_of[(p, layer)]` is
    the row of p's logical `layer`, `part_at[row]` the part a row belongs to."""

    offsets: dict[Part, int]
    salts: np.ndarray  # uint64 [rows], read-only
    rows: int
    row_of: dict[tuple[Part, int], int]
    part_at: tuple[Part, ...]


@functools.lru_cache(maxsize=64)
def layout_salts(layout: KVLayout) -> LayoutSalts:
    """The salts of every (part, slot) of `layout`, as rows of one table (memoised)."""
    offsets: dict[Part, int] = {}
    rows: list[np.ndarray] = []
    row_of: dict[tuple[Part, int], int] = {}
    part_at: list[Part] = []
    for p in layout.parts:
        offsets[p.part] = len(part_at)
        rows.append(salts(p.part, p.layer_ids, p.page_bytes))
        row_of.update({(p.part, layer): len(part_at) + slot for slot, layer in enumerate(p.layer_ids)})
        part_at += [p.part] * p.num_slots
    table = np.concatenate(rows)
    table.flags.writeable = False
    return LayoutSalts(offsets, table, len(table), row_of, tuple(part_at))


def checksums(pages: np.ndarray, part: Part, layer: int) -> np.ndarray:
    """The checksum of each page (uint8 [n, page_bytes]) as `part`'s `layer`: uint64 [n]."""
    x = raw_sums(pages)
    x ^= salt(part, layer, pages.shape[1])
    return fmix64_in_place(x)


def checksums_by_layer(pages: np.ndarray, part: Part, layers: list[int], n: int) -> np.ndarray:
    """The checksums of `len(layers)` blocks of `n` pages each, block i as `layers[i]`
    (uint8 [len(layers) * n, page_bytes] or [len(layers), n, page_bytes] -> uint64
    [len(layers), n]): one pass for every layer of a part."""
    return salted(raw_sums(pages).reshape(len(layers), n), part, layers, pages.shape[-1])


def sample_positions(n: int, op_id: int, verify: Verify) -> np.ndarray | None:
    """Indices (into an op's page list of `n`) that a load checks: None for all of them
    (`Verify.ALL`), every `SAMPLE_EVERY`-th from `op_id % SAMPLE_EVERY` under `SAMPLE`,
    none under `OFF`."""
    if verify is Verify.ALL:
        return None
    if verify is Verify.OFF:
        return np.empty(0, dtype=np.int64)
    return np.arange(op_id % SAMPLE_EVERY, n, SAMPLE_EVERY, dtype=np.int64)
